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
