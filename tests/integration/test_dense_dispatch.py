"""Every head global under a token-level policy: the backend sends each batch to FlashInfer or to
the SegPaged kernels. Decode and the extends in which no request reads a cached segment are dense
attention and go to FlashInfer (those that fill segments write them after each layer); an extend
that reads a segment goes to the SegPaged runner. The routing is checked here with recording
stand-ins for both (FlashInfer needs CUDA); both paths' kernels are checked against the reference
by the startup gate, which runs both when both serve (test_startup_check.py), and a FlashInfer
batch's segment writes against the SegPaged path's (test_dense_writes_equal_the_segpaged_ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from redknot.attention.backend import RedknotAttnBackend
from redknot.attention.segpaged_runner import SegPagedRunner


class Recorder:
    """Records the calls made on it, by name; each returns the name."""

    def __init__(self, touches=False):
        self.calls: list[str] = []
        self.touches = touches

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return name

        return call

    def needs_kernels(self, fb):
        self.calls.append("needs_kernels")
        return self.touches

    dense_writes = None  # no registration in the batch


def backend(dense=True, segpaged=True, touches=False):
    b = RedknotAttnBackend.__new__(RedknotAttnBackend)  # no model: only the routing is tested
    b.dense = Recorder() if dense else None
    b.segpaged = Recorder(touches) if segpaged else None
    b.dense_batch = b.segpaged is None
    return b


def batch(mode):
    return SimpleNamespace(forward_mode=mode)


def run_extend(b, fb):
    b.init_forward_metadata(fb)
    return b.forward_extend(None, None, None, None, fb)


def test_an_extend_without_segment_work_runs_on_flashinfer():
    b = backend()
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        assert run_extend(b, batch(mode)) == "forward_extend"
        assert b.dense.calls[-2:] == ["init_forward_metadata", "forward_extend"]
    # the runner's per-forward state is reset (its layer hooks pass every row), nothing planned
    assert b.segpaged.calls == ["needs_kernels", "plan_dense"] * 2


def test_an_extend_that_touches_a_segment_runs_on_the_segpaged_kernels():
    b = backend(touches=True)
    assert run_extend(b, batch(ForwardMode.EXTEND)) == "extend"
    assert b.segpaged.calls == ["needs_kernels", "plan", "extend"]
    assert b.dense.calls == []
    # the next batch is decided afresh
    b.segpaged.touches = False
    run_extend(b, batch(ForwardMode.EXTEND))
    assert b.dense.calls == ["init_forward_metadata", "forward_extend"]


def test_decode_runs_on_flashinfer_eager_and_in_graphs():
    b = backend(touches=True)  # even while a request of the server reuses a segment
    fb = batch(ForwardMode.DECODE)
    b.init_forward_metadata(fb)
    assert b.forward_decode(None, None, None, None, fb) == "forward_decode"
    b.init_cuda_graph_state(8, 8)
    b.init_forward_metadata_out_graph(fb, in_capture=True)
    b.init_forward_metadata_in_graph(fb)
    assert b.dense.calls == [
        "init_forward_metadata", "forward_decode", "init_cuda_graph_state",
        "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
    ]  # fmt: skip
    assert b.segpaged.calls == ["plan_dense", "init_cuda_graph_state", "begin_forward"]


def test_a_full_prefill_graph_keeps_the_segpaged_kernels_for_extends():
    """A captured graph replays the kernels of its capture, whatever the batch: the SegPaged
    ones, which serve every extend."""
    b = backend()
    fb = batch(ForwardMode.EXTEND)
    b.init_forward_metadata_out_graph(fb)
    b.init_forward_metadata_in_graph(fb)
    assert b.forward_extend(None, None, None, None, fb) == "extend"
    assert b.segpaged.calls == ["plan", "plan_in_graph", "extend"] and b.dense.calls == []


@pytest.mark.parametrize("dense, segpaged", [(True, False), (False, True)])
def test_one_path_takes_every_batch(dense, segpaged):
    b = backend(dense=dense, segpaged=segpaged)
    one = b.dense if dense else b.segpaged
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        fb = batch(mode)
        b.init_forward_metadata(fb)
        b.forward_extend(None, None, None, None, fb)
        b.forward_decode(None, None, None, None, fb)
    names = {"forward_extend", "forward_decode"} if dense else {"extend", "decode"}
    assert names <= set(one.calls)


class NoSync:
    """req_pool_indices whose host copy must not be taken."""

    def tolist(self):
        raise AssertionError("a device sync with no segment work in the server")


def test_needs_kernels_reads_the_batch_only_when_the_server_reads_segments():
    pool = SimpleNamespace(segment_reads={}, segment_jobs={}, capture_jobs={})
    runner = SimpleNamespace(pool=pool)
    pool.segment_jobs[5] = object()  # a registration: FlashInfer runs it, writing its segment
    assert not SegPagedRunner.needs_kernels(runner, SimpleNamespace(req_pool_indices=NoSync()))
    fb = SimpleNamespace(req_pool_indices=torch.tensor([3, 5]))
    for work in (pool.segment_reads, pool.capture_jobs):
        work[7] = object()  # another request's work
        assert not SegPagedRunner.needs_kernels(runner, fb)
        work[5] = object()
        assert SegPagedRunner.needs_kernels(runner, fb)
        work.clear()


class ZerosDense:
    """FlashInfer's stand-in: attention output of zeros (the writes are what is checked)."""

    def init_forward_metadata(self, fb):
        pass

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        return torch.zeros_like(q)


