"""Compose a case into token ids with the segments' rows, as the reference backend serves it.

Every piece is tokenised alone and the ids are concatenated, so a segment's tokens in the
prompt are exactly its tokens when cached alone::

    head  = chat template up to the user message (with ``system`` as system message), or the
            tokenizer's own special tokens (none for SmolLM2) then ``system`` when not chat
    ids   = head + between[0] + segments[0] + ... + between[n-1] + segments[n-1] + question
            + tail (the chat template after the user message; empty when not chat)

``head`` is the exact-prefix part: a server holds it from earlier requests.

:func:`auto_chunked` serves the same prompt with the segments automatic segments would reuse
instead of the case's: the content-defined chunks of the whole prompt that lie inside one of
its segments (a chunk that straddles two of them, or a segment and new text, differs with the
neighbour and is computed in full). :func:`auto_learned` serves it with what ``cdc-edges`` or
``cdc-docs`` would reuse after the same documents were seen in other orders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from redknot.eval.cases import Case

_SENTINEL = "\u2063REDKNOT-USER\u2063"


@dataclass(frozen=True)
class ComposedCase:
    """``ids``: the prompt; ``segments``: ``(start, end)`` rows per segment; ``prefix_len``:
    rows of the head (template head and system)."""

    ids: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    prefix_len: int
    contexts: tuple[tuple[int, ...], ...] | None = None  # per segment: computed after these

    @property
    def segment_tokens(self) -> int:
        return sum(e - s for s, e in self.segments)


def auto_chunked(composed: ComposedCase, chunk_tokens: int = 256) -> ComposedCase:
    """``composed`` with its segments replaced by those chunks of ``--redknot-auto-segments cdc
    --redknot-auto-chunk-tokens chunk_tokens`` (the server's chunker, its minimum segment
    length) that lie inside one of its segments; the prompt is unchanged."""
    from redknot.api.auto import AutoSegments
    from redknot.api.options import AutoSegmentsOption

    auto = AutoSegments(AutoSegmentsOption.parse("cdc", chunk_tokens))
    inside = [
        (a, b)
        for a, b in auto.spans(list(composed.ids))
        if any(s <= a and b <= e for s, e in composed.segments)
    ]
    return ComposedCase(composed.ids, tuple(inside), composed.prefix_len)


def auto_learned(
    tokenizer,
    case: Case,
    chunk_tokens: int,
    mode: str,
    pool: tuple[str, ...] = (),
    orders: int = 16,
    seed: int = 0,
    context_tokens: int = 0,
) -> ComposedCase:
    """The case's prompt with the segments a server under ``--redknot-auto-segments mode``
    (``cdc-edges`` or ``cdc-docs``) would reuse after serving ``orders`` prompts of the same
    documents with two others from ``pool`` (other cases' documents), in random orders (seeded
    by the case), and then this one: the spans of the prompt that its store holds by then
    (documents' edges are learned from the different neighbours a retrieval pool gives them).
    What the store holds follows the capture path
    (``redknot.api.capture``) with nothing evicted: a chunk is stored at its
    ``--redknot-auto-capture-after``-th miss, a learned edge at once, a document run once it is
    due, the pieces it replaces then dropped."""
    import random

    from redknot.api.auto import AutoSegments
    from redknot.api.options import AutoSegmentsOption

    option = AutoSegmentsOption.parse(mode, chunk_tokens, capture_context=context_tokens)
    auto = AutoSegments(option)
    stored: set[tuple[int, ...]] = set()
    misses: dict[tuple[int, ...], int] = {}
    contexts: dict[tuple[int, ...], tuple[int, ...]] | None = {} if context_tokens else None
    rng = random.Random(f"{seed}:{case.id}")
    others = [doc for doc in pool if doc not in case.segments]
    for _ in range(orders):
        docs = list(case.segments) + rng.sample(others, min(2, len(others)))
        rng.shuffle(docs)
        between = (case.between[0], *[case.between[-1]] * (len(docs) - 1))
        other = dataclasses.replace(case, segments=tuple(docs), between=between)
        serve_prompt(auto, list(compose(tokenizer, other).ids), stored, misses, contexts)
    composed = compose(tokenizer, case)
    ids = list(composed.ids)
    # a span reaching into the prompt's head (served by the radix cache in a server) starts
    # where the head ends here: the reference path serves a prefix and segments apart
    head = composed.prefix_len
    kept = [
        (a, b)
        for a, b in auto.spans(ids)
        if b - max(a, head) >= auto.min_store_tokens and tuple(ids[a:b]) in stored
    ]
    held = tuple((max(a, head), b) for a, b in kept)
    if contexts is None:
        return ComposedCase(composed.ids, held, composed.prefix_len)
    # a clipped span's rows are computed after its context and its own clipped-off tokens
    held_contexts = tuple((*contexts[tuple(ids[a:b])], *ids[a : max(a, head)]) for a, b in kept)
    return ComposedCase(composed.ids, held, composed.prefix_len, held_contexts)


def serve_prompt(
    auto, ids: list[int], stored: set, misses: dict, contexts: dict | None = None
) -> int:
    """One prompt through ``auto`` (``redknot.api.auto.AutoSegments``) and a model of the
    capture path's store (``stored``: the spans it holds, ``misses``: per span; ``contexts``,
    when given: per span, the tokens it was captured after, by the server's rules for its
    ``--redknot-auto-capture-context``; see :func:`auto_learned`): the prompt tokens served
    from the store."""
    served = 0
    run: list = [None, ()]  # where the last span captured from this prompt ends, its context

    def store(key: tuple[int, ...], context: Sequence[int], start: int | None = None) -> None:
        """Store ``key``, captured after ``context`` (``start``: where the prompt marks it;
        None: an edge or a document, captured apart); a span that starts where the previous
        one captured from this prompt ends is captured in its prompt, after it
        (``redknot.api.capture._runs``)."""
        stored.add(key)
        if contexts is None or key in contexts:
            return
        context = run[1] if start is not None and run[0] == start else tuple(context)
        contexts[key] = context
        run[:] = [start + len(key), context + key] if start is not None else [None, ()]

    for a, b in auto.spans(ids):
        key = tuple(ids[a:b])
        if key in stored:
            served += b - a
            continue
        before = auto.context_before(ids, a)
        if auto.is_document(key):  # marked only once stored: evicted since, captured again
            store(key, before, a)
            continue
        for edge in auto.learn_edges(key):
            store(tuple(edge), auto.edge_context(key, before, edge))
        misses[key] = misses.get(key, 0) + 1
        if misses[key] >= auto.option.capture_after:
            store(key, before, a)
    for doc in auto.documents_due():
        store(tuple(doc), auto.document_context(doc))
        stored.difference_update(tuple(p) for p in auto.document_pieces(doc) or ())
        auto.document_stored(doc)
    return served


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def head_and_tail(tokenizer, case: Case) -> tuple[list[int], list[int]]:
    if case.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"case {case.id!r} asks for a chat template; the model has none")
        messages = [{"role": "user", "content": _SENTINEL}]
        if case.system:
            messages.insert(0, {"role": "system", "content": case.system})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_SENTINEL)
        return _encode(tokenizer, head), _encode(tokenizer, tail)
    special = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return special + _encode(tokenizer, case.system), []


def compose(tokenizer, case: Case) -> ComposedCase:
    head, tail = head_and_tail(tokenizer, case)
    ids = list(head)
    spans = []
    for between, segment in zip(case.between, case.segments):
        ids += _encode(tokenizer, between)
        seg = _encode(tokenizer, segment)
        spans.append((len(ids), len(ids) + len(seg)))
        ids += seg
    ids += _encode(tokenizer, case.question) + tail
    return ComposedCase(tuple(ids), tuple(spans), len(head))
