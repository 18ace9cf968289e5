"""``--redknot-lfps`` in the attention backend: an extend builds the LFPS state of its long
requests; a decode batch writes every row's K/V, sends its slot holders to LFPS and its other rows
to FlashInfer (a dense stand-in here: FlashInfer needs CUDA), and is kept out of SGLang's decode
graphs. The LFPS computation itself is checked in tests/lfps/test_serving.py."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from redknot.attention.backend import RedknotAttnBackend
from redknot.config import RedknotConfig, RedknotConfigError
from redknot.integration import plugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lfps"))
from test_serving import GRP, HKV, HQ, SCALE, D, Server, dense_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                        scaling=SCALE)  # fmt: skip


class Pool:
    def __init__(self, batch):
        self.k, self.v = batch.k_buffer, batch.v_buffer
        self.writes = 0

    def write_global(self, layer_id, loc, k, v):
        self.writes += 1
        self.k[loc], self.v[loc] = k, v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


class Dense:
    """FlashInfer's stand-in: dense attention over the batch it was planned for."""

    def __init__(self, srv):
        self.srv, self.planned, self.calls = srv, None, []

    def init_forward_metadata(self, fb):
        self.planned = fb
        self.calls.append("init_forward_metadata")

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass  # FlashInfer's buffers: nothing of its graphs is exercised here

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.calls.append("forward_extend")
        return q

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        assert fb is self.planned and k is None and not save_kv_cache
        self.calls.append("forward_decode")
        q = q.view(-1, HQ, D)
        rows = [self.srv.batch.req_pool_indices.tolist().index(int(r)) for r in fb.req_pool_indices]
        out = [dense_attention(self.srv, b, q[i], int(n))
               for i, (b, n) in enumerate(zip(rows, fb.seq_lens))]  # fmt: skip
        return torch.stack(out).view(-1, HQ * D)


def backend(srv):
    b = RedknotAttnBackend.__new__(RedknotAttnBackend)  # no model: routing and plumbing only
    b.dense, b.segpaged, b.dense_batch = Dense(srv), None, True
    b.lfps, b.lfps_pool = srv.serving, Pool(srv.batch)
    b.lfps_plan = b.lfps_dense_batch = None
    return b


def test_an_extend_builds_the_state_of_its_long_requests():
    srv = Server([40, 10, 57], steps=1, min_tokens=20)
    b = backend(srv)
    which = [0, 1, 2]
    lens = [srv.prompt_lens[i] for i in which]
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, rids=[srv.rid(i) for i in which],
        extend_seq_lens_cpu=lens, seq_lens_cpu=torch.tensor(lens),
        req_pool_indices=srv.batch.req_pool_indices[which],
    )  # fmt: skip
    assert b.needs_eager_extend(fb)
    b.init_forward_metadata(fb)
    q = torch.cat([srv.prefill_q[i] for i in which]).view(-1, HQ * D)
    b.forward_extend(q, None, None, LAYER, fb)
    assert b.dense.calls == ["init_forward_metadata", "forward_extend"]
    assert srv.serving.row_of == {"r0": 0, "r2": 1}
    from test_serving import reference_state

    want = reference_state(srv, [0, 2])[0]
    torch.testing.assert_close(srv.store.layers[0].vertical[:2], want.vertical, atol=1e-7,
                               rtol=1e-5)  # fmt: skip
    short = SimpleNamespace(seq_lens_cpu=torch.tensor([10, 12]))
    assert not b.needs_eager_extend(short)


def test_a_decode_batch_splits_its_rows_between_lfps_and_flashinfer():
    """Every row's new K/V is written before anyone attends (the stored keys of the new
    positions are zeroed first, so a missed write would show); the dense row's output is
    FlashInfer's over its own sub-batch, the slot holders' LFPS's."""
    params_exact = {"budget": 10**6, "lam": -1e9, "sparsity_threshold": 2.0}
    from redknot.lfps import LfpsParams

    srv = Server([40, 10, 57], steps=1, min_tokens=20,
                 params=LfpsParams(history_steps=8, **params_exact), factor=10**3)  # fmt: skip
    b = backend(srv)
    srv.prefill([0, 1, 2])
    order = [1, 2, 0]
    fb, q = srv.decode_batch(order, 0)
    r2t = srv.batch.req_to_token
    loc = torch.stack([r2t[int(srv.batch.req_pool_indices[i]), srv.prompt_lens[i]] for i in order])
    new_k = torch.stack([srv.keys[i][srv.prompt_lens[i]] for i in order])
    new_v = torch.stack([srv.values[i][srv.prompt_lens[i]] for i in order])
    srv.batch.k_buffer[loc.long()] = 0.0
    srv.batch.v_buffer[loc.long()] = 0.0
    fb.forward_mode, fb.out_cache_loc, fb.batch_size = ForwardMode.DECODE, loc.long(), 3
    b.init_forward_metadata(fb)  # eager (no graph for this batch size, say)
    assert b.lfps_plan.lfps_rows.tolist() == [1, 2] and b.lfps_plan.dense_rows_list == [0]
    sub = b.dense.planned
    assert sub.batch_size == 1 and sub.seq_lens_sum == 11 and sub.seq_lens.tolist() == [11]
    out = b.forward_decode(q.reshape(3, -1), new_k.reshape(3, -1), new_v.reshape(3, -1), LAYER, fb)
    assert b.lfps_pool.writes == 1
    out = out.view(3, HQ, D)
    for row, i in enumerate(order):
        want = dense_attention(srv, i, q[row], srv.prompt_lens[i] + 1)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)


