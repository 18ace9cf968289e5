"""``--redknot-reuse-gate auto``: the reuse gate corrected by the forward times its server
measures (``redknot.costmodel.measured``), with a clock whose markers the test sets."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from redknot.config import RedknotConfig
from redknot.costmodel.gate import ReuseGate
from redknot.costmodel.measured import (
    MIN_SAMPLES,
    NEAR,
    RATIO_RANGE,
    ForwardTimer,
    MeasuredCorrection,
    TimedForward,
)
from redknot.costmodel.model import PromptWork
from redknot.segcache.reuse import SegmentUse

from .test_gate import CFG_8B, H100


class Marker:
    """A clock marker at time ``at`` (ms); ``reached`` says whether the GPU got there."""

    def __init__(self, clock):
        self.at, self.reached, clock.made = clock.now, False, clock.made + [self]

    def query(self):
        return self.reached

    def elapsed_ms(self, end):
        return end.at - self.at


class Clock:
    def __init__(self):
        self.now, self.made = 0.0, []

    def __call__(self):
        return Marker(self)

    def reach_all(self):
        for m in self.made:
            m.reached = True


def _gate(tmp_path, reuse_gate="auto", tp_size=1, clock=None):
    from redknot.headmap import ModelShape, synthetic_map
    from redknot.pool.layout import HeadLayout

    path = tmp_path / "r.json"
    path.write_text(json.dumps(replace(H100, host_probe_ms=None).to_json()))
    shape = ModelShape.from_hf_config(CFG_8B)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.125, window=256, sink=64))
    config = RedknotConfig(policy="epic", all_global=True, cost_record=str(path),
                           reuse_gate=reuse_gate)  # fmt: skip
    return ReuseGate.build(config, CFG_8B, layout, "NVIDIA H100 80GB HBM3", tp_size=tp_size,
                           clock=clock)  # fmt: skip


def prompt(segment: int, n: int = 8, question: int = 64) -> PromptWork:
    return PromptWork(n * segment + question, 0, tuple((i * segment, segment) for i in range(n)))


def _time(gate, clock, forward: TimedForward, factor: float) -> None:
    """One timed forward that took ``factor`` times the record's prediction."""
    begin = gate.timer.start()
    clock.now += factor * gate.predict(forward)
    gate.timer.finish(begin, forward)


def warmed(*classes) -> MeasuredCorrection:
    """A correction past the first forward of each ``(path, tokens)`` size class (dropped)."""
    c = MeasuredCorrection()
    for path, tokens in classes:
        c.add(path, tokens, 1.0, 1.0)
    assert c.dropped == len(classes) and not any(c.counts().values())
    return c


def test_the_first_forward_of_each_size_class_is_not_kept():
    c = MeasuredCorrection()
    for _ in range(MIN_SAMPLES):
        c.add("reuse", 2000, 80.0, 10.0)  # a first-use compile at a new size, then steady
    assert c.counts()["reuse"] == MIN_SAMPLES - 1 and c.ratios(2000) == (1.0, 1.0)
    c.add("reuse", 1100, 80.0, 10.0)  # 1024-2047 tokens: the same class, kept
    c.add("reuse", 2100, 80.0, 10.0)  # 2048-4095: a new class, dropped
    c.add("recompute", 2000, 10.0, 10.0)  # the other path has classes of its own: dropped
    assert c.counts() == {"reuse": MIN_SAMPLES, "recompute": 0} and c.dropped == 3
    assert c.ratios(2000) == (8.0, 1.0)


def test_ratios_are_local_in_size_and_need_a_few_samples():
    c = warmed(("reuse", 2000), ("reuse", 2500), ("recompute", 1500))
    assert c.ratios(2000) == (1.0, 1.0)
    for _ in range(MIN_SAMPLES - 1):
        c.add("reuse", 2000, 20.0, 10.0)
    assert c.ratios(2000) == (1.0, 1.0)  # not enough yet
    c.add("reuse", 2500, 30.0, 10.0)
    # median of 2, 2, 3; recomputing, unmeasured, is taken as the record predicts it (the
    # faster of the record and the measured reuse: the side that recomputes more)
    assert c.ratios(2000) == (2.0, 1.0)
    assert c.ratios(8000) == (1.0, 1.0)  # nothing within a factor of two of 8000 tokens
    for _ in range(MIN_SAMPLES):
        c.add("recompute", 1500, 11.0, 10.0)
    # recomputing measured slower at 1,500 tokens, outside NEAR of 2,000: not taken there (it
    # would make reuse look better), but at its own size
    assert c.ratios(2000) == pytest.approx((2.0, 1.0))
    assert c.ratios(1500) == pytest.approx((2.0, 1.1))
    fast = warmed(("reuse", 2000), ("recompute", 8000))
    for _ in range(MIN_SAMPLES):
        fast.add("reuse", 2000, 5.0, 10.0)
        fast.add("recompute", 8000, 7.0, 10.0)
    assert fast.ratios(2000) == (0.5, 0.5)  # a fast engine: reuse fast, recompute no slower
    assert fast.ratios(8000) == pytest.approx((1.0, 0.7))  # reuse unmeasured: not below 1
    _, hi = RATIO_RANGE
    c.add("recompute", 2000, 10.0 * hi * 2, 10.0)  # a compile, a stall: dropped
    assert c.dropped == 4 and c.counts() == {"reuse": MIN_SAMPLES, "recompute": MIN_SAMPLES}


