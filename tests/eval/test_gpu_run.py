"""The GPU runner's parts that need no GPU: its command lines, the commit a tree records, the
README blocks it serves, and a bench job run end to end on a CPU script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_machine as gm
import gpu_run


def test_command_lines_parse():
    a = gpu_run.parse(["bench", "--timeline", "ttft", "--points", "32768x8", "--reps", "2"])
    assert (a.job, a.name, a.args, a.timeline) == (
        "bench",
        "ttft",
        ["--points", "32768x8", "--reps", "2"],
        True,
    )
    a = gpu_run.parse(["ab", "--old", "o.tar", "--old-first", "bench", "followup_ttft", "--x"])
    assert a.old == "o.tar" and a.old_first
    assert (a.inner.job, a.inner.name, a.inner.args) == ("bench", "followup_ttft", ["--x"])
    with pytest.raises(SystemExit):
        gpu_run.parse(["ab", "--old", "o.tar", "tests"])
    a = gpu_run.parse(["fidelity", "--specs", "epic64:epic:--redknot-epic-k 64"])
    assert a.specs == "epic64:epic:--redknot-epic-k 64" and a.model == "/tmp/smol-hf"


def test_a_fidelity_server_measures_its_policy_on_every_case():
    """The reuse gate and samkv's size floor are off unless the spec sets them: either would
    compute SmolLM2's short prompts in full and score dense as the policy."""
    flags = gpu_run.fidelity_flags("cacheblend", "", "map.json")
    assert flags[flags.index("--redknot-reuse-gate") + 1] == "always"
    flags = gpu_run.fidelity_flags("samkv", "--redknot-samkv-block 16", "map.json")
    assert flags[flags.index("--redknot-samkv-min-tokens") + 1] == "0"
    flags = gpu_run.fidelity_flags("epic", "--redknot-reuse-gate auto", "map.json")
    assert "--redknot-reuse-gate" not in flags  # the spec's own setting stands
    assert "--redknot-head-map" in gpu_run.fidelity_flags("redknot", "", "map.json")


def test_an_archive_records_its_commit(tmp_path, monkeypatch):
    git = ["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"]
    head = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    tar = tmp_path / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "-o", str(tar)], check=True)
    assert gm.archive_commit(tar) == head
    monkeypatch.setenv("REDKNOT_COMMIT", "someother")  # an archive's own record wins
    tree = gm.unpack_tree(tar, tmp_path / "src")
    assert (tree / "benchmarks/ttft.py").is_file()
    assert gm.tree_commit(tree) == head
    assert gm.tree_commit(tmp_path) == "someother"  # a tree without a record


def test_readme_serving_example_and_request_examples():
    text = (ROOT / "README.md").read_text()
    (lang, block), *_ = gm.readme_blocks(text, gpu_run.README_SERVE)
    assert lang == "bash"
    argv = gm.serve_command(block, "/tmp/smol-hf")
    assert argv[argv.index("--model-path") + 1] == "/tmp/smol-hf"
    assert argv[argv.index("--attention-backend") + 1] == "redknot"
    examples = gm.readme_blocks(text, gpu_run.README_API)
    assert len(examples) == 4 and {lang for lang, _ in examples} <= {"bash", "python"}


def test_a_bench_job_runs_and_collects(tmp_path, monkeypatch, capsys):
    """``bench ab_join`` on two small TTFT results: the script runs in the tree with the job's
    environment, ``--out`` lands in $OUT, and the collected listing shows its headline."""
    run = {
        "device": "cpu",
        "date": "d",
        "commit": "c",
        "command": "x",
        "variants": {"v": {"points": {"8x1": {"ttft_s": 2.0, "ttft_samples_s": [2.0]}}}},
    }
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(run))
    run["variants"]["v"]["points"]["8x1"]["ttft_s"] = 1.0
    new.write_text(json.dumps(run))
    out = tmp_path / "out"
    monkeypatch.setattr(gm, "OUT", out)
    monkeypatch.setattr(gm, "unpack", lambda: (ROOT, {"PATH": "/usr/bin:/bin"}))
    assert gpu_run.main(["bench", "ab_join", "--old", str(old), "--new", str(new)]) == 0
    joined = json.loads((out / "ab_join.json").read_text())
    assert joined["compared"]["v"]["8x1"]["old_over_new"] == 2.0
    assert (out / "ab_join.log").is_file()
    listing = capsys.readouterr().out
    assert "ab_join.json" in listing and "v 8x1: old 2.0 s, new 1.0 s" in listing


