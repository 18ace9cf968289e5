"""``parse_spans``: a usual span is checked without building its messages; any other takes the
checks in order (``_checked``) and says what is wrong first. Both must agree on every item."""

from __future__ import annotations

import itertools

import pytest

from redknot.api.marks import SegmentMarkError
from redknot.api.spans import Span, _checked, parse_spans

VALUES = [0, 1, 3, 9, 10, 11, -1, True, False, 2.0, "2", None]
NAMESPACES = [None, "default", "kb", "", "bad name", "x" * 65, 5, "a/b:c-d.e_f"]


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SegmentMarkError as e:
        return str(e)


def items():
    for start, end, ns in itertools.product(VALUES, VALUES, NAMESPACES):
        item = {"start": start, "end": end}
        if ns is not None:
            item["namespace"] = ns
        yield item
    yield {"start": 0}
    yield {"end": 4}
    yield {"start": 0, "end": 4, "extra": 1}
    yield {"start": 0, "end": 4, "namespace": "kb", "extra": 1}
    yield [0, 4]
    yield "0-4"
    yield type("D", (dict,), {})(start=0, end=4)  # a dict that JSON never makes


@pytest.mark.parametrize("unit", ["token", "character"])
def test_a_single_span_is_checked_alike_on_both_paths(unit):
    seen = {"span": 0, "error": 0}
    for item in items():
        fast = outcome(parse_spans, [item], unit=unit, length=10)
        slow = outcome(_checked, item, "redknot_segments[0]", 10, unit)
        slow = [slow] if isinstance(slow, Span) else slow
        assert fast == slow, item
        seen["span" if isinstance(fast, list) else "error"] += 1
    assert seen["span"] > 20 and seen["error"] > 500  # both kinds of item were tried


def test_spans_are_sorted_and_overlaps_refused():
    spans = parse_spans(
        [{"start": 5, "end": 8, "namespace": "kb"}, {"start": 0, "end": 5}], unit="token", length=8
    )
    assert spans == [Span(0, 5), Span(5, 8, "kb")]
    with pytest.raises(SegmentMarkError, match="overlap"):
        parse_spans([{"start": 0, "end": 5}, {"start": 4, "end": 6}], unit="token", length=8)