def test_a_ratio_from_another_size_stands_in_only_on_the_side_that_recomputes_more():
    """CacheBlend on an H200 (``ttft_phases_queue_h200.json``): reuse measured at 0.77 of the
    record at 2K x 8 (2,113 computed tokens) made 1K x 8 prompts (1,089) reuse, at 1.2x their
    recompute. Forwards of another size within SPAN stand in only where they make reuse
    slower or recomputing faster; forwards within NEAR of the size are taken as they are."""
    c = warmed(("reuse", 2113), ("recompute", 1089), ("reuse", 1089))
    for _ in range(MIN_SAMPLES):
        c.add("reuse", 2113, 7.7, 10.0)
        c.add("recompute", 1089, 9.0, 10.0)
    assert c.ratios(2113) == pytest.approx((0.77, 0.9))  # reuse measured at its size
    assert c.ratios(1089) == pytest.approx((1.0, 0.9))  # the 2K reuse does not stand in
    assert c.ratios(1089 * NEAR) == pytest.approx((1.0, 0.9))
    for _ in range(2 * MIN_SAMPLES):  # reuse measured slow at 2K (newest): stands in at 1K
        c.add("reuse", 2113, 30.0, 10.0)
    assert c.ratios(2113)[0] == pytest.approx(3.0) and c.ratios(1089)[0] == pytest.approx(3.0)
    for _ in range(MIN_SAMPLES):  # and once 1K's own reuse forwards are measured, they count
        c.add("reuse", 1089, 8.0, 10.0)
        c.add("reuse", 1089, 8.0, 10.0)
    assert c.ratios(1089) == pytest.approx((0.8, 0.9))


def test_a_forward_is_read_back_only_once_reached_and_in_order():
    seen = []
    clock = Clock()
    correction = warmed(("reuse", 2112))
    timer = ForwardTimer(correction, lambda f: seen.append(f) or 10.0, clock)
    first = TimedForward("reuse", (prompt(256),), 2112)
    begin = timer.start()
    clock.now = 25.0
    timer.finish(begin, first)
    assert timer.harvest() == 0 and not seen  # the GPU is not there yet
    clock.reach_all()
    assert timer.harvest() == 1 and seen == [first]
    assert correction._samples["reuse"][0].ratio == pytest.approx(2.5)
    assert timer.harvest() == 0


def test_a_warm_harvest_works_the_ratios_out_before_a_decision_asks():
    """After a batch's answers the timer reads its forwards back and works out the ratios at
    their sizes (``warm``): a decision for that size then filters no window. A forward read
    back later drops what was worked out, so no decision takes a stale ratio."""
    clock = Clock()
    correction = warmed(("reuse", 1089), ("recompute", 1089))
    for _ in range(MIN_SAMPLES):
        correction.add("recompute", 1089, 9.0, 10.0)
    worked = []
    original = correction._ratios
    correction._ratios = lambda tokens: worked.append(tokens) or original(tokens)
    timer = ForwardTimer(correction, lambda f: 10.0, clock)

    def forward(path: str, ms: float, work: PromptWork) -> None:
        begin = timer.start()
        clock.now += ms
        timer.finish(begin, TimedForward(path, (work,), 1089))
        clock.reach_all()

    forward("recompute", 9.0, PromptWork(1089))
    assert timer.harvest(warm=True) == 1 and worked == [1089]
    assert correction.ratios(1089) == pytest.approx((1.0, 0.9)) and worked == [1089]
    assert correction.ratios(8000) == (1.0, 1.0) and worked == [1089, 8000]
    for _ in range(MIN_SAMPLES):  # reuse measured slow at this size: the next ask sees it
        forward("reuse", 30.0, prompt(128))
        timer.harvest()
    assert correction.ratios(1089) == pytest.approx((3.0, 0.9)) and worked[-1] == 1089


