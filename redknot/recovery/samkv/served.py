"""SamKV in the server (``--redknot-policy samkv``): what a request holds and how each layer
chooses it.

A request whose marked documents are stored is served as a shorter prompt: every hit document
keeps its anchors (``init_blocks`` blocks at its start, ``local_blocks`` and the remainder at
its end, as :mod:`redknot.recovery.samkv.layout` cuts it) and ``ceil(budget * M)`` of its ``M``
middle blocks; the text between documents and the question stay whole. SGLang sees only that
prompt (:func:`served_ids`), so its token accounting, the KV pool and decode hold and read only
the kept rows: the memory saving is the method's point. Each layer's rows of a document's
middle slots hold the blocks *that layer* chose, in block order, re-rotated to the slots'
positions (rank in the served prompt, as the reference's re-alignment after padding).

Per layer, from the question's queries of the same forward (:func:`layer_choice`):

| step           | what                                                                 |
| -------------- | -------------------------------------------------------------------- |
| generic query  | mean of the question rows' queries, each rotated back to position 0  |
| bias (Eq. 1)   | each document's local anchors' pooled queries, ``|cos|``-weighted, over ``D - 1`` (:func:`redknot.recovery.samkv.query.personalized_queries`) |
| block keys     | each middle block's mean key, rotated back to position 0 (the segment as stored) |
| choice         | per document, its ``kept_blocks`` best blocks by ``sum_h <Q^_h, K_{h/g}>`` (ties: the earlier block) |

Where this differs from the paper (and from the reference path, which follows it):

- the generic query comes from the question's rows in the same forward (over the anchors and
  the blocks the layers below chose), not from a separate prefill of the question over the
  anchors only; a layer chooses before its attention, so the question attends what it chose;
- each document keeps the same number of blocks in every layer (the budget's share of its
  own blocks), not a per-layer cut across documents, and the count is the budget, not Eq. 2-3's
  adaptive Top-P (which needs every layer's scores before the first runs): a slot then holds a
  token of the same document in every layer, which is what lets one row of ``req_to_token``
  serve every layer (the reference path runs this rule as ``samkv_spread="document"``);
- the anchors and every non-document row are recomputed; middle tokens are not (the
  reference's ``selective`` rule also recomputes high-attention middle tokens, which needs
  per-layer rows for the recomputation, not built; the reference path runs the server's rule as
  ``samkv_recompute="anchors"``).
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from redknot.kernels.block_scores import block_scores
from redknot.kernels.rope_reference import delta_cos_sin, rotate_by
from redknot.recovery.samkv.layout import cut_document
from redknot.recovery.samkv.query import personalized_queries


@dataclass(frozen=True)
class ServedDoc:
    """One hit document: at ``source`` in the client's prompt, at ``start`` in the served one."""

    source: int
    start: int
    num_tokens: int  # the document's tokens (its stored segment)
    init: int  # anchor tokens at its start
    num_blocks: int  # middle blocks M
    kept_blocks: int  # middle blocks every layer keeps
    block: int
    namespace: str
    segment_id: str

    @property
    def middle_end(self) -> int:
        """Offset of the local anchors in the document."""
        return self.init + self.num_blocks * self.block

    @property
    def local(self) -> int:
        return self.num_tokens - self.middle_end

    @property
    def slots(self) -> int:
        """Middle rows the document holds in the served prompt."""
        return self.kept_blocks * self.block

    @property
    def served_tokens(self) -> int:
        return self.init + self.slots + self.local

    def served_offsets(self) -> np.ndarray:
        """The document offset each served row holds before any layer chose (the first
        ``kept_blocks`` blocks in the middle slots: what the rows' token ids are)."""
        return np.concatenate([
            np.arange(self.init + self.slots), np.arange(self.middle_end, self.num_tokens)
        ]).astype(np.int64)  # fmt: skip


@dataclass(frozen=True)
class ServedPlan:
    """How a request is served: ``docs`` in prompt order; ``prompt_tokens`` of the client's
    prompt, ``served_tokens`` of the served one; ``note``: why nothing is dropped, if so."""

    prompt_tokens: int
    docs: tuple[ServedDoc, ...]
    served_tokens: int
    note: str | None = None

    @property
    def dropped(self) -> int:
        return self.prompt_tokens - self.served_tokens

    @property
    def sequence_ratio(self) -> float:
        """KV rows the documents hold / their prompt tokens."""
        held = sum(d.served_tokens for d in self.docs)
        return held / max(1, sum(d.num_tokens for d in self.docs))

    def report(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "served_tokens": self.served_tokens,
            "documents": len(self.docs),
            "kept_blocks": [d.kept_blocks for d in self.docs],
            "blocks": [d.num_blocks for d in self.docs],
            "sequence_ratio": round(self.sequence_ratio, 4),
            "note": self.note,
        }


