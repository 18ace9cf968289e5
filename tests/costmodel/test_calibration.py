"""The reuse gate's startup calibration (``ReuseGate.calibration_plan``): which prompts a
server recomputes before it listens, and what their measured times do to its decisions."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from benchmarks.reuse_cost import variant_model
from redknot.costmodel.gate import CALIBRATION_QUESTION, CALIBRATION_TOKENS, ReuseGate, work_of
from redknot.costmodel.measured import (
    MIN_SAMPLES,
    NEAR,
    RATIO_RANGE,
    ForwardTimer,
    MeasuredCorrection,
    TimedForward,
)
from redknot.costmodel.model import PromptWork, ReuseCostModel
from redknot.costmodel.record import record_for

from .test_gate import CFG_8B, ROOT
from .test_measured import Clock

SMOLLM2 = json.loads((ROOT / "benchmarks/models/smollm2-135m-instruct/config.json").read_text())


def timed_gate(cfg, variant: str, device: str, chunk: int = 8192) -> tuple[ReuseGate, Clock]:
    """A server's gate for ``variant`` (its head layout and recovery as the server runs it)
    on ``device``'s shipped record, timing forwards with a clock the test moves."""
    costs, recovery, _, _ = variant_model(variant, cfg, None)
    gate = ReuseGate(ReuseCostModel(costs, recovery, record_for(device)[0], chunk))
    clock = Clock()
    gate.timer = ForwardTimer(MeasuredCorrection(), gate.predict, clock)
    return gate, clock


def calibrate(gate: ReuseGate, clock: Clock, plan, ratio: float) -> None:
    """Recompute the plan's prompts as a server would, each taking ``ratio`` of the record."""
    for tokens, count in plan:
        forward = TimedForward("recompute", (PromptWork(tokens, 0),), tokens)
        for _ in range(count):
            begin = gate.timer.start()
            clock.now += ratio * gate.predict(forward)
            gate.timer.finish(begin, forward)
    clock.reach_all()
    gate.timer.harvest(warm=True)


def best_case(n: int) -> PromptWork:
    return work_of(n, 0, [(0, n - CALIBRATION_QUESTION)])


def test_smollm2_on_the_h200_record_is_no_longer_reused_where_recomputing_is_faster():
    """The measured case: SmolLM2's 512 x 4 prompt (577 tokens) on an H200. The record predicts
    EPIC's reuse at 15.5 ms and recomputing at 22.4, so the gate reused it; servers on SGLang's
    prefill graph recomputed it in 10.5 ms and took 1.75-1.9x that to reuse it
    (``ttft_side_by_side_smollm2_order_h200.json``). Calibrated at 10.5 / 22.4 of the record,
    the gate recomputes it, and every prompt of 4 or 8 segments in the calibrated range whose
    reuse the record predicts above the measured recompute."""
    gate, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    work = PromptWork(577, 0, tuple((1 + i * 128, 128) for i in range(4)))
    before = gate.decide(work)
    assert before.reuse and before.plain_ms == pytest.approx(22.4, abs=0.05)
    plan = gate.calibration_plan(8191)
    ratio = 10.5 / 22.4
    calibrate(gate, clock, plan, ratio)
    after = gate.decide(work)
    assert not after.reuse and after.plain_ms == pytest.approx(10.5, abs=0.1)
    assert "as measured here" in after.reason
    for n in range(plan[0][0], plan[-1][0] + 1, 97):
        for segments in (4, 8):
            per = (n - CALIBRATION_QUESTION) // segments
            w = PromptWork(n, 0, tuple((1 + i * per, per) for i in range(segments)))
            if gate._reuse_ms(w) > (1 - gate.model.record.margin) * ratio * gate._plain_ms(n, 0):
                assert not gate.decide(w).reuse, (n, segments)


