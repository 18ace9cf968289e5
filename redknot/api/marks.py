"""Segment marks as they travel from the HTTP server to the scheduler's ``Req``.

A request's marks ride in ``sampling_params["custom_params"]`` (SGLang carries that dict to the
scheduler's ``Req.sampling_params.custom_params``; its values may only be scalars or flat lists,
so the marks are parallel flat lists):

| key                        | value                                                          |
| -------------------------- | -------------------------------------------------------------- |
| ``redknot_seg_bounds``     | ``[start0, end0, start1, end1, ...]``: token offsets in the    |
|                            | prompt (``input_ids``), ``start`` inclusive, ``end``           |
|                            | exclusive, ascending, not overlapping                          |
| ``redknot_seg_namespaces`` | one namespace per segment                                      |
| ``redknot_seg_ids``        | one id per segment: ``redknot.segcache.entry.segment_id`` of   |
|                            | (namespace, the segment's tokens)                              |
| ``redknot_register``       | ``True`` on a registration (``POST /redknot/segments``): the   |
|                            | prompt is exactly one segment, prefilled standalone            |
| ``redknot_pin``            | with ``redknot_register``: keep it until deleted               |
| ``redknot_capture``        | with ``redknot_register``: a capture on miss                   |
|                            | (``redknot.api.capture``), never pinned; its segments, one or  |
|                            | more, consecutive, end the prompt and may follow a context (the|
|                            | tokens before them in the prompt that missed them), which is   |
|                            | computed and not stored                                        |
| ``redknot_seg_store``      | on an ordinary request: the indices of the marks it stores     |
|                            | itself when it misses them (automatic chunks due for capture,  |
|                            | ``--redknot-auto-capture-in-place``): its own prefill writes   |
|                            | their K/V, computed after everything before them in its prompt |

The HTTP side (``redknot.api.generate``, ``chat``, ``routes``) is the only writer (clients
setting these keys themselves get a 400 on every endpoint); the scheduler reads them with
:func:`segments_of` and :func:`registration_of`, which validate ranges and ids again (the
namespace's existence is an HTTP-side notion and is not re-checked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

KEY_BOUNDS = "redknot_seg_bounds"
KEY_NAMESPACES = "redknot_seg_namespaces"
KEY_IDS = "redknot_seg_ids"
KEY_REGISTER = "redknot_register"
KEY_PIN = "redknot_pin"
KEY_CAPTURE = "redknot_capture"
KEY_STORE = "redknot_seg_store"  # marks the request stores itself on a miss (their indices)
# marks an inert server (no hit can pay: SegmentApi.learn_gate) does not look up: their number
KEY_RECOMPUTED = "redknot_seg_recomputed"
RESERVED_PREFIX = "redknot_"


class SegmentMarkError(ValueError):
    """Invalid segment markup; the message says what is wrong and what to do (HTTP 400)."""

    status_code = 400


@dataclass(frozen=True)
class SegmentMark:
    """One reusable segment of a prompt: tokens ``start .. end - 1`` of ``input_ids``."""

    start: int  # first token, offset in the prompt
    end: int  # one past the last token
    namespace: str
    segment_id: str  # segcache.entry.segment_id(namespace, input_ids[start:end])

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise SegmentMarkError(f"segment {name} must be an integer, got {v!r}")
        if not 0 <= self.start < self.end:
            raise SegmentMarkError(
                f"segment [{self.start}, {self.end}) is not a non-empty token range "
                "with 0 <= start < end"
            )
        if not isinstance(self.namespace, str) or not isinstance(self.segment_id, str):
            raise SegmentMarkError("segment namespace and id must be strings")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Registration:
    """A request that registers its whole prompt as one segment ahead of use (a capture: the
    consecutive segments ``marks`` that end its prompt, each computed after what precedes it)."""

    marks: tuple[SegmentMark, ...]
    pin: bool
    capture: bool = False  # stored on a miss (redknot.api.capture), not registered by a client


def segment_id(namespace: str, token_ids: Sequence[int]) -> str:
    """The content address of a segment; one definition, the segment store's.

    Raises :class:`SegmentMarkError` for what the store refuses (a namespace longer than it
    keys, say): marks that reach the scheduler without the HTTP side's checks (``sgl.Engine``
    callers set ``custom_params`` themselves) must not raise anything else there."""
    from redknot.segcache.entry import SegmentError
    from redknot.segcache.entry import segment_id as store_segment_id

    try:
        return store_segment_id(namespace, list(token_ids))
    except SegmentError as e:
        raise SegmentMarkError(str(e)) from None


def check_marks(
    marks: Sequence[SegmentMark], *, prompt_len: int, context_len: int | None = None
) -> None:
    """Raise :class:`SegmentMarkError` unless ``marks`` are ascending, disjoint, inside the
    prompt and each no longer than the context."""
    check_ranges([(m.start, m.end) for m in marks], prompt_len=prompt_len, context_len=context_len)


def check_ranges(
    ranges: Sequence[tuple[int, int]], *, prompt_len: int, context_len: int | None = None
) -> None:
    """:func:`check_marks` on ``(start, end)`` token ranges (each non-empty already)."""
    prev: tuple[int, int] | None = None
    for i, (start, end) in enumerate(ranges):
        if end > prompt_len:
            raise SegmentMarkError(
                f"segment {i} [{start}, {end}) ends after the prompt ({prompt_len} tokens)"
            )
        if context_len is not None and end - start > context_len:
            raise SegmentMarkError(
                f"segment {i} has {end - start} tokens, more than the model's context "
                f"({context_len} tokens): split it into smaller segments"
            )
        if prev is not None and start < prev[1]:
            raise SegmentMarkError(
                f"segments {i - 1} [{prev[0]}, {prev[1]}) and {i} [{start}, {end}) "
                "overlap or are out of order"
            )
        prev = (start, end)


def encode_marks(
    marks: Sequence[SegmentMark],
    *,
    register: bool = False,
    pin: bool = False,
    capture: bool = False,
    store: Sequence[int] = (),
) -> dict[str, Any]:
    """The ``custom_params`` entries that carry ``marks`` (empty when there are none);
    ``store``: the indices of the marks an ordinary request stores itself on a miss.

    For ``sgl.Engine`` users, who build sampling params themselves::

        >>> ids = tok.encode(doc, add_special_tokens=False)
        >>> mark = SegmentMark(0, len(ids), "kb", segment_id("kb", ids))
        >>> engine.generate(input_ids=ids + q_ids, sampling_params={
        ...     "max_new_tokens": 32, "custom_params": encode_marks([mark])})
    """
    if not marks:
        return {}
    if register and not capture and len(marks) != 1:
        raise SegmentMarkError("a registration carries exactly one segment")
    out: dict[str, Any] = {
        KEY_BOUNDS: [x for m in marks for x in (m.start, m.end)],
        KEY_NAMESPACES: [m.namespace for m in marks],
        KEY_IDS: [m.segment_id for m in marks],
    }
    if register:
        out[KEY_REGISTER] = True
        out[KEY_PIN] = bool(pin) and not capture
        if capture:
            out[KEY_CAPTURE] = True
    elif store:
        out[KEY_STORE] = list(store)
    return out


def stored_marks(req: Any, marks: Sequence[SegmentMark]) -> list[SegmentMark]:
    """Those of a scheduler ``Req``'s ``marks`` that it stores itself on a miss
    (``redknot_seg_store``). Raises :class:`SegmentMarkError` for indices that name no mark."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    index = params.get(KEY_STORE)
    if index is None:
        return []
    ok = isinstance(index, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(marks) for i in index
    )
    if not ok:
        raise SegmentMarkError(
            f"{KEY_STORE} must list indices of the request's {len(marks)} segment marks"
        )
    return [marks[i] for i in sorted(set(index))]


