"""What a policy computed in one prefill, layer by layer: the counts FLOPs are derived from
(:mod:`redknot.recovery.flops`) and the recomputed fractions.

Counted is what the policy needs computed, not what the reference runner happens to compute
(it projects Q/K/V for every row and then overwrites reused KV; a serving kernel does not).

| per layer field       | meaning                                                             |
| --------------------- | ------------------------------------------------------------------- |
| ``classes``           | head classes used (after restore)                                   |
| ``attention_rows``    | rows that computed attention (every query head) and the output projection |
| ``kv_rows``           | per KV head: rows whose K and V were projected (not taken from a cache) |
| ``pairs_global`` / ``pairs_local`` | (query row, visible key) pairs, summed over query heads of each class |
| ``ffn_rows``          | rows that ran the FFN                                               |
| ``probe_pairs``       | (probed query, key) pairs scored for importance or restore, over query heads |
| ``realigned``         | (row, KV head) cached keys rotated to a new position                |
| ``compared``          | (row, KV head) cached KV compared with the fresh KV (CacheBlend's deviation) |
| ``segment_*``         | the same, restricted to segment rows (for the recomputed fractions) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from redknot.headmap import LOCAL


def visible_keys(positions: Tensor, *, local: bool, window: int, sink: int) -> int:
    """Sum over query ``positions`` of the keys a head of that class sees (causal; local:
    sink + window, as :func:`redknot.reference.attention.visible`)."""
    p = positions.to(torch.int64)
    if not local:
        return int((p + 1).sum())
    in_sink = torch.clamp(p + 1, max=sink)
    band_start = torch.clamp(p - window + 1, min=sink)
    in_band = torch.clamp(p - band_start + 1, min=0)
    return int((in_sink + in_band).sum())


@dataclass
class LayerRecord:
    classes: str
    attention_rows: int
    kv_rows: list[int]
    pairs_global: int
    pairs_local: int
    ffn_rows: int
    probe_pairs: int = 0
    realigned: int = 0
    compared: int = 0
    segment_attention_rows: int = 0
    segment_kv_rows: int = 0  # summed over KV heads
    segment_ffn_rows: int = 0


@dataclass
class PrefillRecord:
    """The prefill of one request: ``num_rows`` prompt tokens of which ``prefix_len`` came from
    an exact-prefix hit and ``segment_rows`` from reused segments; ``logits_rows`` rows went
    through the LM head."""

    num_rows: int
    prefix_len: int
    segment_rows: int
    num_kv_heads: int
    logits_rows: int = 1
    layers: list[LayerRecord] = field(default_factory=list)

    @property
    def computed_rows(self) -> int:
        return self.num_rows - self.prefix_len

    def fractions(self) -> dict[str, float | None]:
        """Recomputed fractions over (layer, segment token) pairs: ``attention`` (attention
        computed for the token), ``ffn`` (FFN run for it, the *recomputed-token fraction*),
        and ``kv_heads`` over (layer, KV head, segment token) triples (KV projected rather than
        reused, the *recomputed-head fraction*). ``None`` without segment rows."""
        n = self.segment_rows * len(self.layers)
        if n == 0:
            return {"attention": None, "ffn": None, "kv_heads": None}
        return {
            "attention": sum(r.segment_attention_rows for r in self.layers) / n,
            "ffn": sum(r.segment_ffn_rows for r in self.layers) / n,
            "kv_heads": sum(r.segment_kv_rows for r in self.layers) / (n * self.num_kv_heads),
        }

    def restored_heads(self, map_classes: tuple[str, ...]) -> int:
        """(layer, KV head) pairs that were local in the map and ran global."""
        return sum(
            1
            for rec, base in zip(self.layers, map_classes)
            for c, b in zip(rec.classes, base)
            if b == LOCAL and c != LOCAL
        )