@dataclass(frozen=True)
class SamkvKnobs:
    block: int
    budget: float
    init_blocks: int
    local_blocks: int
    bias: bool
    min_tokens: int = 0  # a request's hit documents must hold this many tokens to be cut

    @classmethod
    def of(cls, config) -> SamkvKnobs:
        """The ``--redknot-samkv-*`` options of a ``redknot.config.RedknotConfig``."""
        return cls(
            config.samkv_block, config.samkv_budget, config.samkv_init_blocks,
            config.samkv_local_blocks, config.samkv_bias == "on", config.samkv_min_tokens,
        )  # fmt: skip


def plan_documents(
    prompt_tokens: int, hits: Sequence[tuple[int, int, str, str]], knobs: SamkvKnobs
) -> ServedPlan:
    """The served prompt of a request of ``prompt_tokens`` whose hit documents are ``hits``:
    ``(start, num_tokens, namespace, segment_id)`` each, not overlapping.

    A document too short for a middle block is kept whole; with no question after the last
    document every block is kept (the choice needs the question's queries; ``note`` says so)."""
    hits = sorted(hits)
    note = None
    last_end = max(s + n for s, n, _, _ in hits)
    whole = last_end >= prompt_tokens
    if whole:
        note = "the prompt ends inside a document: no question to choose blocks, all kept"
    docs, shift = [], 0
    for start, n, namespace, seg_id in hits:
        cut = cut_document(0, 0, n, block=knobs.block, init_blocks=knobs.init_blocks,
                           local_blocks=knobs.local_blocks)  # fmt: skip
        m = cut.num_blocks
        kept = m if whole else min(m, math.ceil(knobs.budget * m - 1e-9))
        doc = ServedDoc(start, start - shift, n, cut.init, m, kept, knobs.block, namespace, seg_id)
        shift += n - doc.served_tokens
        docs.append(doc)
    if note is None and shift == 0:
        if any(d.num_blocks for d in docs):
            note = "the budget keeps every middle block: nothing to drop"
        else:
            note = "no document has a middle block to drop (too short for the block size)"
    return ServedPlan(prompt_tokens, tuple(docs), prompt_tokens - shift, note)


def served_ids(ids: Sequence[int], plan: ServedPlan) -> array:
    """The served prompt's token ids: each document's anchors and its first ``kept_blocks``
    blocks (the middle rows' ids stand for whatever a layer chose there; no layer computes
    them), everything else as it is. One gather in NumPy (a 32K prompt is cut in the
    scheduler's loop)."""
    if isinstance(ids, array) and ids.typecode == "q":
        src = np.frombuffer(ids, dtype=np.int64)
    else:
        src = np.asarray(ids, dtype=np.int64)
    parts, at = [], 0
    for doc in plan.docs:
        parts += [np.arange(at, doc.source), doc.served_offsets() + doc.source]
        at = doc.source + doc.num_tokens
    parts.append(np.arange(at, src.size))
    out = array("q")
    out.frombytes(src[np.concatenate(parts).astype(np.int64)].tobytes())
    assert len(out) == plan.served_tokens, (len(out), plan.served_tokens)
    return out


@dataclass
class LayerInputs:
    """What every layer's choice reads for one extend batch, built once when it is planned
    (tensors on the device; ``C`` middle blocks of ``Dn`` documents of ``B`` requests).

    | field          | shape      | meaning                                                  |
    | -------------- | ---------- | -------------------------------------------------------- |
    | ``question``   | [Q]        | rows of a layer's ``q`` that are question rows           |
    | ``question_req`` | [Q]      | their request                                            |
    | ``local``      | [A]        | rows of ``q`` that are local anchors                     |
    | ``local_doc``  | [A]        | their document                                           |
    | ``q_turn``     | 2 x [Q + A, r/2] | cos, sin turning the ``question`` then the ``local`` rows back to position 0 |
    | ``block_rows`` | [C, block] | segment-region rows of every middle block, documents in order |
    | ``k_turn``     | 2 x [C * block, r/2] | cos, sin turning every middle token back to position 0 (from its offset in its document, as stored) |
    | ``block_doc``  | [C]        | each block's document                                    |
    | ``doc_request``| [Dn]       | each document's request (``doc_request_cpu`` on the host) |
    | ``block_first``| Dn + 1     | (host) first block of each document, then ``C``          |
    | ``kept_cpu``   | Dn         | (host) blocks each document keeps                        |
    """

    question: Tensor
    question_req: Tensor
    local: Tensor
    local_doc: Tensor
    q_turn: tuple[Tensor, Tensor]
    block_rows: Tensor
    k_turn: tuple[Tensor, Tensor]
    block_doc: Tensor
    doc_request: Tensor
    doc_request_cpu: list[int]
    block_first: list[int]
    kept_cpu: list[int]
    num_requests: int
    bias: bool
    question_count: Tensor  # [B] float32: question rows of each request
    local_count: Tensor  # [Dn] float32: local anchors of each document (at least 1)
    block_first_gpu: Tensor  # [Dn] int64: block_first without its end
    kept_gpu: Tensor  # [Dn] int64: kept_cpu
    is_neox: bool  # the model's rotation pairs (SGLang's rotary embedding)


