"""Rewrite a ``/generate`` body that marks segments into one SGLang understands.

Segments are marked either by the ``redknot_segments`` field (``spans.py``) or by in-band
markers in ``text`` (``markers.py``, what ``@sgl.function`` programs send). The rewrite:

- parses and validates the markup (any problem: :class:`SegmentMarkError`, a 400);
- for ``text`` prompts, tokenises piecewise (``tokenize.py``) and sends ``input_ids`` instead
  (every prompt of a batch, so that the batch stays homogeneous);
- removes ``redknot_segments`` and puts the marks into each prompt's
  ``sampling_params["custom_params"]`` (``marks.py``), where SGLang carries them to the
  scheduler's ``Req``;
- removes ``redknot_capture`` (``false``: this request's segments are not captured on a miss)
  and hands the marked segments to capture on miss otherwise (``capture.py``).

A body without markup is returned as ``None``: SGLang serves it untouched. Under
``--redknot-auto-segments cdc`` such a body is rewritten by :func:`rewrite_unmarked` instead
(its content-defined chunks marked in namespace ``auto``: ``auto.py``) unless it says
``"redknot_auto_segments": false``; that field is removed from every body.
"""

from __future__ import annotations

from typing import Any

from redknot.api.auto import AUTO_FIELD
from redknot.api.capture import CAPTURE_FIELD, check_flag, note
from redknot.api.markers import has_markers, parse_markers
from redknot.api.marks import SegmentMarkError, reserved_keys
from redknot.api.options import AUTO_NAMESPACE
from redknot.api.service import SegmentApi
from redknot.api.spans import FIELD, parse_spans

_UNSUPPORTED = ("input_embeds", "image_data", "video_data", "audio_data")


def _is_batch_ids(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _check_ids(ids: Any, where: str) -> list[int]:
    # the types in C (no bool: its type is not int), then the least: 0.13 ms for 6K ids where
    # a Python loop over them took 0.30 (benchmarks/marked_host_cost.py)
    if not isinstance(ids, list) or (ids and (set(map(type, ids)) != {int} or min(ids) < 0)):
        raise SegmentMarkError(f"{where} input_ids must be a list of non-negative integers")
    return ids


def _sampling_params(body: dict, n: int) -> list[dict]:
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if isinstance(sp, dict):
        out = [dict(sp) for _ in range(n)]
    elif isinstance(sp, list) and len(sp) == n and all(isinstance(x, dict) for x in sp):
        out = [dict(x) for x in sp]
    else:
        raise SegmentMarkError(
            "sampling_params must be an object, or a list with one object per prompt, "
            "when segments are marked"
        )
    for p in out:
        custom = p.get("custom_params")
        if custom is not None and not isinstance(custom, dict):
            raise SegmentMarkError(
                "sampling_params.custom_params must be an object (or null), "
                f"got {type(custom).__name__}"
            )
    return out


def needs_rewrite(body: Any) -> bool:
    """True when ``body`` marks segments (or misuses redknot's reserved custom params)."""
    if not isinstance(body, dict):
        return False
    text = body.get("text")
    texts = text if isinstance(text, list) else [text]
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps]
    return (
        FIELD in body
        or CAPTURE_FIELD in body
        or any(isinstance(t, str) and has_markers(t) for t in texts)
        or any(isinstance(sp, dict) and reserved_keys(sp.get("custom_params")) for sp in sps)
    )


def reject_reserved(body: Any, allowed: tuple[str, ...] = ()) -> None:
    """400 when a client sets redknot's reserved ``custom_params`` keys (top level or in
    ``sampling_params``) itself: marks reach the scheduler only after validation here."""
    if not isinstance(body, dict):
        return
    sps = body.get("sampling_params")
    for holder in [body, *(sps if isinstance(sps, list) else [sps])]:
        custom = holder.get("custom_params") if isinstance(holder, dict) else None
        bad = [k for k in reserved_keys(custom if isinstance(custom, dict) else None)]
        bad = [k for k in bad if k not in allowed]
        if bad:
            raise SegmentMarkError(
                f"custom_params keys {bad} are reserved for redknot: mark segments with the "
                f"'{FIELD}' field or redknot.api.segment() instead"
            )


