"""Index selection for sparse decode over SGLang's paged store: exact Top-k (score every key, keep
the best) and LFPS's candidate list from its score tables. Each call is a fixed-shape launch
(plus ``torch.topk``), capturable in a CUDA graph.

>>> idx = exact_topk(q, k_buffer, req_to_token, req_pool_indices, seq_lens, k=2621,
...                  num_sink=4, sm_scale=0.088, width=max_context, rows=4)    # [B, Hkv, k]
>>> cand, count = lfps_candidates(vertical, slash, scale, seq_lens, params, capacity=C)
>>> logits = score_keys(q, k_buffer, req_to_token, req_pool_indices, seq_lens, cand,
...                     num_sink=4, sm_scale=0.088)                              # [B, Hq, C]

References: ``redknot.kernels.sparse_reference`` (scores, Top-k) and
``redknot.lfps.fixed_budget.candidates_reference`` (the candidate rule). Kernels:
``redknot.kernels.triton.lfps_index``.
"""

from __future__ import annotations

import functools

import torch
import triton

from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.lfps_index import (
    lfps_hist_kernel,
    lfps_mark_kernel,
    lfps_moments_kernel,
    lfps_score_kernel,
    lfps_write_kernel,
)
from redknot.lfps.fixed_budget import BINS_PER_OCTAVE, NUM_BINS
from redknot.lfps.params import LfpsParams

SCORE_BLOCK_N = 64  # keys per scoring program
CANDIDATE_CHUNK = 2048  # table entries per program of the candidate kernels
CANDIDATE_BLOCK = 512  # table entries per inner step
CANDIDATE_WARPS = 4  # warps per program of the candidate kernels
# The moments kernel holds its whole chunk in registers (read once for both passes) by default
MOMENTS_BLOCK = CANDIDATE_CHUNK
# The mark kernel's Eq. 9 shifts gathered from the entries it read (``lfps_mark_kernel``'s
# ``GATHER``), not read again at every offset. Measured on an H200 (8B shape, the lists equal):
# the candidate kernels 0.104 ms against 0.117 at 128K x 8 (lfps_candidates_sweep_gather_h200
# .json, the fastest of six settings), and the whole step faster at every length and batch of
# lfps_decode_gather_sizes_h200.json (32K and 128K, B = 1, 8, 32: 1.5% to 6.2%)
MARK_GATHER = True