def test_a_decode_batch_without_slot_holders_is_flashinfers():
    srv = Server([10, 12], steps=1, min_tokens=20)
    b = backend(srv)
    srv.prefill([0, 1])
    fb, _ = srv.decode_batch([0, 1], 0)
    fb.forward_mode, fb.out_cache_loc = ForwardMode.DECODE, torch.zeros(2, dtype=torch.long)
    assert not b.needs_eager_decode(fb)  # a graph serves it
    b.init_forward_metadata(fb)  # eagerly: FlashInfer alone
    assert b.lfps_plan is None and b.dense.planned is fb


def test_sglangs_decode_graph_is_not_replayed_where_the_backend_says_so():
    class Runner:
        def __init__(self, eager):
            self.model_runner = SimpleNamespace(
                attn_backend=SimpleNamespace(needs_eager_decode=lambda fb: eager)
            )

    def original(self, fb):
        return True

    assert plugin._around_decode_can_run_graph(original, Runner(True), None) is False
    assert plugin._around_decode_can_run_graph(original, Runner(False), None) is True
    assert any(h.fn is plugin._around_decode_can_run_graph for h in plugin.HOOKS)


def test_decode_graphs_are_captured_and_replayed_on_lfps():
    """Capture: every row dense on the scratch row. Replay: the rows the can_run_graph hook saw
    (row holders on their state, the others listing every key, padding dense); at the exact
    limit every row's output is dense attention. A replay the hook did not see is refused."""
    from redknot.lfps import LfpsParams

    srv = Server([40, 10, 57], steps=1, min_tokens=20, factor=10**3,
                 params=LfpsParams(history_steps=8, budget=10**6, lam=-1e9,
                                   sparsity_threshold=2.0))  # fmt: skip
    b = backend(srv)
    b.lfps_pool.device = "cpu"
    srv.prefill([0, 1, 2])
    b.init_cuda_graph_state(4, 4)
    capture = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=4, rids=None,
                              out_cache_loc=torch.zeros(4, dtype=torch.long))  # fmt: skip
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    assert b.lfps_graph and srv.serving.graph_dense[:4].all()
    assert b.dense.calls == []  # FlashInfer takes no part in LFPS's decode graphs
    fb, q = srv.decode_batch([1, 2, 0], 0)
    fb.forward_mode, fb.batch_size = ForwardMode.DECODE, 3
    fb.out_cache_loc = torch.tensor([srv.batch.req_to_token[int(r), int(n) - 1]
                                     for r, n in zip(fb.req_pool_indices, fb.seq_lens)])  # fmt: skip
    assert not b.needs_eager_decode(fb)
    from test_serving import padded

    gq, rpi, seq = padded(srv, fb, q, 4)
    view = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=4, req_pool_indices=rpi,
                           seq_lens=seq, out_cache_loc=fb.out_cache_loc)  # fmt: skip
    b.init_forward_metadata_out_graph(view)
    assert srv.serving.graph_dense[:4].tolist() == [True, False, False, True]
    new_k = torch.stack([srv.keys[i][srv.prompt_lens[i]] for i in (1, 2, 0)])
    new_v = torch.stack([srv.values[i][srv.prompt_lens[i]] for i in (1, 2, 0)])
    kv = [torch.cat([x, torch.zeros(1, *x.shape[1:])]).reshape(4, -1) for x in (new_k, new_v)]
    view.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=torch.long)])
    out = b.forward_decode(gq.reshape(4, -1), *kv, LAYER, view).view(4, HQ, D)
    for row, i in enumerate((1, 2, 0)):
        want = dense_attention(srv, i, q[row], srv.prompt_lens[i] + 1)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="did not see"):
        b.init_forward_metadata_out_graph(view)


def test_a_freed_request_slot_frees_its_lfps_row():
    srv = Server([40, 57], steps=1, min_tokens=20)
    srv.prefill([0, 1])
    pool = SimpleNamespace(redknot_lfps=srv.serving)
    plugin._after_req_slot_free(None, pool, SimpleNamespace(rid="r1"))
    assert srv.serving.row_of == {"r0": 0}
    plugin._after_req_slots_clear(None, pool)
    assert srv.serving.row_of == {}
    plugin._after_req_slot_free(None, SimpleNamespace(), SimpleNamespace(rid="r0"))  # LFPS off
    hooked = {h.fn for h in plugin.HOOKS}
    assert {plugin._after_req_slot_free, plugin._after_req_slots_clear} <= hooked


