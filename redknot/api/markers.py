"""In-band segment markers: how ``@sgl.function`` programs mark segments.

The frontend language sends a program's text to ``/generate`` as one string (see
``sglang.lang.backend.runtime_endpoint``), so a segment is marked inside that string with three
reserved characters from Unicode's Supplementary Private Use Area-A::

    OPEN + namespace + NS_END + text + CLOSE

The server parses them out of ``text`` before anything else sees it (``generate.py``): the
markers never reach the tokenizer or the model. Unbalanced or nested markers are a 400.

>>> import sglang as sgl
>>> from redknot.api import segment
>>> @sgl.function
... def rag(s, doc, question):
...     s += segment(doc, namespace="kb") + "\\nQuestion: " + question + "\\nAnswer:"
...     s += sgl.gen("answer", max_tokens=64)
"""

from __future__ import annotations

from redknot.api.marks import SegmentMarkError
from redknot.api.options import DEFAULT_NAMESPACE, check_namespace_name
from redknot.api.spans import Span

OPEN = "\U000f0001"
NS_END = "\U000f0002"
CLOSE = "\U000f0003"
RESERVED = (OPEN, NS_END, CLOSE)


def has_markers(text: str) -> bool:
    return any(c in text for c in RESERVED)


def segment(text: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """``text`` marked as a reusable segment of ``namespace``: use it as a string in
    ``s += ...`` of an ``@sgl.function`` (or anywhere a ``/generate`` text is built)."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"segment() needs a non-empty string, got {text!r}")
    if has_markers(text):
        raise ValueError("segment() text already holds segment markers: segments cannot nest")
    check_namespace_name(namespace, where="segment() namespace")
    return f"{OPEN}{namespace}{NS_END}{text}{CLOSE}"


def strip_markers(text: str) -> str:
    """``text`` as the model sees it (markers and namespaces removed)."""
    return parse_markers(text)[0]


def parse_markers(text: str, *, where: str = "text") -> tuple[str, list[Span]]:
    """``(clean text, character spans of the segments in it)``; 400 on malformed markup."""
    out: list[str] = []
    spans: list[Span] = []
    pos, n = 0, 0  # pos: index in text; n: length of clean text so far
    while True:
        i = text.find(OPEN, pos)
        stray = [c for c in (NS_END, CLOSE) if c in text[pos : len(text) if i < 0 else i]]
        if stray:
            raise SegmentMarkError(
                f"{where} has a segment end marker without its start marker: build segments "
                "with redknot.api.segment(text, namespace) and do not cut its output"
            )
        if i < 0:
            out.append(text[pos:])
            return "".join(out), spans
        out.append(text[pos:i])
        n += i - pos
        j = text.find(NS_END, i + 1)
        k = text.find(CLOSE, i + 1)
        nxt = text.find(OPEN, i + 1)
        if j < 0 or k < 0 or not (j < k) or (0 <= nxt < k):
            raise SegmentMarkError(
                f"{where} has an unbalanced or nested segment marker at character {i}: each "
                "segment needs its own start and end, and segments cannot nest"
            )
        ns = text[i + 1 : j]
        try:
            check_namespace_name(ns, where=f"{where} segment namespace")
        except ValueError as e:
            raise SegmentMarkError(str(e)) from None
        body = text[j + 1 : k]
        if NS_END in body:
            raise SegmentMarkError(f"{where} has a malformed segment marker at character {i}")
        if not body:
            raise SegmentMarkError(f"{where} has an empty segment at character {i}")
        out.append(body)
        spans.append(Span(n, n + len(body), ns))
        n += len(body)
        pos = k + 1
