"""A forward pass over a per-layer sparse KV layout: SamKV's recomputation (§3.3) and its
incremental prefill of the question over the anchors (§3.1) share it.

The pass computes ``T`` rows after an optional exact ``past`` (``P0`` rows, kept whole). Row
``t`` sits at position ``P0 + t`` during the pass (the *padded* frame: every row any layer
keeps). Per layer ``n`` two masks over the rows decide everything:

| mask               | meaning                                                                 |
| ------------------ | ----------------------------------------------------------------------- |
| ``keep[n]``        | the row's KV is part of layer ``n`` (others are padding there: invisible to every other row) |
| ``recompute[n]``   | the row's KV at layer ``n`` is computed from its hidden state (⊆ ``keep[n]``); the other kept rows take their cached KV (rule 2) |

The rows that compute attention and FFN at layer ``n`` are those recomputed at a later layer
(rule 1: a row recomputed at layer ``m`` needs the output of every layer below ``m``). Such a
row sees the kept rows of layer ``n`` up to itself, and its own KV (cached where not
recomputed: the padding of Fig. 5, example 3). Recomputed KV overwrites the cached KV, or is
fused with it (Eq. 4: ``theta * new + (1 - theta) * old``, ``theta`` the cosine of new and old,
per row and KV head, for keys and values apart, clamped to ``[0, 1]``).

After the pass each layer keeps only its ``keep[n]`` rows; every layer keeps the same number,
and the padding is removed by moving each kept key from its padded-frame position to its rank
(``P0 + rank``): the result is a dense :class:`~redknot.reference.ReferenceKV` on which the
question is prefilled as usual. Every head is global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from redknot.reference import ReferenceKV
from redknot.reference.model import LlamaFamily

QUERY_BLOCK = 512  # query rows per attention call

# called once per layer with (layer, q [Hq, T, d] at positions, positions [T])
QueryCapture = Callable[[int, Tensor, Tensor], None]


@dataclass(frozen=True, eq=False)
class SparseLayout:
    """The rows of one sparse forward and what each layer does with them.

    | field           | shape                     | meaning                                     |
    | --------------- | ------------------------- | ------------------------------------------- |
    | ``ids``         | [T] int64                 | token of every row                          |
    | ``keep``        | [N, T] bool               | row part of layer ``n``'s KV                |
    | ``recompute``   | [N, T] bool               | row's KV recomputed at layer ``n``          |
    | ``has_cache``   | [T] bool                  | row has cached KV (rows without must be recomputed wherever kept) |
    | ``cached_keys`` | N x [Hkv, T, d]           | cached keys, rotated to ``P0 + t``          |
    | ``cached_values`` | N x [Hkv, T, d]         | cached values                               |
    """

    ids: Tensor
    keep: Tensor
    recompute: Tensor
    has_cache: Tensor
    cached_keys: list[Tensor]
    cached_values: list[Tensor]

    def __post_init__(self) -> None:
        num_layers, t = self.keep.shape
        assert self.recompute.shape == self.keep.shape and self.ids.shape == (t,)
        assert not bool((self.recompute & ~self.keep).any()), "recomputed rows must be kept"
        missing = self.keep & ~self.recompute & ~self.has_cache[None, :]
        assert not bool(missing.any()), "a kept row without cached KV must be recomputed"
        lengths = set(self.keep.sum(dim=1).tolist())
        assert len(lengths) <= 1, f"every layer must keep the same number of rows: {lengths}"
        assert len(self.cached_keys) == len(self.cached_values) == num_layers

    @property
    def num_rows(self) -> int:
        return int(self.ids.numel())

    def compute(self) -> Tensor:
        """``[N, T]`` bool: rows that compute attention and FFN at layer ``n`` (rule 1)."""
        from_here = self.recompute.to(torch.int8).flip(0).cummax(dim=0).values.flip(0).bool()
        later = torch.zeros_like(self.recompute)
        later[:-1] = from_here[1:]  # any(recompute[n + 1 :])
        return later


@dataclass
class LayerCounts:
    """What one layer of the pass computed (for the prefill record)."""

    attention_rows: int
    kv_rows: int  # rows whose K and V were projected (every KV head)
    pairs: int  # (query row, visible key) pairs, per query head
    realigned: int  # cached keys rotated (padded frame, then rank), per KV head
    compared: int  # rows fused with their cached KV (Eq. 4), per KV head


@dataclass
class SparseResult:
    """``kv``: past rows then each layer's kept rows at ``P0 + rank``; ``kept``: ``N`` x
    ``[L]`` int64 rows of the layout each layer kept, ascending; ``counts`` per layer."""

    kv: ReferenceKV
    kept: list[Tensor]
    counts: list[LayerCounts] = field(default_factory=list)


def cosine_fusion(new: Tensor, old: Tensor) -> Tensor:
    """Eq. 4 per row and head: ``theta * new + (1 - theta) * old`` with ``theta`` the cosine of
    ``new`` and ``old`` (``[H, R, d]``) over ``d``, clamped to ``[0, 1]``."""
    theta = F.cosine_similarity(new.to(torch.float32), old.to(torch.float32), dim=-1)
    theta = theta.clamp(0.0, 1.0)[..., None]
    return (theta * new.to(torch.float32) + (1 - theta) * old.to(torch.float32)).to(new.dtype)


def visible_mask(keep: Tensor, rows: Tensor, past_len: int) -> Tensor:
    """``[R, P0 + T]`` bool: what each query row in ``rows`` sees in one layer: every past row,
    the kept rows up to itself, and itself."""
    t = keep.numel()
    cols = torch.arange(t, device=keep.device)
    mask = (keep[None, :] & (cols[None, :] <= rows[:, None])) | (cols[None, :] == rows[:, None])
    past = torch.ones(rows.numel(), past_len, dtype=torch.bool, device=keep.device)
    return torch.cat((past, mask), dim=1)


@torch.no_grad()
def sparse_forward(
    model: LlamaFamily,
    layout: SparseLayout,
    *,
    past: ReferenceKV | None = None,
    update: str = "overwrite",
    capture: QueryCapture | None = None,
) -> SparseResult:
    """Run ``layout`` after ``past`` (see the module docstring); ``update``: ``overwrite`` or
    ``fusion``; ``capture`` sees every layer's queries."""
    m = model
    p0 = 0 if past is None else past.length
    t = layout.num_rows
    device = m.device
    positions = torch.arange(p0, p0 + t, device=device)
    compute = layout.compute().to(device)
    keep_all, recompute, has_cache = (
        layout.keep.to(device),
        layout.recompute.to(device),
        layout.has_cache.to(device),
    )
    x = m.embed(layout.ids.to(device))
    keys_out, values_out, kept, counts = [], [], [], []
    for layer in range(m.num_layers):
        q, k, v = m.qkv(layer, x, positions)
        if capture is not None:
            capture(layer, q, positions)
        rec, keep = recompute[layer], keep_all[layer]
        keys = layout.cached_keys[layer].to(device=device, dtype=k.dtype).clone()
        values = layout.cached_values[layer].to(device=device, dtype=v.dtype).clone()
        fused = rec & has_cache if update == "fusion" else torch.zeros_like(rec)
        plain = rec & ~fused
        keys[:, plain], values[:, plain] = k[:, plain], v[:, plain]
        if bool(fused.any()):
            keys[:, fused] = cosine_fusion(k[:, fused], keys[:, fused])
            values[:, fused] = cosine_fusion(v[:, fused], values[:, fused])
        full_k, full_v = keys, values
        if past is not None:
            full_k = torch.cat((past.keys[layer].to(k.dtype), keys), dim=1)
            full_v = torch.cat((past.values[layer].to(v.dtype), values), dim=1)

        rows = torch.nonzero(compute[layer]).flatten()
        pairs = 0
        if rows.numel():
            out = torch.empty(q.shape[0], rows.numel(), q.shape[2], dtype=q.dtype, device=device)
            for s in range(0, rows.numel(), QUERY_BLOCK):
                block = rows[s : s + QUERY_BLOCK]
                mask = visible_mask(keep, block, p0)
                pairs += int(mask.sum())
                out[:, s : s + QUERY_BLOCK] = F.scaled_dot_product_attention(
                    q[None, :, block], full_k[None], full_v[None], attn_mask=mask,
                    scale=m.scale, enable_gqa=True,
                )[0]  # fmt: skip
            x = x.index_add(0, rows, m.attn_output(layer, out))
            x = x.index_add(0, rows, m.ffn(layer, x[rows]))

        idx = torch.nonzero(keep).flatten()
        rank = torch.arange(p0, p0 + idx.numel(), device=device)
        moved = m.rope.realign(full_k[:, p0 + idx], positions[idx], rank)
        keys_out.append(torch.cat((full_k[:, :p0], moved), dim=1))
        values_out.append(torch.cat((full_v[:, :p0], full_v[:, p0 + idx]), dim=1))
        kept.append(idx.cpu())
        own_cached = compute[layer] & ~keep & ~rec
        cached_used = int((keep & ~rec).sum() + own_cached.sum())
        cached_used += int((positions[idx] != rank).sum())  # padding removed
        counts.append(
            LayerCounts(
                attention_rows=int(rows.numel()),
                kv_rows=int(rec.sum()),
                pairs=pairs * m.shape.num_attention_heads,
                realigned=cached_used * m.shape.num_kv_heads,
                compared=int(fused.sum()) * m.shape.num_kv_heads,
            )
        )
    return SparseResult(kv=ReferenceKV(keys_out, values_out), kept=kept, counts=counts)
