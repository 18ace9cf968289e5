"""The host probe and the record's host constants scaled to the serving machine's host."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from redknot.costmodel.gate import ReuseGate
from redknot.costmodel.host_probe import SCALE_RANGE, host_scale, probe_ms
from redknot.costmodel.model import PromptWork
from redknot.costmodel.record import FALLBACK, RECORDS_DIR, CostRecord, CostRecordError

ROOT = Path(__file__).resolve().parents[2]
H100 = CostRecord.read(RECORDS_DIR / f"{FALLBACK}.json")
CFG_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072,
}  # fmt: skip


def test_the_probe_times_its_loop_on_the_cpu():
    ms = probe_ms("cpu", iters=20, repeats=3)
    assert 0 < ms < 50  # a few dozen small operations: microseconds to a millisecond


def test_the_factor_is_the_probes_ratio_within_its_range():
    assert host_scale(0.3, 0.15)[0] == pytest.approx(2.0)
    assert host_scale(0.1, 0.2)[0] == pytest.approx(0.5)
    factor, said = host_scale(1.0, 0.1)
    assert factor == SCALE_RANGE[1] and "clamped" in said
    factor, said = host_scale(0.2, None)
    assert factor == 1.0 and "no host probe" in said
    assert host_scale(None, None)[0] == 1.0


def test_scaling_multiplies_every_host_constant_and_no_gpu_constant():
    record = replace(H100, host_probe_ms=0.1)
    slow = record.scaled(2.0)
    assert slow.host_ms == {k: 2 * v for k, v in record.host_ms.items()}
    assert slow.choose_ms == {k: 2 * v for k, v in record.choose_ms.items()}
    for name in ("plan_ms", "plan_ms_per_ktok", "fixed_ms"):
        assert getattr(slow, name) == 2 * getattr(record, name)
    for name in ("gemm_tflops", "attn_tflops", "bandwidth_gbs", "margin", "host_probe_ms"):
        assert getattr(slow, name) == getattr(record, name)


def test_a_record_with_a_bad_probe_is_refused_and_one_without_writes_none():
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(CostRecordError, match="host_probe_ms"):
            CostRecord.from_json({**H100.to_json(), "host_probe_ms": bad}, source="r.json")
    assert "host_probe_ms" not in replace(H100, host_probe_ms=None).to_json()
    again = CostRecord.from_json(json.loads(json.dumps(replace(H100, host_probe_ms=0.2).to_json())))
    assert again.host_probe_ms == 0.2


def _gate(record_path, host_probe):
    """A gate built for EPIC on the 8B shape whose machine probes at ``host_probe``, and the
    list of the probes it took."""
    from redknot.config import RedknotConfig
    from redknot.headmap import ModelShape, synthetic_map
    from redknot.pool.layout import HeadLayout

    shape = ModelShape.from_hf_config(CFG_8B)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.125, window=256, sink=64))
    config = RedknotConfig(policy="epic", all_global=True, cost_record=str(record_path))
    calls: list[float] = []

    def measure():
        calls.append(host_probe)
        return host_probe

    gate = ReuseGate.build(config, CFG_8B, layout, "NVIDIA H100 80GB HBM3", host_probe=measure)
    return gate, calls


def test_a_slower_host_recomputes_what_the_record_reuses(tmp_path, caplog):
    """EPIC at 2K x 8 on the 8B shape: reused under the record as fitted; on a host twice as
    slow as the record's, where the host-bound reuse path doubles and recomputing (GPU-bound)
    barely moves, recomputed; the log says by how much the constants were scaled."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(replace(H100, host_probe_ms=0.1).to_json()))
    work = PromptWork(8 * 256 + 64, 0, tuple((i * 256, 256) for i in range(8)))
    with caplog.at_level("INFO"):
        same = _gate(path, host_probe=0.1)[0].decide(work)
        slow_gate, calls = _gate(path, host_probe=0.2)
        slow = slow_gate.decide(work)
    assert same.reuse and not slow.reuse, (same, slow)
    assert slow_gate.host_scale == pytest.approx(2.0)
    assert slow.reuse_ms > 1.8 * same.reuse_ms and slow.plain_ms < 1.5 * same.plain_ms
    assert "host constants x2.00" in caplog.text
    assert calls == [0.2]  # measured once the record has a probe of its own
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(replace(H100, host_probe_ms=None).to_json()))
    unprobed, calls = _gate(bare, host_probe=0.2)
    assert unprobed.decide(work).reuse_ms == pytest.approx(same.reuse_ms)  # no record probe: as is
    assert calls == [] and unprobed.host_scale == 1.0  # and the machine is not probed