def turn_back(positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin ``[R, r/2]`` float32 of the rotation from ``positions`` ``[R]`` back to 0
    (``cos_sin``: SGLang's ``cos_sin_cache``): the same in every layer, so built once."""
    return delta_cos_sin(positions, torch.zeros_like(positions), cos_sin)


def layer_choice(q: Tensor, region_k: Tensor, inputs: LayerInputs, reduce=None) -> Tensor:
    """One layer's choice: ``[S]`` int64 indices into ``inputs.block_rows.flatten()`` of the
    tokens the middle slots hold, documents in order, each one's blocks in order.

    ``q``: the layer's queries of the rows it computes ``[T, Hq, d]`` (rotated at their
    positions); ``region_k``: the segment region's keys of the layer ``[rows, H, d]`` (every
    head, stored at positions from 0 in each segment); ``reduce``: a sum over tensor-parallel
    ranks of the block scores (each rank holds some heads). No host synchronisation."""
    rows = torch.cat([inputs.question, inputs.local])
    return choice_of(q[rows], region_k, inputs.block_rows.flatten(), inputs, reduce)


def choice_of(
    q_rows: Tensor, keys: Tensor, key_rows: Tensor, inputs: LayerInputs, reduce=None
) -> Tensor:
    """:func:`layer_choice` from the rows it reads: ``q_rows`` ``[Q + A, Hq, d]``, the layer's
    queries of the question then the local anchors; ``keys[key_rows]``, the keys of every middle
    token, blocks in order (``keys``: ``[rows, H, d]``)."""
    hq, d = q_rows.shape[1], q_rows.shape[2]
    free = rotate_by(q_rows, *inputs.q_turn, is_neox=inputs.is_neox)  # [Q + A, Hq, d]
    nq = inputs.question.numel()
    generic = torch.zeros(inputs.num_requests, hq, d, device=q_rows.device)
    generic.index_add_(0, inputs.question_req, free[:nq])
    generic /= inputs.question_count[:, None, None]
    num_docs = inputs.doc_request.numel()
    queries = generic[inputs.doc_request]  # [Dn, Hq, d]
    if inputs.bias:
        local = torch.zeros(num_docs, hq, d, device=q_rows.device)
        local.index_add_(0, inputs.local_doc, free[nq:])
        local /= inputs.local_count[:, None, None]
        queries = biased(queries, local, inputs)
    h = keys.shape[1]
    per_kv = queries.view(num_docs, h, hq // h, d).sum(dim=2)  # [Dn, H, d]
    score = block_scores(keys, key_rows, *inputs.k_turn, per_kv, inputs.block_doc,
                         inputs.block_rows.shape[1], is_neox=inputs.is_neox)  # fmt: skip
    if reduce is not None:
        score = reduce(score)
    return chosen_tokens(score, inputs)


def biased(queries: Tensor, local: Tensor, inputs: LayerInputs) -> Tensor:
    """Eq. 1 within each request: its documents' personalized queries (``queries``: each
    document's request's generic query ``[Dn, Hq, d]``; ``local``: pooled local queries)."""
    out = queries.clone()
    for r in range(inputs.num_requests):  # documents are grouped by request, in order
        mine = [i for i, req in enumerate(inputs.doc_request_cpu) if req == r]
        if len(mine) > 1:
            a, b = mine[0], mine[-1] + 1
            out[a:b] = personalized_queries(queries[a][None], local[a:b][:, None])[:, 0]
    return out


def chosen_tokens(score: Tensor, inputs: LayerInputs) -> Tensor:
    """From block scores ``[C]``: each document's ``kept`` best blocks (ties: the earlier
    block), as token indices into ``block_rows.flatten()``, documents and blocks in order."""
    nb, block = inputs.block_rows.shape
    # best first, then grouped by document (stable sorts: ties stay in block order)
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.sort(inputs.block_doc[order], stable=True).indices]
    doc = inputs.block_doc[order]
    rank = torch.arange(nb, device=score.device) - inputs.block_first_gpu[doc]
    keep = torch.zeros(nb, dtype=torch.bool, device=score.device)
    keep[order] = rank < inputs.kept_gpu[doc]
    blocks = torch.nonzero_static(keep, size=sum(inputs.kept_cpu))[:, 0]
    return (blocks[:, None] * block + torch.arange(block, device=score.device)).flatten()


@dataclass
class BatchChoice:
    """An extend batch's SamKV choice: the layer inputs, and where each layer's chosen tokens
    go among the reads that left recovery (``slot_index`` ``[S]`` into them), with the region
    rows and segment offsets of every middle token (``flat_rows``, ``flat_pos``, ``[C * block]``,
    indexed by :func:`layer_choice`'s result)."""

    inputs: LayerInputs
    slot_index: Tensor
    flat_rows: Tensor
    flat_pos: Tensor
    replay: ChoiceReplay | None = None  # the batch's choice as a CUDA graph, once captured


def plan_batch(
    uses: Sequence[Sequence], prefix: Sequence[int], lens: Sequence[int], keep: Tensor,
    read_tokens: Tensor, leaving: Tensor, bias: bool, cos_sin: Tensor, is_neox: bool, device,
) -> tuple[BatchChoice | None, list[int]]:  # fmt: skip
    """The choice of one extend batch, on the host then moved once (None: no request of it
    chooses), and the requests (batch index) skipped. ``uses[b]``: request ``b``'s segment
    uses (``redknot.segcache.reuse.SegmentUse``, SamKV's carry ``doc``); ``prefix``/``lens``:
    its extend; ``keep``: ``[T]`` bool, the batch rows computed (a layer's ``q`` holds them, in
    order); ``read_tokens``: ``[R]`` batch rows of the reads; ``leaving``: ``[R]`` bool, the
    reads that left recovery; ``cos_sin``, ``is_neox``: the model's rotary embedding (SGLang's
    ``cos_sin_cache``).

    A request chooses when this extend holds its documents and its question (anything else,
    a prefix hit inside a document or a chunk, keeps the first blocks the prompt was cut with:
    skipped)."""
    held_index = torch.cumsum(keep.to(torch.int64), 0) - 1  # batch row -> row of q
    question, question_req, local, local_doc, positions_q, positions_l = [], [], [], [], [], []
    block_rows, block_pos, block_doc, doc_request, block_first, kept = [], [], [], [], [0], []
    slot_rows: list[np.ndarray] = []  # batch rows of the chosen docs' middle slots
    skipped, offset, nreq = [], 0, 0
    for b, (mine, p, e) in enumerate(zip(uses, prefix, lens)):
        docs = [u for u in mine if getattr(u, "doc", None) is not None]
        if docs:
            whole = docs[-1].start + docs[-1].doc.served_tokens >= p + e
            # p + e past the prompt: a retracted request's prefill again, its output included
            if p > docs[0].start or p + e < docs[0].prompt_len or whole:
                skipped.append(b)
            else:
                q_rows = np.arange(docs[-1].start + docs[-1].doc.served_tokens, p + e)
                question.append(q_rows - p + offset)
                question_req.append(np.full(q_rows.size, nreq))
                positions_q.append(q_rows)
                for u in docs:
                    d = u.doc
                    if d.num_blocks == 0:
                        continue
                    di = len(doc_request)
                    lo = u.start + d.init + d.slots
                    l_rows = np.arange(lo, lo + d.local)
                    local.append(l_rows - p + offset)
                    local_doc.append(np.full(l_rows.size, di))
                    positions_l.append(l_rows)
                    offs = d.init + np.arange(d.num_blocks * d.block)
                    block_rows.append(u.entry.rows_of(offs).reshape(d.num_blocks, d.block))
                    block_pos.append(d.init + np.arange(d.num_blocks) * d.block)
                    block_doc.append(np.full(d.num_blocks, di))
                    doc_request.append(nreq)
                    block_first.append(block_first[-1] + d.num_blocks)
                    kept.append(d.kept_blocks)
                    slot_rows.append(np.arange(u.start + d.init, u.start + d.init + d.slots)
                                     - p + offset)  # fmt: skip
                nreq += 1
        offset += e
    if not doc_request:
        return None, skipped
    cat = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64))
    rows_q = held_index[cat(question + local)]
    nq = sum(x.size for x in question)
    chosen_rows = cat(slot_rows)
    left_tokens = read_tokens[leaving]  # batch rows of the reads that left, in their order
    slot_index = torch.nonzero(torch.isin(left_tokens, chosen_rows)).squeeze(1)
    assert slot_index.numel() == chosen_rows.numel(), "a chosen slot did not leave recovery"
    to = lambda x: x.to(device, non_blocking=True)
    rows_all = cat(block_rows)  # [C, block]
    flat_pos = to((cat(block_pos)[:, None] + torch.arange(rows_all.shape[1])).flatten())
    inputs = LayerInputs(
        question=to(rows_q[:nq]), question_req=to(cat(question_req)), local=to(rows_q[nq:]),
        local_doc=to(cat(local_doc) if local_doc else torch.zeros(0, dtype=torch.int64)),
        q_turn=turn_back(to(cat(positions_q + positions_l)), cos_sin), block_rows=to(rows_all),
        k_turn=turn_back(flat_pos, cos_sin), block_doc=to(cat(block_doc)),
        doc_request=to(torch.tensor(doc_request)), doc_request_cpu=doc_request,
        block_first=block_first, kept_cpu=kept, num_requests=nreq, bias=bias,
        question_count=to(_counts(question)), local_count=to(_counts(local)),
        block_first_gpu=to(torch.tensor(block_first[:-1])), kept_gpu=to(torch.tensor(kept)),
        is_neox=is_neox,
    )  # fmt: skip
    return BatchChoice(inputs, to(slot_index), to(rows_all.flatten()), flat_pos), skipped


