"""The held rows of a reusing extend cut into runs (``redknot.kernels.row_runs``): the runs,
their key lists, the PyTorch reference against a row-by-row brute force, and FlashInfer's run
against the reference on the GPU at the 8B shape."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.row_runs import (
    RowRuns,
    row_runs,
    run_kv_indices,
    runs_attention_reference,
    runs_pay,
    tile_keys,
)


def _batch(prefix: list[int], lens: list[int], seed: int, device="cpu"):
    """Token slots of each request (a permutation, so a wrong slot is a wrong key)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    width = max(p + n for p, n in zip(prefix, lens)) + 3
    slots = torch.randperm(B * width, generator=g).view(B, width).to(torch.int32)
    req_to_token = torch.zeros(B + 2, width, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3, 1][:B], dtype=torch.int64)
    req_to_token[rpi] = slots
    qo = torch.zeros(B + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(lens), 0)
    return req_to_token.to(device), rpi.to(device), qo, torch.tensor(prefix, dtype=torch.int32)


def test_runs_are_the_maximal_stretches_of_consecutive_rows_of_one_request():
    # request 0: rows 0-5 (prefix 10), request 1: rows 6-9 (prefix 0), request 2: rows 10-12
    qo = torch.tensor([0, 6, 10, 13], dtype=torch.int32)
    prefix = torch.tensor([10, 0, 4], dtype=torch.int32)
    keep = torch.zeros(13, dtype=torch.bool)
    keep[[0, 1, 3, 4, 5, 6, 7, 9, 12]] = True  # 5 and 6 touch but belong to two requests
    runs = row_runs(keep, qo, prefix)
    assert runs.qo_indptr.tolist() == [0, 2, 5, 7, 8, 9]
    assert runs.request.tolist() == [0, 0, 1, 1, 2]
    # each run's keys end at its last row's position: prefix + row - first row + 1
    assert runs.kv_lens.tolist() == [10 + 2, 10 + 6, 0 + 2, 0 + 4, 4 + 3]
    assert runs.kv_indptr.tolist() == [0, 12, 28, 30, 34, 41]
    assert runs.keys_read == 41


def test_no_held_row_gives_no_run():
    runs = row_runs(torch.zeros(5, dtype=torch.bool), torch.tensor([0, 5]), torch.tensor([3]))
    assert (
        runs.num_runs == 0
        and runs.qo_indptr.tolist() == [0]
        and not runs_pay(runs, [0], torch.tensor([0, 5]), torch.tensor([3]), 32)
    )


def test_runs_pay_where_they_read_no_more_keys_than_the_tiles():
    qo = torch.tensor([0, 4096], dtype=torch.int32)
    prefix = torch.tensor([0], dtype=torch.int32)
    # EPIC-like: the first 16 rows of each of 8 segments and the last 64 rows
    keep = torch.zeros(4096, dtype=torch.bool)
    for s in range(8):
        keep[s * 504 : s * 504 + 16] = True
    keep[-64:] = True
    runs = row_runs(keep, qo, prefix)
    counts = [int(keep.sum())]
    assert runs.num_runs == 9
    assert tile_keys(counts, qo, prefix, 32) == 6 * 4096
    assert runs.keys_read <= 6 * 4096 and runs_pay(runs, counts, qo, prefix, 32)
    # every seventh row (a CacheBlend-like choice): a run per row reads far more keys
    keep = torch.zeros(4096, dtype=torch.bool)
    keep[::7] = True
    runs = row_runs(keep, qo, prefix)
    assert runs.num_runs == int(keep.sum())
    assert not runs_pay(runs, [int(keep.sum())], qo, prefix, 32)


def test_run_kv_indices_list_each_runs_slots_up_to_its_end():
    prefix, lens = [5, 0, 7], [9, 6, 4]
    req_to_token, rpi, qo, pre = _batch(prefix, lens, seed=1)
    keep = torch.zeros(sum(lens), dtype=torch.bool)
    keep[[1, 2, 3, 8, 9, 11, 14, 15, 18]] = True
    runs = row_runs(keep, qo, pre)
    got = run_kv_indices(runs, rpi, req_to_token)
    want = torch.cat(
        [req_to_token[rpi[b], :n] for b, n in zip(runs.request.tolist(), runs.kv_lens.tolist())]
    )
    assert got.dtype == torch.int32 and torch.equal(got, want)


