"""ASGI middleware that rewrites ``/generate`` bodies marking segments (see ``generate.py``)
and refuses redknot's reserved ``custom_params`` keys set by clients on any JSON endpoint.

It also runs capture on miss (``capture.py``): the segments a request marked (here, or in the
chat hook) are handed to the capturer once its answer's first bytes are sent with status 200,
and the call returns when the answer and those captures are done (the client has its answer
before; a capture never delays it). When those first bytes carry the request's reuse report
and it says every marked segment was a hit, nothing is missing from the store and the capturer
is not asked (which would cost a control round trip to the scheduler per request).

It is the app's innermost middleware (inside SGLang's request decompression, CORS and API-key
checks: ``server.install``), in front of SGLang's own ``/generate`` route, which then parses the
rewritten body as usual. Bodies without segment markup pass through untouched after a byte
scan (under ``--redknot-auto-segments cdc`` every ``/generate`` body is parsed, for its
automatic segments, and the first request of any kind waits for the reuse gate's break-even,
which chat requests' automatic segments need too); bodies that are not JSON are left for SGLang
to reject. Invalid markup is answered here with a 400 and never reaches the engine. A chat
request's redknot flags belong in its ``custom_params``: given at the top level of the body,
where SGLang would ignore them, they are a 400 that says so.

The byte scan must see every spelling of markup that SGLang's JSON parser would read: a body is
parsed when it holds ``redknot_``, a marker character in UTF-8, or any JSON ``\\u`` escape
(``"\\u0072edknot_seg_ids"`` is a reserved key, ``"\\uDB80\\uDC01"`` a marker); and every
content type FastAPI parses as JSON (``application/json``, ``application/*+json``) is scanned.
"""

from __future__ import annotations

import asyncio
import email.message
import logging
from collections.abc import Callable

import orjson

from redknot.api import capture
from redknot.api.auto import AUTO_FIELD
from redknot.api.capture import CAPTURE_FIELD, Pending
from redknot.api.chat import NAMESPACE_KEY
from redknot.api.generate import reject_reserved, rewrite_generate
from redknot.api.markers import RESERVED
from redknot.api.marks import RESERVED_PREFIX, SegmentMarkError
from redknot.api.service import SegmentApi
from redknot.segcache.reuse import REPORT_KEY

logger = logging.getLogger(__name__)

PATHS = ("/generate",)  # rewritten; every other JSON POST is only checked for reserved keys
# reserved keys a path may carry
ALLOWED = {"/v1/chat/completions": (NAMESPACE_KEY, CAPTURE_FIELD, AUTO_FIELD)}
# Byte patterns of which one occurs in every body that marks segments: the field or a
# reserved custom-params key ("redknot_"), a marker character (U+F0001..U+F0003) in UTF-8, or a
# JSON escape (which may spell either).
_TRIGGERS = (RESERVED_PREFIX.encode(), "\U000f0000".encode()[:3], b"\\u")


def _may_mark(body: bytes) -> bool:
    """Whether ``body`` holds one of :data:`_TRIGGERS`. A pattern is looked for only when its
    first byte occurs: CPython finds one byte with ``memchr`` and a longer pattern far slower,
    and every unmarked body is scanned (a body of 6K token ids, 35 KB: 0.084 ms for the three
    patterns on a CPU development machine, 0.020 ms so)."""
    return any(t[:1] in body and t in body for t in _TRIGGERS)


def error_body(message: str, status: int = 400) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    )


