"""One LFPS decode step for a batch of requests over SGLang's paged KV store, in fixed shapes
(no ``.item()``, no data-dependent shape, no host sync: capturable in a CUDA graph).

>>> budgets = LfpsBudgets(candidates=4 * k, topk=k)     # k >= params.budget_for(n - sink)
>>> plan = plan_sparse_decode(batch_size=B, num_q_heads=Hq, head_dim=D, rows=state.rows,
...                           width=k, num_sink=params.num_sink, device="cuda")
>>> res = lfps_decode_step(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
...                        state, params, budgets, kernels=True, plan=plan)   # state updated
>>> res.output                                           # [B, Hq, D]

The step, per selection head (``redknot.lfps.batch_state``), with its launches (``kernels=True``;
the PyTorch functions of this module are their references):

| stage          | reference ``lfps_step``      | here                                          |
| -------------- | ---------------------------- | --------------------------------------------- |
| Eq. 5-6        | per query head               | ``lfps_sparsity`` (sink and last keys)        |
| Eq. 7-9        | variable-size candidate mask | ``lfps_candidates``: list of ``C``            |
|                |                              | (``fixed_budget``), 3 launches                |
| scores, Top-k  | every key scored, masked     | ``score_and_rank`` on the list, ``lfps_topk``:|
|                |                              | each row's own budget (``<= K``) by a radix   |
|                |                              | select, in list order                         |
| Eq. 10         | whole tables decayed         | ``lfps_select``, ``lfps_update``: lazy decay, |
|                |                              | only the selected entries written             |
| attention      | sinks + Top-k                | ``lfps_update``: from the scoring's logits    |
|                |                              | and the selected values, sinks and bypass     |
|                |                              | output merged (``run_sparse_decode`` for rows |
|                |                              | listing every key)                            |

With ``rows = 1`` and ``C`` at least every row's candidate count this is the reference exactly
(``tests/lfps/test_batched.py``). With ``rows = Hq / Hkv`` (one selection per KV head, read once
by the kernel for all its query heads) the tables are per KV head: a key's rank is the maximum
logit over the group's non-bypassed query heads, each query head attends the shared selection,
Eq. 10 adds the mean over the non-bypassed heads of their attention renormalised over the
selection, and a group whose heads all bypass is left untouched. ``LfpsBudgets.union``
keeps the lists and tables per KV head but lets each query head choose its own Top-k among the
list's candidates; the list attends the union of its heads' choices (up to ``rows`` times the
budget, each key read once for the group), which keeps each head's choice whole: ``lfps_topk``
over every query head's logits, ``union_marks``, then ``lfps_union`` (the marked entries in
list order).

The selection is in list order (newest position first), not by rank; its consumers (Eq. 10,
the sparse attention) do not depend on the order. Ties in rank at a row's cut go to the
earliest entries of the list, i.e. the newest positions (``rank_topk``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from redknot.kernels.host_stage import HostStage, stage_rows
from redknot.kernels.lfps_index import lfps_candidates, score_and_rank
from redknot.kernels.lfps_step import (
    TOPK_QUERY_ROWS_MAX_BLOCK,
    SelectedValues,
    lfps_select,
    lfps_sparsity,
    lfps_topk,
    lfps_union,
    lfps_update,
)
from redknot.kernels.sparse_decode import SparseDecodePlan, plan_sparse_decode, run_sparse_decode
from redknot.kernels.sparse_reference import score_keys_reference, sparse_decode_reference
from redknot.lfps.batch_state import LfpsBatchState
from redknot.lfps.fixed_budget import candidates_reference
from redknot.lfps.params import LfpsParams


@dataclass(frozen=True)
class LfpsBudgets:
    """Fixed widths of a step: ``candidates`` (C) listed and scored, ``topk`` (K) selected per
    selection head. A row whose ``params.budget_for(n - sink)`` exceeds K keeps K.

    ``union``: 1, a list's Top-K ranked by the maximum logit over its query heads; or the
    state's ``rows`` (one list per KV head), every query head of the list choosing its own
    Top-K and the list attending their union, ``width`` keys at most."""

    candidates: int
    topk: int
    union: int = 1

    def __post_init__(self) -> None:
        assert 1 <= self.topk <= self.candidates, (self.topk, self.candidates)
        assert self.union >= 1, self.union

    @property
    def width(self) -> int:
        """Keys a selection head attends at most: ``topk``, or the union's bound."""
        return min(self.topk * self.union, self.candidates)


