"""SamKV's shorter prompt on the scheduler's side (``--redknot-policy samkv``; SGLang 0.5.17).

A request whose marked documents are stored is *cut* when it enters the waiting queue: its
prompt becomes the served prompt of :mod:`redknot.recovery.samkv.served` (each hit document's
anchors and kept blocks), so that everything SGLang counts and allocates from then on (the
admission budget, ``req_to_token``, the KV pool, decode) holds only those rows. The plan rides
on the request (``reuse.SAMKV_ATTR``); when the request gets its slot,
:func:`redknot.segcache.reuse.start` holds its documents.

| when                          | where                                  | what                   |
| ----------------------------- | -------------------------------------- | ---------------------- |
| the request enters the queue  | ``Scheduler._add_request_to_queue`` (before) | :func:`cut`      |
| its prefix is matched         | ``RedknotRadixCache.match_prefix``     | never past its first document (:func:`prefix_cap`) |
| a prefill batch is filled     | ``PrefillAdder.add_one_req`` (around)  | never split into chunks: one forward chooses every layer's blocks from the question's queries, so it waits for a batch with room (:func:`around_add_one_req`) |
| it finishes                   | ``RedknotRadixCache.cache_finished_req`` | its KV is not put in the radix tree: a middle row holds a different token in each layer |
| its answer is streamed        | ``_GenerationStreamAccumulator.accept`` (after) | the usage's ``prompt_tokens`` is the prompt sent, not the rows held |

A request is served in full, without the cache (exact), and the reason logged and reported
(``meta_info["redknot_reuse"][0]["samkv"]["note"]``) when the cut would drop nothing (no
question after the documents, or documents too short for a middle block), when its stored
documents hold fewer than ``--redknot-samkv-min-tokens`` tokens, when it asks for input-token logprobs of
rows before its last document's end (they are cut; the HTTP side refuses those already),
carries embeddings or images, belongs to a session, or when the served
prompt with ``max_new_tokens`` does not fit one prefill chunk (``--chunked-prefill-size``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from redknot.recovery.samkv.served import SamkvKnobs, plan_documents, served_ids
from redknot.segcache.reuse import SAMKV_ATTR, SAMKV_NOTE

logger = logging.getLogger(__name__)


@functools.cache  # read once per process: the configuration is fixed at launch
def served_knobs() -> SamkvKnobs | None:
    """The served policy's knobs, or None when it is not ``samkv``."""
    from redknot import envs
    from redknot.integration.server_args import published_config

    if envs.REDKNOT_RESOLVED_CONFIG.get() is None:  # not a redknot server
        return None
    config = published_config()
    return SamkvKnobs.of(config) if config.policy == "samkv" else None


def cut(scheduler: Any, req: Any, knobs: SamkvKnobs | None = None) -> None:
    """Cut ``req``'s prompt if its documents are stored (module docstring); no error escapes
    (a request the cut cannot serve keeps its prompt and is computed in full)."""
    from redknot.api.marks import SegmentMarkError, registration_of, segments_of

    store = getattr(getattr(scheduler, "tree_cache", None), "segments", None)
    if store is None or getattr(req, "sampling_params", None) is None:
        return  # not redknot's tree cache (another backend), or no segment region
    knobs = knobs or served_knobs()
    if knobs is None:
        return
    if getattr(req, SAMKV_ATTR, None) is not None:  # a retracted request, cut already
        return
    try:
        if registration_of(req) is not None:
            return
        marks = segments_of(req)
    except SegmentMarkError:  # reuse.start logs it when the request runs
        return
    hits = [
        (m.start, m.num_tokens, m.namespace, m.segment_id)
        for m in marks
        if store.is_ready(m.namespace, m.segment_id, m.num_tokens)
    ]  # fmt: skip
    if not hits:
        return
    plan = plan_documents(len(req.origin_input_ids), hits, knobs)
    note = _refusal(scheduler, req, plan, knobs)
    if note is not None:
        setattr(req, SAMKV_NOTE, note)
        return
    req.origin_input_ids = served_ids(req.origin_input_ids, plan)
    start = getattr(req, "logprob_start_len", None)
    if start is not None and start >= 0:  # past the documents: the same token, fewer before it
        req.logprob_start_len = start - plan.dropped
    setattr(req, SAMKV_ATTR, plan)
    logger.debug(
        "redknot samkv: request %s cut from %d to %d tokens (%d documents)",
        req.rid, plan.prompt_tokens, plan.served_tokens, len(plan.docs),
    )  # fmt: skip


