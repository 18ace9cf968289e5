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
                 heads=(HQ, HKV, D), device="cpu", union=1, host_kv=False):  # fmt: skip
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
            min_tokens=min_tokens, candidate_factor=factor, union=union, kernels=kernels,
            host_kv_dtype=dtype if host_kv else None,
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
    assert srv.serving.row_of == {"r0": 0, "r2": 1}  # r1 is below --redknot-lfps-min-tokens
    want = reference_state(srv, [0, 2])
    for layer in range(2):
        got = srv.store.layers[layer]
        for name in ("vertical", "slash", "mean_key", "mean_value", "query_stat", "scale"):
            torch.testing.assert_close(getattr(got, name)[:2], getattr(want[layer], name),
                                       atol=1e-7, rtol=1e-5)  # fmt: skip


def test_decode_of_slot_holders_equals_the_batched_step():
    """A batch of three requests, two holding rows: the plan takes those two (their state rows
    in the index), the third among the dense rows; each layer's decode equals lfps_decode_step
    on the reference state, and the store's rows follow its updates."""
    srv = Server([40, 10, 57], steps=3, min_tokens=20)
    srv.prefill([2, 1, 0])  # rows: r2 -> 0, r0 -> 1
    want = reference_state(srv, [0, 2])  # in the decode batch's order
    for step in range(srv.steps):
        fb, q = srv.decode_batch([0, 1, 2], step)
        plan = srv.serving.plan_decode(fb)
        assert plan.lfps_rows.tolist() == [0, 2] and plan.index.tolist() == [1, 0]
        assert plan.dense_rows_list == [1]
        longest = max(srv.prompt_lens[b] + step + 1 for b in (0, 2))
        assert plan.topk == srv.params.budget_for(longest - srv.params.num_sink)
        sub_q = q[plan.lfps_rows]
        for layer in range(2):
            got = srv.serving.decode(layer, sub_q, srv.batch.k_buffer, srv.batch.v_buffer,
                                     plan, SCALE)  # fmt: skip
            ref = lfps_decode_step(
                sub_q, srv.batch.k_buffer, srv.batch.v_buffer, srv.batch.req_to_token,
                fb.req_pool_indices[[0, 2]], fb.seq_lens[[0, 2]], want[layer], srv.params,
                LfpsBudgets(candidates=plan.candidates, topk=plan.topk), sm_scale=SCALE,
                kernels=False,
            )  # fmt: skip
            torch.testing.assert_close(got, ref.output)
            held = srv.store.layers[layer]
            torch.testing.assert_close(held.vertical[[1, 0]], want[layer].vertical)
            torch.testing.assert_close(held.scale[[1, 0]], want[layer].scale)


def test_a_request_that_leaves_frees_its_row_for_the_next():
    srv = Server([40, 30, 57], steps=2, slots=3, min_tokens=20)
    srv.prefill([0, 1, 2])
    before = srv.store.layers[0].vertical.clone()
    srv.serving.release("r1")  # its request slot was freed
    srv.serving.release("r7")  # a request that never held a row
    assert srv.serving.row_of == {"r0": 0, "r2": 2} and srv.serving.free == [1]
    fb, _ = srv.decode_batch([0, 2], 0)
    plan = srv.serving.plan_decode(fb)
    assert plan.index.tolist() == [0, 2] and plan.dense_rows_list == []
    torch.testing.assert_close(srv.store.layers[0].vertical[2], before[2])  # nothing moved
    assert srv.serving.acquire("r9") == 1 and srv.serving.free == []
    srv.serving.release_all()
    fb, _ = srv.decode_batch([1], 1)
    assert srv.serving.plan_decode(fb) is None and srv.serving.count == 0
    assert sorted(srv.serving.free) == [0, 1, 2]


def test_when_every_row_is_taken_a_request_decodes_densely():
    srv = Server([40, 30], steps=1, slots=1, min_tokens=20)
    srv.prefill([0, 1])
    assert srv.serving.row_of == {"r0": 0} and srv.serving.refused == 1
    assert srv.serving.stats() == {  # what GET /redknot/stats reports under "lfps"
        "mode": srv.serving.mode, "rows": 1, "in_use": 1, "refused": 1, "min_tokens": 20,
    }  # fmt: skip
    fb, _ = srv.decode_batch([0, 1], 0)
    plan = srv.serving.plan_decode(fb)
    assert plan.lfps_rows.tolist() == [0] and plan.dense_rows_list == [1]
    assert srv.serving.plan_decode(srv.decode_batch([1], 0)[0]) is None  # no row holder


