"""Head classes and sparse-Q together (``redknot+sparseq``): the head map decides which heads
are recovered, SparseX's sparse-Q selection decides which tokens the global heads recompute in
the deep layers.

| layers                    | local heads (segment rows) | global heads                       | FFN            |
| ------------------------- | -------------------------- | ---------------------------------- | -------------- |
| ``< sparseq_boundary``    | cached, aligned KV         | every row recomputed               | every row      |
| ``>= sparseq_boundary``   | cached, aligned KV         | the sparse-Q set recomputed; other segment rows take the cached KV | the sparse-Q set |

As ``redknot`` (:mod:`~redknot.recovery.elastic`): RoPE alignment, local heads served from the
segment's cache (``local_kv``), adaptive restore (``restore_thresh``, ``restore_edge``,
``recent_n``), segments cached under the head map. In place of ``redknot``'s layer schedule
(``dense_layers``, ``mass_thresh``, ``skipped``), one selection in layer
``max(sparseq_boundary - 1, 0)`` by :func:`~redknot.recovery.sparseq.select_tokens`; a segment
row outside the selected set leaves recovery from the boundary on (``skipped="cached"``).

Choices of this combination: the scores sum the query heads of the *global* KV heads only (the
heads whose recomputation the selection drives; every head when a layer has none), over keys as
those heads attend them; the last row is always recomputed (its logits are read). The selection
costs ``QK^T`` of the probed queries over those heads (``probe``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from redknot.headmap import GLOBAL
from redknot.recovery.base import ReusePolicy
from redknot.recovery.elastic import ElasticRecovery
from redknot.recovery.sparseq import SparseQSelection, select_tokens
from redknot.recovery.sparsex import SPARSEQ_KNOBS
from redknot.reference import AttentionProbe, LayerContext


class ElasticSparseQ(ElasticRecovery):
    """The ``redknot+sparseq`` policy."""

    name = "redknot+sparseq"
    knobs = (
        "global_fraction",
        "window",
        "sink",
        "recent_n",
        "restore_thresh",
        "restore_edge",
        "local_kv",
        *SPARSEQ_KNOBS,
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.boundary = self.options.sparseq_boundary
        self.selection: SparseQSelection | None = None

    def restore_classes(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> str:
        classes = super().restore_classes(ctx, q, keys, values)
        if not (self.active and self.is_prefill(ctx)) or self.boundary >= self.shape.num_layers:
            return classes
        ctx = replace(ctx, classes=classes)
        if self.selection is None and ctx.layer == max(self.boundary - 1, 0):
            self.selection = self._select(ctx, q, keys, values)
        if self.selection is not None and ctx.layer >= self.boundary and self.frozen is None:
            frozen = self._segment_mask(ctx) & ~self.selection.recompute
            frozen[-1] = False
            self.frozen = frozen if bool(frozen.any()) else None
        return classes

    def _select(
        self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor
    ) -> SparseQSelection:
        scored = [h for h, c in enumerate(ctx.classes) if c == GLOBAL]
        scored = scored or list(range(len(ctx.classes)))
        served = set(self.reused_heads(ctx))
        if self.boundary == 0:  # sparse in this layer: the scored heads read the cache too
            served |= set(scored)
        if served:
            keys, _ = self.cached_kv(
                ctx, keys.clone(), values.clone(), sorted(served), record=False
            )
        group = self.shape.num_attention_heads // self.shape.num_kv_heads
        kv_index = torch.tensor(scored, device=q.device)
        q_index = (kv_index[:, None] * group + torch.arange(group, device=q.device)).flatten()
        classes = "".join(ctx.classes[h] for h in scored)
        opts = self.options
        selection = select_tokens(
            q.index_select(0, q_index),
            keys.index_select(0, kv_index),
            self.segment_spans(ctx),
            past_len=ctx.past_len,
            classes=classes,
            window=ctx.window,
            sink=ctx.sink,
            scale=ctx.model.scale,
            k=opts.sparseq_k,
            block=opts.sparseq_block,
        )
        self.add_probe_pairs(ctx, selection.probed, classes)
        return selection

    def choose_probe_rows(self, ctx: LayerContext) -> Tensor | None:
        return ReusePolicy.choose_probe_rows(self, ctx)  # no importance probe

    def choose_ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        return self.choose_attention_rows(ctx)
