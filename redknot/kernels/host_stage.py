"""Staging of listed keys and values out of a KV store in host memory (LFPS over offloaded KV).

The decode kernels can read a store in pinned host memory directly
(:func:`redknot.kernels.geometry.store_readable`), but their scattered 256-byte loads reach only
about 14 GB/s over PCIe where a gather of the same rows reaches 47-50 GB/s
(``benchmarks/host_kv_probe.py``). :func:`stage_rows` gathers the rows a step is about to read
(the sinks and a list per KV head) into a dense GPU store, with the page table, list and lengths
that make any of those kernels read the staged rows exactly as it would have read the
originals, in the same order::

    >>> stage = HostStage.empty(B, Hkv, D, num_sink=4, width=K, dtype, device, values=True)
    >>> st = stage_rows(stage, k_host, v_host, req_to_token, req_pool_indices, seq_lens, idx)
    >>> run_sparse_decode(plan, q, st.k, st.v, st.req_to_token, st.req_pool_indices,
    ...                   st.seq_lens, st.indices, sm_scale)   # == the same call over k_host

All of it is CUDA-graph capturable (fixed shapes, no host synchronisation). Kernel:
``redknot.kernels.triton.host_stage``; reference: :func:`stage_rows_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from redknot.kernels.geometry import store_readable
from redknot.kernels.triton.host_stage import host_stage_kernel

BLOCK_T = 64


@dataclass(frozen=True)
class HostStage:
    """Staging buffers of one batch size: ``B * (num_sink + width)`` rows per KV head."""

    num_sink: int
    width: int
    k: torch.Tensor  # [B * (num_sink + width), Hkv, D]
    v: torch.Tensor | None  # like k, or None: keys only (scoring)
    req_to_token: torch.Tensor  # [B, num_sink + width] int32: row b*(S+W)+t at position t
    req_pool_indices: torch.Tensor  # [B] int64: arange
    indices: torch.Tensor  # [B, Hkv, width] int32, filled by stage_rows
    seq_lens: torch.Tensor  # [B] int64, filled by stage_rows

    @classmethod
    def empty(cls, batch_size: int, num_kv_heads: int, head_dim: int, *, num_sink: int,
              width: int, dtype: torch.dtype, device: torch.device | str,
              values: bool = True) -> HostStage:  # fmt: skip
        total = num_sink + width
        rows = batch_size * total
        k = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
        table = torch.arange(rows, dtype=torch.int32, device=device).view(batch_size, total)
        return cls(
            num_sink=num_sink,
            width=width,
            k=k,
            v=torch.zeros_like(k) if values else None,
            req_to_token=table,
            req_pool_indices=torch.arange(batch_size, dtype=torch.int64, device=device),
            indices=torch.empty(batch_size, num_kv_heads, width, dtype=torch.int32, device=device),
            seq_lens=torch.empty(batch_size, dtype=torch.int64, device=device),
        )


def first_rows(stage: HostStage, batch_size: int) -> HostStage:
    """The buffers of ``stage``'s first ``batch_size`` requests (views: a stage made for the
    largest batch serves every smaller one)."""
    rows = batch_size * (stage.num_sink + stage.width)
    return HostStage(
        num_sink=stage.num_sink, width=stage.width, k=stage.k[:rows],
        v=None if stage.v is None else stage.v[:rows],
        req_to_token=stage.req_to_token[:batch_size],
        req_pool_indices=stage.req_pool_indices[:batch_size],
        indices=stage.indices[:batch_size], seq_lens=stage.seq_lens[:batch_size],
    )  # fmt: skip


def _check(stage: HostStage, k_src, v_src, req_to_token, req_pool_indices, seq_lens, idx) -> None:
    B, H, W = idx.shape
    assert W == stage.width and stage.k.shape[0] == B * (stage.num_sink + W), (idx.shape, stage)
    assert stage.k.shape[1:] == (H, k_src.shape[2]) and k_src.shape[1] == H, (k_src.shape, H)
    assert idx.dtype in (torch.int32, torch.int64) and idx.stride(2) == 1, idx.dtype
    assert req_pool_indices.shape == seq_lens.shape == (B,), (req_pool_indices.shape, B)
    for name, src in (("k_src", k_src), ("v_src", v_src)):
        if src is not None:
            assert src.dtype == stage.k.dtype and src.stride(2) == 1, (name, src.dtype)
            assert store_readable(src, stage.k), f"{name} on {src.device}: not readable there"
    assert (stage.v is None) == (v_src is None), "stage values exactly when v_src is given"


def stage_rows(stage: HostStage, k_src: torch.Tensor, v_src: torch.Tensor | None,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, idx: torch.Tensor, *,
               sinks: bool = True) -> HostStage:  # fmt: skip
    """Gather the sinks (``sinks``) and the rows ``idx`` ([B, Hkv, width] positions per KV
    head) of every request out of ``k_src`` / ``v_src`` ([slots, Hkv, D], any readable store)
    into ``stage``; its ``indices`` and ``seq_lens`` are set so that a kernel given the staged
    store, table, list and lengths reads the same keys in the same order. Entries a kernel
    would skip (negative, below ``num_sink``, at or past ``seq_lens``) stay skipped (``-1``)."""
    _check(stage, k_src, v_src, req_to_token, req_pool_indices, seq_lens, idx)
    B, H, W = idx.shape
    S = stage.num_sink
    D = k_src.shape[2]
    # a request shorter than its sinks keeps its length: no listed entry of it is valid
    torch.where(seq_lens < S, seq_lens, torch.full_like(seq_lens, S + W), out=stage.seq_lens)
    if B == 0:
        return stage
    v_src_, v_out = (v_src, stage.v) if v_src is not None else (k_src, stage.k)
    grid = (triton.cdiv(S + W, BLOCK_T), H, B)
    host_stage_kernel[grid](
        k_src, v_src_, req_to_token, req_pool_indices, seq_lens, idx,
        stage.k, v_out, stage.indices,
        S, W,
        k_src.stride(0), k_src.stride(1), v_src_.stride(0), v_src_.stride(1),
        req_to_token.stride(0), idx.stride(0), idx.stride(1),
        stage.k.stride(0), stage.k.stride(1), stage.indices.stride(0), stage.indices.stride(1),
        SINKS=sinks, VALUES=v_src is not None, BLOCK_T=BLOCK_T, HEAD_DIM=D,
    )  # fmt: skip
    return stage


def stage_rows_reference(stage: HostStage, k_src, v_src, req_to_token, req_pool_indices,
                         seq_lens, idx, *, sinks: bool = True) -> HostStage:  # fmt: skip
    """:func:`stage_rows` in PyTorch, row by row (tests)."""
    _check(stage, k_src, v_src, req_to_token, req_pool_indices, seq_lens, idx)
    B, H, W = idx.shape
    S = stage.num_sink
    total = S + W
    for b in range(B):
        n = int(seq_lens[b])
        rpi = int(req_pool_indices[b])
        stage.seq_lens[b] = n if n < S else total
        for h in range(H):
            rows = [(t, t) for t in range(min(S, n))] if sinks else []
            for j in range(W):
                p = int(idx[b, h, j])
                ok = S <= p < n
                stage.indices[b, h, j] = S + j if ok else -1
                if ok:
                    rows.append((S + j, p))
            for t, p in rows:
                slot = int(req_to_token[rpi, p])
                stage.k[b * total + t, h] = k_src[slot, h].to(stage.k.device)
                if v_src is not None:
                    stage.v[b * total + t, h] = v_src[slot, h].to(stage.k.device)
    return stage