def _refusal(scheduler: Any, req: Any, plan, knobs: SamkvKnobs) -> str | None:
    """Why ``req`` cannot be served as the cut prompt ``plan``, or None."""
    if plan.dropped == 0:
        return plan.note or "nothing to drop"
    held = sum(d.num_tokens for d in plan.docs)
    if held < knobs.min_tokens:
        return (
            f"its stored documents hold {held} tokens, fewer than --redknot-samkv-min-tokens "
            f"{knobs.min_tokens}: computed in full, which is faster at that size"
        )
    start = getattr(req, "logprob_start_len", -1)
    last = max(d.source + d.num_tokens for d in plan.docs)
    safe = min(last, plan.prompt_tokens - 1)  # as the HTTP side checks (api.generate)
    if getattr(req, "return_logprob", False) and start is not None and 0 <= start < safe:
        return (
            f"input-token logprobs asked from token {start}: the served prompt leaves the "
            f"documents' rows out before token {safe}"
        )
    if getattr(req, "multimodal_inputs", None) is not None or getattr(req, "input_embeds", None):
        return "the request carries embeddings or images"
    if getattr(req, "session", None) is not None:
        return "session requests keep their prompt"
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    max_new = getattr(req.sampling_params, "max_new_tokens", None) or 0
    if chunk is not None and plan.served_tokens + max_new > chunk:
        return (
            f"the served prompt ({plan.served_tokens} tokens) and max_new_tokens ({max_new}) "
            f"do not fit one prefill chunk (--chunked-prefill-size {chunk}): one forward "
            "chooses the blocks from the question; raise --chunked-prefill-size"
        )
    return None


def prefix_cap(req: Any) -> int | None:
    """The longest exact-prefix match a cut request may take: up to its first document (its
    rows past that are not the prompt's tokens)."""
    plan = getattr(req, SAMKV_ATTR, None) if req is not None else None
    return None if plan is None else plan.docs[0].start


def is_cut(req: Any) -> bool:
    return getattr(req, SAMKV_ATTR, None) is not None


def _before_add_request_to_queue(self: Any, req: Any, is_retracted: bool = False) -> None:
    if not is_retracted:
        cut(self, req)


def around_add_one_req(original, self: Any, req: Any, *args, **kwargs):
    """A cut request whose prompt does not fit what is left of this batch's chunk waits for a
    later batch (first in it, it has the whole chunk: :func:`_refusal` checked that it fits;
    with ``--enable-mixed-chunk`` the running decodes take their share first)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    limit = getattr(self, "rem_chunk_tokens", None)
    if limit is not None and is_cut(req):
        need = len(req.origin_input_ids) + len(req.output_ids) - len(req.prefix_indices)
        if need > limit:
            return AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


def _after_stream_accept(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """The answer's usage counts the prompt the client sent, not the rows a cut request held
    (those are in its reuse report)."""
    req = kwargs.get("req", args[0] if args else None)
    plan = getattr(req, SAMKV_ATTR, None)
    if plan is not None and self.prompt_tokens:
        self.prompt_tokens[-1] = plan.prompt_tokens


_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer"
# (target, HookType name, function), turned into plugin.Hook entries by the plugin.
HOOKS: tuple[tuple[str, str, Any], ...] = (
    (
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        "BEFORE",
        _before_add_request_to_queue,
    ),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "AROUND", around_add_one_req),
    (f"{_STREAMER}._GenerationStreamAccumulator.accept", "AFTER", _after_stream_accept),
)
