"""The batched, fixed-shape LFPS step against the per-request reference ``lfps_step``; the
fixed-capacity candidate rule; the Triton path against the PyTorch path."""

from __future__ import annotations

import math

import pytest
import torch
from kernels.paged_data import make_paged, random_lfps_state

from redknot.lfps import LfpsParams, build_state, lfps_step
from redknot.lfps.batch_state import pack_states
from redknot.lfps.batched import LfpsBudgets, host_stages, lfps_decode_step
from redknot.lfps.candidates import expand_candidates, initial_candidates
from redknot.lfps.fixed_budget import (
    BINS_PER_OCTAVE,
    NUM_BINS,
    candidates_reference,
    tables_by_position,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter

HQ, HKV, D, M = 4, 2, 16, 8
GRP = HQ // HKV


def requests(prompt_lens, steps, seed, sink_boost=()):
    """Per request: history queries [Hq, M, D], keys/values [n0 + steps, Hkv, D] and the decode
    queries [steps, Hq, D]; requests in ``sink_boost`` get large sink keys (bypassing heads)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, n0 in enumerate(prompt_lens):
        k = torch.randn(n0 + steps, HKV, D, generator=g)
        if b in sink_boost:
            k[:4] *= 4.0
        v = torch.randn(n0 + steps, HKV, D, generator=g)
        out.append(
            (torch.randn(HQ, M, D, generator=g), k, v, torch.randn(steps, HQ, D, generator=g))
        )
    return out


def expanded(x: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, D] -> [Hq, n, D], as the reference takes K/V."""
    return x.repeat_interleave(GRP, 1).transpose(0, 1)


def positions(lists: torch.Tensor) -> set[int]:
    return {int(p) for p in lists.flatten() if p >= 0}


def test_batched_step_equals_reference():
    """rows = 1, capacity above every candidate count: candidates, bypass, selection, output
    and tables equal the reference's at every step, for requests of different lengths."""
    params = LfpsParams(budget=0.1, history_steps=M)
    prompt_lens, steps = [40, 57, 80], 4
    reqs = requests(prompt_lens, steps, seed=0, sink_boost=(0,))
    ref = [build_state(qh, expanded(k[:n0]), expanded(v[:n0]), params)
           for (qh, k, v, _), n0 in zip(reqs, prompt_lens)]  # fmt: skip
    max_len = max(prompt_lens) + steps
    state = pack_states(ref, max_len, rows=1, num_kv_heads=HKV)
    totals = [n0 + steps for n0 in prompt_lens]
    batch = make_paged(totals, HKV, D, torch.float32, keys=[r[1] for r in reqs],
                       values=[r[2] for r in reqs])  # fmt: skip
    budgets = LfpsBudgets(candidates=max_len, topk=params.budget_for(max_len))
    bypassed = kept = 0
    for step in range(steps):
        lens = [n0 + step + 1 for n0 in prompt_lens]
        q = torch.stack([r[3][step] for r in reqs])
        res = lfps_decode_step(
            q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
            torch.tensor(lens), state, params, budgets, kernels=False,
        )  # fmt: skip
        vert, slash = state.true_tables()
        for b, ((_, k, v, qs), n) in enumerate(zip(reqs, lens)):
            want = lfps_step(qs[step], expanded(k[:n]), expanded(v[:n]), ref[b], params)
            ref[b] = want.state
            assert torch.equal(res.bypass[b], want.bypass)
            bypassed += int(want.bypass.sum())
            kept += int((~want.bypass).sum())
            for h in range(HQ):
                assert positions(res.candidates[b, h]) == set(
                    want.candidates[h].nonzero()[:, 0].tolist()
                )
                assert int(res.candidate_count[b, h]) == int(want.candidates[h].sum())
                chosen = set(want.selected[h].nonzero()[:, 0].tolist()) - set(range(4))
                assert positions(res.selected[b, h]) == chosen
            torch.testing.assert_close(res.output[b], want.output, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vert[b, :, :n], want.state.vertical, atol=1e-7, rtol=1e-5)
            torch.testing.assert_close(slash[b, :, :n], want.state.slash, atol=1e-7, rtol=1e-5)
            assert not vert[b, :, n:].any() and not slash[b, :, n:].any()
    assert bypassed > 0 and kept > 0  # both branches of Eq. 6 were taken


def loop_fixed_rule(v, sl, mean_v, mean_s, cand_positions, capacity):
    """The capacity rule by a loop on one row: binned priorities, highest bins first, newest
    first within the cut bin."""

    def level(j):
        r = max(v[j] / mean_v if mean_v > 0 else 0.0, sl[j] / mean_s if mean_s > 0 else 0.0)
        return int(min(max(math.log2(max(r, 1e-30)) * BINS_PER_OCTAVE, 0.0), NUM_BINS - 1.0))

    if len(cand_positions) <= capacity:
        return set(cand_positions)
    ordered = sorted(cand_positions, key=lambda j: (-level(j), -j))
    return set(ordered[:capacity])


@pytest.mark.parametrize("capacity", [1000, 30, 9, 1])
def test_fixed_capacity_rule(capacity):
    """Eq. 7-9 on padded rows equal the reference's on each row; over capacity, the kept set is
    the loop's rule and the list is newest first, -1 padded."""
    torch.manual_seed(3)
    B, Hs, N, s = 3, 2, 200, 4
    lens = torch.tensor([200, 133, 6])
    vert, slash = torch.rand(B, Hs, N) ** 6, torch.rand(B, Hs, N) ** 6
    for b, n in enumerate(lens.tolist()):
        vert[b, :, n - 1 :] = 0
        slash[b, :, n - 1 :] = 0
        vert[b, :, :s] = 0
    scale = torch.rand(B, Hs) + 0.5
    params = LfpsParams(lam=0.3)
    got, count = candidates_reference(vert, slash, scale, lens, params, capacity)
    v_pos, sl_pos, _ = tables_by_position(vert, slash, scale, lens, s)
    for b, n in enumerate(lens.tolist()):
        tv, ts = vert[b, :, :n] * scale[b, :, None], slash[b, :, :n] * scale[b, :, None]
        want = expand_candidates(initial_candidates(tv, ts, params), tv, ts, params)
        for h in range(Hs):
            cand = want[h].nonzero()[:, 0].tolist()
            assert int(count[b, h]) == len(cand)
            row = got[b, h].tolist()
            listed = [p for p in row if p >= 0]
            assert listed == sorted(listed, reverse=True) and row[len(listed) :] == [-1] * (
                capacity - len(listed)
            )  # fmt: skip
            v, sl = v_pos[b, h].tolist(), sl_pos[b, h].tolist()
            mean_v, mean_s = sum(v[s:n]) / (n - s), sum(sl[s:n]) / (n - s)
            assert set(listed) == loop_fixed_rule(v, sl, mean_v, mean_s, cand, capacity)


@pytest.mark.parametrize("k", [3, 7])
def test_union_selection_is_the_union_of_each_query_heads_own_top_k(k):
    """``select_topk(union=True)`` against a loop: every non-bypassed query head's ``budget``
    largest logits among its list's candidates (ties to the lowest list index), united per
    list, in list order, -1 after; the logits gathered per query head; a list whose heads all
    bypass selects nothing."""
    from redknot.lfps.batched import select_topk

    g = torch.Generator().manual_seed(11)
    B, Hq, Hs, C = 3, 6, 2, 16
    rows = Hq // Hs
    logits = torch.randn(B, Hq, C, generator=g).round(decimals=1)  # ties
    logits[0, :, 12:] = float("-inf")  # a short list
    candidates = torch.randperm(100, generator=g)[: B * Hs * C].view(B, Hs, C).int()
    bypass = torch.zeros(B, Hq, dtype=torch.bool)
    bypass[1, 0] = True
    bypass[2, 3:] = True  # the second list's heads all bypass
    budget = torch.tensor([k, k - 1, 2])
    selected, per_head = select_topk(logits, candidates, bypass, budget, k, union=True)
    width = min(rows * k, C)
    assert selected.shape == (B, Hs, width) and per_head.shape == (B, Hq, width)
    for b in range(B):
        for s in range(Hs):
            united: set[int] = set()
            for h in range(s * rows, (s + 1) * rows):
                if bypass[b, h]:
                    continue
                entries = [(-float(logits[b, h, e]), e) for e in range(C)
                           if math.isfinite(float(logits[b, h, e]))]  # fmt: skip
                united |= {e for _, e in sorted(entries)[: int(budget[b])]}
            order = sorted(united)
            n = len(order)
            assert selected[b, s, :n].tolist() == [int(candidates[b, s, e]) for e in order]
            assert (selected[b, s, n:] == -1).all()
            for h in range(s * rows, (s + 1) * rows):
                assert per_head[b, h, :n].tolist() == [float(logits[b, h, e]) for e in order]
                assert torch.isinf(per_head[b, h, n:]).all()
    assert (selected[2, 1] == -1).all()


@pytest.mark.parametrize("rows, union", [(1, 1), (GRP, 1), (GRP, GRP)])
def test_triton_path_matches_reference_path(rows, union):
    """The kernels (interpreter) against their references inside the step, fp16 store, with
    overflowing candidate lists; rows = group shares a list per KV head (union: the union of
    its query heads' own Top-k)."""
    params = LfpsParams(budget=5, history_steps=M, lam=0.0)
    prompt_lens, steps = [60, 33], 2
    reqs = requests(prompt_lens, steps, seed=1)
    ref = [build_state(qh, expanded(k[:n0]), expanded(v[:n0]), params)
           for (qh, k, v, _), n0 in zip(reqs, prompt_lens)]  # fmt: skip
    max_len = max(prompt_lens) + steps
    states = [pack_states(ref, max_len, rows=rows, num_kv_heads=HKV) for _ in range(2)]
    batch = make_paged([n0 + steps for n0 in prompt_lens], HKV, D, torch.float16,
                       keys=[r[1] for r in reqs], values=[r[2] for r in reqs])  # fmt: skip
    budgets = LfpsBudgets(candidates=12, topk=5, union=union)
    overflow = False
    for step in range(steps):
        lens = torch.tensor([n0 + step + 1 for n0 in prompt_lens])
        q = torch.stack([r[3][step] for r in reqs]).half()
        args = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
                lens)  # fmt: skip
        got = lfps_decode_step(*args, states[0], params, budgets, kernels=True)
        want = lfps_decode_step(*args, states[1], params, budgets, kernels=False)
        assert torch.equal(got.candidates, want.candidates)
        assert torch.equal(got.candidate_count, want.candidate_count)
        assert torch.equal(got.selected, want.selected)
        assert got.selected.shape[2] == budgets.width
        torch.testing.assert_close(got.output.float(), want.output.float(), atol=4e-3, rtol=4e-3)
        for a, b in zip(states[0].true_tables(), states[1].true_tables()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
        overflow |= bool((got.candidate_count > budgets.candidates).any())
    assert overflow


@pytest.mark.parametrize("union", [1, GRP])
def test_shared_selection_with_identical_heads_equals_per_head(union):
    """rows = group: when a KV head's query heads are identical (same query, same history) the
    shared selection, and the union of the heads' own, is each head's own, so it equals the
    reference per query head."""
    params = LfpsParams(budget=0.1, history_steps=M)
    prompt_lens, steps = [50, 71], 3
    reqs = requests(prompt_lens, steps, seed=2)
    reqs = [(qh[::GRP].repeat_interleave(GRP, 0), k, v, qs[:, ::GRP].repeat_interleave(GRP, 1))
            for qh, k, v, qs in reqs]  # fmt: skip
    ref = [build_state(qh, expanded(k[:n0]), expanded(v[:n0]), params)
           for (qh, k, v, _), n0 in zip(reqs, prompt_lens)]  # fmt: skip
    max_len = max(prompt_lens) + steps
    shared = pack_states(ref, max_len, rows=GRP, num_kv_heads=HKV)
    batch = make_paged([n0 + steps for n0 in prompt_lens], HKV, D, torch.float32,
                       keys=[r[1] for r in reqs], values=[r[2] for r in reqs])  # fmt: skip
    budgets = LfpsBudgets(candidates=max_len, topk=params.budget_for(max_len), union=union)
    for step in range(steps):
        lens = [n0 + step + 1 for n0 in prompt_lens]
        q = torch.stack([r[3][step] for r in reqs])
        res = lfps_decode_step(
            q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
            torch.tensor(lens), shared, params, budgets, kernels=False,
        )  # fmt: skip
        assert res.selected.shape[1] == HKV
        for b, ((_, k, v, qs), n) in enumerate(zip(reqs, lens)):
            want = lfps_step(qs[step], expanded(k[:n]), expanded(v[:n]), ref[b], params)
            ref[b] = want.state
            for h in range(HKV):
                chosen = set(want.selected[h * GRP].nonzero()[:, 0].tolist()) - set(range(4))
                assert positions(res.selected[b, h]) == chosen
            torch.testing.assert_close(res.output[b], want.output, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("union", [1, GRP])
def test_step_with_staged_rows_equals_the_step_over_the_store(union):
    """Issue 28 item 3: scoring the candidates and attending the selection from rows gathered
    into staging buffers (what a store in host memory is read through) changes nothing: outputs,
    candidates, selections and tables bit for bit (Triton path, interpreter)."""
    lens = [70, 41, 3]
    B, n_max = len(lens), max(lens) + 2
    batch = make_paged([n + 1 for n in lens], HKV, D, torch.float16, seed=8)
    state = random_lfps_state(B, HQ, HKV, D, GRP, n_max, seed=9)
    for b, n in enumerate(lens):
        state.vertical[b, :, n - 1 :] = 0
        state.slash[b, :, n - 1 :] = 0
    params = LfpsParams(budget=6, history_steps=M)
    budgets = LfpsBudgets(candidates=14, topk=6, union=union)
    stage = host_stages(B, HKV, D, params, budgets, torch.float16, "cpu")
    seq = torch.tensor([n + 1 for n in lens])
    dense = torch.tensor([False, False, True])
    a, b_ = state.clone(), state.clone()
    q = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(10)).half()
    args = (q, batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices, seq)
    want = lfps_decode_step(*args, a, params, budgets, dense=dense)
    got = lfps_decode_step(*args, b_, params, budgets, dense=dense, stage=stage)
    assert (want.candidate_count > 0).any() and not torch.isnan(want.output).any()
    for field in ("output", "selected", "candidates", "candidate_count", "bypass"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(a.vertical, b_.vertical) and torch.equal(a.scale, b_.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, union", [(1, 1), (4, 1), (4, 4)])
def test_step_cuda_graph_replay_matches_eager(rows, union):
    """The whole Triton step captured once (8B head shape) and replayed over three decode
    steps with new queries and lengths: outputs, selections and tables equal the eager step's
    on a copy of the state."""
    from redknot.kernels.sparse_decode import plan_sparse_decode

    dev, Hq, Hkv, D, B = "cuda", 32, 8, 128, 4
    lens = [5000, 1200, 300, 4096]
    n_max = max(lens) + 4
    batch = make_paged([n + 3 for n in lens], Hkv, D, torch.bfloat16, device=dev, seed=4)
    state = random_lfps_state(B, Hq, Hkv, D, rows, n_max, seed=5)
    for b, n in enumerate(lens):  # tables cover n - 1 keys
        state.vertical[b, :, n - 1 :] = 0
        state.slash[b, :, n - 1 :] = 0
    state = state.to(dev)
    eager = state.clone()
    params = LfpsParams(budget=0.02)
    top = params.budget_for(n_max)
    budgets = LfpsBudgets(candidates=(8 if union > 1 else 4) * top, topk=top, union=union)
    plan = plan_sparse_decode(batch_size=B, num_q_heads=Hq, head_dim=D, rows=rows,
                              width=budgets.width, num_sink=4, device=dev)  # fmt: skip
    q = torch.empty(B, Hq, D, device=dev, dtype=torch.bfloat16)
    seq = torch.tensor(lens, device=dev)
    paged = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices)
    scratch = state.clone()
    q.normal_()
    lfps_decode_step(q, *paged, seq, scratch, params, budgets, plan=plan)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = lfps_decode_step(q, *paged, seq, state, params, budgets, plan=plan)
    for step in range(3):
        q.normal_()
        seq.copy_(torch.tensor([n + step + 1 for n in lens], device=dev))
        graph.replay()
        want = lfps_decode_step(q, *paged, seq, eager, params, budgets, plan=plan)
        torch.cuda.synchronize()
        assert torch.equal(res.selected, want.selected)
        torch.testing.assert_close(res.output, want.output, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(state.vertical, eager.vertical, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(state.scale, eager.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["host", "tiered"])
@pytest.mark.parametrize("rows, union", [(1, 1), (4, 1), (4, 4)])
def test_step_over_pinned_host_kv_equals_the_step_over_device_kv(rows, union, store):
    """Issue 28 item 3: the Triton step reading K/V from pinned host memory (over PCIe, through
    unified addressing), or from a tiered store (``redknot.pool.vmm``: its first 4,096 slots in
    GPU memory, the rest in host memory, one tensor), eagerly, through staging buffers (lists
    per KV head) and replayed from a CUDA graph, gives what it gives over the same K/V in GPU
    memory: outputs, selections and tables bit for bit."""
    from redknot.kernels.sparse_decode import plan_sparse_decode
    from redknot.pool.vmm import tiered_tensor

    dev, Hq, Hkv, D, B = "cuda", 32, 8, 128, 3
    lens = [6000, 700, 3000]
    n_max = max(lens) + 2
    batch = make_paged([n + 1 for n in lens], Hkv, D, torch.bfloat16, device=dev, seed=6)
    if store == "host":
        host_k, host_v = batch.k_buffer.cpu().pin_memory(), batch.v_buffer.cpu().pin_memory()
    else:
        shape, index = tuple(batch.k_buffer.shape), torch.cuda.current_device()
        (host_k, on_k), (host_v, on_v) = (tiered_tensor(shape, torch.bfloat16, index, 4096)
                                          for _ in range(2))  # fmt: skip
        assert on_k == on_v == 4096 < shape[0]
        host_k.copy_(batch.k_buffer)
        host_v.copy_(batch.v_buffer)
    state = random_lfps_state(B, Hq, Hkv, D, rows, n_max, seed=7)
    for b, n in enumerate(lens):
        state.vertical[b, :, n - 1 :] = 0
        state.slash[b, :, n - 1 :] = 0
    state = state.to(dev)
    params = LfpsParams(budget=0.02)
    top = params.budget_for(n_max)
    budgets = LfpsBudgets(candidates=(8 if union > 1 else 4) * top, topk=top, union=union)
    plan = plan_sparse_decode(batch_size=B, num_q_heads=Hq, head_dim=D, rows=rows,
                              width=budgets.width, num_sink=4, device=dev)  # fmt: skip
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    seq = torch.tensor([n + 1 for n in lens], device=dev)
    paged = (batch.req_to_token, batch.req_pool_indices, seq)
    on_gpu, on_host, graphed = state.clone(), state.clone(), state.clone()
    want = lfps_decode_step(q, batch.k_buffer, batch.v_buffer, *paged, on_gpu, params, budgets,
                            plan=plan)  # fmt: skip
    got = lfps_decode_step(q, host_k, host_v, *paged, on_host, params, budgets, plan=plan)
    stage = None
    if rows == Hq // Hkv:  # lists per KV head: also through staging buffers
        stage = host_stages(B, Hkv, D, params, budgets, torch.bfloat16, dev)
    staged_state = state.clone()
    staged = lfps_decode_step(q, host_k, host_v, *paged, staged_state, params, budgets,
                              plan=plan, stage=stage)  # fmt: skip
    scratch = state.clone()
    lfps_decode_step(q, host_k, host_v, *paged, scratch, params, budgets, plan=plan, stage=stage)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = lfps_decode_step(q, host_k, host_v, *paged, graphed, params, budgets,
                                    plan=plan, stage=stage)  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert (want.candidate_count > 0).any()
    for res, st in ((got, on_host), (staged, staged_state), (replayed, graphed)):
        assert torch.equal(res.selected, want.selected)
        assert torch.equal(res.output, want.output)
        assert torch.equal(st.vertical, on_gpu.vertical) and torch.equal(st.scale, on_gpu.scale)