def test_a_synthetic_batch_plans_nothing():
    srv = Server([40], steps=1)
    fb = SimpleNamespace(rids=None, extend_seq_lens_cpu=None)
    srv.serving.plan_extend(fb)
    assert srv.serving.extend_rows == [] and srv.serving.plan_decode(fb) is None


def dense_attention(srv: Server, b: int, q: torch.Tensor, n: int) -> torch.Tensor:
    k, v = expanded(srv.keys[b][:n]), expanded(srv.values[b][:n])  # [Hq, n, D]
    w = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * SCALE, -1)
    return torch.einsum("hn,hnd->hd", w, v)


@pytest.mark.parametrize("mode, rows, union", [("lfps", 1, 1), ("lfps", GRP, 1),
                                               ("lfps", GRP, GRP), ("topk", 1, 1),
                                               ("topk", GRP, 1)])  # fmt: skip
def test_the_exact_limit_is_dense_attention(mode, rows, union):
    """Every key a candidate (lambda far below the tables' spread), the budget every key and no
    bypass: each step's output is dense attention over every key."""
    params = LfpsParams(budget=10**6, lam=-1e9, sparsity_threshold=2.0, history_steps=M)
    srv = Server([40, 57], steps=3, min_tokens=20, mode=mode, rows=rows, params=params,
                 factor=10**3, union=union)  # fmt: skip
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


@pytest.mark.parametrize("mode, union", [("lfps", 1), ("lfps", GRP), ("topk", 1)])
def test_the_kernels_match_the_references_in_the_server_path(mode, union):
    """The Triton path (interpreter, fp16 store) against the references on the same requests,
    with more rows reserved than used (the step gets a slice of the store) and a row that
    decodes densely in the batch."""
    params = LfpsParams(budget=5, history_steps=M, lam=0.0)
    runs = [Server([60, 10, 33], steps=2, slots=4, min_tokens=20, mode=mode, rows=GRP,
                   params=params, factor=3, kernels=kernels, dtype=torch.float16, union=union)
            for kernels in (True, False)]  # fmt: skip
    for srv in runs:
        srv.prefill([2, 1, 0])  # rows: r2 -> 0, r0 -> 1: the step reads them permuted
    for step in range(2):
        outs = []
        for srv in runs:
            fb, q = srv.decode_batch([1, 0, 2], step)
            plan = srv.serving.plan_decode(fb)
            assert plan.lfps_rows.tolist() == [1, 2] and plan.index.tolist() == [1, 0]
            sub = q[plan.lfps_rows].contiguous()
            outs.append([srv.serving.decode(layer, sub, srv.batch.k_buffer, srv.batch.v_buffer,
                                            plan, SCALE) for layer in range(2)])  # fmt: skip
        for got, want in zip(*outs):
            torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
        if mode == "lfps":
            for layer in range(2):
                a, b = (srv.store.layers[layer].true_tables() for srv in runs)
                torch.testing.assert_close(a[0][:2], b[0][:2], atol=1e-6, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode, rows, union", [("lfps", 1, 1), ("lfps", 4, 1), ("lfps", 4, 4),
                                               ("topk", 1, 1), ("topk", 4, 1)])  # fmt: skip
def test_the_server_path_on_the_gpu_at_the_8b_shape(mode, rows, union):
    """32 query / 8 KV heads of 128, bf16, prompts of 4K and 3K tokens plus a short one that
    decodes densely: the kernels against the references (run on the GPU too), two steps."""
    params = LfpsParams(budget=0.02, history_steps=64)
    runs = [Server([4096, 100, 3000], steps=2, slots=3, min_tokens=1024, mode=mode, rows=rows,
                   params=params, kernels=kernels, dtype=torch.bfloat16, heads=(32, 8, 128),
                   device="cuda", union=union, factor=8 if union > 1 else 4)
            for kernels in (True, False)]  # fmt: skip
    for srv in runs:
        srv.prefill([0, 1, 2])
    for step in range(2):
        outs = []
        for srv in runs:
            fb, q = srv.decode_batch([1, 2, 0], step)
            plan = srv.serving.plan_decode(fb)
            assert plan.lfps_rows.tolist() == [1, 2] and plan.dense_rows_list == [0]
            sub = q[plan.lfps_rows].contiguous()
            outs.append([srv.serving.decode(layer, sub, srv.batch.k_buffer, srv.batch.v_buffer,
                                            plan, srv.scale) for layer in range(2)])  # fmt: skip
        for got, want in zip(*outs):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def padded(srv: Server, fb, q, bs: int):
    """A graph batch of size ``bs``: the real rows, then padding (request row 0, length 1)."""
    pad, dev = bs - q.shape[0], q.device
    rpi = fb.req_pool_indices
    rpi = torch.cat([rpi, torch.zeros(pad, dtype=rpi.dtype, device=rpi.device)])
    seq = torch.cat([fb.seq_lens, torch.ones(pad, dtype=fb.seq_lens.dtype, device=dev)])
    return torch.cat([q, torch.zeros(pad, *q.shape[1:], dtype=q.dtype, device=dev)]), rpi, seq


