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
edge a segment of its own.

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

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from redknot.api.chunking import Chunker
from redknot.api.edges import EdgeIndex, documents
from redknot.api.options import AUTO_NAMESPACE, AutoSegmentsOption

if TYPE_CHECKING:
    from redknot.api.namespaces import NamespaceRegistry

logger = logging.getLogger(__name__)

AUTO_FIELD = "redknot_auto_segments"  # per request: false leaves the prompt unsegmented
GATE_PROMPT_TOKENS = 8192  # the prompt length at which the gate's break-even is asked
DOCUMENTS_KEPT = 1 << 12  # cdc-docs: assembled documents remembered for the capture path


class AutoSegments:
    """The automatic chunking of this HTTP server (see the module docstring)."""

    def __init__(self, option: AutoSegmentsOption | None = None):
        self.option = option or AutoSegmentsOption(enabled=False)
        self.chunker = Chunker.of_average(self.option.chunk_tokens)
        self.edges = EdgeIndex() if self.option.edges else None  # cdc-edges, cdc-docs
        self._documents: OrderedDict[int, None] = OrderedDict()  # cdc-docs: hashes of tokens
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
        chunks = self.chunker.spans(token_ids)[1:-1]  # not the first, not the last
        least = self.min_store_tokens
        if self.edges is not None:  # cut around the documents' edges learned so far
            pieces = [p for a, b in chunks for p in self.edges.pieces(token_ids, a, b, least)]
            if self.option.documents:  # a document between two learned edges: one segment
                pieces = documents(pieces, self.max_document_tokens)
                for a, b, kind in pieces:
                    if kind == "document":
                        self._remember_document(token_ids[a:b])
            chunks = [(a, b) for a, b, _ in pieces]
        return [(a, b) for a, b in chunks if b - a >= least]

    @property
    def max_document_tokens(self) -> int:
        """``cdc-docs``: the longest document made one segment (16 of the longest chunks)."""
        return 16 * self.chunker.max_tokens

    def _remember_document(self, ids: Sequence[int]) -> None:
        key = hash(np.asarray(ids, dtype=np.int32).tobytes())
        self._documents.pop(key, None)
        self._documents[key] = None
        if len(self._documents) > DOCUMENTS_KEPT:
            self._documents.popitem(last=False)

    def is_document(self, ids: Sequence[int]) -> bool:
        """``cdc-docs``: whether ``ids`` is a document this server assembled from its learned
        edges (its capture is not deferred: its edges were learned from repeats)."""
        return bool(self._documents) and (
            hash(np.asarray(ids, dtype=np.int32).tobytes()) in self._documents
        )

    def learn_edges(self, chunk: Sequence[int]) -> list[list[int]]:
        """``cdc-edges``: the documents' edges newly learned from a chunk the store lacked
        (``redknot.api.edges``); none without the option."""
        if self.edges is None:
            return []
        return self.edges.learn(chunk, self.min_store_tokens)

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


def gate_state(scheduler: Any) -> dict[str, Any]:
    """Scheduler side of control op ``gate``: whether the segment store holds anything, whether
    a reuse gate decides, its break-even (``None``: no segment length pays at
    ``prompt_tokens``, or no gate), and the longest prompt it recomputes whatever it hits
    (``recompute_up_to``, at most the model's ``context_len``; 0 without a gate)."""
    cache = getattr(scheduler, "tree_cache", None)
    store = getattr(cache, "segments", None)
    gate = getattr(getattr(cache, "pool", None), "reuse_gate", None)
    context = getattr(getattr(scheduler, "model_config", None), "context_len", None)
    return {
        "store_enabled": bool(getattr(store, "enabled", False)),
        "gate": gate is not None,
        "min_segment_tokens": (
            None if gate is None else gate.min_segment_tokens(GATE_PROMPT_TOKENS)
        ),
        "prompt_tokens": GATE_PROMPT_TOKENS,
        "recompute_up_to": 0 if gate is None or not context else gate.recomputed_up_to(context),
        "context_len": context,
    }


__all__ = ["AUTO_FIELD", "AUTO_NAMESPACE", "AutoSegments", "gate_state"]