class ChoiceReplay:
    """One extend batch's choice replayed as a CUDA graph: its first layer runs
    :func:`choice_of` eagerly and captures it, every later layer copies its queries' rows and
    its middle tokens' keys into the graph's inputs and replays it. The choice is some sixty
    small launches whose inputs are the same in every layer but those two, so the graph turns
    about 2.6 ms of host time a layer into three launches (``benchmarks/results/archive``:
    ``profile_samkv_graph_8192x8_bf2a679.json`` against ``profile_samkv_eager_8192x8_c27f4d6``).
    Each capture takes memory of its own graph pool (the profile shows its ``cudaMalloc`` calls,
    1.8-3.4 ms a request): a pool shared by the batches' graphs would reuse it (not built).
    Returns the region rows and segment offsets of the tokens the middle slots hold."""

    def __init__(self, choice: BatchChoice):
        inputs = choice.inputs
        self.choice = choice
        self.rows = torch.cat([inputs.question, inputs.local])
        self.block_rows = inputs.block_rows.flatten()
        self.key_rows = torch.arange(self.block_rows.numel(), device=self.block_rows.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.q_rows = self.keys = None
        self.out: tuple[Tensor, Tensor] | None = None

    def _run(self) -> tuple[Tensor, Tensor]:
        idx = choice_of(self.q_rows, self.keys, self.key_rows, self.choice.inputs)
        return self.choice.flat_rows[idx], self.choice.flat_pos[idx]

    def __call__(self, q: Tensor, region_k: Tensor) -> tuple[Tensor, Tensor]:
        if self.graph is not None:
            torch.index_select(q, 0, self.rows, out=self.q_rows)
            torch.index_select(region_k, 0, self.block_rows, out=self.keys)
            self.graph.replay()
            return self.out
        self.q_rows = q.index_select(0, self.rows)
        self.keys = region_k.index_select(0, self.block_rows)
        here = torch.cuda.current_stream(q.device)
        side = _capture_stream(q.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            first = self._run()  # this layer's choice, and the warm-up capture asks for
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.out = self._run()
            finally:
                graph.capture_end()
        here.wait_stream(side)
        for t in first:  # made on the side stream, read on this one
            t.record_stream(here)
        self.graph = graph
        return first


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream choices are captured on, one per device: a capture needs a stream other than
    the current one, and taking a new one from PyTorch's pool of 32 for every batch would in
    time capture on a pooled stream that other code also uses."""
    return torch.cuda.Stream(device)


def _counts(parts: list[np.ndarray]) -> Tensor:
    """Rows of each group (at least 1, so that an empty group's mean is zero), float32."""
    return torch.tensor([max(1, p.size) for p in parts], dtype=torch.float32)