def _check_input_logprobs(
    body: dict, k: int | None, marks, num_tokens: int, option: str, where: str
) -> None:
    """Refuse input-token logprobs that reused tokens would give: under ``option`` they leave
    recovery, so their hidden states (row ``r`` predicts token ``r + 1``) are not computed past
    some layer. The prompt's last row is always computed."""

    def of(key):
        value = body.get(key)
        return value[k] if isinstance(value, list) and k is not None else value

    start = of("logprob_start_len")
    if not of("return_logprob") or start is None or start < 0:
        return  # no logprobs, or only of the output (SGLang's default start)
    safe = min(max(m.end for m in marks), num_tokens - 1)
    if start < safe:
        raise SegmentMarkError(
            f"{where} asks input-token logprobs from token {start}, but this server ({option}) "
            f"does not compute the reused segment tokens before token {safe} past some layer: "
            f"set logprob_start_len to {safe} or more, or send it without segments"
        )


def rewrite_generate(body: Any, api: SegmentApi) -> dict | None:
    """The rewritten body, or ``None`` when there is nothing to rewrite."""
    auto, body, stripped = _auto_flag(body)
    if not needs_rewrite(body):  # nothing marked
        new = rewrite_unmarked(body, api, capture=True) if auto else None
        return new if new is not None else (body if stripped else None)
    if CAPTURE_FIELD in body:
        rest = {k: v for k, v in body.items() if k != CAPTURE_FIELD}
        if not needs_rewrite(rest):  # nothing marked: the flag goes
            capture = check_flag(body[CAPTURE_FIELD], CAPTURE_FIELD)
            new = rewrite_unmarked(rest, api, capture=capture) if auto else None
            return rest if new is None else new
    reject_reserved(body)
    for key in _UNSUPPORTED:
        if body.get(key) is not None:
            raise SegmentMarkError(
                f"segments cannot be marked in a request with {key}: send text or input_ids only"
            )
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise SegmentMarkError("give exactly one of text and input_ids with segments")
    batch = isinstance(text, list) if text is not None else _is_batch_ids(ids)
    prompts = (text if batch else [text]) if text is not None else (ids if batch else [ids])
    if not prompts:
        raise SegmentMarkError("the request has no prompts")
    field = body.get(FIELD)
    if not batch:
        fields = [field]
    elif field is None:  # a batch marked only by in-band markers
        fields = [None] * len(prompts)
    elif isinstance(field, list) and len(field) == len(prompts):
        fields = field
    else:
        raise SegmentMarkError(
            f"{FIELD} of a batch must be a list with one list of spans (or null) per prompt "
            f"({len(prompts)} prompts)"
        )

    out_ids: list[list[int]] = []
    params = _sampling_params(body, len(prompts))
    marked = 0
    capture = check_flag(body.get(CAPTURE_FIELD, True), CAPTURE_FIELD)
    for k, (prompt, spans_value) in enumerate(zip(prompts, fields, strict=True)):
        where = f"prompt {k}" if batch else "the prompt"
        field_at = f"{FIELD}[{k}]" if batch else FIELD  # names the prompt of a batch
        if text is not None:
            if not isinstance(prompt, str):
                raise SegmentMarkError(f"{where} text must be a string")
            clean, spans = parse_markers(prompt, where=f"{where} text")
            if spans_value is not None:
                if spans:
                    raise SegmentMarkError(
                        f"{where} marks segments both with markers and with '{FIELD}': use one"
                    )
                spans = parse_spans(
                    spans_value, unit="character", length=len(clean), where=field_at
                )
            if spans:
                input_ids, token_spans = api.tokenizer.encode(clean, spans)
            else:
                input_ids, token_spans = list(api.tokenizer.tokenizer.encode(clean)), []
        else:
            # inert markup reads only the prompt's length: SGLang checks its ids as it does
            # an unmarked prompt's
            inert = api.inert is not None and isinstance(prompt, list)
            input_ids = prompt if inert else _check_ids(prompt, where)
            spans = (
                []
                if spans_value is None
                else parse_spans(spans_value, unit="token", length=len(input_ids), where=field_at)
            )
            token_spans = [(s.start, s.end) for s in spans]
        marks = api.marks(input_ids, token_spans, [s.namespace for s in spans], where=where)
        if marks and api.rows_leave and api.inert is None:
            _check_input_logprobs(
                body, k if batch else None, marks, len(input_ids), api.rows_leave, where
            )
        out_ids.append(input_ids)
        marked += _attach(params[k], marks, input_ids, capture, api)

    drop = (FIELD, CAPTURE_FIELD, "text", "input_ids")
    new = {k: v for k, v in body.items() if k not in drop}
    new["input_ids"] = out_ids if batch else out_ids[0]
    new["sampling_params"] = params if batch else params[0]
    if marked:
        api.counters.add(requests_with_segments=1, segments_marked=marked)
    return new


