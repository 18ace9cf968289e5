"""The limits recovery is compared against.

| policy  | segment rows                                                          | head map |
| ------- | --------------------------------------------------------------------- | -------- |
| ``full``  | nothing reused: the whole prompt is prefilled densely                 | none (dense) |
| ``headclass`` | nothing reused: the whole prompt is prefilled under the head map  | the map  |
| ``naive`` | every head of every layer takes the cached KV, RoPE-aligned; no attention, no FFN | none (dense) |

``headclass`` is what head-aware policies (``redknot``, ``redknot+sparseq``) converge to when they
recompute everything: its distance from ``full`` is the head map's own error, which no recovery
under that map can remove.

``naive`` is the standard token-level "naive reuse" baseline of position-independent caching
(CacheBlend, EPIC): only new tokens are computed, attending the concatenated cached KV. Both
run every head global; ``full`` is also the dense reference of the fidelity evaluation.
"""

from __future__ import annotations

from torch import Tensor

from redknot.recovery.base import ReusePolicy
from redknot.recovery.prompt import ReusePrompt
from redknot.reference import AttentionProbe, LayerContext


class FullPrefill(ReusePolicy):
    """Dense prefill of every token; records what it computed."""

    name = "full"

    @property
    def served(self) -> ReusePrompt:
        return self.prompt.without_reuse()


class HeadClassPrefill(FullPrefill):
    """Prefill of every token under the head map (local heads: sink + window), no reuse."""

    name = "headclass"
    knobs = ("global_fraction", "window", "sink")
    uses_head_map = True


class NaiveReuse(ReusePolicy):
    """Reuse everything cached, recompute nothing of it."""

    name = "naive"

    def reused_heads(self, ctx: LayerContext) -> list[int]:
        return self.every_kv_head

    def choose_attention_rows(self, ctx: LayerContext) -> Tensor | None:
        return self.new_rows(ctx) if self.served.segments else None

    def choose_ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        return self.new_rows(ctx) if self.served.segments else None
