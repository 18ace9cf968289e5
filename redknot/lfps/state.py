"""Per-head LFPS state built at the end of prefill: score tables (Eq. 4) and priors.

Layout (one request, ``H`` query heads; GQA callers expand K/V to query heads first):

| field         | shape    | dtype   | meaning                                               |
| ------------- | -------- | ------- | ----------------------------------------------------- |
| ``vertical``  | [H, N]   | float32 | score of key position ``j`` (sinks stay 0)            |
| ``slash``     | [H, N]   | float32 | score of distance ``d = t - j`` (query ``t``, key ``j``) |
| ``mean_key``  | [H, D]   | float32 | mean of the non-sink keys                             |
| ``mean_value``| [H, D]   | float32 | mean of the non-sink values                           |
| ``query_stat``| [H]      | float32 | Var(q) / ||q||^2 of the last prefill query            |

``N`` is the number of keys the tables cover (``length``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from redknot.lfps.params import LfpsParams


@dataclass
class LfpsState:
    """Score tables and priors of one request (see the module table for shapes)."""

    vertical: torch.Tensor
    slash: torch.Tensor
    mean_key: torch.Tensor
    mean_value: torch.Tensor
    query_stat: torch.Tensor
    scale: float

    @property
    def length(self) -> int:
        return int(self.vertical.shape[1])


def causal_weights(queries: torch.Tensor, keys: torch.Tensor, scale: float, num_sink: int):
    """Attention of the last ``m`` positions renormalised over the non-sink keys.

    Args:
        queries: [H, m, D], the queries of positions ``N - m .. N - 1``.
        keys: [H, N, D].
    Returns:
        [H, m, N] float32; row ``i`` sums to 1 over keys ``num_sink .. N - m + i``, zero elsewhere.
    """
    _, m, _ = queries.shape
    n = keys.shape[1]
    logits = torch.einsum("hmd,hnd->hmn", queries.float(), keys.float()) * scale
    pos_q = torch.arange(n - m, n).unsqueeze(1)
    pos_k = torch.arange(n).unsqueeze(0)
    allowed = (pos_k <= pos_q) & (pos_k >= num_sink)
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def distance_view(rows: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """Re-index rows by distance: ``out[..., i, d] = rows[..., i, query_pos[i] - d]`` (0 if < 0).

    Args:
        rows: [H, m, N]; query_pos: [m] long, the position of each row's query.
    Returns:
        [H, m, N], same dtype.
    """
    n = rows.shape[-1]
    d = torch.arange(n).unsqueeze(0)
    src = query_pos.unsqueeze(1) - d
    valid = src >= 0
    idx = src.clamp(min=0).expand(rows.shape[0], -1, -1)
    return torch.gather(rows, -1, idx) * valid


def table_norm(params: LfpsParams, steps: int) -> float:
    """Eq. 4's ``c``: with it the tables built from ``steps`` rows sum to 1/2, the steady-state
    sum of the Eq. 10 update, whose new term is half of a normalised attention row."""
    g = params.decay
    return 0.5 * (1.0 - g) / (1.0 - g**steps)


def build_state(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, params: LfpsParams
) -> LfpsState:
    """Eq. 4 and the per-head priors from the end of prefill.

    Args:
        queries: [H, m, D], the last ``m`` prefill queries (``m <= params.history_steps`` is
            used; older rows are dropped), positions ``N - m .. N - 1``.
        keys, values: [H, N, D], the prompt's keys (after RoPE) and values.
    Returns:
        the request's ``LfpsState`` covering ``N`` keys.
    """
    h, n, dim = keys.shape
    if queries.shape[0] != h or queries.shape[2] != dim:
        raise ValueError(f"queries {tuple(queries.shape)} do not match keys {tuple(keys.shape)}")
    if n <= params.num_sink:
        raise ValueError(f"prompt of {n} tokens has no key beyond the {params.num_sink} sinks")
    queries = queries[:, -params.history_steps :]
    m = queries.shape[1]
    scale = 1.0 / math.sqrt(dim)
    weights = causal_weights(queries, keys, scale, params.num_sink)  # [H, m, N]
    decay = params.decay ** torch.arange(m - 1, -1, -1, dtype=torch.float32)
    decay = decay * table_norm(params, m)  # [m]
    vertical = torch.einsum("hmn,m->hn", weights, decay)
    by_distance = distance_view(weights, torch.arange(n - m, n))
    slash = torch.einsum("hmn,m->hn", by_distance, decay)
    rest_k = keys[:, params.num_sink :].float()
    rest_v = values[:, params.num_sink :].float()
    q_last = queries[:, -1].float()
    query_stat = q_last.var(dim=-1, unbiased=False) / q_last.square().sum(-1).clamp_min(1e-30)
    return LfpsState(
        vertical=vertical,
        slash=slash,
        mean_key=rest_k.mean(1),
        mean_value=rest_v.mean(1),
        query_stat=query_stat,
        scale=scale,
    )
