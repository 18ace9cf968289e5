"""LFPS's table build in Triton (``redknot.kernels.lfps_build``) against the PyTorch build the
server runs (``redknot.lfps.serving.build_tables``): interpreter at small shapes, GPU at the 8B
shape."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.lfps_build import build_tables_kernels
from redknot.lfps import LfpsParams
from redknot.lfps.serving import build_tables


def _case(n, m, hq, hkv, d, dtype, device, seed=0, spare=37):
    g = torch.Generator().manual_seed(seed)
    k_store = torch.randn(n + spare, hkv, d, generator=g).to(dtype).to(device)
    v_store = torch.randn(n + spare, hkv, d, generator=g).to(dtype).to(device)
    slots = (torch.randperm(n + spare, generator=g)[:n]).to(device)
    queries = torch.randn(m, hq, d, generator=g).to(dtype).to(device)
    return queries, k_store, v_store, slots


@pytest.mark.parametrize(
    "n, m, rows, history, split",
    [(300, 40, 1, 16, 128), (300, 40, 4, 64, 4096), (10, 10, 2, 64, 64), (129, 5, 1, 64, 64)],
)
def test_the_kernels_build_the_tables_of_the_pytorch_build(n, m, rows, history, split):
    """Random keys at permuted slots, queries over a few splits of the keys, tables per query
    head and per group of heads, fewer queries than the history, and a request so short that
    its first queries see no key past the sinks (their rows are zero)."""
    hq, hkv, d = 8, 2, 32
    params = LfpsParams(budget=0.1, history_steps=history)
    queries, k_store, v_store, slots = _case(n, m, hq, hkv, d, torch.float32, "cpu")
    want = build_tables(queries, k_store[slots], v_store[slots], params, rows, d**-0.5)
    got = build_tables_kernels(queries, k_store, v_store, slots, params, rows, d**-0.5,
                               keys_per_split=split)  # fmt: skip
    for name, a, b in zip(("vertical", "slash", "mean_key", "mean_value", "stat"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4, msg=name)
    assert got[0][:, : params.num_sink].abs().max() == 0  # sinks are not scored


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5000, 40000])
def test_the_kernels_build_the_tables_at_the_8b_shape_on_the_gpu(n):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = LfpsParams(budget=0.02, history_steps=64)
    queries, k_store, v_store, slots = _case(n, 64, 32, 8, 128, torch.bfloat16, "cuda", seed=1)
    want = build_tables(queries, k_store[slots], v_store[slots], params, 4, 128**-0.5)
    got = build_tables_kernels(queries, k_store, v_store, slots, params, 4, 128**-0.5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=2e-3)
