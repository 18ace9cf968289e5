"""SamKV as a policy of the reference path (``samkv``): multi-context KV sparsification with
local recomputation (SamKV §3). The request's KV for its documents holds only the anchors and
the selected blocks; the question is prefilled over that.

| step (paper)              | here                                                          |
| ------------------------- | ------------------------------------------------------------- |
| generic query (§3.1)      | the new text and the question prefilled over the prefix hit and the anchors of every document (cached, aligned); ``Q_que`` = mean of the question's queries per layer (:mod:`.query`) |
| personalized bias (Eq. 1) | local queries of each document (its last ``local`` tokens, prefilled over its own cache) added with ``abs(cos)`` weights (``samkv_bias``) |
| selection (Eq. 2-3)       | :mod:`.selection`                                              |
| recomputation (§3.3)      | :mod:`.forward` over the padded layout: anchors and high-attention kept tokens recomputed (``samkv_recompute``), ``overwrite`` or ``fusion`` (``samkv_update``) |
| answer                    | the question prefilled over the compacted KV, then greedy decoding (by the runner, with this policy's hooks) |

High-attention tokens: a kept middle token whose attention from its document's local queries
(in the document's own prefill, per layer, mean over query heads) exceeds the mean over the
document's middle tokens by ``samkv_outlier_sigma`` standard deviations (PauTa's criterion;
the paper's A.1 fits power laws to attention columns instead).

Positions: the sparse KV is dense in positions (row ``j`` at position ``P0 + j``), as the
server would hold it; the question follows it. With every block kept and every token
recomputed this is the dense prefill (tests). Every head is global; the head map is not used.

Fallbacks (logged, and listed in :attr:`SamKV.notes`): no cached document or nothing after the
last one (no question to select with) serve a dense prefill; one document gets no bias and
keeps what its own Top-P retrieves (single-context selection); a document too short for one
middle block is kept whole. A document that is not cached is new text to this policy: kept
whole and computed.

The per-document summaries (pooled local queries, attention of the local rows) belong to the
document, not to the request: they are computed once per cached segment and local size (kept
with the segment object) and not counted in a request's FLOPs, as a server would compute them
when it caches the document.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from redknot.headmap import GLOBAL
from redknot.recovery.base import ReusePolicy
from redknot.recovery.prompt import ReusePrompt, Segment
from redknot.recovery.record import LayerRecord
from redknot.recovery.samkv.forward import LayerCounts, SparseLayout, sparse_forward
from redknot.recovery.samkv.layout import DocumentBlocks, cut_document
from redknot.recovery.samkv.query import personalized_queries, pooled, position_free
from redknot.recovery.samkv.selection import (
    BlockSelection,
    block_keys,
    scores,
    select_blocks,
    token_max_scores,
)
from redknot.reference import (
    AttentionProbe,
    LayerContext,
    LayerHooks,
    ReferenceKV,
    ReferenceRunner,
)

logger = logging.getLogger(__name__)

# segment -> local rows -> (pooled local queries [N, Hq, d], attention received [N, n])
_SUMMARIES: weakref.WeakKeyDictionary[Segment, dict[int, tuple[Tensor, Tensor]]] = (
    weakref.WeakKeyDictionary()
)

SAMKV_KNOBS = (
    "samkv_block",
    "samkv_init_blocks",
    "samkv_local_blocks",
    "samkv_stable_layers",
    "samkv_stable_from",
    "samkv_bias",
    "samkv_budget",
    "samkv_recompute",
    "samkv_spread",
    "samkv_update",
    "samkv_block_score",
    "samkv_outlier_sigma",
)


@dataclass
class SamkvReport:
    """What SamKV did with one request's documents.

    | field            | meaning                                                         |
    | ---------------- | --------------------------------------------------------------- |
    | ``docs``         | how each document was cut                                       |
    | ``selection``    | the kept blocks (``None`` on a dense fallback)                  |
    | ``doc_tokens``   | prompt tokens of the reused documents                           |
    | ``kept_tokens``  | of them, KV rows held per layer (the same in every layer)       |
    | ``recomputed``   | per layer, document tokens whose KV was recomputed              |
    | ``computed``     | per layer, document tokens that ran attention and FFN           |
    | ``block_scores`` | per document, every layer's middle-block scores ``[N, M_i]``    |
    | ``queries``      | the documents' (personalized) queries ``[D, N, Hq, d]``, position-free |
    """

    docs: list[DocumentBlocks] = field(default_factory=list)
    selection: BlockSelection | None = None
    doc_tokens: int = 0
    kept_tokens: int = 0
    recomputed: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    block_scores: list[Tensor] = field(default_factory=list)  # per document [N, M_i] (A.2)
    queries: Tensor | None = None

    def fractions(self, num_layers: int) -> dict[str, float | None]:
        """``sequence_ratio`` (KV rows held / document tokens), ``recompute_ratio`` (recomputed
        (layer, document token) pairs / all of them, also ``kv_heads``: every head alike) and
        ``attention`` / ``ffn`` (pairs that ran them)."""
        if not self.doc_tokens:
            return {"attention": None, "ffn": None, "kv_heads": None}
        pairs = num_layers * self.doc_tokens
        recompute = sum(self.recomputed) / pairs
        computed = sum(self.computed) / pairs
        return {
            "attention": computed,
            "ffn": computed,
            "kv_heads": recompute,
            "sequence_ratio": self.kept_tokens / self.doc_tokens,
            "recompute_ratio": recompute,
        }


class _LocalQueries(LayerHooks):
    """Pools the queries of every layer of one forward (all rows probed)."""

    def __init__(self, rope) -> None:
        self.rope = rope
        self.queries: list[Tensor] = []

    def restore_classes(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> str:
        self.queries.append(pooled(self.rope, q, ctx.positions))
        return ctx.classes

    def probe_rows(self, ctx: LayerContext) -> Tensor | None:
        return torch.arange(ctx.num_rows, device=ctx.positions.device)


class SamKV(ReusePolicy):
    """The ``samkv`` policy; knobs ``samkv_*`` (see :class:`RecoveryOptions`)."""

    name = "samkv"
    knobs = SAMKV_KNOBS

    def __init__(self, *args, **kwargs) -> None:
        self.notes: list[str] = []
        super().__init__(*args, **kwargs)
        self.report = SamkvReport()
        self._question_past: int | None = None

    # ---- what is served --------------------------------------------------------------------

    @property
    def dense(self) -> bool:
        """Whether this request falls back to a dense prefill (see the module docstring)."""
        prompt = self.prompt
        return not prompt.segments or prompt.question_start >= prompt.num_rows

    @property
    def served(self) -> ReusePrompt:
        return self.prompt.without_reuse() if self.dense else self.prompt

    def note(self, reason: str) -> None:
        self.notes.append(reason)
        logger.info("samkv: %s", reason)

    def prepare(self, runner: ReferenceRunner) -> tuple[list[int], ReferenceKV | None]:
        prompt = self.served
        if self.dense:
            self.note(
                "no cached document in the prompt: dense prefill"
                if not self.prompt.segments
                else "nothing follows the last document (no question to select with): dense "
                "prefill"
            )
            return list(prompt.ids[prompt.prefix_len :]), prompt.prefix
        opts = self.options
        docs = [
            cut_document(
                i, s.start, s.end, block=opts.samkv_block,
                init_blocks=opts.samkv_init_blocks, local_blocks=opts.samkv_local_blocks,
            )
            for i, s in enumerate(prompt.segments)
        ]  # fmt: skip
        for d in docs:
            if not d.sparsifiable:
                self.note(f"document {d.index} ({d.length} tokens) is too short for one middle "
                          f"block of {d.block} tokens: kept whole")  # fmt: skip
        if len(docs) == 1:
            self.note("one document: no personalized bias, single-context selection")
        self.report = SamkvReport(docs=docs, doc_tokens=sum(d.length for d in docs))
        m = runner.model
        generic = self._generic_query(m, docs)
        need_local = (opts.samkv_bias and len(docs) > 1) or opts.samkv_recompute == "selective"
        local, mass = self._local_summaries(runner, docs) if need_local else (None, None)
        if opts.samkv_bias and local is not None and len(docs) > 1:
            queries = personalized_queries(generic, local)
        else:
            queries = generic.expand(len(docs), *generic.shape)
        self.report.queries = queries
        selection = self._select(m, docs, queries)
        self.report.selection = selection
        result_kv = self._recompute(m, docs, selection, mass)
        self._question_past = result_kv.length
        return list(prompt.ids[prompt.question_start :]), result_kv

    def fractions(self) -> dict[str, float | None]:
        if self.dense:
            out = self.record.fractions()
            return {**out, "sequence_ratio": 1.0 if self.prompt.segments else None,
                    "recompute_ratio": out["kv_heads"]}  # fmt: skip
        return self.report.fractions(self.shape.num_layers)

    # ---- the steps -------------------------------------------------------------------------

    def _rows(self, docs: list[DocumentBlocks]) -> tuple[Tensor, Tensor]:
        """``[R]`` document index (-1: new text) and offset of every row from the prefix to the
        question."""
        prompt = self.prompt
        n = prompt.question_start - prompt.prefix_len
        doc = torch.full((n,), -1, dtype=torch.int64)
        offset = torch.zeros(n, dtype=torch.int64)
        for d in docs:
            a, b = d.start - prompt.prefix_len, d.end - prompt.prefix_len
            doc[a:b] = d.index
            offset[a:b] = torch.arange(d.length)
        return doc, offset

    def _layout(
        self, m, docs, rows: Tensor, keep: Tensor, recompute: Tensor, extra_ids: list[int]
    ) -> SparseLayout:
        """A :class:`SparseLayout` of prompt ``rows`` (relative to the prefix; ``extra_ids``
        follow them, uncached) with the documents' cached KV aligned to the padded frame."""
        prompt = self.prompt
        doc_all, off_all = self._rows(docs)
        doc, off = doc_all[rows], off_all[rows]
        ids = [prompt.ids[prompt.prefix_len + int(r)] for r in rows] + list(extra_ids)
        t = len(ids)
        has_cache = torch.zeros(t, dtype=torch.bool)
        has_cache[: rows.numel()] = doc >= 0
        p0 = prompt.prefix_len
        hkv, hd = self.shape.num_kv_heads, self.shape.head_dim
        cached_k, cached_v = [], []
        device = m.device
        for layer in range(self.shape.num_layers):
            keys = torch.zeros(hkv, t, hd, dtype=m.dtype, device=device)
            values = torch.zeros_like(keys)
            for d in docs:
                where = torch.nonzero(doc == d.index).flatten()
                if not where.numel():
                    continue
                cache = prompt.segments[d.index].cache
                src = off[where].to(device)
                k = cache.keys[layer][:, src]
                keys[:, where] = m.rope.realign(k, src, where.to(device) + p0).to(m.dtype)
                values[:, where] = cache.values[layer][:, src].to(m.dtype)
            cached_k.append(keys)
            cached_v.append(values)
        return SparseLayout(
            torch.tensor(ids, dtype=torch.int64), keep, recompute, has_cache, cached_k, cached_v
        )

    def _generic_query(self, m, docs: list[DocumentBlocks]) -> Tensor:
        """``[N, Hq, d]``: the question prefilled over the anchors (and the new text)."""
        prompt = self.prompt
        doc, off = self._rows(docs)
        anchor = torch.ones_like(doc, dtype=torch.bool)
        for d in docs:
            sel = doc == d.index
            anchor[sel] = d.anchor_mask()[off[sel]]
        rows = torch.nonzero(anchor).flatten()
        question = list(prompt.ids[prompt.question_start :])
        t = rows.numel() + len(question)
        n_layers = self.shape.num_layers
        keep = torch.ones(n_layers, t, dtype=torch.bool)
        fresh = torch.ones(t, dtype=torch.bool)
        fresh[: rows.numel()] = doc[rows] < 0
        recompute = fresh[None].expand(n_layers, t).clone()
        layout = self._layout(m, docs, rows, keep, recompute, question)
        q_rows = torch.arange(rows.numel(), t, device=m.device)
        pooled_q: list[Tensor] = []

        question_q: list[Tensor] = []
        at_prompt = torch.arange(len(question), device=m.device) + prompt.question_start

        def capture(layer: int, q: Tensor, positions: Tensor) -> None:
            pooled_q.append(pooled(m.rope, q[:, q_rows], positions[q_rows]))
            if self.options.samkv_block_score == "attention":  # at their prompt positions
                q_float = q[:, q_rows].to(torch.float32)
                question_q.append(m.rope.realign(q_float, positions[q_rows], at_prompt))

        result = sparse_forward(m, layout, past=prompt.prefix, capture=capture)
        self._add_records(result.counts, probe_pairs=0)
        self._question_q = question_q  # per layer [Hq, T, d] at the prompt (``attention``)
        return torch.stack(pooled_q)

    def _local_summaries(
        self, runner: ReferenceRunner, docs: list[DocumentBlocks]
    ) -> tuple[Tensor, list[Tensor]]:
        """Per document: its local queries pooled (``[D, N, Hq, d]``) and the attention each of
        its tokens receives from them in its own prefill (``[N, n]``, mean over query heads)."""
        local, mass = [], []
        for d in docs:
            segment = self.prompt.segments[d.index]
            rows = max(d.local, 1)
            known = _SUMMARIES.setdefault(segment, {})
            if rows not in known:
                ids = list(self.prompt.ids[d.end - rows : d.end])
                hooks = _LocalQueries(runner.model.rope)
                out = runner.forward(
                    ids, hooks=hooks, past=segment.cache.rows(0, d.length - rows),
                    logits_rows="none", keep_kv=False,
                )  # fmt: skip
                attention = torch.stack([p.key_mass.mean(dim=0) for p in out.probes]).cpu()
                known[rows] = (torch.stack(hooks.queries), attention)
            local.append(known[rows][0])
            mass.append(known[rows][1])
        return torch.stack(local), mass

    def _select(self, m, docs: list[DocumentBlocks], queries: Tensor) -> BlockSelection:
        n_layers = self.shape.num_layers
        anchor_scores = torch.zeros(n_layers, len(docs))
        if self.options.samkv_block_score == "attention":
            block_scores = self._attention_scores(m, docs, anchor_scores)
        else:
            block_scores = self._key_scores(m, docs, queries, anchor_scores)
        self.report.block_scores = block_scores
        width, start = self.options.samkv_stable_layers, self.options.samkv_stable_from
        if start is not None and start + width > n_layers:
            raise ValueError(
                f"samkv_stable_from {start} + samkv_stable_layers {width} exceeds the model's "
                f"{n_layers} layers"
            )
        start = max(0, n_layers - width) if start is None else start
        stable = range(start, min(n_layers, start + width))
        return select_blocks(
            block_scores, anchor_scores, stable_layers=list(stable),
            budget=self.options.samkv_budget,
            per_document=self.options.samkv_spread == "document",
        )  # fmt: skip

    def _key_scores(self, m, docs: list[DocumentBlocks], queries: Tensor,
                    anchor_scores: Tensor) -> list[Tensor]:  # fmt: skip
        """``samkv_block_score`` ``mean`` (the paper) or ``token-max``: each document's blocks
        scored by its personalized query against their position-free keys. Fills
        ``anchor_scores`` and returns per document ``[N, M_i]``."""
        block_scores = []
        for d in docs:
            cache = self.prompt.segments[d.index].cache
            pos = torch.arange(d.length, device=m.device)
            per_layer = []
            for layer in range(self.shape.num_layers):
                if not d.sparsifiable:
                    per_layer.append(torch.zeros(0))
                    continue
                free = position_free(m.rope, cache.keys[layer], pos)
                if self.options.samkv_block_score == "token-max":
                    blocks, anchor = token_max_scores(queries[d.index, layer], free, d)
                    per_layer.append(blocks.cpu())
                    anchor_scores[layer, d.index] = anchor
                    continue
                blocks, anchor = block_keys(free, d)
                per_layer.append(scores(queries[d.index, layer], blocks).cpu())
                anchor_scores[layer, d.index] = float(
                    scores(queries[d.index, layer], anchor[:, None])[0]
                )
            block_scores.append(torch.stack(per_layer))
        return block_scores

    def _attention_scores(self, m, docs: list[DocumentBlocks], anchor_scores: Tensor) -> list:
        """``samkv_block_score="attention"`` (not the paper): per layer, the question's queries
        (from the anchors-only prefill) at their prompt positions against every document's
        cached keys at theirs, one softmax over all of them per query head and question token;
        a token's score is the attention it receives summed over heads and question tokens, a
        block's the mean over its tokens, the anchors' the mean over theirs. Fills
        ``anchor_scores`` and returns per document ``[N, M_i]``."""
        per_doc: list[list[Tensor]] = [[] for _ in docs]
        for layer in range(self.shape.num_layers):
            q = self._question_q[layer]  # [Hq, T, d] at the question's prompt positions
            group = q.shape[0] // self.shape.num_kv_heads
            logits = []
            for d in docs:
                cache = self.prompt.segments[d.index].cache
                pos = torch.arange(d.length, device=m.device)
                k = m.rope.realign(cache.keys[layer].to(torch.float32), pos, pos + d.start)
                k = k.repeat_interleave(group, dim=0)  # [Hq, n, d]
                logits.append(torch.einsum("htd,hnd->htn", q, k) / math.sqrt(q.shape[-1]))
            probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1).sum(dim=(0, 1))  # [sum n]
            for i, part in enumerate(torch.split(probs, [d.length for d in docs])):
                d = docs[i]
                if not d.sparsifiable:
                    per_doc[i].append(torch.zeros(0))
                    continue
                middle = part[d.init : d.middle_end].view(d.num_blocks, d.block).mean(dim=1)
                per_doc[i].append(middle.cpu())
                anchor_scores[layer, d.index] = float(part[d.anchor_mask().to(part.device)].mean())
        return [torch.stack(x) for x in per_doc]

    def _recompute(self, m, docs, selection: BlockSelection, mass) -> ReferenceKV:
        opts = self.options
        n_layers = self.shape.num_layers
        doc, off = self._rows(docs)
        r = doc.numel()
        keep = torch.zeros(n_layers, r, dtype=torch.bool)
        rec = torch.zeros(n_layers, r, dtype=torch.bool)
        new = doc < 0
        keep[:, new] = True
        rec[:, new] = True
        for d in docs:
            sel = torch.nonzero(doc == d.index).flatten()
            anchor = d.anchor_mask()[off[sel]]
            block = d.block_of()[off[sel]]
            kept = torch.zeros(n_layers, sel.numel(), dtype=torch.bool)
            kept[:, anchor] = True
            if d.sparsifiable:
                middle = ~anchor
                kept[:, middle] = selection.kept[d.index][:, block[middle]]
            keep[:, sel] = kept
            if opts.samkv_recompute == "all":
                rec[:, sel] = kept
            elif opts.samkv_recompute == "anchors":  # the server's rule
                chosen = torch.zeros_like(kept)
                chosen[:, anchor] = True
                rec[:, sel] = chosen
            elif opts.samkv_recompute == "selective":
                chosen = torch.zeros_like(kept)
                chosen[:, anchor] = True
                if d.sparsifiable:
                    chosen |= kept & self._outliers(d, mass[d.index])[:, off[sel]]
                rec[:, sel] = chosen
        rows = torch.nonzero(keep.any(dim=0)).flatten()
        layout = self._layout(m, docs, rows, keep[:, rows], rec[:, rows], [])
        result = sparse_forward(m, layout, past=self.prompt.prefix, update=opts.samkv_update)
        probes = self.shape.num_attention_heads * sum(
            d.num_blocks + 1 for d in docs if d.sparsifiable
        )
        if opts.samkv_block_score == "attention":  # every question token against every token
            question = len(self.prompt.ids) - self.prompt.question_start
            probes = self.shape.num_attention_heads * question * sum(d.length for d in docs)
        self._add_records(result.counts, probe_pairs=probes)
        is_doc = (doc >= 0)[rows]
        computed = layout.compute() & is_doc[None]
        report = self.report
        report.kept_tokens = int((keep[0] & (doc >= 0)).sum())
        report.recomputed = [int(x) for x in (rec & (doc >= 0)[None]).sum(dim=1)]
        report.computed = [int(x) for x in computed.sum(dim=1)]
        return result.kv

    def _outliers(self, d: DocumentBlocks, mass: Tensor) -> Tensor:
        """``[N, n]`` bool: middle tokens of ``d`` whose attention in their own document is a
        PauTa outlier (``> mean + sigma * std`` over the middle tokens, per layer)."""
        middle = mass[:, d.init : d.middle_end].to(torch.float64)
        out = torch.zeros(mass.shape, dtype=torch.bool)
        if middle.shape[1] < 2:
            return out
        limit = middle.mean(dim=1, keepdim=True) + self.options.samkv_outlier_sigma * middle.std(
            dim=1, keepdim=True
        )
        out[:, d.init : d.middle_end] = middle > limit
        return out

    def _add_records(self, counts: list[LayerCounts], *, probe_pairs: int) -> None:
        hkv = self.shape.num_kv_heads
        for c in counts:
            self.record.layers.append(
                LayerRecord(
                    classes=GLOBAL * hkv, attention_rows=c.attention_rows, kv_rows=[c.kv_rows] * hkv,
                    pairs_global=c.pairs, pairs_local=0, ffn_rows=c.attention_rows,
                    probe_pairs=probe_pairs, realigned=c.realigned, compared=c.compared,
                )
            )  # fmt: skip

    # ---- hooks of the question's prefill ---------------------------------------------------

    def is_prefill(self, ctx: LayerContext) -> bool:
        if self.dense:
            return super().is_prefill(ctx)
        return ctx.past_len == self._question_past

    def after_layer(self, ctx: LayerContext, hidden: Tensor, probe: AttentionProbe | None) -> None:
        if self.dense:
            return super().after_layer(ctx, hidden, probe)
        if not self.is_prefill(ctx):
            return
        self._layer = {}
        rows, hkv = ctx.num_rows, self.shape.num_kv_heads
        self.record.layers.append(
            LayerRecord(
                classes=ctx.classes, attention_rows=rows, kv_rows=[rows] * hkv,
                pairs_global=self.shape.num_attention_heads * int((ctx.positions + 1).sum()),
                pairs_local=0, ffn_rows=rows,
            )
        )  # fmt: skip