def reserved_keys(custom_params: Any) -> list[str]:
    """Keys of a client's ``custom_params`` that only redknot may set (none when it is not an
    object: SGLang refuses such ``custom_params`` itself)."""
    if not isinstance(custom_params, Mapping):
        return []
    return sorted(k for k in custom_params if str(k).startswith(RESERVED_PREFIX))


def decode_marks(
    custom_params: Mapping[str, Any] | None,
    input_ids: Sequence[int] | None = None,
    *,
    prompt_len: int | None = None,
) -> list[SegmentMark]:
    """The marks in ``custom_params``; with ``input_ids``, also check ranges and ids; with only
    ``prompt_len``, ranges only (the ids are then the caller's to trust)."""
    params = custom_params or {}
    bounds = params.get(KEY_BOUNDS)
    if bounds is None:
        return []
    namespaces, ids = params.get(KEY_NAMESPACES), params.get(KEY_IDS)
    if not (isinstance(bounds, list) and isinstance(namespaces, list) and isinstance(ids, list)):
        raise SegmentMarkError(f"{KEY_BOUNDS}, {KEY_NAMESPACES} and {KEY_IDS} must be lists")
    if len(bounds) != 2 * len(namespaces) or len(ids) != len(namespaces):
        raise SegmentMarkError(
            f"{len(bounds)} bounds, {len(namespaces)} namespaces and {len(ids)} ids do not "
            "describe the same segments (want 2 bounds per segment)"
        )
    marks = [
        SegmentMark(bounds[2 * i], bounds[2 * i + 1], ns, sid)
        for i, (ns, sid) in enumerate(zip(namespaces, ids, strict=True))
    ]
    if input_ids is not None:
        prompt_len = len(input_ids)
    if prompt_len is not None:
        check_marks(marks, prompt_len=prompt_len)
    if input_ids is not None:
        check_ids(input_ids, marks)
    return marks


