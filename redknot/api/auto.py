"""Automatic segments of unmarked prompts: ``--redknot-auto-segments cdc``.

A ``/generate`` request that marks nothing is tokenised as SGLang would tokenise it (the
tokenizer manager's tokenizer over the whole text, or the client's ``input_ids``), cut into
content-defined chunks (``chunking.py``), and its chunks are marked as segments of namespace
``auto`` (``AUTO_NAMESPACE``; created on first use) by ``generate.py``. An OpenAI chat request
(``chat.py``, with ``--redknot-chat-segments off``) gets a segment per message content instead,
cut into chunks only when longer than the chunker's maximum (:meth:`AutoSegments.message_spans`).
From there they are ordinary marked segments: the scheduler looks each one up by content
(namespace and token ids), a hit reuses the stored K/V at the chunk's position, and a miss is
captured after the request's first token (``capture.py``) unless capture is off.

Which chunks of a ``/generate`` prompt become segments:

| chunk                                   | segment? | why                                       |
| --------------------------------------- | -------- | ----------------------------------------- |
| the first (from token 0)                | no       | exact-prefix reuse (SGLang's radix cache) |
|                                         |          | serves a shared prompt head; and its start |
|                                         |          | is the prompt's, not a content-defined cut |
| the last (to the prompt's end)          | no       | its end is the prompt's (the question's)   |
| shorter than ``min_store_tokens``       | no       | too short to pay for itself                |
| every other one                         | yes      |                                           |

Under ``cdc-edges`` a chunk that starts or ends with a document edge learned from earlier
misses (``redknot.api.edges``: what chunks straddling two documents lose) is cut there, the
edge a segment of its own; so are a learned head at the end of the first chunk and a learned
tail at the start of the last (the rest of those two chunks stays unmarked). Under
``cdc-docs``, a run from where a learned head starts to where the next learned tail ends (found
by content, ``redknot.api.edges``) is a document: seen in ``--redknot-auto-capture-after``
prompts it is captured whole, as registering it would store it (with the separator tokens its
edges share across prompts), and from then on marked as one segment in place of its chunks,
which are deleted.

``min_store_tokens`` is the larger of the chunker's minimum and the reuse gate's break-even:
the shortest segment with which an 8K-token prompt made of such segments is served with reuse
(``ReuseGate.min_segment_tokens``), asked once from the scheduler (control op ``gate``). When
the gate says that no segment length pays, or the segment store is off (segment fraction 0),
no chunk is marked (logged once): the gate would recompute every such request anyway, and
capturing its chunks would only cost prefills.

A request opts out with ``"redknot_auto_segments": false`` (in ``custom_params`` for a chat
request); requests that mark segments themselves, carry ``input_embeds`` or media, or that
SGLang would refuse (too long, invalid ids) are left as they are.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from redknot.api.chunking import WINDOW, Chunker, rolling_hash
from redknot.api.edges import EdgeIndex, documents
from redknot.api.options import AUTO_NAMESPACE, AutoSegmentsOption

if TYPE_CHECKING:
    from redknot.api.namespaces import NamespaceRegistry

logger = logging.getLogger(__name__)

AUTO_FIELD = "redknot_auto_segments"  # per request: false leaves the prompt unsegmented
GATE_PROMPT_TOKENS = 8192  # the prompt length at which the gate's break-even is asked
DOCUMENTS_KEPT = 1 << 12  # cdc-docs: assembled documents remembered
DOCUMENTS_DUE = 64  # cdc-docs: documents waiting for the next capture, at most


@dataclasses.dataclass
class _Document:
    """``cdc-docs``: a run from a learned head to the next learned tail, seen in prompts."""

    pieces: tuple[tuple[int, int], ...]  # the chunks and edges it would replace (offsets in it)
    context: tuple[int, ...] = ()  # the tokens before it where it was last sighted
    sightings: int = 0  # prompts that held it while it was not stored
    queued: bool = False  # waiting in the capture queue
    stored: bool = False  # captured (the store may have evicted it since)


class AutoSegments:
    """The automatic chunking of this HTTP server (see the module docstring)."""

    def __init__(self, option: AutoSegmentsOption | None = None):
        self.option = option or AutoSegmentsOption(enabled=False)
        self.chunker = Chunker.of_average(self.option.chunk_tokens)
        self.edges = EdgeIndex() if self.option.edges else None  # cdc-edges, cdc-docs
        self._documents: OrderedDict[int, _Document] = OrderedDict()  # cdc-docs, by token hash
        self._due: OrderedDict[int, list[int]] = OrderedDict()  # cdc-docs: to capture next
        self.gate_min_tokens: int | None = None  # the reuse gate's break-even, once asked
        self.idle: str | None = None  # why no chunk is marked (the store off, nothing pays)
        self._asked = False
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.option.enabled

    @property
    def min_store_tokens(self) -> int:
        """The shortest chunk made a segment."""
        return max(self.chunker.min_tokens, self.gate_min_tokens or 0)

    def usable(self, namespaces: NamespaceRegistry) -> bool:
        """Whether unmarked requests get automatic segments now: the option is on, the segment
        store is on and some segment length pays (``idle`` is ``None``), and requests may use
        namespace ``auto`` (a closed ``--redknot-namespaces`` list without it is warned about
        once)."""
        if not self.enabled or self.idle is not None:
            return False
        if namespaces.closed and not namespaces.is_known(AUTO_NAMESPACE):
            self.warn_once(
                "namespace",
                f"--redknot-namespaces does not declare '{AUTO_NAMESPACE}': unmarked prompts are "
                "served without automatic segments",
            )
            return False
        return True

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("redknot auto segments: %s", message)

    def use_gate(self, gate: dict[str, Any] | None, error: str = "") -> None:
        """What the scheduler's reuse gate said (control op ``gate``, asked once per server by
        :meth:`redknot.api.service.SegmentApi.learn_gate`); None: it could not be asked
        (``error``). Requests that arrive while the first one waits for the answer use the
        chunker's minimum."""
        if self._asked or not self.enabled:
            return
        self._asked = True
        if gate is None:
            logger.warning(
                "redknot auto segments: the reuse gate's break-even is unknown (%s); chunks of "
                "%d+ tokens are segments",
                error,
                self.chunker.min_tokens,
            )
            return
        self.gate_min_tokens = gate.get("min_segment_tokens")
        if not gate.get("store_enabled", True):
            self.idle = (
                "the segment store is off (--redknot-segment-fraction 0, as under a calibrated "
                "default that computes every prompt in full)"
            )
        elif gate.get("inert"):
            self.idle = gate["inert"]
        elif gate.get("gate") and self.gate_min_tokens is None:
            self.idle = (
                "the reuse gate says that no segment length pays in a "
                f"{gate.get('prompt_tokens', GATE_PROMPT_TOKENS)}-token prompt on this model "
                "and device"
            )
        if self.idle is not None:
            logger.warning(
                "redknot auto segments: %s: unmarked prompts are served without automatic "
                "segments",
                self.idle,
            )
            return
        logger.info(
            "redknot auto segments: chunks of about %d tokens; those of %d+ tokens are segments "
            "(%s)",
            self.chunker.avg_tokens,
            self.min_store_tokens,
            (
                f"the reuse gate's break-even: {self.gate_min_tokens}"
                if gate.get("gate")
                else "the scheduler has no reuse gate: --redknot-reuse-gate always"
            ),
        )

    def spans(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """The token ranges of ``token_ids`` to mark as segments of ``AUTO_NAMESPACE``."""
        if self.idle is not None:
            return []
        # the prompt as an array and its rolling hash, once: the chunker, the edges and the
        # documents read them (a list slice converted per chunk was a fifth of this time)
        ids = np.asarray(token_ids, dtype=np.int32)
        h = rolling_hash(ids)
        every = self.chunker.spans(ids, h)
        chunks = every[1:-1]  # not the first, not the last
        least = self.min_store_tokens
        if self.edges is not None:  # cut around the documents' edges learned so far
            pieces = [p for a, b in chunks for p in self.edges.pieces(ids, a, b, least)]
            if len(every) > 1:  # the first chunk's learned head, the last one's learned tail
                first, last = every[0], every[-1]
                heads = self.edges.pieces(ids, *first, least)
                tails = self.edges.pieces(ids, *last, least)
                pieces = [p for p in heads if p[2] == "head"] + pieces
                pieces += [p for p in tails if p[2] == "tail"]
            if self.option.documents:  # a stored document between two learned edges: one segment
                pieces = self._with_documents(token_ids, pieces, ids, h)
            chunks = [(a, b) for a, b, _ in pieces]
        return [(a, b) for a, b in chunks if b - a >= least]

    @property
    def max_document_tokens(self) -> int:
        """``cdc-docs``: the longest document made one segment (16 of the longest chunks)."""
        return 16 * self.chunker.max_tokens

    def _with_documents(
        self,
        token_ids: Sequence[int],
        pieces: list[tuple[int, int, str]],
        ids: np.ndarray,
        h: np.ndarray,
    ) -> list[tuple[int, int, str]]:
        """``pieces`` with each document run (a learned head's start to the next learned
        tail's end, found by content: :meth:`redknot.api.edges.EdgeIndex.boundaries`) that
        was captured made one piece, the pieces it overlaps cut back to what lies outside it;
        a run not stored leaves the pieces as they are, and one seen in
        ``--redknot-auto-capture-after`` prompts is queued for capture (a run is a document
        when it recurs: where a head between was not learned yet, it holds two). ``ids``,
        ``h``: the prompt as an int32 array and its rolling hash."""
        runs = documents(*self.edges.boundaries(ids, h), self.max_document_tokens)
        out = list(pieces)
        for a, b in runs:
            inside = [p for p in pieces if a <= p[0] and p[1] <= b]
            before = self.context_before(token_ids, a)
            key = _hash(ids[a:b])  # from the array: no list slice converted
            if not self._document_sighted(token_ids[a:b], inside, a, before, key):
                continue
            cut = [(a, b, "document")]
            for x, y, kind in out:
                if y <= a or b <= x:
                    cut.append((x, y, kind))
                else:  # what of it lies outside the document
                    cut += [(x, a, kind)] if x < a else []
                    cut += [(b, y, kind)] if b < y else []
            out = sorted(cut)
        return out

    def _document_sighted(
        self,
        ids: Sequence[int],
        inside: list[tuple[int, int, str]],
        start: int,
        before: Sequence[int] = (),
        key: int | None = None,
    ) -> bool:
        """Count a sighting of the run ``ids`` (after the tokens ``before``; ``key``: its
        :func:`_hash` when the caller has it); whether it is stored (served whole)."""
        key = _hash(ids) if key is None else key
        doc = self._documents.pop(key, None) or _Document(
            tuple((x - start, y - start) for x, y, _ in inside)
        )
        doc.context = tuple(before)
        self._documents[key] = doc
        if len(self._documents) > DOCUMENTS_KEPT:
            self._due.pop(self._documents.popitem(last=False)[0], None)
        if doc.stored:
            return True
        doc.sightings += 1
        if doc.sightings >= self.option.capture_after and not doc.queued:
            doc.queued = True
            self._due[key] = list(ids)
            if len(self._due) > DOCUMENTS_DUE:
                dropped, _ = self._due.popitem(last=False)
                if dropped in self._documents:
                    self._documents[dropped].queued = False
        return False

    def documents_due(self) -> list[list[int]]:
        """``cdc-docs``: the documents to capture now (taken off the queue)."""
        due, self._due = list(self._due.values()), OrderedDict()
        return due

    def _document(self, ids: Sequence[int]) -> _Document | None:
        """``cdc-docs``: the document run ``ids`` (None: not one this server assembled)."""
        return self._documents.get(_hash(ids)) if self._documents else None

    def document_stored(self, ids: Sequence[int], stored: bool = True) -> None:
        """``cdc-docs``: the capture of document ``ids`` ended (``stored``: in the store)."""
        doc = self._document(ids)
        if doc is not None:
            doc.queued, doc.stored = False, stored

    def document_unqueued(self, ids: Sequence[int]) -> None:
        """``cdc-docs``: document ``ids`` left the capture path (a later sighting queues it
        again unless it was stored)."""
        doc = self._document(ids)
        if doc is not None:
            doc.queued = False

    def is_document(self, ids: Sequence[int]) -> bool:
        """``cdc-docs``: whether ``ids`` is a document run this server assembled from its
        learned edges (captured when due, whatever its misses)."""
        return self._document(ids) is not None

    def document_pieces(self, ids: Sequence[int]) -> list[list[int]] | None:
        """``cdc-docs``: the chunks and edges (token ids) that the document ``ids`` replaces;
        None: not a document run."""
        doc = self._document(ids)
        return None if doc is None else [list(ids[a:b]) for a, b in doc.pieces]

    def learn_edges(self, chunk: Sequence[int]) -> list[list[int]]:
        """``cdc-edges``: the documents' edges newly learned from a chunk the store lacked
        (``redknot.api.edges``); none without the option."""
        if self.edges is None:
            return []
        boundary = WINDOW if self.option.documents else None  # cdc-docs: shorter ones bound
        return self.edges.learn(chunk, self.min_store_tokens, boundary)

    def context_before(self, token_ids: Sequence[int], start: int) -> list[int]:
        """The tokens a segment starting at ``start`` in ``token_ids`` is captured after
        (``--redknot-auto-capture-context``: up to that many of those before it)."""
        k = self.option.capture_context
        return list(token_ids[max(0, start - k) : start]) if k else []

    def contexts(self, token_ids: Sequence[int], marks: Sequence[Any]) -> list[list[int]]:
        """Per mark (``start``, ``end`` in ``token_ids``): :meth:`context_before` it."""
        return [self.context_before(token_ids, m.start) for m in marks]

    def starts(self, marks: Sequence[Any]) -> list[int] | None:
        """Where the marks start in their prompt, for capture to join those that follow one
        another into one prompt (each computed after the ones before it); None under
        ``--redknot-auto-capture-context 0`` (every segment captured alone)."""
        return [m.start for m in marks] if self.option.capture_context else None

    def document_context(self, ids: Sequence[int]) -> list[int]:
        """``cdc-docs``: the tokens before the document ``ids`` where it was last sighted (its
        capture is computed after them)."""
        doc = self._document(ids)
        return [] if doc is None else list(doc.context)

    def edge_context(
        self, chunk: Sequence[int], context: Sequence[int], edge: Sequence[int]
    ) -> list[int]:
        """The tokens a learned ``edge`` of the missed ``chunk`` (computed after ``context``)
        is captured after: a head ends the chunk and follows the chunk's tokens before it; a
        tail starts the chunk and follows what the chunk followed."""
        k = self.option.capture_context
        n = len(edge)
        if not k or n >= len(chunk) or list(chunk[-n:]) != list(edge):
            return list(context)
        return [*context, *chunk[: len(chunk) - n]][-k:]

    def message_spans(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """The token ranges of one chat message's content (its standalone tokens) to mark as
        segments of ``AUTO_NAMESPACE``: the whole content when it is at most the chunker's
        maximum, else its content-defined chunks (the first and the last included: a message's
        edges are the template's, not the prompt's); only those of ``min_store_tokens`` or
        more."""
        if self.idle is not None:
            return []
        n = len(token_ids)
        chunks = [(0, n)] if n <= self.chunker.max_tokens else self.chunker.spans(token_ids)
        return [(a, b) for a, b in chunks if b - a >= self.min_store_tokens]


def _hash(ids: Sequence[int]) -> int:
    return hash(np.asarray(ids, dtype=np.int32).tobytes())


def gate_state(scheduler: Any) -> dict[str, Any]:
    """Scheduler side of control op ``gate``: whether the segment store holds anything, whether
    a reuse gate decides, its break-even (``None``: no segment length pays at
    ``prompt_tokens``, or no gate), the longest prompt it recomputes whatever it hits by its
    record (``recompute_up_to``, at most the model's ``context_len``; 0 without a gate), why
    it recomputes every prompt up to the context, by the record or as this server measured
    (``inert``, :meth:`redknot.costmodel.gate.ReuseGate.recomputes_all`; None: some may
    reuse), and its
    startup calibration (:meth:`redknot.costmodel.gate.ReuseGate.calibration_plan`, up to the
    context and the prefill chunk)."""
    cache = getattr(scheduler, "tree_cache", None)
    store = getattr(cache, "segments", None)
    gate = getattr(getattr(cache, "pool", None), "reuse_gate", None)
    context = getattr(getattr(scheduler, "model_config", None), "context_len", None)
    # the longest prompt SGLang takes (its scheduler refuses max_req_input_len tokens and more)
    longest = getattr(scheduler, "max_req_input_len", None) or context or 0
    limit = max(0, min(longest, context or longest) - 1)
    chunk = getattr(getattr(scheduler, "server_args", None), "chunked_prefill_size", None)
    if chunk and chunk > 0:  # a longer prompt runs in chunks, each timed as its own forward
        limit = min(limit, chunk)
    plan = gate.calibration_plan(limit) if gate is not None and limit else []
    timer = getattr(gate, "timer", None)
    if timer is not None:
        timer.harvest()  # forwards reached since the last batch's answers
    return {
        "store_enabled": bool(getattr(store, "enabled", False)),
        "gate": gate is not None,
        "min_segment_tokens": (
            None if gate is None else gate.min_segment_tokens(GATE_PROMPT_TOKENS)
        ),
        "prompt_tokens": GATE_PROMPT_TOKENS,
        "recompute_up_to": 0 if gate is None or not context else gate.recomputed_up_to(context),
        "context_len": context,
        # why every prompt up to the context is recomputed whatever it hits (markup inert)
        "inert": None if gate is None or not context else gate.recomputes_all(context),
        # startup calibration (redknot.api.gate_warmup): prompts to recompute, and the
        # recompute ratio measured at each of their sizes so far (None: not yet)
        "calibrate": plan,
        "recompute_ratios": [
            [n, timer.correction.measured("recompute", n)] for n, _ in plan if timer is not None
        ],
    }


__all__ = ["AUTO_FIELD", "AUTO_NAMESPACE", "AutoSegments", "gate_state"]
