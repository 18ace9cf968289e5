"""The rows a reusing extend still computes, attended on FlashInfer's paged prefill
(``redknot.kernels.held_rows``): runs and blocks, their key lists and masks, the PyTorch
reference against a row-by-row brute force, the whole decomposition (plans, masks, merge) with
FlashInfer's semantics stood in for on the CPU, and FlashInfer itself on the GPU at the 8B
shape."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.held_rows import (
    HeldRowsAttention,
    PagedPrefillReference,
    held_rows_reference,
    merge_state_reference,
    row_blocks,
    row_runs,
    runs_pay,
    slot_lists,
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


# request 0: rows 0-5 (prefix 10), request 1: rows 6-9 (prefix 0), request 2: rows 10-12
QO = torch.tensor([0, 6, 10, 13], dtype=torch.int32)
PREFIX = torch.tensor([10, 0, 4], dtype=torch.int32)
KEEP = torch.zeros(13, dtype=torch.bool)
KEEP[[0, 1, 3, 4, 5, 6, 7, 9, 12]] = True  # 5 and 6 touch but belong to two requests


def test_runs_are_the_maximal_stretches_of_consecutive_rows_of_one_request():
    runs = row_runs(KEEP, QO, PREFIX)
    assert runs.qo_indptr.tolist() == [0, 2, 5, 7, 8, 9]
    assert runs.request.tolist() == [0, 0, 1, 1, 2]
    # each run's keys end at its last row's position: prefix + row - first row + 1
    assert runs.kv_lens.tolist() == [10 + 2, 10 + 6, 0 + 2, 0 + 4, 4 + 3]
    assert runs.kv_indptr.tolist() == [0, 12, 28, 30, 34, 41]
    assert runs.keys_read == 41


def test_blocks_group_each_requests_held_rows_by_count():
    blocks = row_blocks(KEEP, QO, PREFIX, block_rows=2)
    # request 0 holds rows 0, 1, 3, 4, 5 (positions 10, 11, 13, 14, 15): blocks of 2, 2, 1
    assert blocks.qo_indptr.tolist() == [0, 2, 4, 5, 7, 8, 9]
    assert blocks.request.tolist() == [0, 0, 0, 1, 1, 2]
    assert blocks.first.tolist() == [10, 13, 15, 0, 3, 6]
    assert blocks.last.tolist() == [11, 14, 15, 1, 3, 6]
    assert blocks.row_pos.tolist() == [10, 11, 13, 14, 15, 0, 1, 3, 6]
    assert blocks.keys_read == 12 + 15 + 16 + 2 + 4 + 7


def test_the_within_mask_lets_each_row_see_its_blocks_keys_up_to_its_position():
    blocks = row_blocks(KEEP, QO, PREFIX, block_rows=3)
    mask, at = blocks.within_mask(), 0
    qo = blocks.qo_indptr.tolist()
    for c in range(blocks.num_blocks):
        first, last = int(blocks.first[c]), int(blocks.last[c])
        for i in range(qo[c], qo[c + 1]):
            want = [first + j <= int(blocks.row_pos[i]) for j in range(last - first + 1)]
            assert mask[at : at + len(want)].tolist() == want
            at += len(want)
    assert at == mask.shape[0]


def test_no_held_row_gives_no_run_and_no_block():
    keep, qo, prefix = torch.zeros(5, dtype=torch.bool), torch.tensor([0, 5]), torch.tensor([3])
    runs, blocks = row_runs(keep, qo, prefix), row_blocks(keep, qo, prefix, 4)
    assert runs.num_runs == blocks.num_blocks == 0 and not runs_pay(runs, blocks)


def test_runs_pay_where_they_read_at_most_twice_the_blocks_keys():
    qo = torch.tensor([0, 4096], dtype=torch.int32)
    prefix = torch.tensor([0], dtype=torch.int32)
    # EPIC-like: the first 16 rows of each of 8 segments and the last 64 rows
    keep = torch.zeros(4096, dtype=torch.bool)
    for s in range(8):
        keep[s * 504 : s * 504 + 16] = True
    keep[-64:] = True
    runs, blocks = row_runs(keep, qo, prefix), row_blocks(keep, qo, prefix, 32)
    assert runs.num_runs == 9 and blocks.num_blocks == 6
    # the blocks [segments 0-1], ..., [segments 6-7], the question in two
    assert blocks.keys_read == 520 + 1528 + 2536 + 3544 + 4064 + 4096
    assert runs.keys_read == 16 + 520 + 1024 + 1528 + 2032 + 2536 + 3040 + 3544 + 4096
    assert blocks.keys_read < runs.keys_read <= 2 * blocks.keys_read and runs_pay(runs, blocks)
    # every seventh row (a CacheBlend-like choice): a run per row reads far more keys
    keep = torch.zeros(4096, dtype=torch.bool)
    keep[::7] = True
    runs, blocks = row_runs(keep, qo, prefix), row_blocks(keep, qo, prefix, 32)
    assert runs.num_runs == int(keep.sum()) and not runs_pay(runs, blocks)


def test_slot_lists_list_each_entrys_slots():
    req_to_token, rpi, _, _ = _batch([5, 0, 7], [9, 6, 4], seed=1)
    request, start, length = (
        torch.tensor([2, 0, 0, 1]),
        torch.tensor([3, 0, 7, 1]),
        torch.tensor([8, 5, 0, 4]),
    )
    got = slot_lists(request, start, length, rpi, req_to_token)
    want = torch.cat([req_to_token[rpi[b], s : s + n] for b, s, n in zip(request, start, length)])
    assert got.dtype == torch.int32 and torch.equal(got, want)


def _case(seed: int, density: float):
    prefix, lens = [11, 0, 3], [17, 9, 40]
    req_to_token, rpi, qo, pre = _batch(prefix, lens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    keep = torch.rand(sum(lens), generator=g) < density
    keep[qo[1:].long() - 1] = True  # each request's last row, as served
    keep[int(qo[1])] = True  # request 1's position 0: a block there has no keys before it
    S = int(req_to_token.max()) + 1
    q = 3 * torch.randn(int(keep.sum()), 8, 16, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(S, 2, 16, generator=g, dtype=torch.float64) for _ in "kv")
    return q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token


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
def test_the_reference_equals_each_row_attending_its_own_keys(logit_cap):
    q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token = _case(3, 0.5)
    out = held_rows_reference(q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token, 0.3,
                              logit_cap)  # fmt: skip
    want = _brute_force(q, k_cache, v_cache, keep, qo, pre, req_to_token, rpi, 0.3, logit_cap)
    torch.testing.assert_close(out.float(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("force", ["runs", "blocks", None])
@pytest.mark.parametrize("density, block_rows", [(0.5, 4), (0.2, 3), (0.9, 32), (1.0, 5)])
def test_runs_and_blocks_equal_the_reference(force, density, block_rows):
    """The decomposition as served (plans, key lists, the within mask, the merge, the block
    at position 0 left out of the merge), FlashInfer's semantics stood in for in PyTorch."""
    q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token = _case(5, density)
    held = HeldRowsAttention(PagedPrefillReference, merge_state_reference, 8, 2, 16,
                             torch.float64, blocks=True, force=force)  # fmt: skip
    plan = held.plan(keep, qo, pre, rpi, req_to_token, block_rows)
    assert type(plan).__name__ == {"runs": "RowRuns", "blocks": "RowBlocks"}.get(
        force, type(plan).__name__
    )
    out = held.run(q, k_cache, v_cache, 0.3)
    want = held_rows_reference(q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token, 0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_runs_at_the_planned_scale_take_the_planned_launch_on_a_strided_query():
    """At the scale the runs were planned with, ``run`` takes the planned launch as it is
    (FlashInfer's ``run``, into an uninitialised output) on the query as the layer has it (a
    view of its fused QKV, rows strided), and equals the reference. A layer at another scale
    restates the launch (FlashInfer's ``forward``) for the rest of the batch; the next plan
    returns to the planned one."""
    q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token = _case(5, 0.5)
    calls = []

    class Recording(PagedPrefillReference):
        def run(self, q, paged_kv, out=None):
            calls.append(("run", q.is_contiguous(), out is not None))
            return super().run(q, paged_kv, out)

        def forward(self, q, paged_kv, causal=False, sm_scale=None, logits_soft_cap=None):
            calls.append(("forward", sm_scale))
            return super().forward(q, paged_kv, causal, sm_scale, logits_soft_cap)

    held = HeldRowsAttention(Recording, merge_state_reference, 8, 2, 16, torch.float64,
                             force="runs", sm_scale=0.3)  # fmt: skip
    fused = torch.cat([q.flatten(1), torch.zeros(q.shape[0], 48, dtype=q.dtype)], 1)
    strided = fused[:, :128].view(-1, 8, 16)

    def want(scale):
        return held_rows_reference(q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token, scale)

    for scale, call in ((0.3, ("run", False, True)), (0.5, ("forward", 0.5)),
                        (0.3, ("forward", 0.3))):  # fmt: skip
        if not calls:
            held.plan(keep, qo, pre, rpi, req_to_token, 4)
        out = held.run(strided, k_cache, v_cache, scale)
        assert calls[-1] == call
        torch.testing.assert_close(out, want(scale), atol=1e-5, rtol=1e-5)
    held.plan(keep, qo, pre, rpi, req_to_token, 4)
    held.run(strided, k_cache, v_cache, 0.3)
    assert calls[-1] == ("run", False, True)


def test_the_blocks_masked_part_may_run_on_another_wrapper():
    """``within_wrapper`` makes the wrapper of the blocks' masked part only (FA3 takes no custom
    mask: FA2 there, FA3 for the rest); the blocks still equal the reference."""
    q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token = _case(5, 0.5)

    class Within(PagedPrefillReference):
        pass

    held = HeldRowsAttention(PagedPrefillReference, merge_state_reference, 8, 2, 16,
                             torch.float64, force="blocks", within_wrapper=Within)  # fmt: skip
    assert type(held.within) is Within
    assert type(held.before) is type(held.runs_wrapper) is PagedPrefillReference
    held.plan(keep, qo, pre, rpi, req_to_token, 4)
    want = held_rows_reference(q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token, 0.3)
    torch.testing.assert_close(held.run(q, k_cache, v_cache, 0.3), want, atol=1e-5, rtol=1e-5)


def test_without_blocks_rows_that_runs_do_not_suit_are_left_to_the_caller():
    *_, keep, qo, pre, rpi, req_to_token = _case(5, 0.5)
    assert row_runs(keep, qo, pre).keys_read > 2 * row_blocks(keep, qo, pre, 8).keys_read
    for blocks, want in ((False, None), (True, "RowBlocks")):
        held = HeldRowsAttention(PagedPrefillReference, merge_state_reference, 8, 2, 16,
                                 torch.float64, blocks=blocks)  # fmt: skip
        plan = held.plan(keep, qo, pre, rpi, req_to_token, 8)
        assert (plan if plan is None else type(plan).__name__) == want
        assert held.plan_of is plan


def test_the_merge_combines_two_key_sets_and_skips_masked_rows():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(12, 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(12, 1, 8, generator=g, dtype=torch.float64)

    def part(lo, hi):
        ref = PagedPrefillReference()
        ref.plan(torch.tensor([0, 5]), torch.tensor([0, hi - lo]), torch.arange(lo, hi),
                 torch.ones(1, dtype=torch.int32), 2, 1, 8, 1)  # fmt: skip
        return ref.forward_return_lse(q, (k.unsqueeze(1), v.unsqueeze(1)), sm_scale=0.5)

    (a, sa), (b, sb), (whole, _) = part(0, 7), part(7, 12), part(0, 12)
    keep_a = a.clone()
    merge_state_reference(a, sa, b, sb, torch.tensor([True, True, False, True, True]))
    torch.testing.assert_close(a[[0, 1, 3, 4]], whole[[0, 1, 3, 4]], atol=1e-6, rtol=1e-6)
    assert torch.equal(a[2], keep_a[2])


def _gpu_case(seed: int):
    prefix, lens = [0, 1000, 300], [32768, 4096, 700]
    req_to_token, rpi, qo, pre = _batch(prefix, lens, seed=seed, device="cuda")
    S = int(req_to_token.max()) + 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache = (
        torch.randn(S, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"
    )
    return req_to_token, rpi, qo, pre, k_cache, v_cache, g


@pytest.mark.gpu
@pytest.mark.parametrize("held_set", ["epic", "scattered"])
@pytest.mark.parametrize("force", ["runs", "blocks", None])
def test_flashinfer_equals_the_reference_at_the_8b_shape(held_set, force):
    """32 query / 8 KV heads, D 128, bf16, FlashInfer's paged prefill: EPIC-like held rows
    (the first 16 of each 4K segment and the question) and CacheBlend-like ones (every row
    with probability 0.15, each request's last), over 32K- and 5K-token requests with cached
    prefixes, as runs, as blocks of 32 (the 8B shape's Triton tile) and as chosen."""
    req_to_token, rpi, qo, pre, k_cache, v_cache, g = _gpu_case(7)
    T = int(qo[-1])
    if held_set == "epic":
        keep = torch.zeros(T, dtype=torch.bool)
        for s in range(8):
            keep[s * 4096 : s * 4096 + 16] = True
        keep[32768 - 64 : 32768] = True
        keep[32768 : 32768 + 4096 : 97] = True
        keep[32768 + 4096 :] = True
    else:
        keep = torch.rand(T, generator=torch.Generator().manual_seed(1)) < 0.15
        keep[qo[1:].long() - 1] = True
    # the queries as a layer has them: a view of its fused QKV (32 + 2 x 8 heads), rows strided
    qkv = torch.randn(int(keep.sum()), 48 * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q = qkv[:, : 32 * 128].view(-1, 32, 128)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    held = HeldRowsAttention.on_flashinfer(workspace, 32, 8, 128, torch.bfloat16, "fa2",
                                           sm_scale=0.088)  # fmt: skip
    held.force, held.blocks = force, True
    plan = held.plan(keep, qo, pre, rpi, req_to_token, 32)
    if force is None:  # runs pay for the EPIC-like rows only
        assert type(plan).__name__ == ("RowRuns" if held_set == "epic" else "RowBlocks")
    for scale in (0.088, 0.05):  # the planned launch, then restated
        out = held.run(q, k_cache, v_cache, scale)
        ref = held_rows_reference(q, k_cache, v_cache, keep, qo, pre, rpi, req_to_token, scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