@functools.cache
def offsets_tensor(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Eq. 9's offsets on ``device``, made once (a copy from the host cannot be captured)."""
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _check_paged(q, k_buffer, req_to_token, req_pool_indices, seq_lens) -> None:
    B, Hq, D = q.shape
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(2) == 1, q.dtype
    assert k_buffer.dim() == 3 and k_buffer.shape[2] == D and k_buffer.stride(2) == 1
    assert k_buffer.dtype == q.dtype and Hq % k_buffer.shape[1] == 0, (k_buffer.shape, Hq)
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert req_pool_indices.shape == (B,) and seq_lens.shape == (B,)


def score_keys(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor | None,
    *,
    num_sink: int,
    sm_scale: float,
    width: int | None = None,
    group_max: bool = False,
) -> torch.Tensor:
    """Scaled logits of listed keys, or of every position ``0 .. width - 1`` (``indices=None``).

    Parameters
    ----------
    q : [B, Hq, D] fp16/bf16.
    k_buffer : [slots, Hkv, D] the layer's key store.
    indices : [B, Hs, W] int32 positions, one list per ``Hq / Hs`` query heads; None scores
        every position for every KV head (``Hs = Hkv``, ``W = width``).
    group_max : return each list's maximum over its query heads instead.

    Returns
    -------
    [B, Hq, W] float32 (``[B, Hs, W]`` with ``group_max``); ``-inf`` outside
    ``num_sink <= p < seq_lens[b]``.
    """
    logits, best = _score(q, k_buffer, req_to_token, req_pool_indices, seq_lens, indices,
                          num_sink, sm_scale, width, not group_max, group_max, None)  # fmt: skip
    return best if group_max else logits


def score_and_rank(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    bypass: torch.Tensor,
    *,
    num_sink: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LFPS's scores of its candidates: every query head's logits ``[B, Hq, C]`` and each
    list's rank ``[B, Hs, C]``, the maximum over its query heads whose ``bypass`` ([B, Hq]
    bool) is False (``-inf`` if all are) (``redknot.lfps.batched.select_topk``'s rank)."""
    assert bypass.shape == q.shape[:2] and bypass.dtype == torch.bool, bypass.shape
    return _score(q, k_buffer, req_to_token, req_pool_indices, seq_lens, indices, num_sink,
                  sm_scale, None, True, True, bypass)  # fmt: skip


def _score(q, k_buffer, req_to_token, req_pool_indices, seq_lens, indices, num_sink, sm_scale,
           width, write_logits, write_max, bypass):  # fmt: skip
    _check_paged(q, k_buffer, req_to_token, req_pool_indices, seq_lens)
    B, Hq, D = q.shape
    grp = Hq // k_buffer.shape[1]
    if indices is None:
        assert width is not None and width <= req_to_token.shape[1], width
        hs, dense = k_buffer.shape[1], True
        idx_arg, stride_ib, stride_ih = seq_lens, 0, 0
    else:
        assert indices.dtype == torch.int32 and indices.stride(2) == 1, indices.dtype
        assert indices.shape[0] == B and Hq % indices.shape[1] == 0, indices.shape
        hs, width, dense = indices.shape[1], indices.shape[2], False
        idx_arg, stride_ib, stride_ih = indices, indices.stride(0), indices.stride(1)
    rows = Hq // hs
    logits = best = None
    if write_logits:
        logits = torch.empty(B, Hq, width, dtype=torch.float32, device=q.device)
    if write_max:
        best = torch.empty(B, hs, width, dtype=torch.float32, device=q.device)
    if B == 0 or width == 0:
        return logits, best
    out, out_max = logits if write_logits else best, best if write_max else logits
    flags = bypass.view(torch.int8) if bypass is not None else seq_lens
    lfps_score_kernel[(triton.cdiv(width, SCORE_BLOCK_N), hs, B)](
        q, k_buffer, req_to_token, req_pool_indices, seq_lens, idx_arg, flags, out, out_max,
        sm_scale, num_sink, width,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        stride_ib, stride_ih, out.stride(0), out.stride(1), out_max.stride(0), out_max.stride(1),
        flags.stride(0),
        ROWS=rows, GRP=grp, BLOCK_H=max(16, rows), BLOCK_N=SCORE_BLOCK_N, HEAD_DIM=D,
        DENSE=dense, WRITE_LOGITS=write_logits, WRITE_MAX=write_max,
        HAS_BYPASS=bypass is not None, UPCAST=upcast_dots(q.dtype),
    )  # fmt: skip
    return logits, best


def exact_topk(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k: int,
    num_sink: int,
    sm_scale: float,
    width: int,
    rows: int,
) -> torch.Tensor:
    """Exact Top-k: score every non-sink key, keep the ``k`` best per list.

    ``rows = Hq / Hkv`` gives one list per KV head, ranked by the maximum logit over its query
    heads; ``rows = 1`` one list per query head. ``width`` (static) bounds ``seq_lens``.

    Returns
    -------
    [B, Hq // rows, k] int32 positions, descending score; -1 where a row has fewer keys.
    """
    Hq, Hkv = q.shape[1], k_buffer.shape[1]
    assert rows in (1, Hq // Hkv), f"rows must be 1 or the group size {Hq // Hkv}, got {rows}"
    assert 1 <= k <= width, (k, width)
    scores = score_keys(
        q, k_buffer, req_to_token, req_pool_indices, seq_lens, None, num_sink=num_sink,
        sm_scale=sm_scale, width=width, group_max=rows > 1,
    )  # fmt: skip
    val, pos = torch.topk(scores, k, dim=-1)
    return torch.where(torch.isfinite(val), pos, -1).to(torch.int32)


def lfps_candidates(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    scale: torch.Tensor,
    seq_lens: torch.Tensor,
    params: LfpsParams,
    capacity: int,
    *,
    rows: torch.Tensor | None = None,
    chunk: int = CANDIDATE_CHUNK,
    block: int = CANDIDATE_BLOCK,
    num_warps: int = CANDIDATE_WARPS,
    moments_block: int | None = None,
    mark_gather: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LFPS Eq. 7-9 into a fixed-capacity list (rule: ``redknot.lfps.fixed_budget``).

    Parameters
    ----------
    vertical, slash : [R, Hs, N_max] float32 stored tables (true value = stored * ``scale``;
        slash indexed by distance); entries past each row's covered keys are 0.
    scale : [R, Hs] float32.
    seq_lens : [B] int32/int64, keys including the new token's (``<= N_max``).
    rows : [B] int32, the table row of each request (``LfpsBatchState.index``); None: request
        ``b`` reads row ``b`` (``R = B``).
    chunk, block : table entries per program and per inner step (powers of two, block <= chunk).
    moments_block : the moments kernel's inner step (default ``min(MOMENTS_BLOCK, chunk)``; at
        ``chunk`` each table entry is read once, not once per pass).
    num_warps : warps per program of the four launches.
    mark_gather : the mark kernel's shifts gathered from the entries it read, in windows of
        ``block`` that overlap by the offsets' reach (default :data:`MARK_GATHER`); the same
        candidates either way.

    Returns
    -------
    candidates : [B, Hs, capacity] int32 positions, newest first, -1 padded.
    count : [B, Hs] int32, candidates before the capacity was applied.
    """
    R, Hs, N = vertical.shape
    assert slash.shape == vertical.shape and scale.shape == (R, Hs), (slash.shape, scale.shape)
    for t in (vertical, slash, scale):
        assert t.dtype == torch.float32 and t.stride(-1) == 1, t.dtype
    B = seq_lens.shape[0]
    if rows is None:
        assert B == R, (B, R)
        rows = torch.arange(B, dtype=torch.int32, device=vertical.device)
    assert rows.shape == (B,) and rows.dtype == torch.int32 and capacity >= 1, (rows, capacity)
    if moments_block is None:
        moments_block = min(MOMENTS_BLOCK, chunk)
    for step in (block, moments_block):
        assert step <= chunk and chunk % step == 0 and step & (step - 1) == 0, (chunk, step)
    if mark_gather is None:
        mark_gather = MARK_GATHER
    halo_l, halo_r = max((0, *params.offsets)), max((0, *(-o for o in params.offsets)))
    if mark_gather and block <= halo_l + halo_r:
        raise ValueError(f"block={block} must exceed the offsets' reach {halo_l + halo_r}")
    dev = vertical.device
    out = torch.empty(B, Hs, capacity, dtype=torch.int32, device=dev)
    count = torch.empty(B, Hs, dtype=torch.int32, device=dev)
    if B == 0:
        return out, count
    chunks = max(1, triton.cdiv(N - params.num_sink, chunk))
    moments = torch.empty(B, Hs, chunks, 8, dtype=torch.float32, device=dev)
    codes = torch.empty(B, Hs, N, dtype=torch.uint8, device=dev)
    chunk_count = torch.empty(B, Hs, chunks, dtype=torch.int32, device=dev)
    chunk_hist = torch.empty(B, Hs, chunks, NUM_BINS, dtype=torch.int32, device=dev)
    grid = (chunks, Hs, B)
    chunks_p2 = max(2, 1 << (chunks - 1).bit_length())
    tables = (vertical.stride(0), vertical.stride(1), slash.stride(0), slash.stride(1),
              scale.stride(0))  # fmt: skip
    m_strides = (moments.stride(0), moments.stride(1), moments.stride(2))
    c_strides = (codes.stride(0), codes.stride(1), chunk_count.stride(0), chunk_count.stride(1),
                 chunk_hist.stride(0), chunk_hist.stride(1), chunk_hist.stride(2))  # fmt: skip
    lfps_moments_kernel[grid](
        vertical, slash, scale, rows, seq_lens, moments, params.num_sink, *tables, *m_strides,
        CHUNK=chunk, BLOCK=moments_block, num_warps=num_warps,
    )  # fmt: skip
    lfps_mark_kernel[grid](
        vertical, slash, scale, rows, seq_lens, offsets_tensor(params.offsets, dev), moments, codes,
        chunk_count, params.lam, params.num_sink, *tables, *m_strides, *c_strides[:4],
        NUM_OFFSETS=len(params.offsets), CHUNK=chunk, CHUNKS_P2=chunks_p2, BLOCK=block,
        GATHER=mark_gather, HALO_L=halo_l, HALO_R=halo_r, num_warps=num_warps,
    )  # fmt: skip
    lfps_hist_kernel[grid](
        vertical, slash, scale, rows, seq_lens, moments, codes, chunk_count, chunk_hist,
        params.lam, params.num_sink, capacity, *tables, *m_strides, *c_strides,
        CHUNK=chunk, CHUNKS_P2=chunks_p2, BLOCK=block, NBINS=NUM_BINS,
        BINS_PER_OCTAVE=BINS_PER_OCTAVE, num_warps=num_warps,
    )  # fmt: skip
    lfps_write_kernel[grid](
        seq_lens, codes, chunk_count, chunk_hist, out, count, params.num_sink, capacity,
        *c_strides, out.stride(0), out.stride(1), count.stride(0),
        CHUNK=chunk, CHUNKS_P2=chunks_p2, BLOCK=block, NBINS=NUM_BINS, num_warps=num_warps,
    )  # fmt: skip
    return out, count
