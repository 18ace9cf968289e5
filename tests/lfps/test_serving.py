"""LFPS in the server (redknot.lfps.serving) on the CPU references: the state built from a
prefill's queries equals the reference's, the decode of a batch's slot holders equals the batched
step on that state, rows are kept contiguous as requests leave, and at the exact limit (every key
a candidate and attended) the decode equals dense attention."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from kernels.paged_data import make_paged

from redknot.lfps import LfpsParams, build_state
from redknot.lfps.batch_state import pack_states
from redknot.lfps.batched import LfpsBudgets, lfps_decode_step
from redknot.lfps.serving import LfpsServing, LfpsShape, LfpsStore, build_tables, state_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HQ, HKV, D, M = 4, 2, 16, 8
GRP = HQ // HKV
SCALE = 1.0 / math.sqrt(D)


def expanded(x: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, D] -> [Hq, n, D], as the reference takes K/V."""
    return x.repeat_interleave(GRP, 1).transpose(0, 1)


@pytest.mark.parametrize("rows", [1, GRP])
@pytest.mark.parametrize("m", [M, 3])
def test_build_tables_equals_the_reference(rows, m):
    """Tables, priors and query statistic equal build_state's on K/V expanded to the query
    heads, averaged per selection head as pack_states does; with fewer queries than
    history_steps (a short last extend) the tables are built from those."""
    g = torch.Generator().manual_seed(1)
    n = 50
    params = LfpsParams(history_steps=M)
    q = torch.randn(m, HQ, D, generator=g)
    k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    vert, sl, mk, mv, qs = build_tables(q, k, v, params, rows, SCALE)
    ref = build_state(q.transpose(0, 1), expanded(k), expanded(v), params)
    want = pack_states([ref], n, rows=rows, num_kv_heads=HKV)
    torch.testing.assert_close(vert, want.vertical[0], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(sl, want.slash[0], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(mk, want.mean_key[0])
    torch.testing.assert_close(mv, want.mean_value[0])
    torch.testing.assert_close(qs, want.query_stat[0])
    assert abs(float(vert.sum()) - 0.5 * HQ // rows) < 1e-4  # Eq. 4's normalisation


class Server:
    """A paged store of ``lens[b]`` keys per request and the LFPS serving over it."""

    def __init__(self, prompt_lens, steps, *, slots=4, min_tokens=20, mode="lfps", rows=1,
                 params=None, factor=4, seed=0, kernels=False, dtype=torch.float32,
                 heads=(HQ, HKV, D), device="cpu"):  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.prompt_lens, self.steps = prompt_lens, steps
        self.hq, hkv, self.d = heads
        totals = [n + steps for n in prompt_lens]
        self.keys = [torch.randn(n, hkv, self.d, generator=g) for n in totals]
        self.values = [torch.randn(n, hkv, self.d, generator=g) for n in totals]
        self.batch = make_paged(totals, hkv, self.d, dtype, keys=self.keys, values=self.values,
                                device=device)  # fmt: skip
        self.params = params or LfpsParams(budget=0.1, history_steps=M)
        self.shape = LfpsShape(num_layers=2, num_q_heads=self.hq, num_kv_heads=hkv,
                               head_dim=self.d, rows=rows, max_len=max(totals) + 3)  # fmt: skip
        self.store = LfpsStore(self.shape, slots, device)
        self.serving = LfpsServing(
            mode, self.params, self.shape, self.store, self.batch.req_to_token,
            min_tokens=min_tokens, candidate_factor=factor, kernels=kernels,
        )  # fmt: skip
        self.prefill_q = [torch.randn(n, self.hq, self.d, generator=g).to(device)
                          for n in prompt_lens]  # fmt: skip
        self.decode_q = [torch.randn(steps, self.hq, self.d, generator=g).to(device)
                         for _ in prompt_lens]  # fmt: skip
        self.scale = 1.0 / math.sqrt(self.d)

    def rid(self, b):
        return f"r{b}"

    def prefill(self, which):
        """One extend of the whole prompts of requests ``which`` (every layer)."""
        lens = [self.prompt_lens[b] for b in which]
        fb = SimpleNamespace(
            rids=[self.rid(b) for b in which], extend_seq_lens_cpu=lens,
            seq_lens_cpu=torch.tensor(lens), req_pool_indices=self.batch.req_pool_indices[which],
        )  # fmt: skip
        self.serving.plan_extend(fb)
        q = (
            torch.cat([self.prefill_q[b] for b in which])
            .view(-1, self.hq * self.d)
            .to(self.batch.k_buffer.dtype)
        )
        for layer in range(self.shape.num_layers):
            self.serving.after_extend(layer, q, self.batch.k_buffer, self.batch.v_buffer,
                                      self.scale)  # fmt: skip

    def decode_batch(self, which, step):
        lens = [self.prompt_lens[b] + step + 1 for b in which]
        fb = SimpleNamespace(
            rids=[self.rid(b) for b in which], seq_lens_cpu=torch.tensor(lens),
            seq_lens=torch.tensor(lens, device=self.batch.k_buffer.device),
            req_pool_indices=self.batch.req_pool_indices[which],
        )  # fmt: skip
        q = torch.stack([self.decode_q[b][step] for b in which])
        return fb, q.to(self.batch.k_buffer.dtype)


def reference_state(srv: Server, which, rows=1) -> list:
    """Per-layer packed reference states of requests ``which`` (both layers alike)."""
    refs = [
        build_state(srv.prefill_q[b][-M:].transpose(0, 1),
                    expanded(srv.keys[b][: srv.prompt_lens[b]]),
                    expanded(srv.values[b][: srv.prompt_lens[b]]), srv.params)
        for b in which
    ]  # fmt: skip
    return [
        pack_states(refs, srv.shape.max_len, rows=rows, num_kv_heads=HKV)
        for _ in range(srv.shape.num_layers)
    ]


def test_prefill_builds_each_long_request_its_row():
    srv = Server([40, 10, 57], steps=2, min_tokens=20)
    srv.prefill([0, 1, 2])
    assert srv.serving.owner == ["r0", "r2"]  # r1 is below --redknot-lfps-min-tokens
    want = reference_state(srv, [0, 2])
    for layer in range(2):
        got = srv.store.view(layer, 2)
        for name in ("vertical", "slash", "mean_key", "mean_value", "query_stat", "scale"):
            torch.testing.assert_close(getattr(got, name), getattr(want[layer], name),
                                       atol=1e-7, rtol=1e-5)  # fmt: skip


def test_decode_of_slot_holders_equals_the_batched_step():
    """A batch of three requests, two holding rows: the plan puts those two in slot order,
    the third among the dense rows; each layer's decode equals lfps_decode_step on the
    reference state, and the store follows its updates."""
    srv = Server([40, 10, 57], steps=3, min_tokens=20)
    srv.prefill([2, 1, 0])  # rows: r2 -> 0, r0 -> 1
    want = reference_state(srv, [2, 0])
    order = [0, 1, 2]  # the decode batch's order differs from the slots'
    for step in range(srv.steps):
        fb, q = srv.decode_batch(order, step)
        plan = srv.serving.plan_decode(fb)
        assert plan.lfps_rows.tolist() == [2, 0] and plan.dense_rows_list == [1]
        longest = max(srv.prompt_lens[b] + step + 1 for b in (0, 2))
        assert plan.topk == srv.params.budget_for(longest - srv.params.num_sink)
        sub_q = q[plan.lfps_rows]
        for layer in range(2):
            got = srv.serving.decode(layer, sub_q, srv.batch.k_buffer, srv.batch.v_buffer,
                                     plan, SCALE)  # fmt: skip
            ref = lfps_decode_step(
                sub_q, srv.batch.k_buffer, srv.batch.v_buffer, srv.batch.req_to_token,
                fb.req_pool_indices[[2, 0]], fb.seq_lens[[2, 0]], want[layer], srv.params,
                LfpsBudgets(candidates=plan.candidates, topk=plan.topk), sm_scale=SCALE,
                kernels=False,
            )  # fmt: skip
            torch.testing.assert_close(got, ref.output)
            torch.testing.assert_close(srv.store.view(layer, 2).vertical, want[layer].vertical)
            torch.testing.assert_close(srv.store.view(layer, 2).scale, want[layer].scale)


def test_a_request_that_leaves_frees_its_row_and_the_rows_stay_contiguous():
    srv = Server([40, 30, 57], steps=2, slots=3, min_tokens=20)
    srv.prefill([0, 1, 2])
    before = srv.store.view(0, 3).vertical.clone()
    fb, _ = srv.decode_batch([0, 2], 0)  # r1 (row 1) finished
    plan = srv.serving.plan_decode(fb)
    assert srv.serving.owner == ["r0", "r2"] and srv.serving.row_of == {"r0": 0, "r2": 1}
    torch.testing.assert_close(srv.store.view(0, 2).vertical[1], before[2])  # moved
    assert plan.lfps_rows.tolist() == [0, 1] and plan.dense_rows_list == []
    fb, _ = srv.decode_batch([2], 1)  # r0 finished: r2 is the last row, nothing moves
    srv.serving.plan_decode(fb)
    assert srv.serving.owner == ["r2"]
    fb, _ = srv.decode_batch([1], 1)
    assert srv.serving.plan_decode(fb) is None and srv.serving.count == 0


def test_when_every_row_is_taken_a_request_decodes_densely():
    srv = Server([40, 30], steps=1, slots=1, min_tokens=20)
    srv.prefill([0, 1])
    assert srv.serving.owner == ["r0"] and srv.serving.refused == 1
    fb, _ = srv.decode_batch([0, 1], 0)
    plan = srv.serving.plan_decode(fb)
    assert plan.lfps_rows.tolist() == [0] and plan.dense_rows_list == [1]
    assert srv.serving.has_rows(fb) and not srv.serving.has_rows(srv.decode_batch([1], 0)[0])


def test_a_synthetic_batch_plans_nothing():
    srv = Server([40], steps=1)
    fb = SimpleNamespace(rids=None, extend_seq_lens_cpu=None)
    srv.serving.plan_extend(fb)
    assert srv.serving.extend_rows == [] and srv.serving.plan_decode(fb) is None


def dense_attention(srv: Server, b: int, q: torch.Tensor, n: int) -> torch.Tensor:
    k, v = expanded(srv.keys[b][:n]), expanded(srv.values[b][:n])  # [Hq, n, D]
    w = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * SCALE, -1)
    return torch.einsum("hn,hnd->hd", w, v)


@pytest.mark.parametrize("mode", ["lfps", "topk"])
@pytest.mark.parametrize("rows", [1, GRP])
def test_the_exact_limit_is_dense_attention(mode, rows):
    """Every key a candidate (lambda far below the tables' spread), the budget every key and no
    bypass: each step's output is dense attention over every key."""
    params = LfpsParams(budget=10**6, lam=-1e9, sparsity_threshold=2.0, history_steps=M)
    srv = Server([40, 57], steps=3, min_tokens=20, mode=mode, rows=rows, params=params,
                 factor=10**3)  # fmt: skip
    srv.prefill([0, 1])
    for step in range(srv.steps):
        fb, q = srv.decode_batch([0, 1], step)
        plan = srv.serving.plan_decode(fb)
        for layer in range(2):
            out = srv.serving.decode(layer, q, srv.batch.k_buffer, srv.batch.v_buffer, plan, SCALE)
            for b in (0, 1):
                n = srv.prompt_lens[b] + step + 1
                torch.testing.assert_close(out[b], dense_attention(srv, b, q[b], n),
                                           atol=1e-5, rtol=1e-5)  # fmt: skip


def test_topk_keeps_each_rows_own_budget():
    """Exact Top-k at a budget below every row's keys: each row attends its sinks and its own
    ``budget_for`` best keys (a shorter row fewer than the batch's K)."""
    params = LfpsParams(budget=0.25, history_steps=M)
    srv = Server([20, 57], steps=1, min_tokens=10, mode="topk", params=params)
    srv.prefill([0, 1])
    fb, q = srv.decode_batch([0, 1], 0)
    plan = srv.serving.plan_decode(fb)
    out = srv.serving.decode(0, q, srv.batch.k_buffer, srv.batch.v_buffer, plan, SCALE)
    for b in (0, 1):
        n = srv.prompt_lens[b] + 1
        k, v = expanded(srv.keys[b][:n]), expanded(srv.values[b][:n])
        logits = torch.einsum("hd,hnd->hn", q[b], k) * SCALE
        keep = params.budget_for(n - 4)
        for h in range(HQ):
            rest = logits[h, 4:]
            top = rest.topk(keep).indices + 4
            pos = torch.cat([torch.arange(4), top])
            w = torch.softmax(logits[h, pos], -1)
            torch.testing.assert_close(out[b, h], w @ v[h, pos], atol=1e-5, rtol=1e-5)


def test_state_bytes_counts_the_store():
    shape = LfpsShape(num_layers=3, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, rows=2,
                      max_len=100)  # fmt: skip
    store = LfpsStore(shape, 5, "cpu")
    held = sum(
        t.numel() * t.element_size()
        for s in store.layers
        for t in (s.vertical, s.slash, s.scale, s.mean_key, s.mean_value, s.query_stat)
    )
    assert state_bytes(shape, 5) == held


@pytest.mark.parametrize("mode", ["lfps", "topk"])
def test_the_kernels_match_the_references_in_the_server_path(mode):
    """The Triton path (interpreter, fp16 store) against the references on the same requests,
    with more rows reserved than used (the step gets a slice of the store) and a row that
    decodes densely in the batch."""
    params = LfpsParams(budget=5, history_steps=M, lam=0.0)
    runs = [Server([60, 10, 33], steps=2, slots=4, min_tokens=20, mode=mode, rows=GRP,
                   params=params, factor=3, kernels=kernels, dtype=torch.float16)
            for kernels in (True, False)]  # fmt: skip
    for srv in runs:
        srv.prefill([0, 1, 2])
    for step in range(2):
        outs = []
        for srv in runs:
            fb, q = srv.decode_batch([1, 0, 2], step)
            plan = srv.serving.plan_decode(fb)
            assert plan.lfps_rows.tolist() == [1, 2]
            sub = q[plan.lfps_rows].contiguous()
            outs.append([srv.serving.decode(layer, sub, srv.batch.k_buffer, srv.batch.v_buffer,
                                            plan, SCALE) for layer in range(2)])  # fmt: skip
        for got, want in zip(*outs):
            torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
        if mode == "lfps":
            for layer in range(2):
                a, b = (srv.store.view(layer, 2).true_tables() for srv in runs)
                torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["lfps", "topk"])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_server_path_on_the_gpu_at_the_8b_shape(mode, rows):
    """32 query / 8 KV heads of 128, bf16, prompts of 4K and 3K tokens plus a short one that
    decodes densely: the kernels against the references (run on the GPU too), two steps."""
    params = LfpsParams(budget=0.02, history_steps=64)
    runs = [Server([4096, 100, 3000], steps=2, slots=3, min_tokens=1024, mode=mode, rows=rows,
                   params=params, kernels=kernels, dtype=torch.bfloat16, heads=(32, 8, 128),
                   device="cuda") for kernels in (True, False)]  # fmt: skip
    for srv in runs:
        srv.prefill([0, 1, 2])
    for step in range(2):
        outs = []
        for srv in runs:
            fb, q = srv.decode_batch([1, 2, 0], step)
            plan = srv.serving.plan_decode(fb)
            assert plan.lfps_rows.tolist() == [2, 1] and plan.dense_rows_list == [0]
            sub = q[plan.lfps_rows].contiguous()
            outs.append([srv.serving.decode(layer, sub, srv.batch.k_buffer, srv.batch.v_buffer,
                                            plan, srv.scale) for layer in range(2)])  # fmt: skip
        for got, want in zip(*outs):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