def _attach(
    params: dict, marks: list, input_ids: list[int], capture: bool, api: SegmentApi,
    *, chunks: bool = False,
) -> int:  # fmt: skip
    """Put ``marks`` into one prompt's sampling ``params`` (its ``custom_params``), hand them
    to capture on miss when ``capture`` and the server's markup is not inert (``chunks``: they
    are content-defined chunks of an unmarked prompt, of which those due for capture are
    stored by this request itself if it misses them, under
    ``--redknot-auto-capture-in-place on``); the number of marks."""
    if not marks:
        return 0
    store: list[int] = []
    if chunks and capture and api.inert is None:
        store = api.capture.stored_here(marks, input_ids, chunks=True)
    custom = dict(params.get("custom_params") or {})
    custom.update(api.encode(marks, store))
    params["custom_params"] = custom
    if capture and api.inert is None:
        note(
            [(m.namespace, input_ids[m.start : m.end]) for m in marks],
            chunks=chunks,
            contexts=api.auto.contexts(input_ids, marks) if chunks else None,
            starts=api.auto.starts(marks) if chunks else None,
        )
    return len(marks)


def _auto_flag(body: Any) -> tuple[bool, Any, bool]:
    """``(automatic segments wanted, body without the flag, whether the flag was there)``."""
    if not isinstance(body, dict) or AUTO_FIELD not in body:
        return True, body, False
    wanted = check_flag(body[AUTO_FIELD], AUTO_FIELD)
    return wanted, {k: v for k, v in body.items() if k != AUTO_FIELD}, True


def _tokens(prompt: Any, is_text: bool, api: SegmentApi, where: str) -> list[int]:
    """A prompt's token ids as SGLang's tokenizer manager makes them (``SegmentMarkError`` for
    what SGLang would refuse or tokenise otherwise)."""
    if not is_text:
        return _check_ids(prompt, where)
    if not isinstance(prompt, str):
        raise SegmentMarkError(f"{where} text must be a string")
    return list(api.tokenizer.tokenizer.encode(prompt))


def rewrite_unmarked(body: Any, api: SegmentApi, *, capture: bool) -> dict | None:
    """``body``, which marks nothing, with its automatic segments (``auto.py``), or ``None``
    when it is served as it is: automatic segments off, no chunk to mark, or a request that this
    path leaves to SGLang (media, embeddings, what SGLang answers with an error)."""
    auto = api.auto
    if not isinstance(body, dict) or not auto.usable(api.namespaces):
        return None
    if any(body.get(key) is not None for key in _UNSUPPORTED):
        return None
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        return None
    batch = isinstance(text, list) if text is not None else _is_batch_ids(ids)
    prompts = (text if batch else [text]) if text is not None else (ids if batch else [ids])
    limit = api.context_len
    try:
        params = _sampling_params(body, len(prompts))
        out_ids = [_tokens(p, text is not None, api, "a prompt") for p in prompts]
    except SegmentMarkError:
        return None  # SGLang answers for what it refuses
    if not prompts or any(limit is not None and len(p) >= limit for p in out_ids):
        return None
    marked = 0
    for k, input_ids in enumerate(out_ids):
        where = f"prompt {k}" if batch else "the prompt"
        spans = auto.spans(input_ids)
        marks = api.marks(input_ids, spans, [AUTO_NAMESPACE] * len(spans), where=where)
        if marks and api.rows_leave:
            try:
                _check_input_logprobs(
                    body, k if batch else None, marks, len(input_ids), api.rows_leave, where
                )
            except SegmentMarkError:
                marks = []  # it asks logprobs of tokens reuse would not compute
        marked += _attach(params[k], marks, input_ids, capture, api, chunks=True)
    if not marked:
        return None
    new = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
    new["input_ids"] = out_ids if batch else out_ids[0]
    new["sampling_params"] = params if batch else params[0]
    api.counters.add(auto_requests=1, auto_chunks_marked=marked)
    return new
