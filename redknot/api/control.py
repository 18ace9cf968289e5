"""The control path from the HTTP server to the scheduler's segment store (SGLang 0.5.17).

``GET/DELETE /redknot/segments`` and ``GET /redknot/stats`` need the scheduler's state, which
SGLang's control requests cannot reach (``/set_internal_state`` takes only numbers,
``RpcReqInput`` returns no data). redknot adds its own request type, the way SGLang's own
control requests work:

| process   | what is added                                   | how                            |
| --------- | ----------------------------------------------- | ------------------------------ |
| every one | ``RedknotSegmentsReq`` / ``...ReqOutput`` known | ``io_struct.hook_custom_types``|
|           | to SGLang's msgpack IPC decoder                 | (``register_types``)           |
| launcher  | ``TokenizerManager.redknot_segments_communicator``| AFTER hook on               |
|           | (a ``FanOutCommunicator``) and its result route | ``init_request_dispatcher``    |
| scheduler | a request route to :func:`handle`, which calls  | AFTER hook on                  |
|           | ``scheduler.tree_cache.segments.<method>``      | ``Scheduler.init_request_dispatcher`` |

Every TP rank runs the request on its own store (SGLang broadcasts control requests); rank 0
answers. With ``--dp-size > 1`` the data-parallel controller, which loads no plugins, could not
decode the request, so the endpoints refuse it (501) instead of sending.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from sglang.srt.managers.io_struct import BaseReq

logger = logging.getLogger(__name__)

OPS = ("list", "delete", "deletes", "stats", "registration", "registrations", "gate")
TIMEOUT_S = 60.0


class RedknotSegmentsReq(BaseReq, kw_only=True):
    op: str  # one of OPS
    namespace: str | None = None
    segment_id: str | None = None
    # "registrations": the (namespace, segment id) of many segments, asked in one round trip
    # (SGLang's communicator has one control request in flight at a time)
    namespaces: list[str] | None = None
    segment_ids: list[str] | None = None


class RedknotSegmentsReqOutput(BaseReq, kw_only=True):
    status: int  # the HTTP status the API answers with
    message: str = ""  # what went wrong, for status != 200
    payload: str = "null"  # JSON of the store's answer


TYPES = (RedknotSegmentsReq, RedknotSegmentsReqOutput)


def register_types() -> None:
    from sglang.srt.managers import io_struct

    if not all(t in io_struct._all_types for t in TYPES):
        io_struct.hook_custom_types(*TYPES)


def types_registered() -> bool:
    from sglang.srt.managers import io_struct

    return all(t in io_struct._all_types for t in TYPES)


# ---- scheduler side ----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def handle(scheduler: Any, req: RedknotSegmentsReq) -> RedknotSegmentsReqOutput:
    """Run ``req`` on ``scheduler.tree_cache.segments``; never raises."""
    store = getattr(getattr(scheduler, "tree_cache", None), "segments", None)
    # --redknot-lfps: the decode's state rows (its request-slot pool holds the serving)
    lfps = getattr(getattr(scheduler, "req_to_token_pool", None), "redknot_lfps", None)
    if store is None and req.op == "stats" and req.namespace is None and lfps is not None:
        return RedknotSegmentsReqOutput(status=200, payload=json.dumps({"lfps": lfps.stats()}))
    if store is None:
        return RedknotSegmentsReqOutput(
            status=503,
            message="this server has no segment store: serve with --attention-backend redknot "
            "and its radix cache (do not pass --disable-radix-cache)",
        )
    try:
        if req.op == "list":
            payload = _plain(store.list(req.namespace))
        elif req.op == "delete":
            payload = {
                "deleted": True,
                "freed_now": bool(store.delete(req.namespace, req.segment_id)),
            }
        elif req.op == "deletes":  # many unpinned at once (False: absent or pinned, kept)
            pairs = zip(req.namespaces or (), req.segment_ids or (), strict=True)
            payload = [_delete_if_stored(store, ns, sid) for ns, sid in pairs]
        elif req.op == "stats":
            payload = store.stats(req.namespace)
            if req.namespace is None:  # server-wide: what the capture-order rule did
                from redknot.integration.capture_order import STATS

                payload["capture_order"] = STATS.as_dict()
                if lfps is not None:
                    payload["lfps"] = lfps.stats()
        elif req.op == "registration":
            payload = store.registration_state(req.namespace, req.segment_id)
        elif req.op == "registrations":
            pairs = zip(req.namespaces or (), req.segment_ids or (), strict=True)
            payload = [store.registration_state(ns, sid) for ns, sid in pairs]
        elif req.op == "gate":  # the reuse gate's break-even, for automatic chunks
            from redknot.api.auto import gate_state

            payload = gate_state(scheduler)
        else:
            return RedknotSegmentsReqOutput(status=400, message=f"unknown op {req.op!r}")
    except LookupError as e:
        return RedknotSegmentsReqOutput(status=404, message=str(e))
    except ValueError as e:
        return RedknotSegmentsReqOutput(status=400, message=str(e))
    except Exception as e:  # the scheduler must keep serving
        logger.exception("redknot: segment store %s failed", req.op)
        return RedknotSegmentsReqOutput(status=500, message=f"{type(e).__name__}: {e}")
    return RedknotSegmentsReqOutput(status=200, payload=json.dumps(payload, default=str))


def after_scheduler_dispatcher(result: Any, self: Any) -> None:
    from sglang.utils import TypeBasedDispatcher

    self._request_dispatcher += TypeBasedDispatcher(
        [(RedknotSegmentsReq, lambda req: handle(self, req))]
    )


# ---- tokenizer (HTTP server) side ----------------------------------------------------------


def after_tokenizer_dispatcher(result: Any, self: Any) -> None:
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.utils import TypeBasedDispatcher

    comm = FanOutCommunicator(self._dispatch_to_scheduler, self.server_args.dp_size)
    self.redknot_segments_communicator = comm
    self._result_dispatcher += TypeBasedDispatcher([(RedknotSegmentsReqOutput, comm.handle_recv)])


class ControlError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def communicator(tokenizer_manager: Any) -> Any:
    """The control path to the scheduler's store, or ``ControlError`` when this server has none
    (``--dp-size`` above 1, or redknot's hook not applied)."""
    dp_size = getattr(getattr(tokenizer_manager, "server_args", None), "dp_size", 1)
    if dp_size != 1:
        raise ControlError(
            501, f"segment control endpoints need --dp-size 1 (this server runs {dp_size})"
        )
    comm = getattr(tokenizer_manager, "redknot_segments_communicator", None)
    if comm is None:
        raise ControlError(
            503, "the redknot control path is not installed in this server's tokenizer manager"
        )
    return comm


async def call(
    tokenizer_manager: Any,
    op: str,
    namespace: str | None = None,
    segment_id: str | None = None,
    **fields: Any,
) -> Any:
    """Send one request to the scheduler's store; the decoded payload, or ``ControlError``.
    ``fields``: the request's other fields (``namespaces``, ``segment_ids``)."""
    comm = communicator(tokenizer_manager)
    if hasattr(tokenizer_manager, "auto_create_handle_loop"):
        tokenizer_manager.auto_create_handle_loop()
    req = RedknotSegmentsReq(op=op, namespace=namespace, segment_id=segment_id, **fields)
    try:
        outs = await asyncio.wait_for(comm(req), TIMEOUT_S)
    except TimeoutError:
        raise ControlError(504, f"the scheduler did not answer within {TIMEOUT_S:.0f} s") from None
    out = outs[0]
    if out.status != 200:
        raise ControlError(out.status, out.message)
    return json.loads(out.payload)


def _delete_if_stored(store: Any, namespace: str, segment_id: str) -> bool:
    try:
        if store.get(namespace, segment_id).pinned:  # only an explicit delete removes it
            return False
        store.delete(namespace, segment_id)
    except LookupError:
        return False
    return True


async def deletes(tokenizer_manager: Any, segments: list[tuple[str, str]]) -> list[bool]:
    """Delete each ``(namespace, segment id)`` the store holds unpinned (what the server's own
    captures may free), in one round trip; whether it was deleted, per segment."""
    if not segments:
        return []
    namespaces, ids = (list(x) for x in zip(*segments, strict=True))
    return await call(tokenizer_manager, "deletes", namespaces=namespaces, segment_ids=ids)


async def registrations(tokenizer_manager: Any, segments: list[tuple[str, str]]) -> list[dict]:
    """The store's ``registration_state`` of each ``(namespace, segment id)``, in one round
    trip (one control request, however many segments)."""
    if not segments:
        return []
    namespaces, ids = (list(x) for x in zip(*segments, strict=True))
    return await call(tokenizer_manager, "registrations", namespaces=namespaces, segment_ids=ids)
