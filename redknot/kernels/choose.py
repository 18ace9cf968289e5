"""The sparse FFN's choice of one request's rows in a deep layer, in place in the layer's keep
mask, with the number of rows it takes out counted on the device: one sort and one launch
instead of a chain of mask operations, and a synchronisation that reads only those counts.

>>> keep = held_mask.clone()                      # rows in recovery (or every row)
>>> skipped = torch.zeros(num_requests, dtype=torch.int32, device=dev)
>>> choose_rows(mass, spec.candidates, spec.candidate_rows, 0.5, keep, skipped, b)
>>> skipped.tolist()                              # how many rows of each request left

Semantics: :func:`redknot.kernels.reference.choose_rows_reference` (from
:func:`redknot.recovery.importance.important_mask`).
"""

from __future__ import annotations

import torch

from redknot.kernels.triton.choose import choose_kernel

BLOCK = 1024


def choose_rows(
    mass: torch.Tensor,
    candidates: torch.Tensor,
    rows: torch.Tensor,
    mass_thresh: float,
    keep: torch.Tensor,
    skipped: torch.Tensor,
    index: int,
    check_votes: bool = False,
) -> None:
    """Clear in ``keep`` the rows of the candidates that skip the FFN and write their number to
    ``skipped[index]``.

    Parameters
    ----------
    mass : [N] float32, importance of each key position of the request.
    candidates : [C] int64 positions (< N) to choose among; ``rows``: [C] int64 their batch rows.
    mass_thresh : the fewest candidates in decreasing mass holding this fraction of theirs are
        taken (0: none, 1: all); the others that are still in recovery skip.
    keep : [T] bool, the rows in recovery; a candidate whose row is False there is inactive
        (mass 0, never counted).
    skipped : [S] int32; ``skipped[index]`` is written only when some candidate can skip (keep
        it zeroed beforehand).
    check_votes : when the whole ``mass`` is zero (no head voted), nobody skips (tensor
        parallelism: a rank may hold no global head).
    """
    C = candidates.numel()
    assert mass.dtype == torch.float32 and keep.dtype == torch.bool, (mass.dtype, keep.dtype)
    assert rows.shape == candidates.shape and skipped.dtype == torch.int32, rows.shape
    if C == 0 or mass_thresh >= 1.0:  # every candidate taken
        return
    active = keep[rows]
    ordered, order = torch.sort(torch.where(active, mass[candidates], 0.0), descending=True,
                                stable=True)  # fmt: skip
    choose_kernel[(1,)](
        ordered, order, rows, mass, keep, skipped, index, C, mass.numel(), float(mass_thresh),
        CHECK_VOTES=check_votes, BLOCK=BLOCK,
    )  # fmt: skip
