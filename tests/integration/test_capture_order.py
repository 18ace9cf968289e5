"""Captures on miss wait while user requests do (``redknot.integration.capture_order``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from redknot.api.marks import SegmentMark, encode_marks
from redknot.integration import capture_order
from redknot.segcache.entry import segment_id


@pytest.fixture(autouse=True)
def _fresh_rule():
    """Each test starts with a step rule that has seen no user prompt."""
    capture_order._rule_of.cache_clear()
    yield
    capture_order._rule_of.cache_clear()


def _req(name: str, tokens: int, kind: str = "user"):
    ids = list(range(tokens))
    mark = SegmentMark(0, tokens, "ns", segment_id("ns", ids))
    params = {
        "user": None,
        "marked": encode_marks([mark]),
        "registration": encode_marks([mark], register=True),
        "capture": encode_marks([mark], register=True, capture=True),
    }[kind]
    return SimpleNamespace(name=name, tokens=tokens, origin_input_ids=ids,
                           sampling_params=SimpleNamespace(custom_params=params))  # fmt: skip


def _sglang_like(budget: int):
    """Stands in for ``Scheduler.get_new_batch_prefill``: takes waiting requests in queue order
    up to ``budget`` tokens and leaves the rest waiting (SGLang reassigns the list)."""
    seen = []

    def original(self, running_batch):
        seen.append([r.name for r in self.waiting_queue])
        batch, room = [], budget
        for req in self.waiting_queue:
            if req.tokens > room:
                break
            batch.append(req)
            room -= req.tokens
        self.waiting_queue = [r for r in self.waiting_queue if r not in batch]
        return [r.name for r in batch]

    return original, seen


def test_only_captures_made_by_the_server_count_as_captures():
    kinds = {k: capture_order.is_capture(_req(k, 4, k)) for k in
             ("user", "marked", "registration", "capture")}  # fmt: skip
    assert kinds == {"user": False, "marked": False, "registration": False, "capture": True}
    assert not capture_order.is_capture(SimpleNamespace())  # no sampling params at all


def test_user_requests_go_first_and_the_captures_keep_their_places():
    original, seen = _sglang_like(budget=100)
    sched = SimpleNamespace(waiting_queue=[
        _req("c1", 30, "capture"), _req("u1", 20), _req("c2", 30, "capture"),
        _req("u2", 90, "registration"),
    ])  # fmt: skip
    first = capture_order.around_get_new_batch_prefill(original, sched, None)
    assert seen[-1] == ["u1", "u2"], "the batch is built from the user requests alone"
    assert first == ["u1"]  # u2 did not fit beside u1
    assert [r.name for r in sched.waiting_queue] == ["u2", "c1", "c2"]
    second = capture_order.around_get_new_batch_prefill(original, sched, None)
    assert second == ["u2"] and [r.name for r in sched.waiting_queue] == ["c1", "c2"]
    third = capture_order.around_get_new_batch_prefill(original, sched, None)
    assert third == ["c1", "c2"], "with no user request waiting, captures run as SGLang decides"
    assert sched.waiting_queue == []


def test_a_queue_without_captures_is_left_to_sglang():
    original, seen = _sglang_like(budget=100)
    reqs = [_req("u1", 20), _req("u2", 20, "marked")]
    sched = SimpleNamespace(waiting_queue=list(reqs))
    assert capture_order.around_get_new_batch_prefill(original, sched, None) == ["u1", "u2"]
    assert seen == [["u1", "u2"]]
    empty = SimpleNamespace(waiting_queue=[])
    assert capture_order.around_get_new_batch_prefill(original, empty, None) == []


def test_held_captures_come_back_when_scheduling_fails():
    def original(self, running_batch):
        self.waiting_queue = self.waiting_queue[1:]
        raise RuntimeError("out of memory")

    sched = SimpleNamespace(waiting_queue=[_req("c1", 8, "capture"), _req("u1", 8)])
    with pytest.raises(RuntimeError):
        capture_order.around_get_new_batch_prefill(original, sched, None)
    assert [r.name for r in sched.waiting_queue] == ["c1"]


def test_captures_alone_start_a_step_of_a_bounded_size():
    step = capture_order.step_rule().tokens()
    assert step == capture_order.CAPTURE_STEP_TOKENS  # no user seen, no server: the default
    original, seen = _sglang_like(budget=8192)
    sched = SimpleNamespace(waiting_queue=[
        _req("c1", step - 500, "capture"), _req("c2", 1000, "capture"),
        _req("c3", 100, "capture"), _req("c4", 3 * step, "capture"), _req("c5", 10, "capture"),
    ])  # fmt: skip
    batches = []
    while sched.waiting_queue:
        batches.append(capture_order.around_get_new_batch_prefill(original, sched, None))
    assert batches == [["c1"], ["c2", "c3"], ["c4"], ["c5"]]
    assert seen[0] == ["c1"], "the held captures were not offered to the batch"


def test_a_users_prompt_in_flight_holds_every_capture(monkeypatch):
    """Between the chunks of a user's long prompt (SGLang's ``chunked_req``, out of the queue)
    no capture joins its batches; once it is done, they run in steps again."""
    monkeypatch.setattr(capture_order, "STATS", capture_order.OrderStats())
    original, seen = _sglang_like(budget=10_000)
    sched = SimpleNamespace(
        waiting_queue=[_req("c1", 30, "capture"), _req("c2", 30, "capture")],
        chunked_req=_req("u1", 20_000),
    )
    assert capture_order.around_get_new_batch_prefill(original, sched, None) == []
    assert seen[-1] == [], "the captures were not offered beside the user's chunk"
    assert [r.name for r in sched.waiting_queue] == ["c1", "c2"]
    sched.waiting_queue.insert(1, _req("u2", 20))  # a user request arrives meanwhile
    assert capture_order.around_get_new_batch_prefill(original, sched, None) == ["u2"]
    assert capture_order.STATS.as_dict() == {
        "batches_for_users": 2, "capture_steps_cut": 0, "captures_held": 4, "chunks_alone": 1,
        "step_tokens": capture_order.CAPTURE_STEP_TOKENS}  # fmt: skip
    sched.chunked_req = _req("c0", 500, "capture")  # a capture's own chunks do not hold others
    assert capture_order.around_get_new_batch_prefill(original, sched, None) == ["c1", "c2"]
    sched.chunked_req = None
    assert capture_order.split_queue(["c"], lambda x: True, len, 8, user_in_flight=True) == (
        [], ["c"])  # fmt: skip


def test_the_hook_is_installed_on_sglangs_scheduler(sglang_plugins):
    from sglang.srt.managers.scheduler import Scheduler

    sglang_plugins.verify()  # every hook of HOOKS took effect
    assert sglang_plugins.wraps(
        Scheduler.get_new_batch_prefill, capture_order.around_get_new_batch_prefill
    )


def test_sglangs_own_method_runs_through_the_hook(sglang_plugins):
    """The installed wrapper around SGLang's real ``get_new_batch_prefill`` (its body runs; the
    batch building below it is replaced by a recorder)."""
    from sglang.srt.managers.scheduler import Scheduler

    sglang_plugins.verify()
    sched = Scheduler.__new__(Scheduler)
    sched.prefill_delayer = None
    offered = []

    def build(prefill_delayer_single_pass, running_batch):
        offered.append([r.name for r in sched.waiting_queue])
        sched.waiting_queue = sched.waiting_queue[1:]  # the first one was scheduled
        return None, running_batch

    sched._get_new_batch_prefill_raw = build
    sched.waiting_queue = [_req("c1", 8, "capture"), _req("u1", 8), _req("u2", 8)]
    plan = sched.get_new_batch_prefill("running")
    assert plan.running_batch == "running" and plan.batch_to_run is None
    assert offered == [["u1", "u2"]]
    assert [r.name for r in sched.waiting_queue] == ["u2", "c1"]


def test_the_rule_counts_what_it_held_back(monkeypatch):
    monkeypatch.setattr(capture_order, "STATS", capture_order.OrderStats())
    original, _ = _sglang_like(budget=10_000)
    sched = SimpleNamespace(waiting_queue=[_req("c1", 30, "capture"), _req("u1", 20)])
    capture_order.around_get_new_batch_prefill(original, sched, None)  # u1 only, c1 held
    step = capture_order.step_rule().tokens()
    assert step == capture_order.MIN_STEP_TOKENS  # a 20-token user prompt: the smallest step
    assert capture_order.STATS.as_dict() == {
        "batches_for_users": 1, "capture_steps_cut": 0, "captures_held": 1, "chunks_alone": 0,
        "step_tokens": capture_order.CAPTURE_STEP_TOKENS}  # fmt: skip
    sched.waiting_queue += [_req("c2", step, "capture"), _req("c3", 10, "capture")]
    capture_order.around_get_new_batch_prefill(original, sched, None)  # c1 alone: c2 over step
    capture_order.around_get_new_batch_prefill(original, sched, None)  # c2 alone: c3 over step
    capture_order.around_get_new_batch_prefill(original, sched, None)  # c3: nothing held
    capture_order.around_get_new_batch_prefill(original, sched, None)  # empty queue
    assert capture_order.STATS.as_dict() == {
        "batches_for_users": 1, "capture_steps_cut": 2, "captures_held": 4, "chunks_alone": 0,
        "step_tokens": step}  # fmt: skip
    # a scheduling pass that builds no batch (SGLang returns None) counts nothing
    sched.waiting_queue = [_req("c4", 30, "capture"), _req("u2", 20)]
    capture_order.around_get_new_batch_prefill(lambda self, rb: None, sched, None)
    assert capture_order.STATS.batches_for_users == 1
    assert [r.name for r in sched.waiting_queue] == ["u2", "c4"]


def test_server_wide_stats_carry_the_rules_counters(monkeypatch):
    from redknot.api import control
    from redknot.api.control import RedknotSegmentsReq

    monkeypatch.setattr(capture_order, "STATS", capture_order.OrderStats(batches_for_users=3))
    store = SimpleNamespace(stats=lambda namespace=None: {"hits": 1})
    sched = SimpleNamespace(tree_cache=SimpleNamespace(segments=store))
    out = control.handle(sched, RedknotSegmentsReq(op="stats"))
    assert out.status == 200
    payload = json.loads(out.payload)
    assert payload["capture_order"]["batches_for_users"] == 3 and payload["hits"] == 1
    one = json.loads(control.handle(sched, RedknotSegmentsReq(op="stats", namespace="kb")).payload)
    assert "capture_order" not in one  # a namespace's stats are the store's alone


def test_the_step_follows_the_shortest_recent_user_prompt():
    rule = capture_order.StepRule(max_tokens=2048, fraction=0.1)
    assert rule.tokens() == 2048, "before any user prompt: the fixed step"
    rule.saw_user("a", 16_000)
    assert rule.tokens() == 1600
    rule.saw_user("b", 5_000)
    assert rule.tokens() == 500, "the shortest recent prompt sets it"
    rule.saw_user("b", 5_000)  # the same request seen again (still waiting) counts once
    for k in range(capture_order.RECENT_USERS - 1):  # b and 7 more: b is still in the window
        rule.saw_user(f"long{k}", 40_000)
    assert rule.tokens() == 500
    for k in range(capture_order.RECENT_USERS - 1, capture_order.RECENT_USERS):
        rule.saw_user(f"long{k}", 40_000)
    assert rule.tokens() == 2048, "b is out of the window; 10% of 40K is over the maximum"
    rule.saw_user("chat", 300)
    assert rule.tokens() == capture_order.MIN_STEP_TOKENS, "never under the smallest step"
    assert capture_order.StepRule(100, 0.1).tokens() == 100
    small = capture_order.StepRule(100, 0.1)
    small.saw_user("chat", 300)
    assert small.tokens() == 100, "a maximum under the smallest step is kept"
    fixed = capture_order.StepRule(2048, 0.0)
    fixed.saw_user("chat", 300)
    assert fixed.tokens() == 2048, "fraction 0: the fixed step only"


def test_a_short_user_prompt_makes_the_next_capture_steps_short(monkeypatch):
    """After a 3,000-token user prompt the captures start 300 tokens at a time (10%), where
    2,048 would have started together."""
    monkeypatch.setattr(capture_order, "STATS", capture_order.OrderStats())
    original, _ = _sglang_like(budget=8192)
    sched = SimpleNamespace(waiting_queue=[_req("u1", 3000)] + [
        _req(f"c{k}", 200, "capture") for k in range(6)])  # fmt: skip
    batches = []
    while sched.waiting_queue:
        batches.append(capture_order.around_get_new_batch_prefill(original, sched, None))
    assert batches == [["u1"], ["c0"], ["c1"], ["c2"], ["c3"], ["c4"], ["c5"]]
    assert capture_order.STATS.step_tokens == 300
    capture_order._rule_of.cache_clear()  # no user seen: the fixed step takes them together
    sched.waiting_queue = [_req(f"c{k}", 200, "capture") for k in range(6)]
    assert capture_order.around_get_new_batch_prefill(original, sched, None) == [
        f"c{k}" for k in range(6)]  # fmt: skip