@pytest.mark.parametrize(
    "cfg, variant, device",
    [
        (SMOLLM2, "epic", "NVIDIA H200"),
        (SMOLLM2, "cacheblend", "NVIDIA H200"),
        (CFG_8B, "epic", "NVIDIA H200"),
        (CFG_8B, "cacheblend", "NVIDIA H100 80GB HBM3"),
        (CFG_8B, "redknot-g0.125-reuse-sparse-cached", "NVIDIA H100 80GB HBM3"),
    ],
)
def test_the_plan_covers_every_size_a_measured_recompute_could_turn(cfg, variant, device):
    """Each size the plan keeps is one where the lowest ratio the correction keeps, measured
    for recomputing, makes the gate recompute the best-case prompt of that size or of the
    lower edge of the sizes it measures (``n / NEAR``); each size up to 8K that
    no kept size is within NEAR of is one where that prompt is reused even then. Kept sizes
    step by at most NEAR ** 2, and each gets MIN_SAMPLES kept forwards (one more where it
    opens a size class, whose first forward is dropped)."""
    gate, clock = timed_gate(cfg, variant, device)
    plan = gate.calibration_plan(8191)
    assert plan, "every case here has sizes whose decision a calibration can turn"
    sizes = [n for n, _ in plan]
    lo, hi = CALIBRATION_TOKENS
    assert sizes == sorted(set(sizes)) and sizes[0] >= lo and sizes[-1] <= min(hi, 8191)
    assert all(gate.hopeless(n) is None for n in sizes)
    lowest = RATIO_RANGE[0] * (1 + 1e-6)  # (the clock's sums round; exactly the bound may not keep)
    for _, count in plan:
        assert count in (MIN_SAMPLES, MIN_SAMPLES + 1)
    for a, b in itertools.pairwise(sizes):
        assert b <= a * NEAR * NEAR + 1
    calibrate(gate, clock, plan, lowest)
    fix = gate.timer.correction
    assert fix.counts()["recompute"] == MIN_SAMPLES * len(plan)
    for n in sizes:  # the lowest ratio, measured there, recomputes the best-case prompt of
        # that size or of the lower edge of what it measures
        assert fix.measured("recompute", n) == pytest.approx(lowest)
        edge = max(lo, int(n / NEAR))
        assert not (gate.decide(best_case(n)).reuse and gate.decide(best_case(edge)).reuse), n
    # a size no kept one measures: even at the lowest ratio the best case is reused there
    fresh, _ = timed_gate(cfg, variant, device)
    left_out = [
        n for n in range(sizes[0], 8192, 61) if all(not m / NEAR <= n <= m * NEAR for m in sizes)
    ]
    for n in left_out:
        floor = (1 - fresh.model.record.margin) * RATIO_RANGE[0] * fresh._plain_ms(n, 0)
        assert fresh._reuse_ms(best_case(n)) <= floor, n
    assert left_out or sizes[-1] == 8191


def test_no_plan_without_a_timer_or_where_every_prompt_is_recomputed():
    """The record alone (no timer) measures nothing; SmolLM2 on the H100 record recomputes
    every prompt whatever it hits (its markup is inert), so nothing needs measuring."""
    gate, _ = timed_gate(CFG_8B, "epic", "NVIDIA H200")
    gate.timer = None
    assert gate.calibration_plan(8191) == []
    inert, _ = timed_gate(SMOLLM2, "cacheblend", "NVIDIA H100 80GB HBM3")
    assert inert.recomputed_up_to(8191) == 8191 and inert.calibration_plan(8191) == []
    short, _ = timed_gate(CFG_8B, "epic", "NVIDIA H200")
    assert short.calibration_plan(CALIBRATION_TOKENS[0] - 1) == []


def test_the_gate_control_op_carries_the_plan_and_what_was_measured():
    """``gate_state``: the plan up to the context and the prefill chunk, and the recompute
    ratio measured at each of its sizes (None before the calibration's forwards)."""
    from redknot.api.auto import gate_state

    gate, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    cache = SimpleNamespace(segments=SimpleNamespace(enabled=True), pool=SimpleNamespace())
    cache.pool.reuse_gate = gate
    scheduler = SimpleNamespace(
        tree_cache=cache,
        model_config=SimpleNamespace(context_len=8192),
        server_args=SimpleNamespace(chunked_prefill_size=2048),
    )
    state = gate_state(scheduler)
    assert state["calibrate"] == gate.calibration_plan(2048)
    assert state["calibrate"][-1][0] == 2048  # the chunk bounds it
    assert all(r is None for _, r in state["recompute_ratios"])
    calibrate(gate, clock, state["calibrate"], 0.5)
    measured = gate_state(scheduler)["recompute_ratios"]
    assert [n for n, _ in measured] == [n for n, _ in state["calibrate"]]
    assert all(r == pytest.approx(0.5) for _, r in measured)
    scheduler.server_args.chunked_prefill_size = -1  # no chunking: up to the context
    assert gate_state(scheduler)["calibrate"][-1][0] == min(8191, CALIBRATION_TOKENS[1])
    gate.timer = None
    assert gate_state(scheduler)["calibrate"] == []


