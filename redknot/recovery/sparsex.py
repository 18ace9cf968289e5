"""SparseX as a token-level policy (``sparsex``, SparseX §3.2-3.4 and Algorithm 1): full
recomputation below a boundary layer, one sparse-Q selection, then only the selected set is
recomputed (selection rules in :mod:`~redknot.recovery.sparseq`).

| layers (0-based)              | what happens                                                   |
| ----------------------------- | -------------------------------------------------------------- |
| ``< sparseq_boundary``        | every token recomputed, full causal attention (Phase 1)        |
| ``sparseq_boundary - 1``      | the selection, from this layer's queries and keys (Phase 2: ``Q^{l*}``, ``K^{l*}`` of the last full layer) |
| ``>= sparseq_boundary``       | only ``I_nr | key | overflow | tail`` computed; the other segment tokens keep their cached, aligned KV in every head (Phase 3) |

``sparseq_boundary`` 0 is SparseX "without hybrid attention" (sparse from the first layer):
the selection then reads layer 0's queries against the aligned cached keys of the segments, and
layer 0 already computes only the selected set. A boundary at or past the last layer, or
``sparseq_k`` covering every row, is a dense prefill; ``sparseq_boundary`` 0 with ``sparseq_k``
and ``sparseq_block`` 0 on a prompt that ends with new text is naive reuse (plus the selection's
cost).

Cost of the selection (:mod:`~redknot.recovery.flops`): ``QK^T`` of every probed query over
its visible keys, every query head (``probe``). Every head is global (no head map).
"""

from __future__ import annotations

import torch
from torch import Tensor

from redknot.recovery.sparseq import SparseQSelection, select_tokens
from redknot.recovery.tokenwise import TokenRecovery
from redknot.reference import LayerContext

SPARSEQ_KNOBS = ("sparseq_boundary", "sparseq_k", "sparseq_block")


class SparseX(TokenRecovery):
    """The ``sparsex`` policy; knobs ``sparseq_boundary``, ``sparseq_k``, ``sparseq_block``."""

    name = "sparsex"
    knobs = SPARSEQ_KNOBS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.selection: SparseQSelection | None = None

    @property
    def select_layer(self) -> int:
        return max(self.options.sparseq_boundary - 1, 0)

    @property
    def sparse_from(self) -> int:
        return self.options.sparseq_boundary

    def select(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        if self.sparse_from == self.select_layer:  # sparse in this layer: keys as served
            keys, _ = self.cached_kv(
                ctx, keys.clone(), values.clone(), self.every_kv_head, record=False
            )
        opts = self.options
        selection = select_tokens(
            q,
            keys,
            self.segment_spans(ctx),
            past_len=ctx.past_len,
            classes=ctx.classes,
            window=ctx.window,
            sink=ctx.sink,
            scale=ctx.model.scale,
            k=opts.sparseq_k,
            block=opts.sparseq_block,
        )
        self.selection = selection
        self.add_probe_pairs(ctx, selection.probed, ctx.classes)
        return torch.nonzero(selection.recompute & self._segment_mask(ctx)).flatten()
