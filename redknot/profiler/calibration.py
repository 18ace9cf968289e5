"""Calibration prompts, generated offline and deterministically from a seed.

Two kinds, built at the token level so that spans are exact:

* :class:`NeedlePrompt` (long-range need): filler prose with one fact (the needle) at a chosen
  depth, then a question about it and the start of the answer. The last rows (question and
  answer start) are the late queries whose attention the profiler measures.
* :class:`SegmentCase` (prefix sensitivity): a document of records (the reusable segment) and
  several different prefixes to place it after, as a position-independent cache would.

Text comes from templates over :mod:`redknot.profiler.words`; the same seed gives the same
prompts on every machine for the same tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from redknot.profiler import words as W

CALIBRATION_VERSION = 2
_SENTINEL = "\u2063REDKNOT-CONTENT\u2063"


class TextEncoder(Protocol):
    """What calibration needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added."""

    def prompt_parts(self) -> tuple[list[int], list[int]]:
        """Tokens before and after a user message (the chat template), possibly empty."""


class HFTextEncoder:
    """A :class:`TextEncoder` over a Hugging Face tokenizer. With ``chat=True`` (the default
    when the tokenizer has a chat template) prompts are wrapped as one user turn followed by
    the assistant's turn; otherwise they start with BOS when the tokenizer has one."""

    def __init__(self, tokenizer, *, chat: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_parts(self) -> tuple[list[int], list[int]]:
        if not self.chat:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            return ([bos] if bos is not None else []), []
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        head, tail = text.split(_SENTINEL)
        return self.encode(head), self.encode(tail)


@dataclass(frozen=True)
class NeedlePrompt:
    """``ids``: the prompt's tokens; ``needle``: ``(start, end)`` rows of the fact;
    ``question_start``: first row after the filler (question, template tail, answer start);
    ``answer``: the text the model should continue with."""

    ids: tuple[int, ...]
    needle: tuple[int, int]
    question_start: int
    answer: str
    kind: str

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class SegmentCase:
    """A reusable segment and the prefixes it is placed after."""

    segment: tuple[int, ...]
    prefixes: tuple[tuple[int, ...], ...]


def _full_name(rng: random.Random) -> str:
    return f"{rng.choice(W.FIRST_NAMES)} {rng.choice(W.FAMILY_NAMES)}"


def filler_sentence(rng: random.Random) -> str:
    """One sentence of neutral prose. It names no place and no number, so that a needle's
    answer is the only candidate in the filler."""
    a, n, v = W.ADJECTIVES, W.NOUNS, W.VERBS
    choice = rng.randrange(4)
    if choice == 0:
        return f"The {rng.choice(a)} {rng.choice(n)} {rng.choice(v)} the {rng.choice(a)} {rng.choice(n)}."
    if choice == 1:
        return f"In the {rng.choice(n)}, a {rng.choice(a)} {rng.choice(n)} {rng.choice(v)} the {rng.choice(n)}."
    if choice == 2:
        return f"Near the {rng.choice(n)}, the {rng.choice(n)} was {rng.choice(a)} and {rng.choice(a)}."
    return f"Later that day the {rng.choice(n)} from the {rng.choice(n)} {rng.choice(v)} a {rng.choice(n)}."


def record_sentence(rng: random.Random, index: int) -> str:
    """One line of a records document (the segments of prefix-sensitivity cases)."""
    return (
        f"Record {index}: {_full_name(rng)} of {rng.choice(W.PLACES)} {rng.choice(W.VERBS)} "
        f"{rng.randint(2, 99)} {rng.choice(W.NOUNS)}s on day {rng.randint(1, 365)}."
    )


def _sentences(rng: random.Random, enc: TextEncoder, budget: int, make) -> list[list[int]]:
    """Tokenised sentences (each with a leading space) totalling at most ``budget`` tokens."""
    out: list[list[int]] = []
    used, index = 0, 1
    while True:
        ids = enc.encode(" " + make(rng, index))
        if used + len(ids) > budget:
            return out
        out.append(ids)
        used += len(ids)
        index += 1


def _needle_fact(rng: random.Random) -> tuple[str, str, str, str]:
    """(fact, question, answer start, answer) of a random needle kind."""
    if rng.random() < 0.5:
        who, number = _full_name(rng), str(rng.randint(10000, 99999))
        return (
            f"The secret number of {who} is {number}.",
            f"What is the secret number of {who}?",
            f"The secret number of {who} is",
            number,
        )
    thing = f"{rng.choice(W.COLOURS)} {rng.choice(W.OBJECTS)}"
    place = rng.choice(W.PLACES)
    return (
        f"The {thing} is hidden in the town of {place}.",
        f"In which town is the {thing} hidden?",
        f"The {thing} is hidden in the town of",
        place,
    )


def needle_prompt(
    rng: random.Random, enc: TextEncoder, length: int, depth: float | None = None
) -> NeedlePrompt:
    """A needle prompt of at most ``length`` tokens with the fact at relative ``depth`` of the
    filler (drawn uniformly in [0.05, 0.85] when ``None``)."""
    fact, question, answer_start, answer = _needle_fact(rng)
    depth = rng.uniform(0.05, 0.85) if depth is None else depth
    head, tail = enc.prompt_parts()
    needle = enc.encode(" " + fact)
    ask = enc.encode("\n\n" + question)
    start = enc.encode(answer_start)
    space = enc.encode(" ")
    if len(space) == 1 and enc.encode(" " + answer)[:1] == space:
        # the tokenizer emits the space before the answer alone (SmolLM2 before digits):
        # it belongs to the prompt, so that the first generated token is the answer's.
        start = start + space
    fixed = len(head) + len(needle) + len(ask) + len(tail) + len(start)
    if fixed >= length:
        raise ValueError(f"a needle prompt needs more than {length} tokens (fixed part {fixed})")
    filler = _sentences(rng, enc, length - fixed, lambda r, i: filler_sentence(r))
    cut = round(depth * len(filler))
    before = [t for s in filler[:cut] for t in s]
    after = [t for s in filler[cut:] for t in s]
    ids = head + before + needle + after
    needle_span = (len(head) + len(before), len(head) + len(before) + len(needle))
    question_start = len(ids)
    ids = ids + ask + tail + start
    return NeedlePrompt(tuple(ids), needle_span, question_start, answer, "needle")


def segment_case(
    rng: random.Random, enc: TextEncoder, segment_len: int, prefix_lens: Sequence[int]
) -> SegmentCase:
    """A records document of at most ``segment_len`` tokens and one prefix per entry of
    ``prefix_lens`` (template head, then prose and records of another document)."""
    base = rng.randint(1, 500)
    segment = _sentences(rng, enc, segment_len, lambda r, i: record_sentence(r, base + i))
    head, _ = enc.prompt_parts()
    prefixes = []
    for n in prefix_lens:
        budget = max(n - len(head), 0)
        prose = _sentences(rng, enc, budget // 2, lambda r, i: filler_sentence(r))
        other = rng.randint(1000, 5000)
        used = sum(map(len, prose))
        records = _sentences(
            rng, enc, budget - used, lambda r, i, o=other: record_sentence(r, o + i)
        )
        prefixes.append(tuple(head + [t for s in prose + records for t in s]))
    return SegmentCase(tuple(t for s in segment for t in s), tuple(prefixes))
