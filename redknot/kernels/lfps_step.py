"""Launches of the per-head pieces of LFPS's batched decode step (``redknot.lfps.batched``):
Eq. 5-6 with the bypass output, the Top-k of the candidates' rank, the selection with Eq. 10,
and the attention over the selection. Fixed shapes, capturable in a CUDA graph.

>>> sparsity, bypass, bypass_out = lfps_sparsity(q, k_buffer, v_buffer, req_to_token,
...                                              req_pool_indices, seq_lens, state, params, scale)
>>> val, at = lfps_topk(rank, seq_lens, params, k)        # rank from score_and_rank
>>> sel = lfps_select(val, at, cand, count, logits, bypass, seq_lens, state, params)
>>> out = lfps_update(sel, SelectedValues(q, k_buffer, v_buffer, req_to_token,
...                                       req_pool_indices, seq_lens, None, scale, bypass_out))

References: ``redknot.lfps.batched.head_sparsity``, ``rank_topk_in_list_order``,
``select_topk``, ``update_tables_`` and ``redknot.kernels.sparse_reference
.sparse_decode_reference``. Kernels: ``redknot.kernels.triton.lfps_step`` and ``lfps_select``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.lfps_select import lfps_topk_kernel, lfps_union_kernel
from redknot.kernels.triton.lfps_step import (
    lfps_attend_merge_kernel,
    lfps_sparsity_kernel,
    lfps_update_add_kernel,
    lfps_update_stats_kernel,
)
from redknot.lfps.batch_state import LfpsBatchState
from redknot.lfps.params import LfpsParams

# Top-K entries per program of the two update kernels and warps of the add launch, measured on
# an H100 (lfps_update_sweep.json, 128K x 8, the step at 9 settings): 128 x 4 warps was the
# fastest (0.290 ms a step against 0.305 at 256 x 4, where it stood before the add launch also
# weighted the values); 64 x 2 was within 0.1%.
UPDATE_BLOCK_K = 128
UPDATE_WARPS = 4
# The Top-k kernel's launch, measured on an H100 (benchmarks/lfps_candidates_sweep.py, 8B shape,
# B = 8, lfps_candidates_sweep.json): within 2% of the best setting swept at C = 10,484 (128K)
# and 6% at C = 2,620 (32K); the first default (a whole row of up to 16,384 in registers, a warp
# per 1,024 ranks, 6 bits) was 1.7x (128K) and 3.8x (32K) slower than this one.
TOPK_MAX_BLOCK = 4096  # ranks per inner step (a whole row, held in registers, up to this)
TOPK_WARPS = 16
TOPK_RADIX_BITS = 5  # key bits resolved per pass (7 passes)
# The Top-k's passes stop once the bin found holds exactly the keys still wanted
# (``lfps_topk_kernel``'s ``EARLY_EXIT``; the same set): the whole step 5-26% faster at all six
# shapes, 32K and 128K x B = 1, 8, 32, selections and outputs equal at each
# (lfps_decode_topk_early_h200.json, H200; 128K x 8: 0.259 -> 0.231 ms)
TOPK_EARLY_EXIT = True
# The union selection's first Top-k has a row per query head (32 a request at the 8B shape, 4x
# the programs): a block of 2,048 was 17% (128K, C = 20,968) and 31% (32K) faster than 4,096
# there (lfps_topk_sweep_query_rows.json, H100, every setting checked equal to the reference).
TOPK_QUERY_ROWS_MAX_BLOCK = 2048


@functools.cache
def budget_tensor(budget: float, device: torch.device) -> torch.Tensor:
    """``[1]`` float64 budget on ``device``, made once (a copy from the host cannot be
    captured)."""
    return torch.tensor([float(budget)], dtype=torch.float64, device=device)


def row_budget_args(params: LfpsParams, device: torch.device) -> tuple[torch.Tensor, bool]:
    """What the kernels' ``row_budget`` reads: ``params.budget`` on ``device`` and whether it
    is a fraction of the keys (``FRACTION``) rather than a count."""
    budget = params.budget
    fraction = isinstance(budget, float) and budget < 1.0
    return budget_tensor(budget if fraction else int(budget), device), fraction


def lfps_sparsity(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    state: LfpsBatchState,
    params: LfpsParams,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 5-6 for every query head.

    Returns
    -------
    sparsity : [B, Hq] float32 (0 for rows without a non-sink key; all 0 without sinks).
    bypass : [B, Hq] bool, ``sparsity > params.sparsity_threshold``.
    bypass_out : [B, Hq, D] float32, the sink-plus-mean output.
    """
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(2) == 1, q.dtype
    for store in (k_buffer, v_buffer):
        assert store.shape[1:] == (Hkv, D) and store.dtype == q.dtype and store.stride(2) == 1
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert state.batch_size == B and state.mean_key.shape[1:] == (Hkv, D), state.mean_key.shape
    assert state.query_stat.shape[1] == Hq, state.query_stat.shape
    alloc = torch.zeros if B == 0 or params.num_sink == 0 else torch.empty  # else all written
    sparsity = alloc(B, Hq, dtype=torch.float32, device=q.device)
    flags = alloc(B, Hq, dtype=torch.int8, device=q.device)
    bypass_out = alloc(B, Hq, D, dtype=torch.float32, device=q.device)
    if B == 0 or params.num_sink == 0:  # no sink: no bypass (the reference's convention)
        return sparsity, flags.view(torch.bool) & (params.sparsity_threshold < 0), bypass_out
    grp = Hq // Hkv
    span = params.num_sink + params.local_window
    lfps_sparsity_kernel[(Hkv, B)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, state.mean_key,
        state.mean_value, state.query_stat, state.state_rows(), sparsity, flags, bypass_out,
        sm_scale, params.sparsity_threshold, params.num_sink, params.local_window,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), state.mean_key.stride(0),
        state.mean_key.stride(1), state.mean_value.stride(0), state.mean_value.stride(1),
        state.query_stat.stride(0), sparsity.stride(0), flags.stride(0), bypass_out.stride(0),
        bypass_out.stride(1),
        GRP=grp, BLOCK_H=max(16, grp), BLOCK_P=max(16, 1 << (span - 1).bit_length()),
        HEAD_DIM=D, UPCAST=upcast_dots(q.dtype),
    )  # fmt: skip
    return sparsity, flags.view(torch.bool), bypass_out


