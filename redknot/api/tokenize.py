"""Piecewise tokenisation: a segment's tokens inside a prompt equal its standalone tokens.

A tokenizer run over a whole prompt may merge characters across a segment's edges (BPE) or
change a segment's first token by what precedes it (SentencePiece's leading-space marker), so
the segment's tokens would depend on its context and could never hit the cache. Instead the
prompt is cut at segment edges and every piece is encoded on its own without special tokens:

    ids = specials_before + enc(gap0) + enc(seg0) + enc(gap1) + ... + specials_after

where ``enc(x) = tokenizer.encode(x, add_special_tokens=False)`` is also how a segment is
tokenised when registered (``segment_tokens``), and the special tokens (a BOS, say) are those
the tokenizer adds around a whole text, found once by encoding a probe with and without them.
A prompt without segments is left to SGLang's own tokenisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redknot.api.spans import Span

_PROBE = "redknot probe text"


class PiecewiseTokenizer:
    """Wraps a Hugging Face tokenizer (the one SGLang's tokenizer manager holds)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._specials: dict[bool, tuple[list[int], list[int]]] = {}

    def segment_tokens(self, text: str) -> list[int]:
        """The standalone tokens of a segment (no special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def specials(self, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """Token ids the tokenizer adds before and after a text (e.g. ``([bos], [])``)."""
        if add_special_tokens not in self._specials:
            plain = self.segment_tokens(_PROBE)
            full = list(self.tokenizer.encode(_PROBE, add_special_tokens=add_special_tokens))
            for i in range(len(full) - len(plain) + 1):
                if full[i : i + len(plain)] == plain:
                    self._specials[add_special_tokens] = (full[:i], full[i + len(plain) :])
                    break
            else:
                raise ValueError(
                    "the tokenizer's special tokens wrap text in a way redknot cannot separate "
                    "from the text's own tokens: give input_ids instead of text"
                )
        return self._specials[add_special_tokens]

    def encode(
        self, text: str, spans: Sequence[Span], *, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """``(input_ids, token spans)`` of ``text`` with character ``spans`` (sorted, disjoint)
        tokenised on their own; token spans are ``[start, end)`` offsets in ``input_ids``."""
        before, after = self.specials(add_special_tokens)
        ids = list(before)
        token_spans = []
        pos = 0
        for span in spans:
            if span.start > pos:
                ids += self.segment_tokens(text[pos : span.start])
            seg = self.segment_tokens(text[span.start : span.end])
            token_spans.append((len(ids), len(ids) + len(seg)))
            ids += seg
            pos = span.end
        if pos < len(text):
            ids += self.segment_tokens(text[pos:])
        return ids + list(after), token_spans

    def encode_pieces(
        self, pieces: Sequence[tuple[str, bool]], *, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Like :meth:`encode` for a text given as ``(piece, is_segment)`` pieces."""
        text, spans, pos = "", [], 0
        for piece, is_segment in pieces:
            if is_segment:
                spans.append(Span(pos, pos + len(piece)))
            text += piece
            pos += len(piece)
        return self.encode(text, spans, add_special_tokens=add_special_tokens)
