"""``benchmarks/lfps_decode.py`` end to end at its tiny CPU shape (kernels under the Triton
interpreter): every method runs and the JSON carries what the GPU run reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, out: Path, *args: str) -> dict:
    """``benchmarks/<script>`` on the CPU under the Triton interpreter; the JSON it wrote."""
    cmd = [sys.executable, f"benchmarks/{script}", "--small", "--device", "cpu", *args,
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_smoke_run_writes_every_field(tmp_path):
    out = tmp_path / "lfps_decode.json"
    data = run_script("lfps_decode.py", out, "--lengths", "300", "--batches", "1,2")
    for key in ("device", "date", "commit", "command", "shape", "lfps_params", "timing"):
        assert data[key], key
    assert data["device"] == "cpu" and "lfps_decode.py" in data["command"]
    assert data["summary"]["target"].startswith("decode attention >= 5x")
    assert [(r["L"], r["B"]) for r in data["rows"]] == [(300, 1), (300, 2)]
    for row in data["rows"]:
        assert not row.get("notes"), row.get("notes")
        assert row["full_impl"].startswith("redknot dense decode")
        assert row["topk"] == 6 and row["candidates"] == 24  # 2% of 296 keys, C = 4 K
        for sel in ("kv_head", "query_head"):
            for method in ("topk", "attend", "lfps"):
                assert row[f"ms_{method}_{sel}"] > 0
            assert row[f"speedup_lfps_{sel}"] == row["ms_full"] / row[f"ms_lfps_{sel}"]
            assert 0 < row[f"lfps_candidate_share_{sel}"] < 1
            assert f"index_ms_lfps_{sel}" in row and f"index_ms_topk_{sel}" in row
        assert set(row["timing"].values()) == {"cpu_wall"}


def test_stage_profile_names_the_step_operators(tmp_path):
    """``--stages`` records where an LFPS step's time goes (on the CPU: operator self times; the
    kernels run as Python there, so the step's own operators are its buffers' allocations)."""
    args = ("--stages", "--lengths", "300", "--batches", "1", "--selections", "kv_head")
    data = run_script("lfps_decode.py", tmp_path / "lfps_decode.json", *args)
    stages = data["rows"][0]["lfps_stages_kv_head"]
    assert "aten::empty" in stages and all(t > 0 for t in stages.values()), stages


def test_update_settings_are_each_checked_against_the_default_and_timed(tmp_path):
    args = ("--update-settings", "8:4,4:2", "--lengths", "300", "--batches", "2",
            "--selections", "kv_head")  # fmt: skip
    data = run_script("lfps_decode.py", tmp_path / "lfps_decode.json", *args)
    settings = data["rows"][0]["update_settings_kv_head"]
    assert [(s["block"], s["num_warps"]) for s in settings] == [(8, 4), (4, 2)]
    assert all(s["ms"] > 0 and s["max_abs_diff"] < 2e-3 for s in settings), settings


def test_candidate_sweep_checks_each_setting_against_the_default(tmp_path):
    data = run_script("lfps_candidates_sweep.py", tmp_path / "sweep.json")
    (row,) = data["rows"]
    assert {(s["chunk"], s["block"], s["mark_gather"]) for s in row["settings"]} == {
        (chunk, block, gather) for chunk in (128, 256) for block in (64, 128)
        for gather in (False, True)
    }  # fmt: skip
    # the mark kernel's shifts gathered from its window: the same lists as read again
    assert all(s["same_as_default"] and s["ms"] > 0 for s in row["settings"]), row["settings"]
    assert row["best"] in row["settings"] and row["ms_topk"] > 0
    assert {(s["block"], s["radix_bits"], s["early_exit"]) for s in row["topk_settings"]} == {
        (block, bits, early) for block in (0, 16) for bits in (0, 8) for early in (False, True)
    }  # fmt: skip
    # the passes stopped early: the same set as the reference's
    assert all(s["same_as_reference"] and s["ms"] > 0 for s in row["topk_settings"])


def test_mark_gather_times_each_mark_kernel_after_checking_them_equal(tmp_path):
    """``--mark-gather`` times the step with each mark kernel after their selections and outputs
    were compared."""
    args = ("--mark-gather", "--lengths", "300", "--batches", "2", "--selections", "kv_head")
    data = run_script("lfps_decode.py", tmp_path / "lfps_decode.json", *args)
    row = data["rows"][0]
    assert row["gather_equal_kv_head"] is True and not row.get("notes"), row.get("notes")
    for name in ("lfps", "lfps_loads", "lfps_gather"):
        assert row[f"ms_{name}_kv_head"] > 0
        assert row[f"speedup_{name}_kv_head"] == row["ms_full"] / row[f"ms_{name}_kv_head"]


@pytest.mark.parametrize("switch", ["mark_gather", "topk_early_exit"])
def test_switch_variants_restore_the_setting_and_compare_results(monkeypatch, switch):
    """A two-way setting's variants compare what the two steps return (a differing output is
    reported unequal) and restore the setting to what it was, even when a step fails."""
    import importlib
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("lfps_decode", ROOT / "benchmarks/lfps_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    module_name, attr, (off, on), key = mod.SWITCHES[switch]
    module = importlib.import_module(f"redknot.kernels.{module_name}")

    class Result:
        def __init__(self, setting):
            self.selected = torch.zeros(2, dtype=torch.int32)
            self.output = torch.full((2,), 1.0 if setting else 0.0)

    class State:
        def clone(self):
            return self

    class Timer:
        device = "cpu"

        def __call__(self, f):
            f()
            return 1.0, "cpu_wall"

    def call(state=None):
        return Result(getattr(module, attr))

    def failing(state=None):
        raise RuntimeError("boom")

    for before in (False, True):
        monkeypatch.setattr(module, attr, before)
        row = {}
        mod.switch_variants(row, "kv_head", call, State(), Timer(), "cpu", False, switch)
        assert row[f"{key}_kv_head"] is False
        assert row[f"ms_lfps_{off}_kv_head"] == row[f"ms_lfps_{on}_kv_head"] == 1.0
        assert getattr(module, attr) is before
        with pytest.raises(RuntimeError, match="boom"):
            mod.switch_variants({}, "kv_head", failing, State(), Timer(), "cpu", False, switch)
        assert getattr(module, attr) is before


def test_topk_early_exit_times_both_after_checking_them_equal(tmp_path):
    """``--topk-early-exit`` times the step with the Top-k's passes run to the last and stopped
    early, after their selections and outputs were compared."""
    args = ("--topk-early-exit", "--lengths", "300", "--batches", "2", "--selections", "kv_head")
    data = run_script("lfps_decode.py", tmp_path / "lfps_decode.json", *args)
    row = data["rows"][0]
    assert row["topk_early_equal_kv_head"] is True and not row.get("notes"), row.get("notes")
    for name in ("lfps_topk_passes", "lfps_topk_early"):
        assert row[f"ms_{name}_kv_head"] > 0
        assert row[f"speedup_{name}_kv_head"] == row["ms_full"] / row[f"ms_{name}_kv_head"]
