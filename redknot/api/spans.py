"""The ``redknot_segments`` request field of ``/generate``: parsing and validation.

    {"text": "...", "redknot_segments": [{"start": 0, "end": 120, "namespace": "kb"}, ...]}

Over ``input_ids`` the offsets count tokens; over ``text`` they count characters (Python
``str`` indices, i.e. Unicode code points) and the server tokenises piecewise (``tokenize.py``).
``namespace`` is optional ("default"). Spans may come in any order; they must not overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from redknot.api.marks import SegmentMarkError
from redknot.api.options import DEFAULT_NAMESPACE, check_namespace_name, valid_namespace_name

FIELD = "redknot_segments"
_KEYS = {"start", "end", "namespace"}


@dataclass(frozen=True)
class Span:
    """A segment asked for in a request: ``[start, end)`` in tokens or characters."""

    start: int
    end: int
    namespace: str = DEFAULT_NAMESPACE


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SegmentMarkError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    return value


def _checked(item: Any, at: str, length: int, unit: str) -> Span:
    """One span ``item`` at ``at``, checked in order, with what is wrong said first."""
    if not isinstance(item, dict):
        raise SegmentMarkError(
            f"{at} must be an object {{start, end, namespace}}, got {type(item).__name__}"
        )
    if set(item) - _KEYS or "start" not in item or "end" not in item:
        raise SegmentMarkError(
            f"{at} needs 'start' and 'end' (optional 'namespace'), got keys {sorted(item)}"
        )
    start, end = _int(item["start"], f"{at}.start"), _int(item["end"], f"{at}.end")
    try:
        ns = check_namespace_name(item.get("namespace", DEFAULT_NAMESPACE), where=f"{at}.namespace")
    except ValueError as e:
        raise SegmentMarkError(str(e)) from None
    if start < 0 or end < 0:
        raise SegmentMarkError(f"{at} [{start}, {end}) has a negative offset: offsets start at 0")
    if end <= start:
        raise SegmentMarkError(f"{at} [{start}, {end}) is empty: end must be greater than start")
    if end > length:
        raise SegmentMarkError(
            f"{at} [{start}, {end}) is out of range: the prompt has {length} {unit}s"
        )
    return Span(start, end, ns)


def parse_spans(value: Any, *, unit: str, length: int, where: str = FIELD) -> list[Span]:
    """Validated spans of one prompt of ``length`` ``unit`` s, sorted by start."""
    if not isinstance(value, list):
        raise SegmentMarkError(
            f"{where} must be a list of {{start, end, namespace}} objects, "
            f"got {type(value).__name__}"
        )
    spans = []
    for i, item in enumerate(value):
        if type(item) is dict:  # the usual span, checked without building its messages
            start, end = item.get("start"), item.get("end")
            ns = item.get("namespace", DEFAULT_NAMESPACE)
            if (
                type(start) is int  # not bool, whose type is not int
                and type(end) is int
                and 0 <= start < end <= length
                and type(ns) is str
                and valid_namespace_name(ns)
                and len(item) == 2 + ("namespace" in item)  # no other key
            ):
                spans.append((i, Span(start, end, ns)))
                continue
        spans.append((i, _checked(item, f"{where}[{i}]", length, unit)))  # raises what is wrong
    spans.sort(key=lambda t: t[1].start)
    for (i, a), (j, b) in pairwise(spans):
        if b.start < a.end:
            raise SegmentMarkError(
                f"{where}[{i}] [{a.start}, {a.end}) and {where}[{j}] [{b.start}, {b.end}) "
                "overlap: segments must be disjoint (nesting is not supported)"
            )
    return [s for _, s in spans]