def test_measured_slow_reuse_turns_a_reuse_decision_into_recompute(tmp_path):
    """EPIC at 2K x 8 on the 8B shape: the record reuses it. Forwards of that size measured
    twice the record's prediction when reusing and as predicted when recomputing: the gate
    recomputes it, says why, and reuses again once reuse is measured fast."""
    clock = Clock()
    gate = _gate(tmp_path, clock=clock)
    work = prompt(256)
    first = gate.decide(work)
    assert first.reuse and "measured here" not in first.reason
    reused = TimedForward("reuse", (work,), work.computed)
    plain = TimedForward("recompute", (PromptWork(work.computed),), work.computed)
    gate.timer.correction = warmed(("reuse", work.computed), ("recompute", work.computed))
    for _ in range(MIN_SAMPLES):
        _time(gate, clock, reused, 2.0)
        _time(gate, clock, plain, 1.0)
    assert gate.decide(work).reuse  # nothing read back yet: the markers are not reached
    clock.reach_all()
    d = gate.decide(work)
    assert not d.reuse and "x2.00 and x1.00 as measured here" in d.reason
    assert d.reuse_ms == pytest.approx(2.0 * first.reuse_ms)
    assert d.plain_ms == pytest.approx(first.plain_ms)
    for _ in range(2 * MIN_SAMPLES):  # the newest forwards are fast again
        _time(gate, clock, reused, 0.8)
    clock.reach_all()
    assert gate.decide(work).reuse


def test_the_record_alone_several_ranks_or_no_gpu_time_nothing(tmp_path, caplog):
    alone = _gate(tmp_path, "record", clock=Clock())
    assert alone.timer is None and "(--redknot-reuse-gate record)" in alone.source
    with caplog.at_level("INFO", logger="redknot.costmodel.gate"):
        gate = _gate(tmp_path, tp_size=2, clock=Clock())
    assert gate.timer is None and "under tensor parallelism" in caplog.text
    assert _gate(tmp_path, clock=Clock()).timer is not None
    assert _gate(tmp_path).timer is None  # this machine: no GPU, no clock given


def _batch(mode, slots, prefix, lens):
    kind = SimpleNamespace(name=mode, is_extend=lambda: mode in ("EXTEND", "MIXED"))
    return SimpleNamespace(
        forward_mode=kind, redknot_req_slots=slots,
        extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=lens,
    )  # fmt: skip


def _pool(reads=None, captures=None):
    return SimpleNamespace(segment_reads=reads or {}, capture_jobs=captures or {})


def _uses(prompt_len, segments=((1, 100), (101, 100))):
    return [SegmentUse(start, SimpleNamespace(num_tokens=n), prompt_len) for start, n in segments]


def test_describe_times_only_what_the_record_predicts(tmp_path):
    gate = _gate(tmp_path, clock=Clock())
    # two plain requests, one after an exact-prefix hit
    got = gate.describe(_batch("EXTEND", [3, 4], [0, 50], [300, 100]), _pool())
    assert got.path == "recompute" and got.tokens == 400
    assert got.works == (PromptWork(300, 0), PromptWork(100, 50))
    # a reusing request whose extend ends its prompt
    got = gate.describe(_batch("EXTEND", [3], [0], [265]), _pool({3: _uses(265)}))
    assert got.path == "reuse" and got.tokens == 265
    assert got.works[0].reused == 200
    assert gate.predict(got) == pytest.approx(gate.model.batch_ms([got.works[0]], [True]))
    none = [
        (_batch("DECODE", [3], [0], [1]), _pool()),
        (_batch("MIXED", [3], [0], [265]), _pool()),
        (_batch("EXTEND", [3, 4], [0, 0], [265, 10]), _pool({3: _uses(265)})),  # mixed paths
        (_batch("EXTEND", [3], [0], [200]), _pool({3: _uses(265)})),  # a chunk of the prompt
        (_batch("EXTEND", [3], [0], [265]), _pool(captures={3: object()})),  # it captures
    ]
    for batch, pool in none:
        assert gate.describe(batch, pool) is None


def _served(tmp_path):
    """A gate that times, past the first forward of a 265-token reuse, and a model runner whose
    pool holds it and request slot 3's two segment reads."""
    clock = Clock()
    gate = _gate(tmp_path, clock=clock)
    gate.timer.correction = warmed(("reuse", 265))
    pool = _pool({3: _uses(265)})
    pool.reuse_gate = gate
    return clock, gate, pool, SimpleNamespace(token_to_kv_pool=pool)


