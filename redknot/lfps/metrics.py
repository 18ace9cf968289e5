"""Eq. 2's overlap rate between a selection and the exact Top-k."""

from __future__ import annotations

import torch


def recall_vs_exact_topk(
    query: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor, k: int, num_sink: int
) -> torch.Tensor:
    """Share of the exact non-sink Top-k keys that ``chosen`` contains.

    Args:
        query: [H, D]; keys: [H, N, D]; chosen: [H, N] bool (sinks ignored); k: Top-k size.
    Returns:
        [H] float32 in [0, 1].
    """
    logits = torch.einsum("hd,hnd->hn", query.float(), keys.float())[:, num_sink:]
    exact = torch.topk(logits, k, dim=-1).indices
    hit = torch.gather(chosen[:, num_sink:], 1, exact)
    return hit.float().mean(-1)


def recall_vs_group_topk(
    query: torch.Tensor,
    keys: torch.Tensor,
    chosen: torch.Tensor,
    k: int,
    num_sink: int,
    rows: int,
    active: torch.Tensor,
) -> torch.Tensor:
    """Share of a KV head's exact non-sink Top-k that its shared selection ``chosen`` contains,
    the exact Top-k ranked as the engine's exact Top-k per KV head ranks it (``topk`` with lists
    per KV head): a key's score is its highest logit over the group's ``rows`` query heads that
    did not bypass.

    Args:
        query: [H, D]; keys: [H, N, D] (expanded to the query heads); chosen: [H // rows, N]
        bool (sinks ignored); k: Top-k size; active: [H] bool, the heads that did not bypass.
    Returns:
        [H // rows] float32 in [0, 1], NaN for a group whose heads all bypassed.
    """
    logits = torch.einsum("hd,hnd->hn", query.float(), keys.float())[:, num_sink:]
    logits = logits.masked_fill(~active[:, None], float("-inf"))
    group = logits.view(-1, rows, logits.shape[-1]).amax(1)
    exact = torch.topk(group, k, dim=-1).indices
    hit = torch.gather(chosen[:, num_sink:], 1, exact).float().mean(-1)
    return torch.where(active.view(-1, rows).any(1), hit, float("nan"))