def test_a_batch_no_graph_can_serve_runs_eagerly():
    srv = Server([40, 57], steps=1, slots=1, min_tokens=20)
    b = backend(srv)
    srv.prefill([0, 1])
    fb, _ = srv.decode_batch([0, 1], 0)
    assert b.needs_eager_decode(fb) and b.lfps_graph_rows is None


@pytest.mark.parametrize(
    "options, wrong",
    [
        ({"head_map": "x.json", "lfps": "lfps"}, "needs every head global"),
        ({"all_global": True, "lfps": "lfps", "kernel": "triton"}, "needs --redknot-kernel auto"),
        ({"all_global": True, "lfps": "sparse"}, "is not one of"),
        ({"all_global": True, "lfps": "lfps", "lfps_selection": "head"}, "is not one of"),
        ({"all_global": True, "lfps": "lfps", "lfps_budget": 0.0}, "must be a number > 0"),
        ({"all_global": True, "lfps": "lfps", "lfps_budget": 2.5}, "whole number"),
        ({"all_global": True, "lfps": "lfps", "lfps_decay": 1.0}, "in (0, 1)"),
        ({"all_global": True, "lfps": "lfps", "lfps_max_requests": 0}, "integer >= 1"),
        (
            {"all_global": True, "lfps": "topk", "lfps_selection": "kv-head-union"},
            "a rule of --redknot-lfps lfps",
        ),
    ],
)
def test_inconsistent_lfps_options_fail_at_startup(options, wrong):
    with pytest.raises(RedknotConfigError, match=wrong.replace("(", r"\(").replace(")", r"\)")):
        RedknotConfig(**options)


def test_lfps_options_that_work():
    c = RedknotConfig(all_global=True, lfps="topk", lfps_budget=512.0, lfps_selection="kv-head")
    assert c.lfps == "topk" and GRP == 2
    assert RedknotConfig(policy="cacheblend", lfps="lfps").all_global
    assert RedknotConfig(all_global=True, lfps="lfps", lfps_selection="kv-head-union").lfps


class HostExtend:
    """``redknot.attention.host_extend.HostPrefixExtend``'s stand-in (FlashInfer needs CUDA)."""

    def __init__(self):
        self.calls = []

    def plan(self, fb):
        self.calls.append("plan")
        return any(fb.extend_prefix_lens_cpu)

    def forward(self, q, k, v, layer, k_buffer, v_buffer):
        self.calls.append("forward")
        return q


def test_an_offloaded_extend_with_a_prefix_gathers_it_instead_of_flashinfers_paged_read():
    """Under --redknot-lfps-offload-gb an extend batch with a prefix (a later chunk, a cache
    hit) runs eagerly on the host-prefix path: its K/V written to the pool, attention by the
    gathered prefix, LFPS's tables still built. Without a prefix it stays on FlashInfer."""
    srv = Server([40, 10, 57], steps=1, min_tokens=20)
    b = backend(srv)
    b.host_extend = HostExtend()
    which = [0, 2]
    lens = [srv.prompt_lens[i] for i in which]
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, rids=[srv.rid(i) for i in which],
        extend_seq_lens_cpu=[8, 9], extend_prefix_lens_cpu=[lens[0] - 8, lens[1] - 9],
        seq_lens_cpu=torch.tensor(lens), req_pool_indices=srv.batch.req_pool_indices[which],
        out_cache_loc=torch.arange(17) + 200,
    )  # fmt: skip
    assert b.needs_eager_extend(fb)
    b.init_forward_metadata(fb)
    assert b.host_batch and b.dense.calls == []
    q = torch.randn(17, HQ * D)
    k, v = torch.randn(17, HKV * D), torch.randn(17, HKV * D)
    assert b.forward_extend(q, k, v, LAYER, fb) is q
    assert b.host_extend.calls == ["plan", "forward"] and b.lfps_pool.writes == 1
    assert torch.equal(b.lfps_pool.k[200:217], k.view(17, HKV, D))
    assert set(srv.serving.row_of) == {"r0", "r2"}  # the tables were built
    fresh = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, rids=["x"], extend_seq_lens_cpu=[12],
        extend_prefix_lens_cpu=[0], seq_lens_cpu=torch.tensor([12]),
        req_pool_indices=srv.batch.req_pool_indices[:1],
    )  # fmt: skip
    assert not b.needs_eager_extend(fresh)
    b.init_forward_metadata(fresh)
    assert not b.host_batch and b.dense.calls == ["init_forward_metadata"]
