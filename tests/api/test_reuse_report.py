"""What a request's answer says about its reuse: ``meta_info["redknot_reuse"]``
(``redknot.segcache.reuse``), through the CPU server stand-in, and through SGLang's own output
path from the scheduler's request to the payload the tokenizer manager reads."""

from __future__ import annotations

import types
from array import array

import pytest

from redknot.segcache.reuse import REPORT_KEY
from tests.api.test_capture import DOC
from tests.api.test_capture import _generate as marked_request


@pytest.fixture
def server(http_app, smollm_tokenizer, server_args):
    from tests.api.cpu_server import CpuServer

    return CpuServer(http_app, smollm_tokenizer, server_args=server_args)


def _generate(client, question):
    """The marked request of ``test_capture`` (``DOC`` in namespace kb): its meta_info."""
    r = marked_request(client, question)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_a_miss_then_a_hit_are_reported_with_their_segment(server, client, smollm_tokenizer):
    n = len(smollm_tokenizer.encode(DOC, add_special_tokens=False))
    meta = _generate(client, "Capital of France?")
    (report,) = meta[REPORT_KEY]
    assert report == {
        "segments_marked": 1, "segments_hit": 0, "reused_tokens": 0, "segments": [],
        "policy": None,
    }  # fmt: skip
    meta = _generate(client, "Capital of Germany?")  # captured after the miss: a hit
    (report,) = meta[REPORT_KEY]
    start = len(smollm_tokenizer.encode("Context: "))  # the prompt's text before DOC
    assert (
        report["segments_hit"] == 1 and report["reused_tokens"] == n == meta["standin_read_tokens"]
    )
    assert report["segments"] == [{"namespace": "kb", "start": start, "tokens": n}]
    assert report["policy"] == "redknot"  # the stand-in pool's
    assert "gate" not in report  # the stand-in has no reuse gate


