"""Token importance for the sparse FFN of deep layers (RedKnot §4.2, "partial sparse FFN"),
and the plain top-k of a score that the token-level policies select with (:func:`top_rows`).

Importance of a key row = attention mass the newest tokens put on it, summed over the probed
query rows and over query heads (``AttentionProbe.key_mass.sum(0)``), as the layer actually
attended (local heads within sink + window, segment KV as the policy served it). Among the
candidate rows (segment rows that do not run the FFN anyway), the most important are taken,
in decreasing mass, until ``mass_thresh`` of the candidates' total mass is covered.
"""

from __future__ import annotations

import torch
from torch import Tensor


def newest_rows(num_rows: int, question_start: int, recent_n: int, device=None) -> Tensor:
    """``[P]`` int64: rows ``[min(question_start, num_rows - recent_n), num_rows)``, the
    question and at least the last ``recent_n`` rows (rows of the current forward)."""
    start = max(min(question_start, num_rows - recent_n), 0)
    return torch.arange(start, num_rows, device=device)


def select_important(mass: Tensor, candidates: Tensor, mass_thresh: float) -> Tensor:
    """The fewest ``candidates`` whose mass reaches ``mass_thresh`` of theirs in total.

    Parameters
    ----------
    mass : ``[T]`` float, importance of every row.
    candidates : ``[C]`` int64 ascending rows to choose from.
    mass_thresh : in ``[0, 1]``; 0 chooses none, 1 chooses every candidate.

    Returns
    -------
    ``[K]`` int64 ascending: the ``K`` highest-mass candidates (ties: the lower row first), ``K``
    the smallest count whose mass is ``>= mass_thresh * total``.
    """
    return candidates[important_mask(mass, candidates, mass_thresh)]


def important_mask(
    mass: Tensor, candidates: Tensor, mass_thresh: float, active: Tensor | None = None
) -> Tensor:
    """:func:`select_important` as a ``[C]`` bool mask over ``candidates``, chosen among the
    ``active`` ones only (``[C]`` bool; default every one), without a host synchronisation.

    Inactive candidates count as mass 0 and are never chosen; they sort after every active
    candidate of positive mass, which the threshold always reaches first."""
    C = candidates.numel()
    if C == 0 or mass_thresh >= 1.0:
        chosen = torch.ones(C, dtype=torch.bool, device=candidates.device)
        return chosen if active is None else chosen & active
    if mass_thresh <= 0.0:
        return torch.zeros(C, dtype=torch.bool, device=candidates.device)
    m = mass[candidates]
    if active is not None:
        m = m * active
    ordered, order = torch.sort(m, descending=True, stable=True)
    covered = torch.cumsum(ordered, dim=0, dtype=torch.float64)
    total = covered[-1:]
    # taken in decreasing mass while the mass taken before is short of the threshold
    taken = (covered - ordered) < mass_thresh * total
    chosen = torch.empty_like(taken).scatter_(0, order, taken) & (total > 0)
    return chosen if active is None else chosen & active


def top_rows(scores: Tensor, candidates: Tensor, count: int) -> Tensor:
    """The ``count`` ``candidates`` of highest score.

    Parameters
    ----------
    scores : ``[T]`` float, the score of every row.
    candidates : ``[C]`` int64 ascending rows to choose from.
    count : how many to take (all when ``count >= C``).

    Returns
    -------
    ``[min(count, C)]`` int64 ascending; ties: the lower row first.
    """
    if count <= 0 or candidates.numel() == 0:
        return candidates[:0]
    if count >= candidates.numel():
        return candidates
    order = torch.argsort(scores[candidates].to(torch.float64), descending=True, stable=True)
    return torch.sort(candidates[order[:count]]).values