def test_a_prompt_recomputing_measured_too_fast_for_any_reuse_is_answered_before_lookups():
    """After the calibration measured SmolLM2's recompute at 10.5 / 22.4 of the H200 record,
    even the cheapest reusing extend (15.2 ms of host) is slower than recomputing: ``hopeless``
    answers the 577-token prompt as ``decide`` answers each of its hit sets, so the scheduler
    neither makes entries for its hits nor decides. The record-only answer, on which markup
    made inert for good and the calibration's first size rest, does not move."""
    gate, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    upto = gate.recomputed_up_to(8191)
    assert gate.hopeless(577) is None and gate.hopeless(577, measured=False) is None
    calibrate(gate, clock, gate.calibration_plan(8191), 10.5 / 22.4)
    answer = gate.hopeless(577)
    assert answer is not None and not answer.reuse and "as measured here" in answer.reason
    assert answer.plain_ms == pytest.approx(10.5, abs=0.1)
    assert gate.hopeless(577, measured=False) is None
    assert gate.recomputed_up_to(8191) == upto
    segments = tuple((1 + i * 64, 64) for i in range(8))
    for k in range(1, 9):  # every hit set: recomputed by the decision too
        assert not gate.decide(PromptWork(577, 0, segments[:k])).reuse
    assert gate.hopeless(577, 256) is not None  # after an exact-prefix hit: fewer tokens


def test_a_server_measured_slower_than_the_record_keeps_the_records_answer():
    """Recomputing measured at twice the record: an unmeasured reuse is taken as at least as
    slow, so both sides double and ``hopeless`` answers as the record does, where the record
    calls a size hopeless (SmolLM2 on the H100 record) and where it does not (the 8B)."""
    for cfg, device, hopeless in ((SMOLLM2, "NVIDIA H100 80GB HBM3", True),
                                  (CFG_8B, "NVIDIA H200", False)):  # fmt: skip
        gate, clock = timed_gate(cfg, "cacheblend", device)
        sizes = (300, 1000, 4000)
        assert all((gate.hopeless(n) is not None) == hopeless for n in sizes)
        calibrate(gate, clock, [(n, 4) for n in sizes], 2.0)
        assert gate.timer.correction.ratios(1000) == pytest.approx((2.0, 2.0))
        assert all((gate.hopeless(n) is not None) == hopeless for n in sizes)


def test_a_size_below_every_measured_one_is_bounded_by_the_smallest_measured_recompute():
    """A prompt shorter than the calibration's first size has no ratio of its own; recomputing
    it takes no longer than the shortest measured size took, so the gate does not take it to
    be slower (on the record, SmolLM2's H200 gate would reuse a 100-token prompt at any
    length, the record's recompute being mostly fixed host time)."""
    gate, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    work = PromptWork(100, 0, ((4, 90),))
    assert gate.decide(work).reuse  # by the record
    plan = gate.calibration_plan(8191)
    assert plan[0][0] == CALIBRATION_TOKENS[0]
    ratio = 10.5 / 22.4
    calibrate(gate, clock, plan, ratio)
    smallest = ratio * gate._plain_ms(plan[0][0], 0)
    after = gate.decide(work)
    assert not after.reuse and after.plain_ms == pytest.approx(smallest, rel=1e-6)
    # after a prefix the bound is the whole prompt's: no measured size as long, no bound
    long_prefix = PromptWork(90, 8500, ((0, 80),))
    assert gate._factors(90, 8500)[1] == gate.timer.correction.ratios(90)[1]
    assert gate.decide(long_prefix).plain_ms == pytest.approx(gate._plain_ms(90, 8500) * 1.0)


