"""The request API's state in the HTTP server process: tokenizer, options, namespaces, counters.

One :class:`SegmentApi` is built when the HTTP server starts (``server.py``) around SGLang's
``TokenizerManager``; the ``/generate`` middleware, the chat hook and the ``/redknot`` routes
all go through it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redknot.api import control
from redknot.api.auto import AutoSegments
from redknot.api.capture import Capturer
from redknot.api.marks import (
    KEY_RECOMPUTED,
    SegmentMark,
    SegmentMarkError,
    check_ranges,
    encode_marks,
    range_ids,
)
from redknot.api.namespaces import NamespaceRegistry
from redknot.api.options import AutoSegmentsOption, ChatSegments
from redknot.api.tokenize import PiecewiseTokenizer

logger = logging.getLogger(__name__)


@dataclass
class ApiCounters:
    """What the HTTP side saw; reported by ``GET /redknot/stats`` under ``"api"``."""

    requests_with_segments: int = 0
    segments_marked: int = 0
    rejected: int = 0
    registrations: int = 0
    # capture on miss (redknot.api.capture): segments handed to it and what became of them
    captures_sent: int = 0  # registrations sent for missing segments
    captures_stored: int = 0  # ... that the store then held
    captures_failed: int = 0  # ... that stored nothing (reason in the log)
    captures_skipped: int = 0  # already stored or being written: nothing sent
    captures_deduplicated: int = 0  # the same segment was being captured already
    captures_dropped: int = 0  # too many captures pending
    captures_deferred: int = 0  # automatic chunks missed for the first time: not captured yet
    captures_prefix_cached: int = 0  # automatic segments inside the prefix-cache hit: not captured
    captures_in_place: int = 0  # automatic chunks the missing request's own prefill stored
    # automatic segments (redknot.api.auto): unmarked requests given chunks, and the chunks
    auto_requests: int = 0
    auto_chunks_marked: int = 0
    auto_edges_learned: int = 0  # cdc-edges: documents' edges learned (and captured)
    captures_superseded: int = 0  # cdc-docs: chunks deleted once their document was stored
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class SegmentApi:
    def __init__(
        self,
        tokenizer_manager: Any,
        *,
        chat: ChatSegments | None = None,
        namespaces: NamespaceRegistry | None = None,
        rows_leave: str | None = None,
        capture: bool = False,
        auto: AutoSegmentsOption | None = None,
        in_place: bool = False,
    ):
        self.tokenizer_manager = tokenizer_manager
        self.chat = chat or ChatSegments(enabled=False)
        self.namespaces = namespaces or NamespaceRegistry()
        # the server option under which reused tokens leave recovery (RedknotConfig.rows_leave)
        self.rows_leave = rows_leave
        self.counters = ApiCounters()
        self.capture = Capturer(
            self,
            enabled=capture,
            auto_capture_after=auto.capture_after if auto else 2,
            in_place=in_place,
        )
        self.auto = AutoSegments(auto)
        self._piecewise: PiecewiseTokenizer | None = None
        # why segment markup does nothing on this server (learn_gate), None while it may
        self.inert: str | None = None
        self._gate_asked = False

    @classmethod
    def from_config(cls, tokenizer_manager: Any, config: Any) -> SegmentApi:
        """From a ``RedknotConfig`` (its ``chat_segments``, ``namespaces``, ``capture`` and
        ``auto_*`` options, and whether reused tokens leave recovery)."""
        return cls(
            tokenizer_manager,
            chat=ChatSegments.parse(config.chat_segments),
            namespaces=NamespaceRegistry.from_option(config.namespaces),
            rows_leave=config.rows_leave,
            capture=config.capture == "on",
            in_place=config.auto_capture_in_place == "on",
            auto=AutoSegmentsOption.parse(
                config.auto_segments,
                config.auto_chunk_tokens,
                config.auto_capture_after,
                config.auto_capture_context,
            ),
        )

    @property
    def context_len(self) -> int | None:
        return getattr(self.tokenizer_manager, "context_len", None)

    @property
    def tokenizer(self) -> PiecewiseTokenizer:
        raw = getattr(self.tokenizer_manager, "tokenizer", None)
        if raw is None:
            raise SegmentMarkError(
                "this server has no tokenizer (--skip-tokenizer-init): mark segments over "
                "input_ids instead of text"
            )
        if self._piecewise is None or self._piecewise.tokenizer is not raw:
            self._piecewise = PiecewiseTokenizer(raw)
        return self._piecewise

    def marks(
        self,
        input_ids: Sequence[int],
        token_spans: Sequence[tuple[int, int]],
        namespaces: Sequence[str],
        *,
        where: str,
    ) -> list[SegmentMark]:
        """Validated marks of one prompt from its token spans (sorted, disjoint)."""
        ranges = []
        for i, ((start, end), ns) in enumerate(zip(token_spans, namespaces, strict=True)):
            self.namespaces.require(ns, where=f"{where} segment {i} namespace")
            if end <= start:
                raise SegmentMarkError(
                    f"{where} segment {i} has no tokens: its text tokenises to nothing"
                )
            ranges.append((ns, start, end))
        check_ranges(
            [r[1:] for r in ranges], prompt_len=len(input_ids), context_len=self.context_len
        )
        # the prompt packed once for all its segments; inert: no id is ever looked up
        ids = range_ids(input_ids, ranges) if ranges and self.inert is None else [""] * len(ranges)
        return [SegmentMark(a, b, ns, sid) for (ns, a, b), sid in zip(ranges, ids, strict=True)]

    def encode(self, marks: Sequence[SegmentMark], store: Sequence[int] = ()) -> dict[str, Any]:
        """The ``custom_params`` entries that carry one prompt's ``marks`` to the scheduler
        (``store``: the indices of those the request stores itself on a miss); on an inert
        server only their number, which its answer reports."""
        if self.inert is not None:
            return {KEY_RECOMPUTED: len(marks)} if marks else {}
        return encode_marks(marks, store=store)

    async def learn_gate(self) -> None:
        """Ask the scheduler's reuse gate once (control op ``gate``; never raises). When it
        recomputes every prompt this model takes whatever the prompt hits (by its device
        record, or by the recompute times this server measured, its startup calibration among
        them: ``ReuseGate.recomputes_all``), markup is :attr:`inert` for the server's life:
        marks are checked but carry no ids, nothing is looked up or captured, and a marked
        prompt costs what it costs unmarked. Asked at the first request that may mark
        segments, after the calibration (which runs before the server listens), and not asked
        again: an inert server measures no reuse, and the recompute times it measures later
        do not turn it back.
        Requests that arrive while the first one waits for the answer are served as before."""
        if self._gate_asked:
            return
        self._gate_asked = True
        try:
            gate = await control.call(self.tokenizer_manager, "gate")
        except control.ControlError as e:
            self.auto.use_gate(None, str(e))
            return
        self.auto.use_gate(gate)
        if gate.get("gate") and gate.get("inert"):
            self.inert = str(gate["inert"])
            logger.info(
                "redknot: segment markup is inert: %s; marked prompts are served as unmarked "
                "ones (their answers report the marks), without lookups or captures",
                self.inert,
            )
