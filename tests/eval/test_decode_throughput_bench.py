"""``benchmarks/decode_throughput.py`` on the CPU: its engine process against a stand-in for
SGLang's engine, and its runner's figures from the logs a child returns (a GPU run is the only
other way to reach this code)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_throughput as bench
import serving_common as common

from .standin import child_result, model_dir, stand_in_engine


def test_child_generates_every_session_and_reports_its_rate(tmp_path, monkeypatch, capsys):
    seen = {}

    class Engine:
        def __init__(self, **kwargs):
            seen["kwargs"] = kwargs

        def generate(self, input_ids, sampling_params):
            seen["prompts"] = input_ids
            return [{"output_ids": [1] * sampling_params["max_new_tokens"]} for _ in input_ids]

        def shutdown(self):
            seen["shutdown"] = True

    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, Engine)
    argv = ["decode_throughput.py", "--child", "redknot-g0.125", "--model", str(model),
            "--sessions", "3", "--prompt-len", "16", "--new-tokens", "5",
            "--slots", "4"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = child_result(capsys)
    assert result["generated_tokens"] == 15 and result["end_to_end_tokens_per_s"] > 0
    assert len(seen["prompts"]) == 3 and all(len(p) == 16 for p in seen["prompts"])
    assert seen["kwargs"]["attention_backend"] == "redknot" and seen["shutdown"]
    assert seen["kwargs"]["max_running_requests"] == 4


def test_runner_takes_the_rate_at_the_largest_batch(tmp_path, monkeypatch):
    logs = {
        "flashinfer": ["#running-req: 24, gen throughput (token/s): 800.0",
                       "#running-req: 24, gen throughput (token/s): 840.0",
                       "#running-req: 12, gen throughput (token/s): 500.0"],
        "redknot-g0.125": ["#running-req: 64, gen throughput (token/s): 4000.0",
                           "#running-req: 40, gen throughput (token/s): 2000.0"],
    }  # fmt: skip

    def run_child(script, args, log_grep=None):
        name = args[args.index("--child") + 1]
        e2e = {"flashinfer": 100.0, "redknot-g0.125": 180.0}[name]
        return {"end_to_end_tokens_per_s": e2e, "log_lines": logs[name]}

    monkeypatch.setattr(common, "run_child", run_child)
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "argv", ["decode_throughput.py", "--out", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    assert data["variants"]["flashinfer"]["peak_running"] == 24
    assert data["variants"]["flashinfer"]["decode_tokens_per_s"] == 820.0  # median at 24
    assert data["variants"]["redknot-g0.125"]["decode_tokens_per_s"] == 4000.0
    ratios = data["ratios"]["redknot-g0.125"]
    assert abs(ratios["decode_speedup"] - 4000 / 820) < 1e-9
    assert abs(ratios["end_to_end_speedup"] - 1.8) < 1e-9
    assert {"device", "date", "commit", "command"} <= set(data)
