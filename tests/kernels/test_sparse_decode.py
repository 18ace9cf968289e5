"""Sparse decode attention (sinks + listed positions over the paged store) against the PyTorch
reference, under ``TRITON_INTERPRET=1`` at small shapes with small blocks, so that splits,
partial blocks, padding and invalid entries all occur; GPU tests at the 8B shape."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.kernels.sparse_decode import (
    SparseDecodeConfig,
    choose_sparse_splits,
    plan_sparse_decode,
    run_sparse_decode,
)
from redknot.kernels.sparse_reference import sparse_decode_reference

from .paged_data import make_paged

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

SMALL = SparseDecodeConfig(block_n=16, min_chunk=16)
SINK = 4
# a padded row (0 keys), fewer keys than sinks, a short row, rows of a few hundred keys
SEQ_LENS = [0, 3, 37, 150, 301]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 2e-2 if out.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def random_lists(seq_lens, heads, width, seed, device="cpu") -> torch.Tensor:
    """[B, heads, width] int32 distinct non-sink positions per list where the row has them,
    then padding (-1) and invalid entries (past the row, sinks, negative)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(seq_lens), heads, width), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for h in range(heads):
            pool = torch.randperm(max(n - SINK, 0), generator=g)[: width - 3] + SINK
            out[b, h, : pool.numel()] = pool.to(torch.int32)
            junk = torch.tensor([n, n + 5, 1], dtype=torch.int32)  # past the row; a sink
            slots = torch.randperm(width, generator=g)[:3]
            out[b, h, slots] = torch.where(out[b, h, slots] < 0, junk, out[b, h, slots])
    return out.to(device)


def run_case(grp, rows, dim, dtype, num_splits, indices=None, seq_lens=SEQ_LENS, width=24,
             device="cpu", config=SMALL, num_kv=2, seed=0):  # fmt: skip
    batch = make_paged(seq_lens, num_kv, dim, dtype, device=device, seed=seed)
    Hq = num_kv * grp
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(len(seq_lens), Hq + 2, dim, generator=g).to(dtype).to(device)
    q = qkv[:, :Hq]  # a strided view, as SGLang passes it
    if indices is None:
        indices = random_lists(seq_lens, Hq // rows, width, seed + 2, device)
    plan = plan_sparse_decode(
        batch_size=len(seq_lens), num_q_heads=Hq, head_dim=dim, rows=rows,
        width=indices.shape[2], num_sink=SINK, device=device, num_splits=num_splits,
        config=config,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(dim)
    lse = torch.empty(len(seq_lens), Hq, device=device)
    args = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
            batch.seq_lens)  # fmt: skip
    out = run_sparse_decode(plan, *args, indices, scale, lse=lse)
    ref_out, ref_lse = sparse_decode_reference(*args, indices, SINK, scale)
    return out, lse, ref_out, ref_lse, indices


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "grp,rows,dim,dtype",
    [(4, 4, 32, torch.bfloat16), (4, 1, 16, torch.float16), (3, 3, 16, torch.float16),
     (1, 1, 32, torch.bfloat16)],
)  # fmt: skip
def test_sparse_decode_matches_reference(grp, rows, dim, dtype, num_splits):
    """One list per KV head (rows = group) or per query head (rows = 1), one split or several;
    padding, positions past the row, sink positions in the list and short rows."""
    out, lse, ref_out, ref_lse, _ = run_case(grp, rows, dim, dtype, num_splits)
    assert torch.isfinite(out.float()).all()
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # the padded row