def test_an_unmarked_request_reports_no_segment(server, client):
    body = {"text": f"Context: {DOC}", "sampling_params": {"max_new_tokens": 1}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    (report,) = r.json()["meta_info"][REPORT_KEY]
    assert report["segments_marked"] == 0 and report["reused_tokens"] == 0


class _Gate:
    """``decide`` answers ``reuse``; ``hopeless``: every prompt is answered before any
    lookup (as the real gate where no hit can pay for the prompt's size)."""

    def __init__(self, reuse: bool, hopeless: bool = False):
        from redknot.costmodel.gate import Decision

        self.reuse, self.recomputed = reuse, 0
        self.answer = Decision(False, 5.0, 4.0, "no hit pays") if hopeless else None

    def hopeless(self, prompt_len, prefix_len):
        return self.answer

    def count_recomputed(self):
        self.recomputed += 1

    def decide(self, work):
        from redknot.costmodel.gate import Decision

        return Decision(self.reuse, 5.0, 4.0, "predicted 5.0 ms with reuse against 4.0 ms")


@pytest.mark.parametrize("pays, hopeless", [(True, False), (False, False), (True, True)])
def test_the_gate_decision_is_reported_and_a_recompute_reuses_nothing(
    server, client, smollm_tokenizer, pays, hopeless
):
    _generate(client, "Capital of France?")  # stores the document
    server.scheduler.pool.reuse_gate = gate = _Gate(pays, hopeless)
    meta = _generate(client, "Capital of Germany?")
    (report,) = meta[REPORT_KEY]
    assert report["segments_hit"] == 1 and gate.recomputed == int(hopeless)
    pays = pays and not hopeless
    reason = "no hit pays" if hopeless else "predicted 5.0 ms with reuse against 4.0 ms"
    assert report["gate"] == {
        "decision": "reuse" if pays else "recompute", "reuse_ms": 5.0, "recompute_ms": 4.0,
        "reason": reason,
    }  # fmt: skip
    n = len(smollm_tokenizer.encode(DOC, add_special_tokens=False))
    assert report["reused_tokens"] == (n if pays else 0) == meta["standin_read_tokens"]
    assert (report["policy"] is None) == (not pays) and len(report["segments"]) == int(pays)


def test_tokens_an_exact_prefix_hit_covers_are_not_counted_as_segment_reuse():
    from redknot.segcache import reuse

    a, b = (types.SimpleNamespace(num_tokens=10, namespace=ns) for ns in "ab")
    uses = [reuse.SegmentUse(4, a, 40), reuse.SegmentUse(20, b, 40)]
    req = types.SimpleNamespace(prefix_indices=list(range(8)), customized_info={"other": [1]})
    pool = types.SimpleNamespace(reuse_policy="cacheblend")
    reuse._report(req, pool, 3, 2, uses)
    (report,) = req.customized_info[REPORT_KEY]
    assert report["reused_tokens"] == (14 - 8) + 10  # the first segment's tokens 8..13, all of
    assert report["policy"] == "cacheblend" and report["segments_marked"] == 3
    assert req.customized_info["other"] == [1]  # what else the request carries is kept


def test_sglang_carries_the_report_from_the_scheduler_to_the_tokenizer_manager():
    # SGLang 0.5.17's own output path: a request's customized_info reaches the payload the
    # tokenizer manager turns into meta_info, the report with the first output token only
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import unwrap_from_pickle
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.output_streamer import (
        _GenerationStreamAccumulator,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from redknot.segcache import reuse

    def accumulator():
        return _GenerationStreamAccumulator(
            return_logprob=False, return_hidden_states=False, return_routed_experts=False,
            return_indexer_topk=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL, default_stream_interval=1,
            default_force_stream_interval=1, get_cached_tokens_details=lambda r: None,
        )  # fmt: skip

    req = Req("r1", "", array("q", [1, 2, 3, 4, 5, 6]), SamplingParams(max_new_tokens=3))
    req.stream = True
    entry = types.SimpleNamespace(num_tokens=3, namespace="kb")
    reuse._report(req, types.SimpleNamespace(reuse_policy="epic"), 1, 1,
                  [reuse.SegmentUse(2, entry, 6)])  # fmt: skip
    sent = []
    for token in (7, 8):  # two decode steps, each streamed
        req.output_ids.append(token)
        acc = accumulator()
        acc.accept(req=req)
        sent.append(
            unwrap_from_pickle(acc.to_payload(dp_rank=0, is_idle_batch=False).customized_info)
        )
    first, second = (s[REPORT_KEY][0] for s in sent)
    assert first == [req.customized_info[REPORT_KEY][0]] and second == []
    assert first[0]["reused_tokens"] == 3 and first[0]["policy"] == "epic"


class _HopelessGate:
    """A reuse gate that recomputes every prompt up to ``up_to`` tokens whatever it hits."""

    def __init__(self, up_to: int):
        from redknot.costmodel.gate import Decision

        self.up_to, self.asked, self.decided, self.inert = up_to, [], 0, 0
        self.answer = Decision(False, 30.0, 10.0, "no hit pays at this size")

    def hopeless(self, prompt_len, prefix_len=0, *, measured=True):
        self.asked.append((prompt_len, prefix_len))
        return self.answer if prompt_len <= self.up_to else None

    def recomputed_up_to(self, limit):
        return min(limit, self.up_to)

    def recomputes_all(self, limit):
        return "every prompt is recomputed" if self.up_to >= limit else None

    def min_segment_tokens(self, prompt_tokens=8192, question=64):
        return None

    def calibration_plan(self, limit):  # no timer (as the record alone): nothing to measure
        return []

    def count_recomputed(self):
        pass

    def count_inert(self):
        self.inert += 1

    def decide(self, work):
        from redknot.costmodel.gate import Decision

        self.decided += 1
        return Decision(False, 30.0, 10.0, "looked up and decided")


@pytest.mark.parametrize("inert", [True, False])
def test_markup_is_inert_where_the_gate_recomputes_every_prompt_the_model_takes(
    server, client, inert
):
    """Inert: the first marked request learns it from the scheduler's gate; from then on the
    prompt reaches the scheduler with the number of its marks only, nothing is looked up or
    captured, and the answer reports the marks with the gate's reason. Otherwise (the gate
    lets long prompts reuse) marks are looked up and captured as always."""
    from redknot.api.marks import KEY_BOUNDS, KEY_RECOMPUTED

    context = 4096
    server.scheduler.model_config = types.SimpleNamespace(context_len=context)
    server.scheduler.pool.reuse_gate = gate = _HopelessGate(context if inert else 1024)
    ops = server.record_control_ops()
    reports = [_generate(client, q)[REPORT_KEY][0] for q in ("France?", "Germany?", "Spain?")]
    sent = server.tm.last.sampling_params["custom_params"]
    stats = server.store.stats("kb")
    if inert:
        assert ops == ["gate"]  # asked once; no capture asked anything
        assert sent[KEY_RECOMPUTED] == 1 and KEY_BOUNDS not in sent
        assert stats["hits"] == stats["misses"] == 0 and not server.tm.captures
        want = {"decision": "recompute", "reuse_ms": 30.0, "recompute_ms": 10.0,
                "reason": "no hit pays at this size"}  # fmt: skip
        for report in reports:
            assert report["segments_marked"] == 1 and report["segments_hit"] is None
            assert report["reused_tokens"] == 0 and report["gate"] == want
        assert gate.decided == 0 and gate.inert == 3
        body = {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 2},
                "redknot_segments": [{"start": 2, "end": 30, "namespace": "kb"}]}  # fmt: skip
        r = client.post("/generate", json=body)  # token ids in: only their count is read
        assert r.status_code == 200, r.text
        report = r.json()["meta_info"][REPORT_KEY][0]
        assert report["segments_marked"] == 1 and report["segments_hit"] is None
        assert server.tm.last.input_ids == list(range(100, 140))
    else:
        assert ops[0] == "gate" and KEY_BOUNDS in sent and KEY_RECOMPUTED not in sent
        assert stats["misses"] == 1 and stats["hits"] == 2  # captured after the first miss
        assert [r["segments_hit"] for r in reports] == [0, 1, 1]
        # the prompts are short: answered without checking ids, their hits never held
        assert all(r["gate"]["reason"] == "no hit pays at this size" for r in reports[1:])
