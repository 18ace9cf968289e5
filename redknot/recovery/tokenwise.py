"""Token-level recovery, the shape CacheBlend, EPIC and SparseX share: one decision per token
for every head at once (RedKnot §3.1), taken once per request.

In the layer :attr:`TokenRecovery.select_layer` the policy picks the segment rows to
recompute (:meth:`TokenRecovery.select`); from layer :attr:`TokenRecovery.sparse_from` on,
only the *kept* rows are computed:

| rows                                        | layers ``< sparse_from``  | layers ``>= sparse_from``        |
| ------------------------------------------- | ------------------------- | -------------------------------- |
| new (non-segment) rows and the last row     | computed                  | computed (attention, KV, FFN)    |
| selected segment rows                       | computed                  | computed (attention, KV, FFN)    |
| other segment rows                          | computed                  | cached, aligned KV in every head; no attention, no FFN |

The last row is always kept: its logits are read. The selection runs in the policy's
``restore_classes`` hook, the point where the runner hands over this layer's fresh ``q``,
``K`` and ``V`` (before attention); token-level policies never change head classes. Every
head is global (no head map). When ``sparse_from`` is past the last layer nothing is
selected: the policy is a dense prefill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from redknot.recovery.base import ReusePolicy
from redknot.reference import AttentionProbe, LayerContext


class TokenRecovery(ReusePolicy):
    """Base of the token-level policies; subclasses set the two layers and :meth:`select`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keep: Tensor | None = None  # [T] bool over the prefill rows, once selected
        self.selected: Tensor | None = None  # [K] int64 ascending: the chosen segment rows

    @property
    def select_layer(self) -> int:
        """The layer whose fresh ``q`` / ``K`` / ``V`` the selection reads."""
        return 0

    @property
    def sparse_from(self) -> int:
        """The first layer that computes only the kept rows."""
        return 0

    def select(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """``[K]`` int64 ascending segment rows (of this call) to recompute above
        ``sparse_from``. ``q``: ``[Hq, T, d]``; ``keys`` / ``values``: ``[Hkv, past_len + T,
        d]``, fresh (before any cached KV is served in this layer)."""
        raise NotImplementedError

    # ---- helpers ---------------------------------------------------------------------------

    def always_kept(self, ctx: LayerContext) -> Tensor:
        """``[T]`` bool: new rows and the last row."""
        always = ~self._segment_mask(ctx)
        always[-1] = True
        return always

    def _sparse(self, ctx: LayerContext) -> bool:
        return self.keep is not None and ctx.layer >= self.sparse_from and self.is_prefill(ctx)

    def _kept_rows(self, ctx: LayerContext) -> Tensor | None:
        if not self._sparse(ctx) or bool(self.keep.all()):
            return None
        return torch.nonzero(self.keep).flatten()

    # ---- hooks -----------------------------------------------------------------------------

    def restore_classes(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> str:
        if (
            self.keep is None
            and self.served.segments
            and self.is_prefill(ctx)
            and ctx.layer == self.select_layer
            and self.sparse_from < self.shape.num_layers
        ):
            self.selected = self.select(ctx, q, keys, values)
            keep = self.always_kept(ctx)
            keep[self.selected] = True
            self.keep = keep
        return ctx.classes

    def edit_kv(self, ctx: LayerContext, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if not self._sparse(ctx) or bool(self.keep.all()):
            return keys, values
        return self.cached_kv(ctx, keys, values, self.every_kv_head, ~self.keep)

    def choose_attention_rows(self, ctx: LayerContext) -> Tensor | None:
        return self._kept_rows(ctx)

    def choose_ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        return self._kept_rows(ctx)
