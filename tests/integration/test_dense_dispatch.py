"""Every head global under a token-level policy: the backend sends each batch to FlashInfer or to
the SegPaged kernels. Decode and the extends in which no request reuses, registers or captures a
segment are dense attention and go to FlashInfer; an extend that touches a segment goes to the
SegPaged runner, which alone reads and fills the segment cache. The routing is checked here with
recording stand-ins for both (FlashInfer needs CUDA); both paths' kernels are checked against the
reference by the startup gate, which runs both when both serve (test_startup_check.py)."""

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

    def touches_segments(self, fb):
        self.calls.append("touches_segments")
        return self.touches


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
    assert b.segpaged.calls == ["touches_segments", "begin_forward"] * 2


def test_an_extend_that_touches_a_segment_runs_on_the_segpaged_kernels():
    b = backend(touches=True)
    assert run_extend(b, batch(ForwardMode.EXTEND)) == "extend"
    assert b.segpaged.calls == ["touches_segments", "plan", "extend"]
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
    assert b.segpaged.calls == ["begin_forward", "init_cuda_graph_state", "begin_forward"]


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


def test_touches_segments_reads_the_batch_only_when_the_server_has_segment_work():
    pool = SimpleNamespace(segment_reads={}, segment_jobs={}, capture_jobs={})
    runner = SimpleNamespace(pool=pool)
    assert not SegPagedRunner.touches_segments(runner, SimpleNamespace(req_pool_indices=NoSync()))
    fb = SimpleNamespace(req_pool_indices=torch.tensor([3, 5]))
    for work in (pool.segment_reads, pool.segment_jobs, pool.capture_jobs):
        work[7] = object()  # another request's work
        assert not SegPagedRunner.touches_segments(runner, fb)
        work[5] = object()
        assert SegPagedRunner.touches_segments(runner, fb)
        work.clear()