def test_a_failing_command_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gm, "OUT", tmp_path)
    assert gpu_run.main.__module__ == "gpu_run"
    monkeypatch.setattr(gm, "unpack", lambda: (ROOT, {"PATH": "/usr/bin:/bin"}))
    assert gpu_run.main(["bench", "ab_join", "--old", "/nonexistent"]) != 0
    assert "= rc 2" in capsys.readouterr().out


def test_the_gpu_tests_leave_out_the_docs_tests_when_the_results_are_not_carried(tmp_path):
    """The archive carried to the GPU machine has no benchmarks/results; tests/docs (no GPU
    test) reads that folder while collecting, which stopped the whole run."""
    assert "--ignore=tests/docs" in gpu_run.tests_command(tmp_path, [], None)
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    cmd = gpu_run.tests_command(tmp_path, ["tests/lfps"], "union")
    assert "--ignore=tests/docs" not in cmd and cmd[-2:] == ["-k", "union"]
    assert "tests/lfps" in cmd and "gpu" in cmd


def test_the_first_half_of_an_ab_on_a_fresh_machine_gets_room_to_compile(tmp_path, monkeypatch):
    """With FlashInfer's JIT cache empty the first half's time limit grows by
    ``COLD_COMPILE_S``, the second keeps its own; with a compiled kernel there, neither grows."""
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    assert gpu_run.flashinfer_cold()
    limits = []
    monkeypatch.setattr(gpu_run.gm, "unpack_tree", lambda tar, dest: tmp_path)
    monkeypatch.setattr(gpu_run.gm, "tree_commit", lambda tree: "abc1234")
    monkeypatch.setattr(gpu_run.gm, "install", lambda tree: None)
    monkeypatch.setattr(gpu_run, "bench_once",
                        lambda inner, *a, **k: limits.append(inner.timeout) or 0)  # fmt: skip
    a = gpu_run.parse(["ab", "--old", "o.tar", "bench", "--timeout", "100", "ttft"])
    gpu_run.job_ab(a, tmp_path, {})
    assert limits == [100 + gpu_run.COLD_COMPILE_S, 100]
    ops = tmp_path / ".cache/flashinfer/0.6/90a/cached_ops/batch_prefill"
    ops.mkdir(parents=True)
    (ops / "batch_prefill.so").write_bytes(b"")
    assert not gpu_run.flashinfer_cold()
    limits.clear()
    gpu_run.job_ab(a, tmp_path, {})
    assert limits == [100, 100]


def test_a_bench_jobs_profiles_are_summarised_into_one_file(tmp_path, monkeypatch):
    """The traces a script left under its ``--profile-dir`` (one folder per row and point) come
    back as one summary, keyed by folder and file: the device returns at most 8 files, and a
    profiled side-by-side run with three servers' logs wrote 12 (its TTFT JSON was lost)."""
    import gzip

    script = tmp_path / "fake_bench.py"
    script.write_text("import sys\n")  # the script's own work is not the point here
    profiles = tmp_path / "prof"
    for row in ("epic-512x4", "flashinfer-512x4"):
        (profiles / row).mkdir(parents=True)
        events = [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10, "tid": 7}]
        with gzip.open(profiles / row / "1-TP-0.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    out = tmp_path / "out"
    monkeypatch.setattr(gm, "OUT", out)
    monkeypatch.setattr(gm, "unpack", lambda: (ROOT, {"PATH": "/usr/bin:/bin"}))
    monkeypatch.setattr(gm, "script", lambda tree, name: script)
    argv = ["bench", "fake_bench", "--profile-dir", str(profiles)]
    assert gpu_run.main(argv) == 0
    summaries = sorted(p.name for p in out.glob("profile_*.json"))
    assert summaries == ["profile_fake_bench.json"]
    traces = json.loads((out / "profile_fake_bench.json").read_text())["traces"]
    assert set(traces) == {
        "epic-512x4/1-TP-0.trace.json.gz",
        "flashinfer-512x4/1-TP-0.trace.json.gz",
    }
    assert all(t["gpu_busy_ms"] == 0.01 for t in traces.values())