def check_ids(input_ids: Sequence[int], marks: Sequence[SegmentMark]) -> None:
    """Raise :class:`SegmentMarkError` unless each mark's id is the id of its tokens in
    ``input_ids`` (its ranges checked already)."""
    if not marks:
        return
    actual = segment_ids(input_ids, marks)
    for i, (m, sid) in enumerate(zip(marks, actual)):
        if sid != m.segment_id:
            raise SegmentMarkError(
                f"segment {i} id {m.segment_id!r} is not the id of its tokens in namespace "
                f"{m.namespace!r}: build marks with redknot.api.marks.segment_id"
            )


def segment_ids(input_ids: Sequence[int], marks: Sequence[SegmentMark]) -> list[str]:
    """The content address of each mark's tokens in ``input_ids`` (the prompt packed once);
    what :func:`segment_id` gives for each, with its errors."""
    return range_ids(input_ids, [(m.namespace, m.start, m.end) for m in marks])


def range_ids(input_ids: Sequence[int], ranges: Sequence[tuple[str, int, int]]) -> list[str]:
    """:func:`segment_ids` of ``(namespace, start, end)`` ranges of ``input_ids`` (checked
    already: :func:`check_ranges`)."""
    from redknot.segcache.entry import SegmentError
    from redknot.segcache.entry import segment_ids as store_segment_ids

    try:
        return store_segment_ids(input_ids, ranges)
    except SegmentError as e:
        raise SegmentMarkError(str(e)) from None


def recomputed_marks(req: Any) -> int:
    """How many segments a scheduler ``Req`` marked on an inert server (not looked up)."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    n = params.get(KEY_RECOMPUTED, 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def segments_of(req: Any, verify: bool = True) -> list[SegmentMark]:
    """The validated segment marks of a scheduler ``Req`` (empty when it has none);
    ``verify=False``: their ranges only, not their ids (for a request that reads no K/V).

    Raises :class:`SegmentMarkError` when the marks do not fit the request's prompt."""
    params = getattr(req.sampling_params, "custom_params", None)
    ids = req.origin_input_ids
    if verify:
        return decode_marks(params, ids)
    return decode_marks(params, prompt_len=len(ids))


def registration_of(req: Any) -> Registration | None:
    """The registration a scheduler ``Req`` carries, or ``None`` for an ordinary request."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    if not params.get(KEY_REGISTER):
        return None
    marks = segments_of(req)
    capture = bool(params.get(KEY_CAPTURE, False))
    n = len(req.origin_input_ids)
    if capture:  # after its context, one or more consecutive segments ending the prompt
        joined = all(a.end == b.start for a, b in pairwise(marks))
        if not (marks and joined and marks[-1].end == n):
            raise SegmentMarkError(
                "a capture's prompt must be its context, then consecutive segments ending it"
            )
    elif len(marks) != 1 or (marks[0].start, marks[0].end) != (0, n):
        raise SegmentMarkError("a registration's prompt must be exactly one segment")
    return Registration(tuple(marks), bool(params.get(KEY_PIN, False)) and not capture, capture)
