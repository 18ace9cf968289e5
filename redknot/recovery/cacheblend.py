"""CacheBlend as a token-level policy (``cacheblend``): recompute the segment tokens whose KV
deviates most from their cache (CacheBlend, as described in RedKnot §2.1 and SparseX §3.4).

| layers                      | what happens                                                      |
| --------------------------- | ----------------------------------------------------------------- |
| ``<= blend_check_layer``    | every token recomputed (dense)                                    |
| ``== blend_check_layer``    | KV deviation of every segment token: its fresh K/V against its cached, aligned K/V; the ``round(blend_ratio * S)`` tokens of largest deviation are selected (``S``: segment tokens of the request, ranked together) |
| ``> blend_check_layer``     | only the selected tokens and the new text are computed; the others keep their cached KV in every head (:mod:`~redknot.recovery.tokenwise`) |

Deviation of a token (:func:`kv_deviation`): ``sum_h ||K_h - K~_h||^2 + ||V_h - V~_h||^2``
over the KV heads ``h``, fresh ``K`` / ``V`` against the cached ``K~`` (re-aligned) / ``V~``:
the paper's "KV deviation". CacheBlend's public code scores values only and refines its choice
gradually over a few layers; here one check layer chooses once, as SparseX §3.4 describes it.
The comparison costs one re-alignment of each cached key and ``6 d`` FLOPs per (token, KV head)
(:mod:`~redknot.recovery.flops`).

``blend_ratio`` 1 (or a check layer at or past the last layer) is a dense prefill; ratio 0
with check layer 0 recomputes only layer 0, whose KV depends on token and position alone, so it
equals naive reuse up to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from redknot.recovery.importance import top_rows
from redknot.recovery.tokenwise import TokenRecovery
from redknot.reference import LayerContext


def kv_deviation(
    keys: Tensor, values: Tensor, cached_keys: Tensor, cached_values: Tensor
) -> Tensor:
    """``[R]`` float64 KV deviation of ``R`` tokens: squared differences of fresh and cached K
    and V summed over heads and dims. Every argument: ``[Hkv, R, d]``, keys at the same
    positions."""
    assert keys.shape == values.shape == cached_keys.shape == cached_values.shape, keys.shape
    dk = (keys.to(torch.float64) - cached_keys.to(torch.float64)).square().sum(dim=(0, 2))
    dv = (values.to(torch.float64) - cached_values.to(torch.float64)).square().sum(dim=(0, 2))
    return dk + dv


def blend_count(ratio: float, segment_tokens: int) -> int:
    """Tokens CacheBlend recomputes: ``ratio`` of the segment tokens, rounded half up."""
    return min(segment_tokens, math.floor(ratio * segment_tokens + 0.5))


class CacheBlend(TokenRecovery):
    """The ``cacheblend`` policy; knobs ``blend_check_layer`` and ``blend_ratio``."""

    name = "cacheblend"
    knobs = ("blend_check_layer", "blend_ratio")

    @property
    def select_layer(self) -> int:
        return self.options.blend_check_layer

    @property
    def sparse_from(self) -> int:
        return self.options.blend_check_layer + 1

    def select(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        segment = torch.nonzero(self._segment_mask(ctx)).flatten()  # [S] rows of this call
        every_head = self.every_kv_head
        cached_k, cached_v = self.cached_kv(
            ctx, keys.clone(), values.clone(), every_head, record=False
        )
        kv_rows = segment + ctx.past_len
        deviation = torch.zeros(ctx.num_rows, dtype=torch.float64, device=keys.device)
        deviation[segment] = kv_deviation(
            keys[:, kv_rows], values[:, kv_rows], cached_k[:, kv_rows], cached_v[:, kv_rows]
        )
        self._layer["compared"] = int(segment.numel()) * len(every_head)
        count = blend_count(self.options.blend_ratio, int(segment.numel()))
        return top_rows(deviation, segment, count)