def test_the_fit_takes_the_machines_probe_from_the_ttft_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reuse_cost import host_probe_of

    assert host_probe_of([{"host_probe_ms": 0.1}, {"host_probe_ms": 0.3}]) == 0.2
    assert host_probe_of([{"host_probe_ms": 0.1}, {}]) is None


def _ttft_result(variants: dict, baselines: dict | None = None) -> dict:
    """A ``benchmarks/ttft.py`` result of ``{variant: TTFT ms}`` at one point (1K x 8)."""
    row = {"length": 1024, "segments": 8, "prompt_tokens": 1088, "every_segment_hit": True}
    res = {"variants": {n: {"points": {"1024x8": {**row, "ttft_samples_s": [ms / 1e3]}}}
                        for n, ms in variants.items()}}  # fmt: skip
    if baselines is not None:
        res["baselines"] = baselines
    return res


def test_the_fit_compares_each_variant_with_its_own_runs_flashinfer():
    """As ``benchmarks/ttft.py`` compares them: a run's variants with that run's flashinfer, a
    run without one with the first run's, a merged run's by its ``baselines`` (``flashinfer@N``,
    a name the fit reads as flashinfer)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reuse_cost import points_of

    runs = [_ttft_result({"flashinfer": 30.0, "epic[reuse_gate=always]": 40.0}),
            _ttft_result({"cacheblend[reuse_gate=always]": 50.0}),
            _ttft_result({"sparsex[reuse_gate=always]": 60.0, "flashinfer": 70.0})]  # fmt: skip
    merged = _ttft_result(
        {"flashinfer": 30.0, "cacheblend[reuse_gate=always]": 50.0,
         "sparsex[reuse_gate=always]": 60.0, "flashinfer@3": 70.0},
        baselines={"flashinfer": "flashinfer", "cacheblend[reuse_gate=always]": "flashinfer",
                   "sparsex[reuse_gate=always]": "flashinfer@3", "flashinfer@3": "flashinfer@3"},
    )  # fmt: skip
    for results in (runs, [merged]):
        points = points_of(results, 64)
        base_ms = {p[4]: p[3] for p in points if p[4][1] == p[0]}
        paired = {p[0].split("[")[0]: base_ms[p[4]] for p in points if p[4][1] != p[0]}
        assert paired["sparsex"] == 70.0 and paired["cacheblend"] == 30.0, paired
        assert paired.get("epic", 30.0) == 30.0


def test_results_of_two_models_are_each_compared_with_their_own_models_flashinfer():
    """``--fit PATH@MODEL``: a second model's variants are named with its tag, and a run of it
    without a flashinfer of its own pairs with the first flashinfer of the same model, never
    with the other model's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reuse_cost import points_of

    runs = [_ttft_result({"flashinfer": 30.0, "epic[reuse_gate=always]": 40.0}),
            _ttft_result({"flashinfer": 10.0, "epic[reuse_gate=always]": 25.0}),
            _ttft_result({"cacheblend[reuse_gate=always]": 50.0})]  # fmt: skip
    points = points_of(runs, 64, ["", "small:", "small:"])
    names = [p[0] for p in points]
    assert names == [
        "flashinfer",
        "epic[reuse_gate=always]",
        "small:flashinfer",
        "small:epic[reuse_gate=always]",
        "small:cacheblend[reuse_gate=always]",
    ]
    base_ms = {p[4]: p[3] for p in points if p[4][1] == p[0]}
    paired = {p[0]: base_ms[p[4]] for p in points if p[4][1] != p[0]}
    assert paired == {"epic[reuse_gate=always]": 30.0, "small:epic[reuse_gate=always]": 10.0,
                      "small:cacheblend[reuse_gate=always]": 10.0}  # fmt: skip


def test_the_check_takes_flashinfers_throughput_where_the_record_fitted_or_held_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reuse_cost import flashinfer_tflops

    held = replace(H100, provenance={"held": {"attn_tflops_flashinfer": 600.0}})
    fitted = replace(H100, provenance={"fitted": {"attn_tflops_flashinfer": 178.9}})
    assert flashinfer_tflops(held) == 600.0 and flashinfer_tflops(fitted) == 178.9
    assert flashinfer_tflops(replace(H100, provenance={})) == H100.attn_tflops