def lfps_topk(
    rank: torch.Tensor,
    seq_lens: torch.Tensor,
    params: LfpsParams,
    k: int,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    radix_bits: int = TOPK_RADIX_BITS,
    max_block: int = TOPK_MAX_BLOCK,
    early_exit: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``min(params.budget_for(n - sink), k)`` largest finite ranks, in list order.

    Reference: ``redknot.lfps.batched.rank_topk_in_list_order``. The set is
    ``torch.topk(rank, k)``'s cut to the row's budget, ties at the cut going to the lowest
    indices; ``lfps_select`` takes it in place of ``torch.topk``'s output.

    Parameters
    ----------
    rank : [B, Hs, C] float32, ``-inf`` where not a key (no NaN).
    seq_lens : [B], keys including the new token's.
    k : K, the width of the result (``1 <= k <= C``).
    block, num_warps : ranks per inner step (a power of two) and warps; default a whole row
        (up to ``max_block``, then held in registers) and a warp per 256 of it (4 to
        ``TOPK_WARPS``).
    radix_bits : key bits per pass (``cdiv(32, radix_bits)`` histogram passes, 1 to 8).
    early_exit : stop the passes once the bin found holds exactly the keys still wanted
        (default :data:`TOPK_EARLY_EXIT`); the same result.

    Returns
    -------
    top_val : [B, Hs, k] float32, the selected ranks by ascending index, then ``-inf``.
    top_at : [B, Hs, k] int64, their indices in the row, then 0.
    """
    B, Hs, C = rank.shape
    assert rank.dtype == torch.float32 and rank.stride(2) == 1, (rank.dtype, rank.stride())
    assert seq_lens.shape == (B,) and 1 <= k <= C, (seq_lens.shape, k, C)
    if block is None:
        block = min(max_block, max(16, 1 << (C - 1).bit_length()))
    assert block & (block - 1) == 0 and 1 <= radix_bits <= 8, (block, radix_bits)
    if num_warps is None:
        num_warps = max(4, min(TOPK_WARPS, block // 256))
    top_val = torch.empty(B, Hs, k, dtype=torch.float32, device=rank.device)
    top_at = torch.empty(B, Hs, k, dtype=torch.int64, device=rank.device)
    if B == 0:
        return top_val, top_at
    budget, fraction = row_budget_args(params, rank.device)
    lfps_topk_kernel[(Hs, B)](
        rank, seq_lens, budget, top_val, top_at, params.num_sink, k, C,
        rank.stride(0), rank.stride(1), top_val.stride(0), top_val.stride(1),
        BLOCK=block, ONE_BLOCK=block >= C, RADIX_BITS=radix_bits, FRACTION=fraction,
        EARLY_EXIT=TOPK_EARLY_EXIT if early_exit is None else early_exit, num_warps=num_warps,
    )  # fmt: skip
    return top_val, top_at


def lfps_union(
    marks: torch.Tensor, width: int, *, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The marked entries of each row in list order, ``width`` wide (the union of its query
    heads' selections, ``redknot.lfps.batched.union_marks``).

    Reference: ``rank_topk_in_list_order(marks, width, width)`` (every marked entry, as
    ``lfps_topk`` with a budget of ``width`` gives them), in one pass over the row.

    Parameters
    ----------
    marks : [B, Hs, C] float32, 0 where marked, ``-inf`` elsewhere; at most ``width`` marked.

    Returns
    -------
    top_val : [B, Hs, width] float32, 0 per marked entry, then ``-inf``.
    top_at : [B, Hs, width] int64, their indices in the row, then 0.
    filled : [B, Hs] int32, the marked entries (``filled`` of ``lfps_select`` and
        ``run_sparse_decode``).
    """
    B, Hs, C = marks.shape
    assert marks.dtype == torch.float32 and marks.stride(2) == 1, (marks.dtype, marks.stride())
    assert 1 <= width <= C and block & (block - 1) == 0, (width, C, block)
    top_val = torch.empty(B, Hs, width, dtype=torch.float32, device=marks.device)
    top_at = torch.empty(B, Hs, width, dtype=torch.int64, device=marks.device)
    filled = torch.empty(B, Hs, dtype=torch.int32, device=marks.device)
    if B == 0:
        return top_val, top_at, filled
    lfps_union_kernel[(Hs, B)](
        marks, top_val, top_at, filled, C, width, marks.stride(0), marks.stride(1),
        top_val.stride(0), top_val.stride(1), filled.stride(0), BLOCK=block,
    )  # fmt: skip
    return top_val, top_at, filled


@dataclass(frozen=True)
class SelectedValues:
    """Where :func:`lfps_update` reads what the attention over a selection needs besides the
    logits: the values of Top-K entry ``e`` at position ``indices[b, hs, e]`` of ``v_buffer``
    (through ``req_to_token``, where ``num_sink <= p < seq_lens[b]``; ``indices`` None: at its
    selected position, in the store the tables index), and the sinks' keys and values
    (positions ``< min(num_sink, seq_lens[b])``). The store being read, or staging buffers
    holding its rows (``redknot.kernels.host_stage``: ``st.k, st.v, st.req_to_token,
    st.req_pool_indices, st.seq_lens, st.indices``)."""

    q: torch.Tensor  # [B, Hq, D] fp16/bf16
    k_buffer: torch.Tensor  # [slots, Hkv, D] like q
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [R, ctx] int32
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    indices: torch.Tensor | None  # [B, Hs, K] int32, or None: the selection's positions
    sm_scale: float
    bypass_out: torch.Tensor  # [B, Hq, D] float32, the bypassed heads' output


@dataclass(frozen=True)
class LfpsSelection:
    """What :func:`lfps_select` leaves for :func:`lfps_update`: its inputs, the selection and
    each segment's softmax stats."""

    top_val: torch.Tensor
    top_at: torch.Tensor
    candidates: torch.Tensor
    count: torch.Tensor
    logits: torch.Tensor
    bypass: torch.Tensor
    seq_lens: torch.Tensor
    state: LfpsBatchState
    params: LfpsParams
    filled: torch.Tensor | None
    block: int
    selected: torch.Tensor  # [B, Hs, K] int32 positions, -1 past the budget or the candidates
    stats: torch.Tensor  # [B, Hs, segments, rows, 2] float32 (max, sum of exponentials)


def lfps_select(
    top_val: torch.Tensor,
    top_at: torch.Tensor,
    candidates: torch.Tensor,
    count: torch.Tensor,
    logits: torch.Tensor,
    bypass: torch.Tensor,
    seq_lens: torch.Tensor,
    state: LfpsBatchState,
    params: LfpsParams,
    filled: torch.Tensor | None = None,
    *,
    block: int | None = None,
) -> LfpsSelection:
    """The selection from the Top-K of the rank, with each segment of ``block`` entries' softmax
    stats, and the decay of Eq. 10 (:func:`lfps_update` adds the attention: the softmax over a
    row's selection needs every segment's stats before any entry's attention is added).

    Parameters
    ----------
    top_val, top_at : [B, Hs, K] ``lfps_topk(rank, ...)``'s values (float32) and indices (int64),
        or ``torch.topk(rank, K)``'s: entry ``e`` is kept if its value is finite and ``e`` is
        under the row's budget.
    candidates : [B, Hs, C] int32; count : [B, Hs] int32 (both emptied for a selection head
        whose query heads all bypass).
    logits : [B, Hq, C] float32 every query head's logits of the candidates.
    bypass : [B, Hq] bool.
    filled : optional [B, Hs] int32: entries past this many are padding (``-1`` written, not
        read; ``lfps_union``'s count).
    block : Top-K entries per program (a power of two; default ``UPDATE_BLOCK_K``).
    """
    block = block or UPDATE_BLOCK_K
    B, Hs, K = top_val.shape
    Hq, C = logits.shape[1:]
    assert top_at.shape == (B, Hs, K) and top_at.dtype == torch.int64, top_at.dtype
    assert top_at.stride() == top_val.stride(), (top_at.stride(), top_val.stride())
    assert candidates.shape == (B, Hs, C) and candidates.dtype == torch.int32
    assert count.shape == (B, Hs) and logits.shape == (B, Hq, C) and bypass.shape == (B, Hq)
    assert state.batch_size == B and state.selection_heads == Hs and Hq == Hs * state.rows
    for t in (top_val, top_at, candidates, logits):
        assert t.stride(-1) == 1, t.stride()
    if filled is not None:
        assert filled.shape == (B, Hs) and filled.dtype == torch.int32 and filled.stride(1) == 1
    selected = torch.empty(B, Hs, K, dtype=torch.int32, device=top_val.device)
    segments = triton.cdiv(K, block)
    stats = torch.empty(B, Hs, segments, state.rows, 2, dtype=torch.float32,
                        device=top_val.device)  # fmt: skip
    sel = LfpsSelection(top_val, top_at, candidates, count, logits, bypass, seq_lens, state,
                        params, filled, block, selected, stats)  # fmt: skip
    if B == 0:
        return sel
    budget, fraction = row_budget_args(params, top_val.device)
    flags = bypass.view(torch.int8)
    fill = selected if filled is None else filled
    fill_stride = 0 if filled is None else filled.stride(0)
    lfps_update_stats_kernel[(segments, Hs, B)](
        top_val, top_at, candidates, logits, flags, seq_lens, budget, state.scale,
        state.state_rows(), selected, fill, stats,
        params.decay, params.num_sink, K,
        *_top_strides(sel), logits.stride(0), logits.stride(1), flags.stride(0),
        state.scale.stride(0), selected.stride(0), selected.stride(1), fill_stride,
        stats.stride(0), stats.stride(1), stats.stride(2),
        **_update_constants(sel, fraction, block_r=None),
    )  # fmt: skip
    return sel


def _top_strides(sel: LfpsSelection) -> tuple[int, ...]:
    return (sel.top_val.stride(0), sel.top_val.stride(1), sel.candidates.stride(0),
            sel.candidates.stride(1))  # fmt: skip


def _update_constants(sel: LfpsSelection, fraction: bool, block_r: int | None) -> dict:
    rows = sel.state.rows
    return {
        "HAS_FILLED": sel.filled is not None,
        "ROWS": rows,
        "BLOCK_R": block_r or max(2, 1 << (rows - 1).bit_length()),
        "BLOCK_K": sel.block,
        "FRACTION": fraction,
    }


def lfps_update(sel: LfpsSelection, attend: SelectedValues | None = None) -> torch.Tensor | None:
    """Eq. 10's adds of :func:`lfps_select`'s selection to its state (in place); with
    ``attend``, the same launch also weights the selection's values, and a second one gives
    every head's output: the attention over its sinks and the selection (what
    ``run_sparse_decode`` gives for the sinks and ``sel.selected``, without reading a key
    again: the logits are the scoring's), or the bypass output for a bypassed head.

    Returns
    -------
    out : [B, Hq, D] like ``attend.q`` (None without ``attend``).
    """
    top_val, state, logits = sel.top_val, sel.state, sel.logits
    B, Hs, K = top_val.shape
    Hq, C = logits.shape[1:]
    segments = sel.stats.shape[2]
    dev = top_val.device
    if attend is not None:
        q = attend.q
        D = q.shape[2]
        Hkv = attend.k_buffer.shape[1]
        assert q.shape == (B, Hq) + (D,) and q.dtype in (torch.float16, torch.bfloat16)
        for store in (attend.k_buffer, attend.v_buffer):
            assert store.shape[1:] == (Hkv, D) and store.dtype == q.dtype, store.shape
            assert store.stride(2) == 1 and Hq % Hkv == 0, store.stride()
        idx = sel.selected if attend.indices is None else attend.indices
        assert idx.shape == (B, Hs, K) and idx.dtype == torch.int32 and idx.stride(2) == 1
        assert attend.req_to_token.dtype == torch.int32
        assert attend.bypass_out.shape == (B, Hq, D), attend.bypass_out.shape
        out = torch.empty_like(q)
        part_o = torch.empty(B, Hq, segments, D, dtype=torch.float32, device=dev)
        lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
        values = (attend.v_buffer, attend.req_to_token, attend.req_pool_indices,
                  attend.seq_lens, idx, part_o, lse)  # fmt: skip
        value_strides = (attend.v_buffer.stride(0), attend.v_buffer.stride(1),
                         attend.req_to_token.stride(0), idx.stride(0), idx.stride(1),
                         part_o.stride(0), part_o.stride(1), part_o.stride(2),
                         lse.stride(0))  # fmt: skip
        grp, head_dim = Hq // Hkv, D
    else:
        out = None
        values = (top_val,) * 7  # not read
        value_strides = (0,) * 9
        grp, head_dim = 1, 16
    if B == 0:
        return out
    budget, fraction = row_budget_args(sel.params, dev)
    flags = sel.bypass.view(torch.int8)
    fill = sel.selected if sel.filled is None else sel.filled
    fill_stride = 0 if sel.filled is None else sel.filled.stride(0)
    stats = sel.stats
    lfps_update_add_kernel[(segments, Hs, B)](
        top_val, sel.top_at, sel.candidates, sel.count, logits, flags, sel.seq_lens, budget,
        state.vertical, state.slash, state.scale, state.state_rows(), fill, stats, *values,
        sel.params.decay, sel.params.num_sink, K, C,
        *_top_strides(sel), sel.count.stride(0), logits.stride(0), logits.stride(1),
        flags.stride(0), state.vertical.stride(0), state.vertical.stride(1),
        state.slash.stride(0), state.slash.stride(1), state.scale.stride(0), fill_stride,
        stats.stride(0), stats.stride(1), stats.stride(2), *value_strides,
        SEGMENTS_P2=max(2, 1 << (segments - 1).bit_length()), ATTEND=attend is not None,
        DIRECT=attend is not None and attend.indices is None, GRP=grp, HEAD_DIM=head_dim,
        UPCAST=attend is not None and upcast_dots(attend.q.dtype),
        **_update_constants(sel, fraction, block_r=16 if attend is not None else None),
        num_warps=UPDATE_WARPS,
    )  # fmt: skip
    if attend is None:
        return None
    a, bo = attend, attend.bypass_out
    lfps_attend_merge_kernel[(B, Hq)](
        a.q, a.k_buffer, a.v_buffer, a.req_to_token, a.req_pool_indices, a.seq_lens, part_o,
        lse, flags, bo, out,
        a.sm_scale, sel.params.num_sink, segments,
        a.q.stride(0), a.q.stride(1), a.k_buffer.stride(0), a.k_buffer.stride(1),
        a.v_buffer.stride(0), a.v_buffer.stride(1), a.req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), lse.stride(0), flags.stride(0),
        bo.stride(0), bo.stride(1), out.stride(0), out.stride(1),
        GRP=grp, SINKS_P2=max(2, 1 << max(0, sel.params.num_sink - 1).bit_length()),
        SEGMENTS_P2=max(2, 1 << (segments - 1).bit_length()), HEAD_DIM=head_dim,
    )  # fmt: skip
    return out