def test_sparse_decode_only_sinks_and_empty_lists():
    """All-padding lists: attention over the sinks alone (every row has at most 4 keys)."""
    idx = torch.full((len(SEQ_LENS), 2, 8), -1, dtype=torch.int32)
    out, lse, ref_out, ref_lse, _ = run_case(4, 4, 16, torch.float16, 2, indices=idx)
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_duplicate_positions_count_once_per_occurrence():
    """A position listed twice gets twice its weight: the same as listing it once with its score
    raised by log 2."""
    seq_lens = [60]
    idx = torch.tensor([[[10, 20, 20, 33, -1]]], dtype=torch.int32)
    out, _, ref_out, _, _ = run_case(4, 4, 16, torch.float16, 1, indices=idx, seq_lens=seq_lens,
                                     num_kv=1)  # fmt: skip
    _close(out, ref_out)
    batch = make_paged(seq_lens, 1, 16, torch.float16, seed=0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 16, generator=g).to(torch.float16)[:, :4]
    pos = torch.tensor([0, 1, 2, 3, 10, 20, 33])
    slots = batch.req_to_token[int(batch.req_pool_indices[0]), pos].long()
    k, v = batch.k_buffer[slots, 0].float(), batch.v_buffer[slots, 0].float()
    s = q[0].float() @ k.T / 4.0
    s[:, 5] += math.log(2.0)
    want = torch.softmax(s, -1) @ v
    _close(out[0], want)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_filled_reads_only_the_first_entries(num_splits):
    """``filled``: a list's entries past its count are not read. With the count of valid
    entries the output and log-sum-exp are bit-equal to the call without it; with a smaller
    count, equal to the list cut there (the rest set to -1)."""
    seq_lens = [0, 37, 150, 301]
    lists = random_lists(seq_lens, 2, 24, seed=5)
    valid = lists >= 0
    order = torch.argsort((~valid).int(), dim=-1, stable=True)  # valid entries first
    compact = torch.gather(lists, 2, order).contiguous()
    count = torch.gather(valid, 2, order).sum(-1).int()
    batch = make_paged(seq_lens, 2, 16, torch.float16, seed=6)
    q = torch.randn(len(seq_lens), 8, 16, generator=torch.Generator().manual_seed(7)).half()
    plan = plan_sparse_decode(batch_size=len(seq_lens), num_q_heads=8, head_dim=16, rows=4,
                              width=24, num_sink=SINK, device="cpu", num_splits=num_splits,
                              config=SMALL)  # fmt: skip
    args = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
            batch.seq_lens)  # fmt: skip
    lse_a, lse_b = torch.empty(len(seq_lens), 8), torch.empty(len(seq_lens), 8)
    whole = run_sparse_decode(plan, *args, compact, 0.25, lse=lse_a)
    bounded = run_sparse_decode(plan, *args, compact, 0.25, lse=lse_b, filled=count)
    assert torch.equal(whole, bounded) and torch.equal(lse_a, lse_b)
    short = (count // 2).int()
    cut = torch.where(torch.arange(24) < short[..., None], compact, -1).contiguous()
    want = run_sparse_decode(plan, *args, cut, 0.25)
    got = run_sparse_decode(plan, *args, compact, 0.25, filled=short)
    assert torch.equal(got, want)
    assert int(count.max()) > int(short.max()) > 0


def test_splits_from_the_shape():
    assert choose_sparse_splits(1, 8, 2625, num_sms=132, config=SparseDecodeConfig()) == 21
    assert choose_sparse_splits(32, 8, 2625, num_sms=132, config=SparseDecodeConfig()) == 5
    assert choose_sparse_splits(64, 32, 100, num_sms=132, config=SparseDecodeConfig()) == 1


# ---- GPU: the 8B shape ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 1])
def test_sparse_decode_gpu_8b_shape(rows):
    lens = [1, 300, 4097, 32768, 20011]
    out, lse, ref_out, ref_lse, _ = run_case(
        4, rows, 128, torch.bfloat16, None, seq_lens=lens, width=700, device="cuda",
        config=SparseDecodeConfig(), num_kv=8,
    )  # fmt: skip
    _close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_stores_are_readable_on_the_queries_device_or_pinned_on_the_host_only():
    from redknot.kernels.geometry import store_readable

    q = torch.zeros(1, 2, 4)
    assert store_readable(torch.zeros(3, 1, 4), q)
    assert not store_readable(torch.zeros(3, 1, 4, device="meta"), q)
    # a host store for GPU queries must be pinned (checked with real tensors in
    # tests/lfps/test_batched.py::test_step_over_pinned_host_kv_equals_the_step_over_device_kv)