@pytest.mark.parametrize("mode, rows, union", [("lfps", 1, 1), ("lfps", GRP, GRP),
                                               ("topk", 1, 1)])  # fmt: skip
def test_graph_decode_equals_eager_decode(mode, rows, union):
    """The graph path (fixed budgets, every row on LFPS's kernels, state rows through the
    index, padded rows) gives each row holder what the eager path gives it, and a row without
    state attends every key; both update the same tables."""
    twins = [Server([40, 10, 57], steps=3, min_tokens=20, mode=mode, factor=10**3, rows=rows,
                    union=union) for _ in range(2)]  # fmt: skip
    eager, graph = twins
    for srv in twins:
        srv.prefill([0, 1, 2])
    graph.serving.init_graph_state(8, "cpu")
    assert graph.serving.graph_topk == 16  # min_tokens - sinks: the short request fits
    for step in range(eager.steps):
        fb, q = eager.decode_batch([2, 1, 0], step)
        plan = eager.serving.plan_decode(fb)
        assert graph.serving.fits_graph(fb)
        rows = graph.serving.graph_rows(fb)
        assert rows == ([1, graph.store.scratch, 0], [False, True, False])
        graph.serving.begin_graph(5, rows)
        gq, rpi, seq = padded(graph, fb, q, 5)
        for layer in range(2):
            want = eager.serving.decode(layer, q[plan.lfps_rows], eager.batch.k_buffer,
                                        eager.batch.v_buffer, plan, SCALE)  # fmt: skip
            got = graph.serving.decode_graph(layer, gq, graph.batch.k_buffer,
                                             graph.batch.v_buffer, rpi, seq, SCALE)  # fmt: skip
            torch.testing.assert_close(got[[0, 2]], want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[1], dense_attention(graph, 1, q[1], 11 + step),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
            if mode == "lfps":
                a, b = (srv.store.layers[layer].true_tables()[0][:2] for srv in twins)
                torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_a_long_request_without_state_keeps_a_batch_out_of_the_graphs():
    srv = Server([40, 57, 10], steps=1, slots=1, min_tokens=20)
    srv.prefill([0, 1, 2])
    assert srv.serving.row_of == {"r0": 0}  # r1 found every row taken
    fb, _ = srv.decode_batch([0, 1, 2], 0)
    assert not srv.serving.fits_graph(fb)
    fb, _ = srv.decode_batch([0, 2], 0)
    assert srv.serving.fits_graph(fb)


@pytest.mark.gpu
@pytest.mark.parametrize("mode, union", [("lfps", 1), ("lfps", 4), ("topk", 1)])
def test_the_graph_path_is_captured_and_replayed_on_the_gpu(mode, union):
    """The graph step at the 8B shape captured in a CUDA graph (padding rows, a row without
    state), replayed for two steps with new rows and queries: each row holder's output equals
    the eager kernels' on a twin server, the short request's equals dense attention."""
    params = LfpsParams(budget=0.02, history_steps=64)
    twins = [Server([4096, 300, 3000], steps=2, slots=3, min_tokens=1024, mode=mode, rows=4,
                    params=params, kernels=True, dtype=torch.bfloat16, heads=(32, 8, 128),
                    factor=10**3, device="cuda", union=union) for _ in range(2)]  # fmt: skip
    eager, graph = twins
    for srv in twins:
        srv.prefill([0, 1, 2])
    names = ("vertical", "slash", "scale")
    built = {name: getattr(graph.store.layers[0], name)[:3].clone() for name in names}
    bs = 4
    graph.serving.init_graph_state(8, "cuda")
    fb, q = graph.decode_batch([0, 1, 2], 0)
    static_q, rpi, seq = padded(graph, fb, q, bs)
    graph.serving.begin_graph(bs, None)
    args = (graph.batch.k_buffer, graph.batch.v_buffer, rpi, seq, graph.scale)
    graph.serving.decode_graph(0, static_q, *args)  # compile outside the capture
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        static_out = graph.serving.decode_graph(0, static_q, *args)
    for name in names:  # warm-up and capture updated the scratch row, not the requests' rows
        assert torch.equal(getattr(graph.store.layers[0], name)[:3], built[name]), name
        # the twins' builds agree up to the order of the slash table's atomic adds
        a, b = (getattr(srv.store.layers[0], name)[:3] for srv in twins)
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-5)
    for step in range(2):
        fb, q = eager.decode_batch([0, 1, 2], step)
        plan = eager.serving.plan_decode(fb)
        want = eager.serving.decode(0, q[plan.lfps_rows].contiguous(), eager.batch.k_buffer,
                                    eager.batch.v_buffer, plan, eager.scale)  # fmt: skip
        graph.serving.begin_graph(bs, graph.serving.graph_rows(fb))
        new_q, new_rpi, new_seq = padded(graph, fb, q, bs)
        static_q.copy_(new_q)
        rpi.copy_(new_rpi)
        seq.copy_(new_seq)
        cuda_graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out[[0, 2]].float(), want.float(), atol=2e-2,
                                   rtol=2e-2)  # fmt: skip
        k = graph.keys[1][: 301 + step].cuda().repeat_interleave(4, 1).transpose(0, 1).float()
        v = graph.values[1][: 301 + step].cuda().repeat_interleave(4, 1).transpose(0, 1).float()
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[1].float(), k) * graph.scale, -1)
        torch.testing.assert_close(static_out[1].float(), torch.einsum("hn,hnd->hd", w, v),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("union", [1, GRP])
def test_staging_a_host_store_changes_no_output(monkeypatch, union):
    """Over a store in host memory (--redknot-lfps-offload-gb) LFPS's step gathers the rows it
    reads into GPU buffers where batch x context reaches STAGE_MIN_TOKENS, eagerly and in the
    graphs (buffers of the largest graph batch, sliced): outputs and tables equal the step
    reading the store directly (interpreter; the store here is in CPU memory, as are the
    buffers). Lists per query head are never staged."""
    from redknot.lfps import serving as serving_mod

    monkeypatch.setattr(serving_mod, "STAGE_MIN_TOKENS", 100)
    params = LfpsParams(budget=5, history_steps=M, lam=0.0)
    twins = [Server([60, 10, 33], steps=2, slots=4, min_tokens=20, rows=GRP, params=params,
                    factor=3, kernels=True, dtype=torch.float16, union=union, host_kv=host)
             for host in (False, True)]  # fmt: skip
    direct, staged = twins
    assert direct.serving.triton_build and not staged.serving.triton_build
    direct.serving.triton_build = False  # both build their tables alike: only staging differs
    assert staged.serving.stages and not direct.serving.stages
    assert staged.serving.stage_pays(2, 60) and not staged.serving.stage_pays(1, 60)
    for srv in twins:
        srv.prefill([2, 1, 0])
        srv.serving.init_graph_state(4, "cpu")
    assert staged.serving.graph_stage is not None and direct.serving.graph_stage is None
    calls = []
    real = serving_mod.LfpsServing._attend

    def spy(self, *args):
        calls.append(args[-1] is not None)
        return real(self, *args)

    monkeypatch.setattr(serving_mod.LfpsServing, "_attend", spy)
    for step in range(2):
        fb, q = staged.decode_batch([1, 0, 2], step)
        outs = []
        for srv in twins:
            plan = srv.serving.plan_decode(fb)
            sub = q[plan.lfps_rows].contiguous()
            outs.append([srv.serving.decode(layer, sub, srv.batch.k_buffer, srv.batch.v_buffer,
                                            plan, SCALE) for layer in range(2)])  # fmt: skip
            rows = srv.serving.graph_rows(fb)
            srv.serving.begin_graph(4, rows)
            gq, rpi, seq = padded(srv, fb, q, 4)
            outs.append([srv.serving.decode_graph(layer, gq, srv.batch.k_buffer,
                                                  srv.batch.v_buffer, rpi, seq, SCALE)
                         for layer in range(2)])  # fmt: skip
        for got, want in zip(outs[2] + outs[3], outs[0] + outs[1]):  # padding rows: NaN
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert calls == [False, False, False, False, True, True, True, True] * 2
    for layer in range(2):
        a, b = (srv.store.layers[layer].true_tables()[0] for srv in twins)
        assert torch.equal(a, b)
    per_query_head = Server([60], steps=1, rows=1, kernels=True, dtype=torch.float16,
                            host_kv=True)  # fmt: skip
    assert not per_query_head.serving.stages
