"""Sparse decode attention over SGLang's paged KV store: each (request, selection head) attends
its ``num_sink`` first tokens plus a fixed-width list of key positions (LFPS or exact Top-k).

>>> plan = plan_sparse_decode(batch_size=B, num_q_heads=32, head_dim=128, rows=4, width=K,
...                           num_sink=4, device="cuda")            # once per batch size
>>> for layer in range(num_layers):                                   # CUDA-graph capturable
...     run_sparse_decode(plan, q, k_buffer[layer], v_buffer[layer], req_to_token,
...                       req_pool_indices, seq_lens, indices, sm_scale, out=out)

``indices`` is ``[B, Hq // rows, width]`` int32: one list per KV head shared by its ``rows`` =
``Hq / Hkv`` query heads, or one per query head with ``rows = 1``. Entries that are negative, at
or past ``seq_lens[b]``, or below ``num_sink`` are skipped; a position listed twice is attended
twice (deduplicate beforehand). Semantics: ``redknot.kernels.sparse_reference``; kernel:
``redknot.kernels.triton.sparse_decode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from redknot.kernels.geometry import num_sms as device_sms
from redknot.kernels.geometry import store_readable
from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.sparse_decode import sparse_decode_kernel, sparse_decode_merge_kernel

_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class SparseDecodeConfig:
    """Launch constants (not semantics); defaults not yet tuned on a GPU."""

    block_n: int = 64  # keys per inner-loop block
    num_warps: int = 4
    num_stages: int = 2
    min_chunk: int = 128  # fewest keys a split takes
    programs_per_sm: int = 8  # split target: programs per SM over all rows


@dataclass(frozen=True)
class SparseDecodePlan:
    """Static launch shape of one batch size (fixed for a captured CUDA graph)."""

    config: SparseDecodeConfig
    rows: int  # query heads per selection head (its list is shared by them)
    width: int  # listed positions per selection head
    num_sink: int
    num_splits: int
    part_o_gpu: torch.Tensor  # [B, Hq, num_splits, D] float32, split outputs
    part_lse_gpu: torch.Tensor  # [B, Hq, num_splits] float32, split base-2 log-sum-exps

    def __post_init__(self) -> None:
        assert self.rows >= 1 and self.width >= 1 and self.num_sink >= 0
        assert self.num_splits >= 1
        B, Hq, S, _ = self.part_o_gpu.shape
        assert S == self.num_splits and Hq % self.rows == 0, (self.part_o_gpu.shape, self.rows)
        assert self.part_lse_gpu.shape == (B, Hq, S)

    @property
    def batch_size(self) -> int:
        return self.part_o_gpu.shape[0]


def choose_sparse_splits(
    batch_size: int, selection_heads: int, keys: int, *, num_sms: int, config: SparseDecodeConfig
) -> int:
    """Splits so that ``batch_size * selection_heads`` rows of ``keys`` keys make about
    ``programs_per_sm`` programs per SM, each split at least ``min_chunk`` keys."""
    rows = max(1, batch_size * selection_heads)
    want = math.ceil(config.programs_per_sm * num_sms / rows)
    return max(1, min(want, math.ceil(keys / config.min_chunk)))


def plan_sparse_decode(
    *,
    batch_size: int,
    num_q_heads: int,
    head_dim: int,
    rows: int,
    width: int,
    num_sink: int,
    device: torch.device | str,
    num_splits: int | None = None,
    config: SparseDecodeConfig = SparseDecodeConfig(),
) -> SparseDecodePlan:
    """Plan (and allocate the split partials of) a batch of ``batch_size`` requests.

    Parameters
    ----------
    rows : query heads sharing one list (``Hq / Hkv`` for one list per KV head, 1 per query head).
    width : listed positions per list (the fixed Top-k budget).
    num_splits : split count; default from the batch, the heads and ``num_sink + width``.
    """
    assert num_q_heads % rows == 0, (num_q_heads, rows)
    if num_splits is None:
        num_splits = choose_sparse_splits(
            batch_size, num_q_heads // rows, num_sink + width, num_sms=device_sms(device),
            config=config,
        )  # fmt: skip
    shape = (batch_size, num_q_heads, num_splits)
    return SparseDecodePlan(
        config=config,
        rows=rows,
        width=width,
        num_sink=num_sink,
        num_splits=num_splits,
        part_o_gpu=torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
        part_lse_gpu=torch.empty(shape, dtype=torch.float32, device=device),
    )


def run_sparse_decode(
    plan: SparseDecodePlan,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    filled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse decode attention of one layer.

    Parameters
    ----------
    q : [B, Hq, D] fp16/bf16, the new token of every request.
    k_buffer, v_buffer : [slots, Hkv, D] the layer's paged store (same dtype as ``q``).
    req_to_token : [R, max_ctx] int32, slot of each position of each request row.
    req_pool_indices : [B] int32/int64, each request's row of ``req_to_token``.
    seq_lens : [B] int32/int64, keys of each request including the new token's.
    indices : [B, Hq // plan.rows, plan.width] int32 key positions (see the module docstring).
    out : [B, Hq, D] like ``q`` (allocated if None; pass it under CUDA graphs).
    lse : optional [B, Hq] float32, filled with the natural-log log-sum-exp (``-inf``: no key).
    filled : optional [B, Hq // plan.rows] int32: each list's entries past this many are padding
        and are not read (the same output, fewer loads for lists filled below their width).

    Returns
    -------
    out : [B, Hq, D]
    """
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    cfg = plan.config
    assert B == plan.batch_size and plan.part_o_gpu.shape[1:] == (Hq, plan.num_splits, D)
    assert q.dtype in _DTYPES and q.stride(2) == 1, (q.dtype, q.stride())
    assert Hq % Hkv == 0 and (Hq // Hkv) % plan.rows == 0, (Hq, Hkv, plan.rows)
    for name, store in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        assert store.dim() == 3 and store.shape[1:] == (Hkv, D), f"{name}: {store.shape}"
        assert store.dtype == q.dtype, f"{name}: dtype {store.dtype}, q has {q.dtype}"
        assert store_readable(store, q), f"{name}: on {store.device} (not pinned), q on {q.device}"
        assert store.stride(2) == 1, f"{name}: head_dim must be contiguous"
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert req_pool_indices.shape == (B,) and req_pool_indices.dtype in _INDEX_DTYPES
    assert seq_lens.shape == (B,) and seq_lens.dtype in _INDEX_DTYPES
    hs = Hq // plan.rows
    assert indices.shape == (B, hs, plan.width) and indices.dtype == torch.int32, indices.shape
    assert indices.stride(2) == 1, indices.stride()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if lse is not None:
        assert lse.shape == (B, Hq) and lse.dtype == torch.float32 and lse.stride(1) == 1
    if filled is not None:
        assert filled.shape == (B, hs) and filled.dtype == torch.int32, filled.shape
        assert filled.stride(1) == 1, filled.stride()
    if B == 0:
        return out
    split = plan.num_splits > 1
    lse_arg = lse if lse is not None else plan.part_lse_gpu
    po, pl = plan.part_o_gpu, plan.part_lse_gpu
    sparse_decode_kernel[(plan.num_splits, hs, B)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, indices,
        indices if filled is None else filled,
        out, lse_arg, po, pl,
        sm_scale * math.log2(math.e), plan.num_sink, plan.width,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        indices.stride(0), indices.stride(1), 0 if filled is None else filled.stride(0),
        out.stride(0), out.stride(1), lse_arg.stride(0),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        HAS_FILLED=filled is not None, ROWS=plan.rows, GRP=Hq // Hkv,
        BLOCK_H=max(16, plan.rows), BLOCK_N=cfg.block_n, HEAD_DIM=D, SPLIT=split,
        WRITE_LSE=lse is not None, UPCAST=upcast_dots(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        splits_p2 = 1 << max(0, (plan.num_splits - 1).bit_length())
        sparse_decode_merge_kernel[(B, Hq)](
            out, lse_arg, po, pl, plan.num_splits,
            out.stride(0), out.stride(1), lse_arg.stride(0),
            po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
            HEAD_DIM=D, SPLITS_P2=splits_p2, SPLITS_BLOCK=min(splits_p2, 16),
            WRITE_LSE=lse is not None, num_warps=4,
        )  # fmt: skip
    return out
