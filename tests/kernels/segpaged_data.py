"""Random SegPaged batches for the kernel tests: per-request keys and values written into a
global store, a local store (token table or ring) and ``req_to_token`` the way the pool would,
with randomly permuted slots and request rows. Slots nobody wrote hold NaN, so a kernel that
reads a key it should not see produces NaN instead of a plausible number."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.kernels.geometry import LayerHeads, SegGeometry
from redknot.pool.layout import HeadLayout


@dataclass
class SegBatch:
    geo: SegGeometry
    heads: LayerHeads
    k_global: torch.Tensor  # [S_g, G_l, D]
    v_global: torch.Tensor
    k_local: torch.Tensor  # [S_l, L_l, D]
    v_local: torch.Tensor
    req_to_token: torch.Tensor  # [R, max_ctx] int32
    req_pool_indices: torch.Tensor  # [B] int64


def make_geometry(classes: str, grp: int, head_dim: int, sink: int, window: int, mode: str,
                  ring_extra: int = 3) -> tuple[SegGeometry, HeadLayout]:  # fmt: skip
    layout = HeadLayout(
        classes=(classes,), num_q_heads=len(classes) * grp, head_dim=head_dim,
        window=window, sink=sink,
    )  # fmt: skip
    ring_len = sink + window + ring_extra if mode == "ring" else 0
    return SegGeometry.from_layout(layout, local_mode=mode, ring_len=ring_len), layout


def _nan_store(slots: int, columns: int, dim: int, dtype, device) -> torch.Tensor:
    return torch.full((max(slots, 1), max(columns, 1), dim), float("nan"), dtype=dtype,
                      device=device)  # fmt: skip


def make_batch(
    geo: SegGeometry,
    layout: HeadLayout,
    cached_lens: list[int],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[SegBatch, list[torch.Tensor], list[torch.Tensor]]:
    """Stores holding positions ``0 .. cached_lens[b] - 1`` of every request; returns the batch
    and the per-request keys/values ``[cached_lens[b], H_kv, D]`` that were written."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = len(cached_lens), geo.num_kv_heads, geo.head_dim
    heads = LayerHeads.from_layout(layout, 0, device)
    is_local = heads.is_local_gpu.tolist()
    column = heads.column_gpu.tolist()
    R = B + 2
    max_ctx = max(cached_lens + [1]) + 5
    S = R * max_ctx + 11
    perm = torch.randperm(S, generator=g)[: R * max_ctx].view(R, max_ctx)
    req_to_token = perm.to(torch.int32).to(device)
    req_rows = torch.randperm(R, generator=g)[:B]
    kg = _nan_store(S, heads.num_global, D, dtype, device)
    vg = kg.clone()
    s_local = R * geo.ring_len if geo.ring else S
    kl = _nan_store(s_local, heads.num_local, D, dtype, device)
    vl = kl.clone()
    keys, values = [], []
    for b, n in enumerate(cached_lens):
        k = torch.randn(n, H, D, generator=g).to(dtype).to(device)
        v = torch.randn(n, H, D, generator=g).to(dtype).to(device)
        keys.append(k)
        values.append(v)
        row = int(req_rows[b])
        pos = torch.arange(n)
        token_slots = req_to_token[row, :n].long()
        if geo.ring:  # positions in order: later ones overwrite the ring entries of earlier ones
            span = geo.ring_len - geo.sink
            ring = torch.where(pos < geo.sink, pos, geo.sink + (pos - geo.sink) % span)
            keep = (pos < geo.sink) | (pos >= n - span)
            ring_slots = (row * geo.ring_len + ring[keep]).to(device)
        for h in range(H):
            if not is_local[h]:
                kg[token_slots, column[h]] = k[:, h]
                vg[token_slots, column[h]] = v[:, h]
            elif geo.ring:
                kl[ring_slots, column[h]] = k[keep.to(device), h]
                vl[ring_slots, column[h]] = v[keep.to(device), h]
            else:
                kl[token_slots, column[h]] = k[:, h]
                vl[token_slots, column[h]] = v[:, h]
    batch = SegBatch(geo, heads, kg, vg, kl, vl, req_to_token, req_rows.to(device))
    return batch, keys, values


def with_restore(
    batch: SegBatch,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    promote: dict[int, list[int]],
    restore: int,
) -> tuple[SegBatch, torch.Tensor]:
    """``batch`` with ``restore`` restore columns after the global store's columns, and request
    ``b`` of ``promote`` promoting the local heads ``promote[b]`` (at most ``restore``): their
    cached keys/values (``keys[b]``, as :func:`make_batch` returned them) written to the
    request's restore columns. Returns the batch and the ``[rows of req_to_token, restore]``
    int32 table of promoted heads (-1: none)."""
    heads = batch.heads
    G, device = heads.num_global, batch.k_global.device
    S, _, D = batch.k_global.shape
    kg = _nan_store(S, G + restore, D, batch.k_global.dtype, device)
    vg = kg.clone()
    kg[:, :G], vg[:, :G] = batch.k_global[:, :G], batch.v_global[:, :G]
    promoted = torch.full((batch.req_to_token.shape[0], restore), -1, dtype=torch.int32)
    for b, hs in promote.items():
        assert len(hs) <= restore and all(heads.is_local_gpu[h] for h in hs), hs
        row = int(batch.req_pool_indices[b])
        slots = batch.req_to_token[row, : keys[b].shape[0]].long()
        for r, h in enumerate(hs):
            promoted[row, r] = h
            kg[slots, G + r] = keys[b][:, h]
            vg[slots, G + r] = values[b][:, h]
    out = SegBatch(batch.geo, heads, kg, vg, batch.k_local, batch.v_local, batch.req_to_token,
                   batch.req_pool_indices)  # fmt: skip
    return out, promoted.to(device)
