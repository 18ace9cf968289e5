"""``benchmarks/capacity.py`` on the CPU: the engine process against a stand-in for SGLang's
engine, and the runner's slots and ratios from what its children report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import capacity as bench
import serving_common as common

from .standin import child_result, model_dir, stand_in_engine

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "head_dim": 128, "vocab_size": 128256}  # fmt: skip


class Engine:
    """Reports a pool of 1,000,000 token slots and 20 request slots; keeps each start's
    arguments."""

    started: ClassVar[list[dict]] = []

    def __init__(self, **kwargs):
        Engine.started.append(kwargs)

    def get_server_info(self):
        return {"max_total_num_tokens": 1_000_000,
                "internal_states": [{"effective_max_running_requests_per_dp": 20}]}  # fmt: skip

    def shutdown(self):
        pass


def test_child_reads_the_pools_the_scheduler_allocated(tmp_path, monkeypatch, capsys):
    stand_in_engine(monkeypatch, tmp_path, Engine)
    model = model_dir(tmp_path, LLAMA_8B)
    argv = ["capacity.py", "--child", "redknot-g0.125", "--model", str(model), "--slots", "30"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = child_result(capsys)
    # 1,000,000 // (32768 + 128) = 30 requests fit the token slots; 20 request slots bound it
    assert result == {"max_total_num_tokens": 1_000_000, "max_running_requests": 20,
                      "admitted": 20}  # fmt: skip


def test_runner_sizes_the_tuned_slots_from_the_dense_count(tmp_path, monkeypatch):
    calls = []

    def run_child(script, args, log_grep=None):
        name, slots = args[args.index("--child") + 1], int(args[args.index("--slots") + 1])
        calls.append((name, slots))
        admitted = 23 if name == "flashinfer" else (slots or 40)
        return {"admitted": admitted}

    monkeypatch.setattr(common, "run_child", run_child)
    out = tmp_path / "capacity.json"
    argv = ["capacity.py", "--model", str(model_dir(tmp_path, LLAMA_8B)), "--out", str(out),
            "--variants", "flashinfer,redknot-g0.125-default,redknot-g0.125"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    data = json.loads(out.read_text())
    from redknot.headmap import ModelShape

    shape, need = ModelShape.from_hf_config(LLAMA_8B), 32768 + 128
    ideal = bench.kv_bytes_per_request(None, need, shape, 320) / bench.kv_bytes_per_request(
        0.125, need, shape, 320
    )
    tuned = dict(calls)["redknot-g0.125"]
    assert tuned == int(23 * ideal) + 2 and dict(calls)["redknot-g0.125-default"] == 0
    summary = data["summary"]["redknot-g0.125"]
    assert summary["admitted"] == tuned and summary["ratio_vs_flashinfer"] == tuned / 23
    assert abs(summary["fraction_of_ideal"] - tuned / 23 / ideal) < 1e-12
    assert data["flashinfer_admitted"] == 23 and "flashinfer" not in data["summary"]


def test_kv_bytes_count_a_ring_for_local_heads():
    from redknot.headmap import ModelShape

    shape = ModelShape.from_hf_config(LLAMA_8B)
    row = 2 * 128 * 2  # K and V of one head and token, bf16
    assert bench.kv_bytes_per_request(None, 1000, shape, 320) == 256 * 1000 * row
    # 32 of 256 (layer, KV head) pairs global over every token, 224 over a ring of 320
    assert bench.kv_bytes_per_request(0.125, 1000, shape, 320) == (32 * 1000 + 224 * 320) * row


def test_the_variant_without_segments_turns_the_segment_region_off(tmp_path, monkeypatch, capsys):
    """``redknot-g0.125-noseg`` starts the tuned 1/8 map with ``--redknot-segment-fraction 0``;
    the other redknot variants keep the default region."""
    monkeypatch.setattr(Engine, "started", [])
    stand_in_engine(monkeypatch, tmp_path, Engine)
    model = model_dir(tmp_path, LLAMA_8B)
    for name in ("redknot-g0.125-noseg", "redknot-g0.125"):
        argv = ["capacity.py", "--child", name, "--model", str(model), "--slots", "30"]
        monkeypatch.setattr(sys, "argv", argv)
        bench.main()
        child_result(capsys)
    noseg, default = Engine.started
    assert noseg["redknot_segment_fraction"] == 0.0 and noseg["max_running_requests"] == 30
    assert "redknot_segment_fraction" not in default and default["attention_backend"] == "redknot"
