"""The sparse FFN's choice among one request's candidate rows, after they are sorted by mass.

One program. Pass 1 sums the sorted masses (float64; and, with ``CHECK_VOTES``, the mass of
every key, to tell whether any head voted); pass 2 walks them in decreasing order with a running
exclusive sum: a candidate is taken while the mass taken before it is short of ``mass_thresh``
of the total, and an active candidate (its row still in recovery) that is not taken is cleared
in ``Keep`` and counted. The semantics are
:func:`redknot.recovery.importance.important_mask`'s (ties broken by the sort's order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_cand", "num_keys", "out_index"])
def choose_kernel(
    Ordered,  # [C] fp32: the candidates' masses in decreasing order (0 for inactive ones)
    Order,  # [C] int64: the candidate of each
    Rows,  # [C] int64: the batch row of each candidate
    Mass,  # [num_keys] fp32: every key's mass (read with CHECK_VOTES only)
    Keep,  # [T] bool: rows in recovery on entry; the skipped candidates cleared on exit
    Skipped,  # [S] int32: the count of skipped candidates is written at out_index
    out_index,
    num_cand,
    num_keys,
    mass_thresh,
    CHECK_VOTES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, num_cand, BLOCK):
        v = tl.load(Ordered + start + offs, mask=start + offs < num_cand, other=0.0)
        total += v.to(tl.float64)
    total_mass = tl.sum(total, axis=0)
    voted = total_mass > 0
    any_vote = voted
    if CHECK_VOTES:
        every = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, num_keys, BLOCK):
            w = tl.load(Mass + start + offs, mask=start + offs < num_keys, other=0.0)
            every += w.to(tl.float64)
        any_vote = tl.sum(every, axis=0) > 0
    # nothing is taken when the candidates hold no mass (every exclusive sum is >= 0)
    limit = tl.where(voted, mass_thresh * total_mass, -1.0)
    before = total_mass * 0.0  # float64 running sum of the blocks before
    count = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for start in range(0, num_cand, BLOCK):
        inside = start + offs < num_cand
        v = tl.load(Ordered + start + offs, mask=inside, other=0.0).to(tl.float64)
        exclusive = before + tl.cumsum(v, axis=0) - v
        taken = exclusive < limit
        cand = tl.load(Order + start + offs, mask=inside, other=0)
        row = tl.load(Rows + cand, mask=inside, other=0)
        active = tl.load(Keep + row, mask=inside, other=0) != 0
        skip = inside & active & (taken == 0)
        if CHECK_VOTES:  # no global head on any rank voted: nobody skips
            skip = skip & ((offs * 0 + tl.where(any_vote, 1, 0)) != 0)
        tl.store(Keep + row, tl.zeros([BLOCK], dtype=tl.int1), mask=skip)
        count += tl.sum(skip.to(tl.int32), axis=0)
        before += tl.sum(v, axis=0)
    tl.store(Skipped + out_index, count)
