"""The ``/redknot`` endpoints: register, list and delete segments, read cache statistics.

| method and path                              | what                                         |
| -------------------------------------------- | -------------------------------------------- |
| ``POST /redknot/segments``                   | register a segment ahead of use: prefill it  |
|   ``{namespace, text | input_ids, pin}``     | standalone (a ``max_new_tokens=0`` generate  |
|                                              | request marked as a registration); 200 when  |
|                                              | stored, 202 while another registration of    |
|                                              | the same tokens writes it, 413 (longer than  |
|                                              | the segment region) or 409 (region full of   |
|                                              | pinned/live segments, caching off, aborted)  |
|                                              | when nothing was stored                      |
| ``GET /redknot/segments?namespace=``         | the namespace's segments                     |
| ``DELETE /redknot/segments/{id}?namespace=`` | delete one (404 when unknown)                |
| ``GET /redknot/stats[?namespace=]``          | store counters and usage, API counters,      |
|                                              | known namespaces; ``auto``: automatic chunks |
|                                              | (with ``--redknot-auto-segments cdc``)       |

Errors are ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx status, like SGLang's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from redknot.api import control
from redknot.api.marks import SegmentMark, SegmentMarkError, encode_marks, segment_id
from redknot.api.options import AUTO_NAMESPACE, DEFAULT_NAMESPACE
from redknot.api.service import SegmentApi

PREFIX = "/redknot"
_REGISTER_KEYS = {"namespace", "text", "input_ids", "pin"}


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _json({"error": {"message": message, "type": kind, "code": status}}, status)


def registration_tokens(body: Any, api: SegmentApi) -> tuple[str, list[int], bool]:
    """``(namespace, token ids, pin)`` of a registration body; 400 on anything invalid."""
    if not isinstance(body, dict):
        raise SegmentMarkError("the body must be a JSON object {namespace, text | input_ids, pin}")
    unknown = sorted(set(body) - _REGISTER_KEYS)
    if unknown:
        raise SegmentMarkError(f"unknown fields {unknown}; known: {sorted(_REGISTER_KEYS)}")
    namespace = api.namespaces.admit_registration(body.get("namespace", DEFAULT_NAMESPACE))
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise SegmentMarkError(f"pin must be true or false, got {pin!r}")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise SegmentMarkError("give exactly one of text and input_ids")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise SegmentMarkError("text must be a non-empty string")
        ids = api.tokenizer.segment_tokens(text)
    elif not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise SegmentMarkError("input_ids must be a list of non-negative integers")
    if not ids:
        raise SegmentMarkError("the segment is empty: it has no tokens")
    vocab = getattr(getattr(api.tokenizer_manager, "model_config", None), "vocab_size", None)
    if vocab is not None and max(ids) >= vocab:
        raise SegmentMarkError(f"input_ids hold token {max(ids)}, outside the vocabulary ({vocab})")
    context = api.context_len
    if context is not None and len(ids) >= context:
        raise SegmentMarkError(
            f"the segment has {len(ids)} tokens, not less than the model's context "
            f"({context} tokens): split it into smaller segments"
        )
    return namespace, ids, pin


def build_router(get_api: Callable[[], SegmentApi]) -> APIRouter:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.utils.auth import AuthLevel, auth_level

    router = APIRouter(prefix=PREFIX)

    @router.post("/segments")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def register_segment(request: Request):
        api = get_api()
        try:
            namespace, ids, pin = registration_tokens(await _body(request), api)
        except SegmentMarkError as e:
            api.counters.add(rejected=1)
            return _error(400, str(e))
        try:  # its answer needs the store: refuse before the prefill when it is out of reach
            control.communicator(api.tokenizer_manager)
        except control.ControlError as e:
            return _error(e.status, str(e))
        mark = SegmentMark(0, len(ids), namespace, segment_id(namespace, ids))
        custom = encode_marks([mark], register=True, pin=pin)
        obj = GenerateReqInput(
            input_ids=ids, sampling_params={"max_new_tokens": 0, "custom_params": custom}
        )
        try:
            out = await api.tokenizer_manager.generate_request(obj, request).__anext__()
        except ValueError as e:
            return _error(getattr(e, "status_code", 400), str(e))
        try:  # what the scheduler's store made of it
            state = await control.call(
                api.tokenizer_manager, "registration", namespace, mark.segment_id
            )
        except control.ControlError as e:
            return _error(e.status, str(e))
        if state["status"] != 200:
            api.counters.add(rejected=1)
            return _error(
                state["status"],
                f"segment {mark.segment_id} ({len(ids)} tokens, namespace {namespace!r}) was "
                f"not stored: {state['reason']}",
            )
        api.namespaces.create(namespace)
        api.counters.add(registrations=1)
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        answer = {
            "segment_id": mark.segment_id,
            "namespace": namespace,
            "num_tokens": len(ids),
            "pinned": pin,
            "cached_tokens": meta.get("cached_tokens"),
            "state": state["state"],
        }
        # writing: another registration of the same tokens is filling it; usable when it ends
        return _json(answer, status=200 if state["state"] == "ready" else 202)

    @router.get("/segments")
    async def list_segments(namespace: str = DEFAULT_NAMESPACE):
        return await _control(get_api(), "list", namespace, None, key="segments")

    @router.delete("/segments/{segment_id}")
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def delete_segment(segment_id: str, namespace: str = DEFAULT_NAMESPACE):
        return await _control(get_api(), "delete", namespace, segment_id)

    @router.get("/stats")
    async def stats(namespace: str | None = None):
        api = get_api()
        out = await _control(api, "stats", namespace, None, key="store")
        if out.status_code == 200:
            body = orjson.loads(out.body)
            store = body["store"]
            for key in ("capture_order", "lfps"):  # the scheduler's, not the store's
                value = store.pop(key, None)
                if value is not None:
                    body[key] = value
            if not store:  # an LFPS server without a segment store
                body["store"] = None
            body.update(api=api.counters.as_dict(), namespaces=api.namespaces.known())
            if api.auto.enabled:
                body["auto"] = await _auto_stats(api)
            return _json(body)
        return out

    return router


async def _auto_stats(api: SegmentApi) -> dict[str, Any]:
    """Automatic segments (``--redknot-auto-segments``): the chunking, what the HTTP side
    marked, and the store's counters of namespace ``auto``."""
    try:
        store = await control.call(api.tokenizer_manager, "stats", AUTO_NAMESPACE)
    except control.ControlError as e:
        return {"namespace": AUTO_NAMESPACE, "error": str(e)}
    auto = api.auto
    return {
        "namespace": AUTO_NAMESPACE,
        "chunk_tokens": auto.chunker.avg_tokens,
        "min_store_tokens": auto.min_store_tokens,
        "gate_min_tokens": auto.gate_min_tokens,
        "idle": auto.idle,  # why no chunk is marked, or None
        "requests": api.counters.auto_requests,
        "chunks_marked": api.counters.auto_chunks_marked,
        "edges_learned": api.counters.auto_edges_learned,
        "chunk_hits": store["hits"],
        "chunk_misses": store["misses"],
        "chunk_hit_tokens": store["hit_tokens"],
        "chunk_captures": store["captures"],
        "chunk_evictions": store["evictions"],
        "chunks_stored": store["segments"],
    }


async def _body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise SegmentMarkError(f"the body is not valid JSON: {e}") from None


async def _control(
    api: SegmentApi, op: str, namespace: str | None, sid: str | None, *, key: str | None = None
) -> Response:
    try:
        if namespace is not None:
            api.namespaces.check(namespace)
    except SegmentMarkError as e:
        api.counters.add(rejected=1)
        return _error(400, str(e))
    try:
        payload = await control.call(api.tokenizer_manager, op, namespace, sid)
    except control.ControlError as e:
        return _error(e.status, str(e))
    body = {"namespace": namespace, key: payload} if key else {"namespace": namespace, **payload}
    if sid is not None:
        body["segment_id"] = sid
    return _json(body)