def test_the_forward_hook_times_what_the_gate_describes(tmp_path):
    from redknot.integration.plugin import _around_model_forward

    clock, gate, pool, runner = _served(tmp_path)

    def forward(self, batch, **kwargs):
        clock.now += 40.0
        return "logits"

    assert _around_model_forward(forward, runner, _batch("EXTEND", [3], [0], [265])) == "logits"
    assert _around_model_forward(forward, runner, _batch("DECODE", [3], [0], [1])) == "logits"
    assert len(gate.timer._pending) == 1  # the decode step is not timed
    clock.reach_all()
    _around_model_forward(forward, runner, _batch("DECODE", [3], [0], [1]))  # reads it back
    (sample,) = gate.timer.correction._samples["reuse"]
    assert sample.tokens == 265
    assert sample.ratio == pytest.approx(40.0 / gate.predict(gate.describe(
        _batch("EXTEND", [3], [0], [265]), pool)))  # fmt: skip
    off = SimpleNamespace(token_to_kv_pool=SimpleNamespace(reuse_gate=None))
    assert _around_model_forward(forward, off, _batch("EXTEND", [3], [0], [265])) == "logits"


def test_a_requests_first_extend_is_timed_from_its_slots_allocation(tmp_path):
    """The marker taken when the request got its slot (where its segments were looked up) opens
    the span of its first extend's forward; the forward batch takes it from its requests once."""
    from redknot.integration.plugin import _after_forward_batch_init, _around_model_forward

    clock, gate, pool, runner = _served(tmp_path)
    req = SimpleNamespace(req_pool_idx=3, redknot_t0=gate.timer.start())  # at allocation
    clock.now += 12.0  # the lookups, the batch's planning
    batch = _batch("EXTEND", [3], [0], [265])
    _after_forward_batch_init(batch, None, SimpleNamespace(reqs=[req]))
    assert req.redknot_t0 is None and batch.redknot_t0 is not None  # taken once

    def forward(self, batch, **kwargs):
        clock.now += 40.0

    _around_model_forward(forward, runner, batch)
    clock.reach_all()
    gate.timer.harvest()
    (sample,) = gate.timer.correction._samples["reuse"]
    assert sample.ratio == pytest.approx(52.0 / gate.predict(gate.describe(batch, pool)))
    again = _batch("EXTEND", [3], [265], [10])
    _after_forward_batch_init(again, None, SimpleNamespace(reqs=[req]))
    assert again.redknot_t0 is None  # a later extend of the request: from its forward's start


def test_a_new_request_slot_starts_its_span_when_the_gate_times(tmp_path):
    from redknot.integration.plugin import _around_req_slot_alloc

    clock = Clock()
    segments = SimpleNamespace(enabled=False)
    for gate, timed in ((_gate(tmp_path, clock=clock), True), (None, False)):
        pool = SimpleNamespace(reuse_gate=gate, layout=SimpleNamespace(restore=False))
        cache = SimpleNamespace(pool=pool, uses_snapshots=False, segments=segments)
        slots = SimpleNamespace(redknot_cache=cache)
        reqs = [SimpleNamespace(req_pool_idx=None)]

        def alloc(self, reqs):
            for i, r in enumerate(reqs):
                r.req_pool_idx = i
            return [r.req_pool_idx for r in reqs]

        assert _around_req_slot_alloc(alloc, slots, reqs) == [0]
        assert (getattr(reqs[0], "redknot_t0", None) in clock.made) is timed


@pytest.mark.gpu
def test_cuda_markers_time_work_on_the_current_stream():
    """The server's clock: events on the current stream, reached once the GPU passes them."""
    import torch

    from redknot.costmodel.measured import cuda_marker

    x = torch.randn(2048, 2048, device="cuda")
    begin = cuda_marker()
    for _ in range(20):
        x = x @ x / 2048
    end = cuda_marker()
    torch.cuda.synchronize()
    assert begin.query() and end.query()
    assert begin.elapsed_ms(end) > 0.0


def test_the_batch_result_hook_reads_the_forward_back_and_warms_its_size(tmp_path):
    """Once a prefill batch's answers are out the scheduler's hook reads its timed forward
    back and works out the ratios at its size; after a decode batch it does nothing."""
    from redknot.integration.plugin import _after_batch_result, _around_model_forward

    clock, gate, pool, runner = _served(tmp_path)

    def forward(self, batch, **kwargs):
        clock.now += 40.0
        return "logits"

    extend = _batch("EXTEND", [3], [0], [265])
    _around_model_forward(forward, runner, extend)
    clock.reach_all()
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(pool=pool))
    assert _after_batch_result(None, scheduler, _batch("DECODE", [3], [0], [1]), None) is None
    assert len(gate.timer._pending) == 1 and not gate.timer.correction._memo
    assert _after_batch_result(None, scheduler, extend, None) is None
    assert not gate.timer._pending and gate.timer.correction.counts()["reuse"] == 1
    assert list(gate.timer.correction._memo) == [265]
    idle = SimpleNamespace(tree_cache=SimpleNamespace(pool=SimpleNamespace(reuse_gate=None)))
    assert _after_batch_result(None, idle, extend, None) is None