def _capture_world():
    """A World of two all-global layers whose region keeps every head, with the RoPE to rotate
    captured keys back, and a capture in flight for request 2: 5 tokens of context, then
    segments A (6 tokens) and B (7), as ``redknot.segcache.registration`` plans it."""
    from redknot.kernels.rope_align import alignable_rope
    from redknot.kernels.rope_reference import sglang_rope
    from redknot.segcache.registration import WriteJob
    from redknot.segcache.store import SegmentStore
    from tests.attention.test_segpaged_runner import D, World

    w = World(("GGGG", "GGGG"), 2, torch.bfloat16, seed=1, segment_fraction=0.1,
              segment_heads="all")  # fmt: skip
    w.runner.rope = alignable_rope(sglang_rope(D, D, 512, 10000.0, True))
    store = SegmentStore.for_pool(w.pool)
    w.pool.cache = SimpleNamespace(segments=store)
    a = store.register("kb", list(range(100, 106)), pin=False)
    b = store.register("kb", list(range(200, 207)), pin=False)
    for entry in (a, b):
        assert store.claim_write(entry)
    w.pool.segment_jobs[2] = WriteJob([(a, 5), (b, 11)])
    return w, (a, b)


def test_dense_writes_equal_the_segpaged_ones():
    """A capture after its context in a batch FlashInfer runs: the backend routes it to the
    dense path (it reads no segment), and after each layer writes exactly what the SegPaged
    path writes for the same K/V (the segments' rows, keys rotated back to positions from 0),
    completing the segments; the batch's other request is untouched."""
    from tests.attention.test_skipped_cached import _batch

    n = 18
    lay = _capture_world()[0].layout
    H, Hq, D = lay.num_kv_heads, lay.num_q_heads, lay.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, n + 3, Hq * D, generator=g).to(torch.bfloat16)
    k = torch.randn(2, n + 3, H * D, generator=g).to(torch.bfloat16)
    v = torch.randn(2, n + 3, H * D, generator=g).to(torch.bfloat16)
    stored = {}
    for path in ("segpaged", "dense"):
        w, entries = _capture_world()
        fb = _batch(w, [2, 3], [n, 3])  # request 3: a plain prompt in the same batch
        b = backend()
        b.segpaged, b.dense = w.runner, ZerosDense()
        if path == "dense":
            b.init_forward_metadata(fb)
            assert b.dense_batch and b.segpaged.dense_writes is not None
        else:  # as before: the SegPaged runner serves the batch
            w.runner.plan(fb)
            b.dense_batch = False
        for lid in range(2):
            attn = SimpleNamespace(layer_id=lid, scaling=D**-0.5, logit_cap=0,
                                   is_cross_attention=False, qk_head_dim=D, v_head_dim=D)  # fmt: skip
            b.forward_extend(q[lid], k[lid], v[lid], attn, fb)
        store = w.pool.cache.segments
        assert not w.pool.segment_jobs
        for ids in (range(100, 106), range(200, 207)):
            assert store.lookup("kb", list(ids)) is not None  # ready
        stored[path] = [w.pool.segments.read(lid, e.rows()) for lid in range(2) for e in entries]
    for (ks, vs), (kd, vd) in zip(stored["segpaged"], stored["dense"]):
        assert torch.equal(ks, kd) and torch.equal(vs, vd)
    # the keys were rotated (a capture after its context), the values copied as they are
    a_rows = v[0, 5:11].view(6, H, D)
    assert torch.equal(stored["dense"][0][1], a_rows)
    assert not torch.equal(stored["dense"][0][0], k[0, 5:11].view(6, H, D))
