"""``benchmarks/marked_host_cost.py`` on the CPU stand-in: the marked requests reuse their
registered documents (the timed functions run on them), the plain ones mark nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_marked_and_plain_requests_are_timed_apart(tmp_path):
    import marked_host_cost

    out = tmp_path / "cost.json"
    argv = ["--docs", "2", "--doc-tokens", "64", "--block", "2", "--blocks", "2", "--out", str(out)]
    assert marked_host_cost.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"device", "date", "commit", "command"} <= set(data)
    calls = data["calls"]
    assert calls["marked"]["rewrite_generate"] == 4 and calls["plain"]["rewrite_generate"] == 0
    # every document is registered, so every marked answer reports all hits: nothing to capture
    assert calls["marked"]["Capturer.capture"] == 0
    assert set(data["per_call_ms_p50"]["marked"]) == {"rewrite_generate", "start", "plan_reads"}
    assert data["request_ms_p50"]["marked"] > 0 and data["request_ms_p50"]["plain"] > 0


def test_the_automatic_rewrite_is_timed_on_every_replayed_prompt(tmp_path):
    """``benchmarks/auto_rewrite_cost.py``: every closed-loop RAG prompt of the replay goes
    through the middleware's rewrite (automatic segments on), each call timed."""
    import auto_rewrite_cost

    out = tmp_path / "auto.json"
    argv = ["--workloads", "rag", "--requests", "6", "--warmup", "2", "--out", str(out)]
    assert auto_rewrite_cost.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"device", "date", "commit", "command"} <= set(data)
    (row,) = data["rows"]
    assert row["workload"] == "rag" and row["auto_mode"] == "cdc-docs" and row["calls"] == 4
    assert 0 < row["rewrite_ms_p50"] <= row["rewrite_ms_p90"]


def test_the_scheduler_start_of_a_marked_prompt_is_timed_against_an_unmarked_one(tmp_path):
    """``benchmarks/reuse_start_cost.py``: every marked prompt finds its segments stored, and the
    gate under the H200 record recomputes CacheBlend's 1K x 8 and reuses its 8K x 8 (the
    decisions of ``tests/costmodel/test_gate.py``'s fitted points)."""
    import reuse_start_cost

    for length, decision in ((1024, "recompute"), (8192, "reuse")):
        out = tmp_path / f"start_{length}.json"
        argv = ["--length", str(length), "--reps", "3", "--out", str(out)]
        assert reuse_start_cost.main(argv) == 0
        data = json.loads(out.read_text())
        assert {"device", "date", "commit", "command"} <= set(data)
        assert data["segments_hit"] == [8] and data["gate_decisions"] == [decision]
        times = data["start_ms_p50"]
        assert set(times) == {"marked", "marked_new_layout", "unmarked"}
        assert times["marked"] > times["unmarked"] > 0 and times["marked_new_layout"] > 0