@pytest.mark.parametrize("variant", ["epic", "cacheblend"])
def test_every_prompt_is_recomputed_where_the_calibration_measured_no_hit_can_pay(variant):
    """``recomputes_all`` (what makes markup inert): SmolLM2 on the H200 record, whose cheapest
    reuse is 0.717 of the record's recompute at every length. Calibrated at 0.47 (measured) no
    length up to the context is worth reusing, which a scan of every length confirms; at 0.75
    some length is, and the scan finds one; a reuse measured anywhere, or no calibration, and
    it is not claimed. The 8B shape never: long prompts pay."""
    limit = 8192
    gate, clock = timed_gate(SMOLLM2, variant, "NVIDIA H200")
    assert gate.recomputes_all(limit) is None  # the record alone: every length may pay
    calibrate(gate, clock, gate.calibration_plan(limit - 1), 0.47)
    why = gate.recomputes_all(limit)
    assert why is not None and "measured recompute times" in why
    lengths = [*range(1, 600), *range(600, limit + 1, 11), limit]
    assert all(gate.hopeless(n) is not None for n in lengths)
    for n in (300, 1000, 4000, limit):  # whatever the hits, from scratch
        for segments in (1, 4, 8):
            per = (n - 8) // segments
            hits = tuple((4 + i * per, per) for i in range(segments))
            assert not gate.decide(PromptWork(n, 0, hits)).reuse, (n, segments)
    # a reuse measured somewhere: the floor is no longer known to hold there
    gate.timer.correction.add("reuse", 3000, 5.0, 10.0)
    gate.timer.correction.add("reuse", 3000, 5.0, 10.0)
    assert gate.timer.correction.counts()["reuse"] == 1
    assert gate.recomputes_all(limit) is None

    slow, clock = timed_gate(SMOLLM2, variant, "NVIDIA H200")
    calibrate(slow, clock, slow.calibration_plan(limit - 1), 0.75)
    assert slow.recomputes_all(limit) is None
    assert any(slow.hopeless(n) is None for n in lengths)

    big, clock = timed_gate(CFG_8B, variant, "NVIDIA H200")
    calibrate(big, clock, big.calibration_plan(8191), 0.3)
    assert big.recomputes_all(131072) is None


def test_one_length_that_could_pay_is_found_between_the_measured_sizes():
    """The check is made at the edges of the measured sizes' windows only: a calibration fast
    everywhere but at one size (measured slower there, 0.9 of the record) is not claimed, and
    a scan of every length finds the lengths it leaves worth reusing."""
    limit = 8192
    gate, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    plan = gate.calibration_plan(limit - 1)
    odd = plan[len(plan) // 2][0]
    for size, count in plan:
        calibrate(gate, clock, [(size, count)], 0.9 if size == odd else 0.47)
    assert gate.recomputes_all(limit) is None
    open_lengths = [n for n in range(1, limit + 1, 3) if gate.hopeless(n) is None]
    assert open_lengths and all(odd / 1.25 <= n <= odd * 1.25 for n in open_lengths)
    fast, clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200")
    calibrate(fast, clock, plan, 0.47)
    assert fast.recomputes_all(limit) is not None


def test_recomputing_costs_no_less_for_more_tokens_or_a_longer_prefix():
    """What ``recomputes_all`` and ``recomputed_up_to`` rest on, for every shipped record and
    the two model shapes: the record's recompute time does not fall as the computed tokens or
    the exact-prefix hit grow, and a prompt after a prefix costs no more than the whole prompt
    from scratch."""
    from redknot.costmodel.record import RECORDS_DIR

    devices = [json.loads(p.read_text())["device"] for p in RECORDS_DIR.glob("*.json")]
    assert len(devices) >= 2
    for device in devices:
        for cfg in (SMOLLM2, CFG_8B):
            gate, _ = timed_gate(cfg, "epic", device)
            sizes = [1, 2, 7, 64, 255, 256, 1000, 4096, 8191, 8192, 8193, 20000, 65536, 131072]
            for p in (0, 100, 5000, 60000):
                times = [gate._plain_ms(n, p) for n in sizes]
                assert times == sorted(times), (device, p)
            for n in (1, 300, 5000):
                times = [gate._plain_ms(n, p) for p in (0, 1, 100, 5000, 60000)]
                assert times == sorted(times), (device, n)
                for p in (1, 100, 5000):
                    assert gate._plain_ms(n, p) <= gate._plain_ms(n + p, 0) + 1e-9, (device, n, p)