class SegmentMarkupMiddleware:
    def __init__(self, app, api: Callable[[], SegmentApi | None]):
        self.app = app
        self.api = api

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("method") not in ("POST", "PUT")
            or not _is_json(scope)
        ):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        api = self.api()
        pending: list = []  # segments this request marks, for capture on miss
        token = capture.PENDING.set(pending)
        try:
            await self._serve(scope, receive, send, body, api, pending)
        finally:
            capture.PENDING.reset(token)

    async def _serve(self, scope, receive, send, body: bytes, api, pending: list) -> None:
        path = scope.get("path")
        auto = api is not None and api.auto.enabled
        triggered = api is not None and _may_mark(body)
        if api is not None and (auto or triggered or api.chat.enabled):
            try:
                await api.learn_gate()  # once per server
            except Exception:  # a bug there must not fail the request
                logger.exception("redknot: asking the reuse gate failed")
        if api is not None and ((auto and path in PATHS) or triggered):
            try:
                if path in PATHS:
                    new = rewrite_generate(orjson.loads(body), api)
                else:  # other endpoints: refuse reserved custom_params keys and markers
                    _check_other(orjson.loads(body), path)
                    new = None
            except orjson.JSONDecodeError:
                new = None  # SGLang answers malformed JSON itself
            except SegmentMarkError as e:
                api.counters.add(rejected=1)
                await _respond(send, 400, error_body(str(e)))
                return
            except Exception as e:  # a bug here must not take the server down
                logger.exception("redknot: segment markup rewrite failed")
                await _respond(send, 500, error_body(f"redknot segment markup: {e}", 500))
                return
            if new is not None:
                body = orjson.dumps(new)
                scope = dict(scope)
                scope["headers"] = [
                    (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
                ] + [(b"content-length", str(len(body)).encode())]
        replay = _replay([{"type": "http.request", "body": body}], receive)
        if api is None or not api.capture.enabled:
            await self.app(scope, replay, send)
            return
        await _serve_capturing(self.app, scope, replay, send, api, pending)


async def _serve_capturing(app, scope, receive, send, api: SegmentApi, pending: list) -> None:
    """Serve the request; capture ``pending`` once the answer's first bytes are sent (200)."""
    status, task = None, None

    async def sending(message):
        nonlocal status, task
        await send(message)
        if message["type"] == "http.response.start":
            status = message.get("status")
        elif message["type"] == "http.response.body" and task is None and status == 200 and pending:
            meta = _first_answer(message.get("body", b""))
            served = _take(pending, _in_prefix_hit(pending, meta))
            if served:
                api.counters.add(captures_prefix_cached=len(served))
                api.capture.served(served)
            stored = _take(pending, _stored_here(pending, meta))
            if _all_hit(meta, len(stored)):
                api.counters.add(captures_skipped=len(pending))
                pending.clear()
            if pending or stored:
                task = asyncio.ensure_future(api.capture.capture(list(pending), stored))

    try:
        await app(scope, receive, sending)
    finally:
        if task is not None:
            await task


def _take(pending: list[Pending], items: list[Pending]) -> list[Pending]:
    """``items`` (some of ``pending``), taken out of ``pending``."""
    gone = {id(p) for p in items}
    pending[:] = [p for p in pending if id(p) not in gone]
    return items


def _first_answer(first: bytes) -> dict | None:
    """The ``meta_info`` of an answer's first bytes (a JSON answer, or a stream's first
    ``data:`` event; a chat answer's first choice's, which it has under ``return_meta_info``);
    None for anything else (a batch, a chat answer without it, bytes cut mid-event)."""
    if first.startswith(b"data:"):
        first = first[5:].split(b"\n\n", 1)[0]
    try:
        answer = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    meta = answer.get("meta_info")
    choices = answer.get("choices")
    if meta is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        meta = choices[0].get("meta_info")  # a chat answer under return_meta_info
    return meta if isinstance(meta, dict) else None


def _in_prefix_hit(pending: list[Pending], meta: dict | None) -> list[Pending]:
    """The automatic segments of ``pending`` (those with a place in the prompt) that start
    inside the prompt's prefix that SGLang's prefix cache served (``meta_info.cached_tokens``).
    They are not captured: a request that continues this prompt (a chat's next turn, a prompt
    with the same head) is served the same K/V by the prefix cache, so a capture would prefill
    them again for reuse that cache already gives, and on chat traffic such captures were most
    of the GPU's work (``trace_replay_capture_context.json``: 1,385 captures of ~320 tokens
    against 133K tokens the users' own prompts computed). The segment that straddles the hit's
    end is one of them: in a conversation it holds the end of the previous turn, inside the next
    turn's hit. Their sightings still count toward the capture threshold
    (``Capturer.served``): a segment a later prompt holds elsewhere is captured from the first
    request that computes it once it has been seen often enough."""
    cached = meta.get("cached_tokens") if meta is not None else None
    if not isinstance(cached, int) or cached <= 0:
        return []
    return [p for p in pending if p.start is not None and p.start < cached]


def _report_of(meta: dict | None) -> dict | None:
    """The reuse report (``redknot.segcache.reuse``) in an answer's ``meta_info``, or None."""
    report = meta.get(REPORT_KEY) if meta is not None else None
    if not (isinstance(report, list) and report and isinstance(report[0], dict)):
        return None
    return report[0]


def _stored_here(pending: list[Pending], meta: dict | None) -> list[Pending]:
    """The automatic segments of ``pending`` that the request's own prefill stored (its
    report's ``stored``, by namespace and place in the prompt): nothing to capture for them. A
    chat answer carries the report only under ``return_meta_info``; without it the capture
    path finds them stored and skips them."""
    report = _report_of(meta)
    stored = report.get("stored") if report is not None else None
    if not isinstance(stored, list):
        return []
    where = {(s.get("namespace"), s.get("start")) for s in stored if isinstance(s, dict)}
    return [p for p in pending if p.start is not None and (p.ns, p.start) in where]


def _all_hit(meta: dict | None, stored: int = 0) -> bool:
    """Whether an answer's ``meta_info`` (:func:`_first_answer`) reports every segment of the
    request a hit (``redknot.segcache.reuse``'s report), but the ``stored`` ones its own
    prefill stored. Anything else: False."""
    report = _report_of(meta)
    if report is None:
        return False
    marked, hit = report.get("segments_marked"), report.get("segments_hit")
    return (
        isinstance(marked, int) and isinstance(hit, int) and marked > 0 and hit + stored == marked
    )


def _check_other(body, path) -> None:
    allowed = ALLOWED.get(path, ())
    misplaced = [k for k in allowed if isinstance(body, dict) and k in body]
    if misplaced:
        raise SegmentMarkError(
            f"{misplaced} must be given inside custom_params in a {path} request "
            f'(e.g. "custom_params": {{"{misplaced[0]}": ...}}), not at the top level'
        )
    reject_reserved(body, allowed)
    if any(c.encode() in orjson.dumps(body) for c in RESERVED):
        raise SegmentMarkError(
            f"segment markers (redknot.api.segment) are understood only by /generate, not {path}"
            ": send the program to /generate, or use --redknot-chat-segments for chat requests"
        )


def _is_json(scope) -> bool:
    """Whether FastAPI reads the body as JSON: the content type test of ``fastapi.routing``."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-type":
            message = email.message.Message()
            message["content-type"] = value.decode("latin-1")
            subtype = message.get_content_subtype()
            return message.get_content_maintype() == "application" and (
                subtype == "json" or subtype.endswith("+json")
            )
    return scope.get("path") in PATHS  # SGLang's /generate parses bodies without a type too


def _replay(messages, receive):
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _respond(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
