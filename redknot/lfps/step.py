"""One LFPS decode step for one request, batched over heads (Eq. 5-10)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.lfps.candidates import expand_candidates, initial_candidates
from redknot.lfps.params import LfpsParams
from redknot.lfps.sparsity import bypass_output, head_sparsity
from redknot.lfps.state import LfpsState


@dataclass
class LfpsStepResult:
    """What one step produced.

    Attributes:
        output: [H, D] float32, the attention output of each head.
        selected: [H, N] bool, keys attended (sinks included; all False on bypass heads).
        candidates: [H, N] bool, keys whose exact score was needed (Eq. 9's set).
        bypass: [H] bool, heads that took the sink-plus-mean bypass.
        sparsity: [H] float32, Eq. 6's estimate.
        state: the tables after Eq. 10, covering ``N`` keys.
    """

    output: torch.Tensor
    selected: torch.Tensor
    candidates: torch.Tensor
    bypass: torch.Tensor
    sparsity: torch.Tensor
    state: LfpsState


def grow(table: torch.Tensor, n: int) -> torch.Tensor:
    """Pad [H, M] with zeros on the right to [H, n]."""
    return torch.nn.functional.pad(table, (0, n - table.shape[1]))


def decayed_update(
    table_by_pos: torch.Tensor, half_weights: torch.Tensor, active: torch.Tensor, decay: float
) -> torch.Tensor:
    """Eq. 10 on heads where ``active`` ([H] bool); others are returned unchanged.

    ``table <- decay * table + (1 - decay) * half_weights`` with ``half_weights`` ([H, N]) half
    of the attention renormalised over the selected non-sink keys, zero off the selection.
    """
    updated = decay * table_by_pos + (1.0 - decay) * half_weights
    return torch.where(active.unsqueeze(-1), updated, table_by_pos)


def lfps_step(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    state: LfpsState,
    params: LfpsParams,
) -> LfpsStepResult:
    """Attend one new query with LFPS.

    Args:
        query: [H, D], the query of position ``t = N - 1``.
        keys, values: [H, N, D], the request's KV including the current token's (``N - 1``).
        state: tables covering ``N - 1`` keys (from ``build_state`` or the previous step).
        params: the knobs.
    Returns:
        ``LfpsStepResult``; ``state`` is a new object, the input is not modified.
    """
    n = keys.shape[1]
    if state.length != n - 1:
        raise ValueError(f"state covers {state.length} keys; expected {n - 1} (N - 1)")
    s = params.num_sink
    vertical = grow(state.vertical, n)
    slash = grow(state.slash, n)

    sparsity = head_sparsity(query, keys, state, params)
    bypass = sparsity > params.sparsity_threshold

    initial = initial_candidates(vertical, slash, params)
    candidates = expand_candidates(initial, vertical, slash, params)
    candidates &= ~bypass.unsqueeze(-1)

    # Exact scores on the candidates. The reference scores all keys and masks; a kernel gathers.
    logits = torch.einsum("hd,hnd->hn", query.float(), keys.float()) * state.scale
    masked = logits.masked_fill(~candidates, float("-inf"))
    k = min(params.budget_for(n - s), n - s)
    top = torch.topk(masked, k, dim=-1).indices
    chosen = torch.zeros_like(candidates).scatter_(1, top, True) & candidates

    selected = chosen.clone()
    selected[:, :s] = True
    attn = torch.softmax(logits.masked_fill(~selected, float("-inf")), dim=-1)
    dense_out = torch.einsum("hn,hnd->hd", attn, values.float())
    output = dense_out
    if s > 0:
        output = torch.where(
            bypass.unsqueeze(-1), bypass_output(query, keys, values, state, s), dense_out
        )
    selected &= ~bypass.unsqueeze(-1)

    half = 0.5 * torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1).nan_to_num(0.0)
    new_vertical = decayed_update(vertical, half, ~bypass, params.decay)
    new_slash_pos = decayed_update(slash.flip(-1), half, ~bypass, params.decay)
    new_state = LfpsState(
        vertical=new_vertical,
        slash=new_slash_pos.flip(-1),
        mean_key=state.mean_key,
        mean_value=state.mean_value,
        query_stat=state.query_stat,
        scale=state.scale,
    )
    return LfpsStepResult(output, selected, candidates, bypass, sparsity, new_state)
