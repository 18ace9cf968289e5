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
