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
neighbour and is computed in full).
"""

from __future__ import annotations

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
