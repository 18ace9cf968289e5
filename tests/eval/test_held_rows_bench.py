"""``benchmarks/held_rows.py`` on the CPU: its held sets, FLOP and byte counts, and one case run
end to end with FlashInfer's wrapper stood in for by its PyTorch semantics (the GPU run times
FlashInfer itself)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import held_rows as bench
import segpaged_kernels


def test_held_sets_are_the_policies_rows():
    epic = bench.held_set("epic", 1024)
    assert int(epic.sum()) == 8 * 16 + 64
    assert epic[:16].all() and not epic[16:128].any() and epic[128:144].all()
    assert epic[1024:].all()
    blend = bench.held_set("cacheblend", 8192)
    assert blend[8192:].all() and abs(float(blend[:8192].float().mean()) - 0.15) < 0.02
    with pytest.raises(ValueError, match="epic or cacheblend"):
        bench.held_set("naive", 1024)


def test_flops_and_read_rates_count_what_they_say():
    keep = torch.tensor([True, False, True])  # rows at positions 0 and 2: 1 + 3 keys
    assert bench.attention_flops(keep) == 4 * 32 * 128 * 4
    assert bench.read_rate(1000, 1.0) == pytest.approx(1000 * 8 * 128 * 4 / 1e-3 / 1e12)
    assert bench.read_rate(1000, None) is None


def test_a_case_runs_end_to_end_on_the_cpu(monkeypatch):
    """Every method of one case through the script's own code, FlashInfer's wrapper stood in
    for and the Triton kernel interpreted: each runs, and the runs' and blocks' outputs agree
    with the Triton kernel's."""
    from redknot.kernels.held_rows import (
        HeldRowsAttention,
        PagedPrefillReference,
        merge_state_reference,
    )

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(segpaged_kernels, "DEV", "cpu")
    monkeypatch.setattr(segpaged_kernels, "flashinfer_workspace", lambda: None)
    monkeypatch.setattr(bench, "QUESTION", 8)
    monkeypatch.setattr(bench, "EPIC_K", 4)
    outputs = {}

    def stand_in(workspace, hq, hk, d, dtype, backend="auto", sm_scale=None, within_backend=None):
        held = HeldRowsAttention(PagedPrefillReference, merge_state_reference, hq, hk, d, dtype,
                                 sm_scale=sm_scale)  # fmt: skip
        real = held.run

        def run(*a, **k):
            outputs[(held.force, backend, within_backend)] = out = real(*a, **k)
            return out

        held.run = run
        return held

    monkeypatch.setattr(HeldRowsAttention, "on_flashinfer", staticmethod(stand_in))
    from redknot.kernels import extend

    real_extend = extend.run_extend

    def run_extend(*a, out, **k):
        outputs["triton"] = out
        return real_extend(*a, out=out, **k)

    monkeypatch.setattr(extend, "run_extend", run_extend)
    timer = segpaged_kernels.Timer(calls=1, repeats=1, device="cpu")
    row = bench.held_case("epic", 256, timer, extend_configs=("64x32w4s2",))
    assert row["held_rows"] == 8 * 4 + 8 and row["runs"] == 9
    # the sweep's kernel under other launch constants: timed, and checked against the default's
    assert row["ms_triton_64x32w4s2"] is not None, row.get("notes")
    assert 0 <= row["max_abs_err_triton_64x32w4s2"] < 2e-2
    for name in ("runs_fa2", "runs_fa3", "blocks_fa2", "blocks_fa3", "blocks_fa3_fa2", "triton"):
        assert row[f"ms_{name}"] is not None, row.get("notes")
    assert row["ms_dense"] is None  # FlashInfer's own wrapper: not on the CPU
    assert len(outputs) == 6
    for out in outputs.values():
        torch.testing.assert_close(out.float(), outputs["triton"].float(), atol=2e-2, rtol=2e-2)
    for name in ("runs_fa2", "runs_fa3", "blocks_fa2", "blocks_fa3", "blocks_fa3_fa2"):
        assert 0 <= row[f"max_abs_err_{name}"] < 2e-2  # the script's own check, as recorded


def test_extend_configs_parse_and_malformed_ones_are_refused():
    cfg = bench.extend_config("64x128w4s2")
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 128, 4, 2)
    for bad in ("64x128", "64x128w4", "x128w4s2", "64x128w4s2,"):
        with pytest.raises(SystemExit, match="MxNwWsS"):
            bench.extend_config(bad)


def test_triton_only_times_the_kernel_and_no_flashinfer_method(monkeypatch):
    """``--triton-only`` (a launch-constant sweep on a fresh machine): the Triton kernel under
    both launches, checked against each other; no FlashInfer wrapper is built."""
    from redknot.kernels.held_rows import HeldRowsAttention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(segpaged_kernels, "DEV", "cpu")
    monkeypatch.setattr(bench, "QUESTION", 8)
    monkeypatch.setattr(bench, "EPIC_K", 4)

    def no_flashinfer(*a, **k):
        raise AssertionError("a FlashInfer method was built under triton_only")

    monkeypatch.setattr(HeldRowsAttention, "on_flashinfer", staticmethod(no_flashinfer))
    monkeypatch.setattr(segpaged_kernels, "flashinfer_workspace", no_flashinfer)
    timer = segpaged_kernels.Timer(calls=1, repeats=1, device="cpu")
    row = bench.held_case("epic", 256, timer, extend_configs=("64x32w4s2",), triton_only=True)
    assert row["ms_triton"] is not None and row["ms_triton_64x32w4s2"] is not None
    assert 0 <= row["max_abs_err_triton_64x32w4s2"] < 2e-2
    assert not any(k.startswith(("ms_runs", "ms_blocks", "ms_dense")) for k in row)