def _brute_force(q, k_cache, v_cache, keep, qo, prefix, req_to_token, rpi, scale, cap):
    """Each held row on its own: softmax over its request's keys at or before its position
    (logits capped at ``cap`` by ``cap * tanh(x / cap)`` when ``cap > 0``)."""
    rows = keep.nonzero().squeeze(1).tolist()
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, row in enumerate(rows):
        b = int(torch.searchsorted(qo, torch.tensor(row), right=True)) - 1
        pos = int(prefix[b]) + row - int(qo[b])
        slots = req_to_token[rpi[b], : pos + 1].long()
        for h in range(q.shape[1]):
            kh = k_cache[slots, h // group].float()
            x = kh @ q[i, h].float() * scale
            p = torch.softmax(cap * torch.tanh(x / cap) if cap else x, 0)
            out[i, h] = p @ v_cache[slots, h // group].float()
    return out


@pytest.mark.parametrize("logit_cap", [0.0, 7.5])
def test_the_reference_over_runs_equals_each_row_attending_its_own_keys(logit_cap):
    prefix, lens = [11, 0, 3], [17, 9, 12]
    req_to_token, rpi, qo, pre = _batch(prefix, lens, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(sum(lens), generator=g) < 0.5
    keep[qo[1:].long() - 1] = True  # each request's last row, as served
    runs = row_runs(keep, qo, pre)
    S = int(req_to_token.max()) + 1
    q = 3 * torch.randn(int(keep.sum()), 8, 16, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(S, 2, 16, generator=g, dtype=torch.float64) for _ in "kv")
    out = runs_attention_reference(
        q, k_cache, v_cache, runs, run_kv_indices(runs, rpi, req_to_token), 0.3, logit_cap
    )
    want = _brute_force(q, k_cache, v_cache, keep, qo, pre, req_to_token, rpi, 0.3, logit_cap)
    torch.testing.assert_close(out.float(), want, atol=1e-5, rtol=1e-5)


def test_every_row_held_is_one_run_per_request():
    """The limit where nothing left recovery: one run per request, its whole extend."""
    qo = torch.tensor([0, 7, 7, 12], dtype=torch.int32)  # request 1 has no new row
    runs = row_runs(torch.ones(12, dtype=torch.bool), qo, torch.tensor([3, 9, 0]))
    assert isinstance(runs, RowRuns) and runs.request.tolist() == [0, 2]
    assert runs.qo_indptr.tolist() == [0, 7, 12] and runs.kv_lens.tolist() == [10, 5]


@pytest.mark.gpu
def test_flashinfer_runs_equal_the_reference_at_the_8b_shape():
    """32 query / 8 KV heads, D 128, bf16: EPIC-like runs over 32K- and 5K-token requests with
    cached prefixes, plus scattered single rows."""
    from redknot.kernels.row_runs import RunsAttention

    prefix, lens = [0, 1000, 300], [32768, 4096, 700]
    req_to_token, rpi, qo, pre = _batch(prefix, lens, seed=7, device="cuda")
    keep = torch.zeros(sum(lens), dtype=torch.bool)
    for s in range(8):
        keep[s * 4096 : s * 4096 + 16] = True
    keep[32768 - 64 : 32768] = True
    keep[32768 : 32768 + 4096 : 97] = True
    keep[32768 + 4096 :] = True
    runs = row_runs(keep, qo, pre)
    S = int(req_to_token.max()) + 1
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(int(keep.sum()), 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k_cache, v_cache = (
        torch.randn(S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fi = RunsAttention(workspace, 32, 8, 128, torch.bfloat16)
    fi.plan(runs, rpi, req_to_token)
    out = fi.run(q, k_cache, v_cache, 0.088)
    ref = runs_attention_reference(
        q, k_cache, v_cache, runs, run_kv_indices(runs, rpi, req_to_token), 0.088
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