@dataclass
class LfpsBatchResult:
    """What one batched step produced (``Hs`` selection heads; the state is updated in place)."""

    output: torch.Tensor  # [B, Hq, D] like q
    selected: torch.Tensor  # [B, Hs, budgets.width] int32 attended non-sink positions, -1 padded
    candidates: torch.Tensor  # [B, Hs, C] int32 listed positions, -1 padded
    candidate_count: torch.Tensor  # [B, Hs] int32, candidates before the capacity (0: bypass)
    bypass: torch.Tensor  # [B, Hq] bool, heads that took the sink-plus-mean bypass
    sparsity: torch.Tensor  # [B, Hq] float32, Eq. 6's estimate


def gather_keys(buffer, req_to_token, req_pool_indices, positions, valid) -> torch.Tensor:
    """[B, P, Hkv, D] float32 entries of ``buffer`` at ``positions`` [B, P] (0 where not
    ``valid``)."""
    slots = req_to_token[req_pool_indices[:, None], positions.clamp_min(0)].long()
    return torch.where(valid[..., None, None], buffer[slots].float(), 0.0)


def head_sparsity(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    state: LfpsBatchState,
    params: LfpsParams,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5-6 and the bypass output (``redknot.lfps.sparsity``) for every query head.

    Returns:
        sparsity: [B, Hq] float32 (0 for rows without a non-sink key, or without sinks).
        bypass_out: [B, Hq, D] float32, softmax over the sinks and the count-weighted mean key
            applied to the sink values and the mean value.
    """
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    grp = Hq // Hkv
    s, w = params.num_sink, params.local_window
    n = seq_lens.view(B, 1).long()
    if s == 0:
        return torch.zeros(B, Hq, device=q.device), torch.zeros(B, Hq, D, device=q.device)
    pos = torch.cat(
        [torch.arange(s, device=q.device).expand(B, s), n - w + torch.arange(w, device=q.device)],
        dim=1,
    )  # [B, s + w]: the sinks, then the last w keys (local term, non-sink ones only)
    valid = torch.cat([pos[:, :s] < n, (pos[:, s:] >= s) & (pos[:, s:] < n)], dim=1)
    keys = gather_keys(k_buffer, req_to_token, req_pool_indices, pos, valid)
    qg = q.float().view(B, Hkv, grp, D)
    logits = torch.einsum("bkgd,bpkd->bkgp", qg, keys).reshape(B, Hq, s + w) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logits = logits[..., :s]
    sink = torch.logsumexp(sink_logits, -1)
    local = torch.logsumexp(logits[..., s:], -1)
    idx = state.state_rows().long()
    mean_key = state.mean_key[idx].repeat_interleave(grp, 1)  # [B, Hq, D]
    mean_value = state.mean_value[idx].repeat_interleave(grp, 1)
    qf = q.float()
    mu = (qf * mean_key).sum(-1) * sm_scale
    spread = sm_scale * qf.norm(dim=-1) * mean_key.norm(dim=-1)
    sigma2 = state.query_stat[idx] * spread.square()
    log_rest = torch.log((n - s).clamp_min(1).float())  # [B, 1]
    rest = torch.maximum(log_rest + mu + 0.5 * sigma2, local)
    has_rest = n > s
    sparsity = torch.where(has_rest, torch.sigmoid(sink - rest), 0.0)

    mean_logit = mu + log_rest
    probs = torch.softmax(torch.cat([sink_logits, mean_logit[..., None]], -1), -1)
    sink_values = gather_keys(v_buffer, req_to_token, req_pool_indices, pos[:, :s], valid[:, :s])
    vals = sink_values.repeat_interleave(grp, 2)  # [B, s, Hq, D]
    bypass_out = torch.einsum("bhs,bshd->bhd", probs[..., :s], vals)
    bypass_out = bypass_out + probs[..., s:] * mean_value
    return sparsity, bypass_out


def row_budgets(seq_lens: torch.Tensor, params: LfpsParams) -> torch.Tensor:
    """[B] int64 ``params.budget_for(n - sink)`` on the device (1 for rows without such keys)."""
    keys = (seq_lens.long() - params.num_sink).clamp_min(0)
    if isinstance(params.budget, float) and params.budget < 1.0:
        k = torch.round(params.budget * keys.double()).long()
    else:
        k = torch.full_like(keys, int(params.budget))
    return torch.minimum(k, keys).clamp_min(1)


def rank_topk(
    rank: torch.Tensor, budget: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``min(budget, k)`` largest finite ranks by descending rank; among equal ranks
    the lowest index first (a stable sort), so ties at the cut go to the lowest indices.

    Args:
        rank: [B, Hs, C] float32 (``-inf``: not a key); budget: [B] int64.
    Returns:
        values [B, Hs, k] float32 and indices [B, Hs, k] int64; ``(-inf, 0)`` past the kept.
    """
    B = rank.shape[0]
    order = torch.sort(rank, dim=-1, descending=True, stable=True)
    val, at = order.values[..., :k], order.indices[..., :k]
    keep = torch.isfinite(val) & (torch.arange(k, device=val.device) < budget.view(B, 1, 1))
    return val.masked_fill(~keep, float("-inf")), at.masked_fill(~keep, 0)


def in_list_order(val: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rank_topk``'s entries by ascending index, the ``(-inf, 0)`` padding last."""
    key = torch.where(torch.isfinite(val), at, torch.iinfo(torch.int64).max)
    order = key.argsort(dim=-1, stable=True)
    return torch.gather(val, -1, order), torch.gather(at, -1, order)


def rank_topk_in_list_order(
    rank: torch.Tensor, budget: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``redknot.kernels.lfps_step.lfps_topk``: ``rank_topk`` in list order."""
    return in_list_order(*rank_topk(rank, budget, k))


def union_marks(top_val: torch.Tensor, top_at: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """[B, Hs, size] float32: 0 at the list entries that any of a list's ``rows`` query heads
    selected, -inf elsewhere.

    Args:
        top_val, top_at: [B, Hq, K] each query head's selection (``rank_topk`` or ``lfps_topk``:
            an entry counts where its value is finite; padding may repeat an index).
    """
    B, Hq, K = top_at.shape
    src = torch.where(torch.isfinite(top_val), 0.0, float("-inf"))
    marks = torch.full((B, Hq // rows, size), float("-inf"), device=top_val.device)
    shape = (B, Hq // rows, rows * K)
    return marks.scatter_reduce_(2, top_at.reshape(shape), src.reshape(shape), "amax")


def select_topk(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    bypass: torch.Tensor,
    budget: torch.Tensor,
    k: int,
    *,
    list_order: bool = False,
    union: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of each list by its rank (maximum logit over the non-bypassed query heads),
    then each row's ``budget`` first (``rank_topk``: ties to the lowest list index).
    ``union``: instead every non-bypassed query head takes the Top-``k`` (then ``budget``) of
    its own logits, and each list keeps the union of its heads' selections, in list order,
    ``rows * k`` wide.

    Args:
        logits: [B, Hq, C] float32 scaled logits of the listed keys (-inf: not a key).
        candidates: [B, Hs, C] int32 positions.
        bypass: [B, Hq] bool; budget: [B] int64.
        list_order: order the selection as the list (``lfps_topk``'s order) instead of by rank.
    Returns:
        selected: [B, Hs, k] int32 positions (-1 padded), descending rank or list order
            (``union``: [B, Hs, min(rows * k, C)], list order).
        selected_logits: [B, Hq, k] float32 each query head's logits of them (-inf: padding).
    """
    B, Hq, C = logits.shape
    Hs = candidates.shape[1]
    rows = Hq // Hs
    if union:
        val, at = rank_topk(logits.masked_fill(bypass[..., None], float("-inf")), budget, k)
        width = min(rows * k, C)
        marks = union_marks(val, at, rows, C)
        val, at = rank_topk(marks, torch.full_like(budget, width), width)  # equal: list order
    else:
        rank = logits.masked_fill(bypass[..., None], float("-inf")).view(B, Hs, rows, C).amax(2)
        val, at = rank_topk(rank, budget, k)
        if list_order:
            val, at = in_list_order(val, at)
    keep = torch.isfinite(val)
    selected = torch.where(keep, torch.gather(candidates, 2, at), -1)
    per_head = torch.gather(logits, 2, at.repeat_interleave(rows, 1))
    per_head = per_head.masked_fill(~keep.repeat_interleave(rows, 1), float("-inf"))
    return selected, per_head


def update_tables_(
    state: LfpsBatchState,
    selected: torch.Tensor,
    selected_logits: torch.Tensor,
    bypass: torch.Tensor,
    seq_lens: torch.Tensor,
    decay: float,
) -> None:
    """Eq. 10 in place with the lazy decay: each selection head with a non-bypassed query head
    decays (``scale *= decay``) and adds ``(1 - decay) / 2`` times the mean over those heads of
    their attention renormalised over ``selected``, at each selected position (vertical) and
    distance ``t - j`` (slash)."""
    B, Hs, k = selected.shape
    rows = state.rows
    active = ~bypass  # [B, Hq]
    attn = torch.softmax(selected_logits, -1).nan_to_num(0.0) * active[..., None]
    heads = active.view(B, Hs, rows).sum(-1)  # [B, Hs]
    mean_attn = attn.view(B, Hs, rows, k).sum(2) / heads.clamp_min(1)[..., None]
    idx = state.state_rows().long()
    vertical, slash, scale = state.vertical[idx], state.slash[idx], state.scale[idx]
    new_scale = torch.where(heads > 0, scale * decay, scale)
    add = (1.0 - decay) * 0.5 * mean_attn / new_scale[..., None]
    add = torch.where(selected >= 0, add, 0.0)
    N = state.max_len
    t = seq_lens.view(B, 1, 1).long() - 1
    vertical.scatter_add_(2, selected.long().clamp_min(0), add)
    slash.scatter_add_(2, (t - selected.long()).clamp(0, N - 1), add)
    state.vertical[idx], state.slash[idx], state.scale[idx] = vertical, slash, new_scale


def every_key(
    selected: torch.Tensor, dense: torch.Tensor, seq_lens: torch.Tensor, num_sink: int
) -> torch.Tensor:
    """``selected`` [B, Hs, K] with the rows of ``dense`` [B] listing every non-sink position
    below their length (the first ``K`` of them), -1 after."""
    width = selected.shape[2]
    listed = num_sink + torch.arange(width, device=selected.device, dtype=torch.int32)
    listed = torch.where(listed < seq_lens.view(-1, 1), listed, -1)  # [B, K]
    return torch.where(dense.view(-1, 1, 1), listed[:, None, :], selected).contiguous()


def host_stages(batch_size: int, num_kv_heads: int, head_dim: int, params: LfpsParams,
                budgets: LfpsBudgets, dtype: torch.dtype,
                device: torch.device | str) -> tuple[HostStage, HostStage]:  # fmt: skip
    """The staging buffers :func:`lfps_decode_step` takes as ``stage`` (a store in host memory):
    the candidates' keys (``budgets.candidates`` wide, keys only) and the sinks and selected
    keys and values (``budgets.width`` wide)."""
    shape = (batch_size, num_kv_heads, head_dim)
    return (
        HostStage.empty(*shape, num_sink=params.num_sink, width=budgets.candidates, dtype=dtype,
                        device=device, values=False),
        HostStage.empty(*shape, num_sink=params.num_sink, width=budgets.width, dtype=dtype,
                        device=device),
    )  # fmt: skip


def lfps_decode_step(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    state: LfpsBatchState,
    params: LfpsParams,
    budgets: LfpsBudgets,
    *,
    sm_scale: float | None = None,
    kernels: bool = True,
    plan: SparseDecodePlan | None = None,
    dense: torch.Tensor | None = None,
    stage: tuple[HostStage, HostStage] | None = None,
) -> LfpsBatchResult:
    """Attend one new token per request with LFPS; ``state`` is updated in place (Eq. 10).

    ``dense`` ([B] bool): requests attended over every key instead (no bypass; their
    selection lists positions ``num_sink .. n - 1``, which ``budgets.width`` must hold); their
    state row is updated as any other, so give them a scratch row (``state.index``).

    Args:
        q: [B, Hq, D] fp16/bf16, post-RoPE queries of positions ``seq_lens - 1``.
        k_buffer, v_buffer: [slots, Hkv, D] the layer's paged store, holding the new token.
        req_to_token: [R, max_ctx] int32; req_pool_indices, seq_lens: [B].
        state: tables covering ``seq_lens - 1`` keys (``seq_lens <= state.max_len``).
        kernels: the Triton kernels (else the PyTorch references of this module, for tests).
        plan: the sparse attention's plan (width ``budgets.width``; made here if None).
        stage: for a store in host memory (selections per KV head, kernels only;
            :func:`host_stages`): the candidates' keys and the sinks and selected keys and
            values are gathered into these GPU buffers first
            (:func:`redknot.kernels.host_stage.stage_rows`) and scored and attended there; the
            result is the same bit for bit.
    """
    B, Hq, D = q.shape
    assert stage is None or kernels, "staging buffers feed the Triton path only"
    assert budgets.union in (1, state.rows), (budgets.union, state.rows)
    union = budgets.union > 1
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    paged = (req_to_token, req_pool_indices, seq_lens)
    rows = state.state_rows()
    if kernels:
        tables = (state.vertical, state.slash, state.scale)
    else:  # the reference reads each request's row, gathered once
        idx = rows.long()
        tables = (state.vertical[idx], state.slash[idx], state.scale[idx])
    tables = (*tables, seq_lens, params, budgets.candidates)
    if kernels:
        sparsity, bypass, bypass_out = lfps_sparsity(
            q, k_buffer, v_buffer, *paged, state, params, sm_scale
        )
        if dense is not None:
            bypass = bypass & ~dense[:, None]
        cand, count = lfps_candidates(*tables, rows=rows)
        scored = (k_buffer, paged, cand)
        if stage is not None:
            assert state.selection_heads == k_buffer.shape[1], "staging needs lists per KV head"
            st = stage_rows(stage[0], k_buffer, None, *paged, cand, sinks=False)
            scored = (st.k, (st.req_to_token, st.req_pool_indices, st.seq_lens), st.indices)
        logits, rank = score_and_rank(q, scored[0], *scored[1], scored[2], bypass,
                                      num_sink=params.num_sink, sm_scale=sm_scale)  # fmt: skip
        chosen, filled = params, None
        if union:
            rank = logits.masked_fill(bypass[..., None], float("-inf"))
            val, at = lfps_topk(rank, seq_lens, params, budgets.topk,
                                max_block=TOPK_QUERY_ROWS_MAX_BLOCK)  # fmt: skip
            chosen = dataclasses.replace(params, budget=budgets.width)  # every marked entry
            marks = union_marks(val, at, state.rows, cand.shape[2])
            val, at, filled = lfps_union(marks, budgets.width)
        else:
            val, at = lfps_topk(rank, seq_lens, params, budgets.topk)
        sel = lfps_select(val, at, cand, count, logits, bypass, seq_lens, state, chosen, filled)
        selected = attended = sel.selected
        if dense is not None:
            attended = every_key(selected, dense, seq_lens, params.num_sink)
        store, listed = (k_buffer, v_buffer, *paged), attended
        values = None  # the selection's own positions in the store
        if stage is not None:
            st = stage_rows(stage[1], k_buffer, v_buffer, *paged, attended)
            store = (st.k, st.v, st.req_to_token, st.req_pool_indices, st.seq_lens)
            listed = values = st.indices
        out = lfps_update(sel, SelectedValues(q, *store, values, sm_scale, bypass_out))
        if dense is not None:  # rows listing every key: attended by the sparse attention
            if plan is None:
                plan = plan_sparse_decode(
                    batch_size=B, num_q_heads=Hq, head_dim=D, rows=state.rows,
                    width=budgets.width, num_sink=params.num_sink, device=q.device,
                )  # fmt: skip
            filled = (dense.to(torch.int32) * budgets.width)[:, None]  # others: sinks only
            filled = filled.repeat(1, state.selection_heads)
            out_dense = run_sparse_decode(plan, q, *store, listed, sm_scale, filled=filled)
            out = torch.where(dense[:, None, None], out_dense, out)
        selected = attended
    else:
        sparsity, bypass_out = head_sparsity(q, k_buffer, v_buffer, *paged, state, params, sm_scale)
        bypass = sparsity > params.sparsity_threshold
        if dense is not None:
            bypass = bypass & ~dense[:, None]
        groups_off = bypass.view(B, state.selection_heads, state.rows).all(-1)  # [B, Hs]
        cand, count = candidates_reference(*tables)
        cand = torch.where(groups_off[..., None], -1, cand)
        count = torch.where(groups_off, 0, count)
        logits = score_keys_reference(q, k_buffer, *paged, cand, params.num_sink, sm_scale)
        budget = row_budgets(seq_lens, params)
        selected, selected_logits = select_topk(logits, cand, bypass, budget, budgets.topk,
                                                list_order=True, union=union)  # fmt: skip
        update_tables_(state, selected, selected_logits, bypass, seq_lens, params.decay)
        if dense is not None:
            selected = every_key(selected, dense, seq_lens, params.num_sink)
        out, _ = sparse_decode_reference(
            q, k_buffer, v_buffer, *paged, selected, params.num_sink, sm_scale
        )
        out = torch.where(bypass[..., None], bypass_out.to(out.dtype), out)
    return LfpsBatchResult(out, selected, cand, count, bypass, sparsity)
