"""SamKV's shorter prompt on the scheduler's side (``redknot.segcache.samkv``): a request whose
marked documents are stored is cut when it enters the queue, held when it gets its slot, never
matched past its first document in the radix tree, never split into chunks; one it cannot serve
so keeps its prompt and says why."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from redknot.api.marks import SegmentMark, encode_marks, segment_id
from redknot.recovery.samkv.served import SamkvKnobs
from redknot.segcache import reuse, samkv

KNOBS = SamkvKnobs(block=4, budget=0.25, init_blocks=1, local_blocks=1, bias=True)
DOC = list(range(1000, 1040))  # 4 init, 8 blocks (32), 4 local
QUESTION = [7, 8, 9]


class FakeStore:
    def __init__(self, ready):
        self.ready, self.held = set(ready), []

    def is_ready(self, namespace, seg_id, num_tokens):
        return seg_id in self.ready

    def lookup_id(self, namespace, seg_id, num_tokens):
        if seg_id not in self.ready:
            return None
        return SimpleNamespace(namespace=namespace, num_tokens=num_tokens, segment_id=seg_id)

    def lookup_ids(self, keys):
        return [self.lookup_id(*key) for key in keys]

    def find_ids(self, keys):  # the entries stand for their serials
        return self.lookup_ids(keys)

    def entry_of(self, serial):
        return serial

    def acquire(self, entry):
        self.held.append(entry)

    def release(self, entry):
        self.held.remove(entry)


def request(docs_ready=True, **kw):
    prompt = [1, 2] + DOC + [3] + DOC[::-1] + QUESTION
    marks = [SegmentMark(2, 42, "kb", segment_id("kb", DOC)),
             SegmentMark(43, 83, "kb", segment_id("kb", DOC[::-1]))]  # fmt: skip
    params = SimpleNamespace(custom_params=encode_marks(marks), max_new_tokens=16)
    req = SimpleNamespace(
        rid="r", origin_input_ids=array("q", prompt), sampling_params=params,
        return_logprob=False, logprob_start_len=-1, multimodal_inputs=None, input_embeds=None,
        session=None, output_ids=[], prefix_indices=[], req_pool_idx=3,
    )  # fmt: skip
    for k, v in kw.items():
        setattr(req, k, v)
    ready = [m.segment_id for m in marks] if docs_ready else [marks[0].segment_id]
    store = FakeStore(ready)
    pool = SimpleNamespace(segment_reads={}, reuse_policy="samkv", reuse_gate=None)
    cache = SimpleNamespace(segments=store, pool=pool)
    scheduler = SimpleNamespace(tree_cache=cache, chunked_prefill_size=8192)
    return scheduler, req, prompt


def test_a_request_with_stored_documents_is_cut_then_held_when_it_runs():
    scheduler, req, _ = request()
    samkv.cut(scheduler, req, KNOBS)
    plan = getattr(req, reuse.SAMKV_ATTR)
    # each document: 4 init + 2 of its 8 blocks (ceil(0.25 * 8)) + 4 local = 16 of 40 tokens
    assert [d.served_tokens for d in plan.docs] == [16, 16]
    want = [1, 2] + DOC[:12] + DOC[36:] + [3] + DOC[::-1][:12] + DOC[::-1][36:] + QUESTION
    assert list(req.origin_input_ids) == want
    assert samkv.prefix_cap(req) == 2 and samkv.is_cut(req)
    assert req.logprob_start_len == -1  # output logprobs only: unchanged

    reuse.start(scheduler.tree_cache, req)
    uses = scheduler.tree_cache.pool.segment_reads[3]
    assert [u.start for u in uses] == [2, 19] and all(u.doc is not None for u in uses)
    report = req.customized_info[reuse.REPORT_KEY][0]
    assert report["segments_hit"] == 2 and report["policy"] == "samkv"
    assert report["samkv"]["served_tokens"] == len(want)
    assert [s["start"] for s in report["segments"]] == [2, 43]  # the client's offsets


def test_logprobs_of_the_question_follow_it_into_the_served_prompt():
    scheduler, req, prompt = request(return_logprob=True, logprob_start_len=85)
    samkv.cut(scheduler, req, KNOBS)
    assert req.logprob_start_len == 85 - 48  # two documents of 40 held as 16 each
    assert req.origin_input_ids[req.logprob_start_len] == prompt[85]


def test_a_document_evicted_while_queued_is_computed_from_the_kept_rows(caplog):
    scheduler, req, _ = request()
    samkv.cut(scheduler, req, KNOBS)
    scheduler.tree_cache.segments.ready.remove(segment_id("kb", DOC[::-1]))
    with caplog.at_level("WARNING"):
        reuse.start(scheduler.tree_cache, req)
    assert len(scheduler.tree_cache.pool.segment_reads[3]) == 1
    assert "evicted while the request waited" in caplog.text
    assert req.customized_info[reuse.REPORT_KEY][0]["samkv"]["evicted"] == [43]


@pytest.mark.parametrize(
    "change, why",
    [
        ({"return_logprob": True, "logprob_start_len": 82}, "input-token logprobs"),
        ({"session": object()}, "session"),
        ({"chunk": 40}, "--chunked-prefill-size 40"),
    ],
)
def test_a_request_that_cannot_be_cut_keeps_its_prompt_and_says_why(change, why, caplog):
    scheduler, req, prompt = request(**{k: v for k, v in change.items() if k != "chunk"})
    if "chunk" in change:
        scheduler.chunked_prefill_size = change["chunk"]
    samkv.cut(scheduler, req, KNOBS)
    assert list(req.origin_input_ids) == prompt and not samkv.is_cut(req)
    with caplog.at_level("INFO"):
        reuse.start(scheduler.tree_cache, req)
    assert 3 not in scheduler.tree_cache.pool.segment_reads  # computed in full, exact
    assert why in req.customized_info[reuse.REPORT_KEY][0]["samkv"]["note"]
    assert why in caplog.text


def test_only_stored_documents_are_cut():
    scheduler, req, prompt = request(docs_ready=False)
    samkv.cut(scheduler, req, KNOBS)
    plan = getattr(req, reuse.SAMKV_ATTR)
    assert [d.source for d in plan.docs] == [2]
    assert list(req.origin_input_ids)[18:] == prompt[42:]  # the missed document whole


def test_a_cut_request_waits_for_a_batch_that_holds_it_whole():
    from sglang.srt.managers.schedule_policy import AddReqResult

    scheduler, req, _ = request()
    samkv.cut(scheduler, req, KNOBS)
    n = len(req.origin_input_ids)
    calls = []
    original = lambda self, r, *a, **k: calls.append(r) or "added"
    adder = SimpleNamespace(rem_chunk_tokens=n - 1, can_run_list=[object()])
    assert samkv.around_add_one_req(original, adder, req, False, None) == AddReqResult.OTHER
    adder.rem_chunk_tokens = n
    assert samkv.around_add_one_req(original, adder, req, False, None) == "added"
    plain = SimpleNamespace(origin_input_ids=[1] * 100, output_ids=[], prefix_indices=[])
    adder.rem_chunk_tokens = 10  # an uncut request is chunked as SGLang does
    assert samkv.around_add_one_req(original, adder, plain, False, None) == "added"


def test_another_backends_scheduler_is_left_alone(monkeypatch):
    """The hook runs in every SGLang scheduler the plugin is loaded in: one without redknot's
    tree cache, or a redknot server of another policy, neither reads nor cuts anything."""
    from redknot import envs

    scheduler, req, prompt = request()
    scheduler.tree_cache = SimpleNamespace()  # SGLang's own radix cache: no segment store
    samkv._before_add_request_to_queue(scheduler, req)
    assert list(req.origin_input_ids) == prompt
    monkeypatch.delenv(envs.REDKNOT_RESOLVED_CONFIG.name, raising=False)
    samkv.served_knobs.cache_clear()
    scheduler, req, prompt = request()
    samkv._before_add_request_to_queue(scheduler, req)  # no resolved configuration: not redknot
    assert list(req.origin_input_ids) == prompt and not samkv.is_cut(req)
    samkv.served_knobs.cache_clear()  # read again by whoever comes next


def test_the_samkv_policy_resolves_its_knobs_and_refuses_bad_ones():
    from redknot.attention.token_policy import TokenPolicy
    from redknot.config import RedknotConfig, RedknotConfigError

    config = RedknotConfig(policy="samkv", samkv_block=32, samkv_budget=0.2)
    assert config.all_global and config.segment_heads == "all"  # a token-level policy
    policy = TokenPolicy.of(config)
    assert policy.samkv == SamkvKnobs(32, 0.2, 1, 2, True, 4096) and policy.chooses_at_plan
    assert "0.2 of its middle blocks" in policy.describe()
    assert not TokenPolicy.of(RedknotConfig(policy="samkv", samkv_bias="off")).samkv.bias
    for bad, flag in (({"samkv_budget": 1.5}, "--redknot-samkv-budget"),
                      ({"samkv_block": 0}, "--redknot-samkv-block"),
                      ({"samkv_local_blocks": -1}, "--redknot-samkv-local-blocks"),
                      ({"samkv_bias": "yes"}, "--redknot-samkv-bias")):  # fmt: skip
        with pytest.raises(RedknotConfigError, match=flag):
            RedknotConfig(policy="samkv", **bad)
    with pytest.raises(RedknotConfigError, match="--redknot-segment-fraction 0"):
        RedknotConfig(policy="samkv", segment_fraction=0)


@pytest.mark.parametrize(
    "knobs, why",
    [
        (SamkvKnobs(4, 0.25, 1, 1, True, min_tokens=81), "--redknot-samkv-min-tokens 81"),
        (SamkvKnobs(4, 1.0, 1, 1, True), "nothing to drop"),  # every block kept
        (SamkvKnobs(64, 0.25, 1, 1, True), "too short"),  # no document has a middle block
    ],
)
def test_a_cut_that_saves_nothing_or_too_little_is_not_made(knobs, why, caplog):
    scheduler, req, prompt = request()
    samkv.cut(scheduler, req, knobs)
    assert list(req.origin_input_ids) == prompt and not samkv.is_cut(req)
    with caplog.at_level("INFO"):
        reuse.start(scheduler.tree_cache, req)
    assert 3 not in scheduler.tree_cache.pool.segment_reads
    assert why in req.customized_info[reuse.REPORT_KEY][0]["samkv"]["note"]
    cut_at_80 = request()[1]  # 80 document tokens are enough at min_tokens 80
    samkv.cut(scheduler, cut_at_80, SamkvKnobs(4, 0.25, 1, 1, True, min_tokens=80))
    assert samkv.is_cut(cut_at_80)


def test_the_answer_counts_the_prompt_sent_not_the_rows_held():
    scheduler, req, prompt = request()
    samkv.cut(scheduler, req, KNOBS)
    acc = SimpleNamespace(prompt_tokens=[len(req.origin_input_ids)])  # what SGLang appended
    samkv._after_stream_accept(None, acc, req=req)
    assert acc.prompt_tokens == [len(prompt)]
    plain = request(docs_ready=False)[1]
    plain.sampling_params.custom_params = {}
    acc = SimpleNamespace(prompt_tokens=[7])
    samkv._after_stream_accept(None, acc, req=plain)
    assert acc.prompt_tokens == [7]
