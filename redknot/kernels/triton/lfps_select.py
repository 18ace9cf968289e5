"""LFPS's Top-K of the candidates' rank without a sort: a radix select per selection head.

``lfps_topk_kernel``, grid ``(Hs, B)``: of a row of ``C`` ranks (float32, ``-inf``: not a key),
the ``k = min(budget_for(n - num_sink), K, finite entries)`` largest, written in list order
(ascending index ``i``) as ``(value, i)`` to slots ``0 .. k - 1`` of the row's ``K``; the other
slots get ``(-inf, 0)``. Ties at the cut go to the lowest indices.

How: each rank becomes a 32-bit key that orders like the float (``-0.0`` taken as ``+0.0``;
``-inf`` and entries past ``C`` as 0, below every finite rank's key). ``cdiv(32, RADIX_BITS)``
passes over the row each build a ``2^RADIX_BITS``-bin histogram (``tl.histogram``: one warp
ballot per key bit) of the next ``RADIX_BITS`` bits of the keys that share the bits found so
far, most significant first; the bin where the count from the top reaches the ``k`` still
wanted gives those bits of the ``k``-th largest key ``T``. A last pass writes the entries with
key ``> T`` and the first ``k - count(key > T)`` with key ``== T``, in list order (a running
prefix count gives each its slot).

The row is read in blocks of ``BLOCK``; with ``BLOCK >= C`` (``ONE_BLOCK``) the keys are loaded
once and stay in registers for every pass. With ``EARLY_EXIT`` the passes stop at the first
whose bin holds exactly the keys still wanted (all of them are taken, so the bits below do not
matter): with distinct ranks that is after a few passes, where a bin holds one key or none.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.lfps_step import row_budget


@triton.jit
def order_keys(Rank_row, i, ok):
    """Ordered uint32 keys of the ranks at entries ``i``: negative floats bit-flipped, others
    with the sign bit set, ``-0.0`` as ``+0.0``; 0 for ``-inf`` and where not ``ok``."""
    x = tl.load(Rank_row + i, mask=ok, other=float("-inf"))
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    flip = tl.where((bits & sign) != 0, tl.full(bits.shape, 0xFFFFFFFF, tl.uint32), sign)
    key = tl.where(x == 0.0, sign, bits ^ flip)
    return tl.where(x > float("-inf"), key, tl.zeros_like(key))


@triton.jit
def digit_histogram(key, prefix, known, shift, RADIX_BITS: tl.constexpr):
    """Histogram of bits ``[shift, shift + RADIX_BITS)`` of the finite keys whose ``known``
    bits equal ``prefix``'s."""
    digit = ((key >> shift) & ((1 << RADIX_BITS) - 1)).to(tl.int32)
    return tl.histogram(digit, 1 << RADIX_BITS, mask=(key != 0) & ((key & known) == prefix))


@triton.jit
def radix_pass(rank_row, row_keys, lanes, bins, capacity, prefix, known, want, shift,
               BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
               FIRST: tl.constexpr):  # fmt: skip
    """One pass: the histogram of the next ``RADIX_BITS`` bits (at ``shift``) of the keys
    that share ``prefix`` on the ``known`` bits, and the bin where the count from the top
    reaches ``want``. Returns the new ``(prefix, known, want)``, the keys in that bin, and
    the ``want`` the pass started from (the first pass cuts it to the finite keys)."""
    if ONE_BLOCK:
        hist = digit_histogram(row_keys, prefix, known, shift, RADIX_BITS)
    else:
        hist = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
        for start in range(0, capacity, BLOCK):
            i = start + lanes
            key = order_keys(rank_row, i, i < capacity)
            hist += digit_histogram(key, prefix, known, shift, RADIX_BITS)
    total = tl.sum(hist, 0)
    if FIRST:
        want = tl.minimum(want, total)
    above = total - tl.cumsum(hist, 0)  # keys in higher bins
    cut = tl.max(tl.where(above + hist >= want, bins, 0), 0)
    left = want - tl.sum(tl.where(bins == cut, above, 0), 0)
    in_cut = tl.sum(tl.where(bins == cut, hist, 0), 0)
    prefix = prefix | (cut.to(tl.uint32) << shift)
    known = known | (tl.full([], (1 << RADIX_BITS) - 1, tl.uint32) << shift)
    return prefix, known, left, in_cut, want


@triton.jit
def lfps_topk_kernel(
    Rank, Seq_lens, Budget, Top_val, Top_at,
    num_sink, width, capacity,
    stride_rb, stride_rh, stride_tb, stride_th,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    FRACTION: tl.constexpr,
    EARLY_EXIT: tl.constexpr = False,
):  # fmt: skip
    hs = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(Seq_lens + b).to(tl.int32)
    rank_row = Rank + b.to(tl.int64) * stride_rb + hs * stride_rh
    top_row = b.to(tl.int64) * stride_tb + hs * stride_th
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << RADIX_BITS)
    if ONE_BLOCK:
        row_keys = order_keys(rank_row, lanes, lanes < capacity)
    else:
        row_keys = tl.zeros([BLOCK], dtype=tl.uint32)  # not read: every pass loads the row

    # the k-th largest key, RADIX_BITS a pass; ``want``: how many of the keys that share the
    # bits found so far are still wanted (pass 0 counts the row's finite ranks). With
    # EARLY_EXIT the passes stop once every key of the bin found is wanted (the same set)
    want = tl.minimum(row_budget(Budget, n, num_sink, FRACTION), width)
    prefix = tl.sum(lanes * 0, 0).to(tl.uint32)
    known = tl.sum(lanes * 0, 0).to(tl.uint32)  # the bits found
    prefix, known, want, in_cut, wanted = radix_pass(
        rank_row, row_keys, lanes, bins, capacity, prefix, known, want, 32 - RADIX_BITS,
        BLOCK, ONE_BLOCK, RADIX_BITS, True,
    )  # fmt: skip
    done = (want == in_cut).to(tl.int32)
    for p in tl.static_range(1, (32 + RADIX_BITS - 1) // RADIX_BITS):
        shift = max(32 - RADIX_BITS * (p + 1), 0)  # the last pass may re-read known bits
        if EARLY_EXIT:
            if done == 0:
                prefix, known, want, in_cut, _ = radix_pass(
                    rank_row, row_keys, lanes, bins, capacity, prefix, known, want, shift,
                    BLOCK, ONE_BLOCK, RADIX_BITS, False,
                )  # fmt: skip
                done = (want == in_cut).to(tl.int32)
        else:
            prefix, known, want, in_cut, _ = radix_pass(
                rank_row, row_keys, lanes, bins, capacity, prefix, known, want, shift,
                BLOCK, ONE_BLOCK, RADIX_BITS, False,
            )  # fmt: skip

    # the keys above ``prefix`` (the k-th largest), then the first ``want`` equal to it (after
    # an early exit ``prefix`` is the least key of its bin, every key of which is wanted)
    written = tl.sum(lanes * 0, 0)
    ties = tl.sum(lanes * 0, 0)
    for start in range(0, capacity, BLOCK):
        i = start + lanes
        if ONE_BLOCK:
            key = row_keys
        else:
            key = order_keys(rank_row, i, i < capacity)
        ok = (key != 0) & (wanted > 0)
        tie = (ok & (key == prefix)).to(tl.int32)
        chosen = (ok & (key > prefix)) | ((tie > 0) & (ties + tl.cumsum(tie, 0) - tie < want))
        c = chosen.to(tl.int32)
        slot = written + tl.cumsum(c, 0) - c
        x = tl.load(rank_row + i, mask=chosen, other=float("-inf"))
        tl.store(Top_val + top_row + slot, x, mask=chosen)
        tl.store(Top_at + top_row + slot, i.to(tl.int64), mask=chosen)
        written += tl.sum(c, 0)
        ties += tl.sum(tie, 0)
    for start in range(0, width, BLOCK):
        e = start + lanes
        pad = (e >= written) & (e < width)
        tl.store(Top_val + top_row + e, float("-inf"), mask=pad)
        tl.store(Top_at + top_row + e, e.to(tl.int64) * 0, mask=pad)


@triton.jit
def lfps_union_kernel(
    Marks, Top_val, Top_at, Filled, C, W,
    stride_mb, stride_mh, stride_tb, stride_th, stride_fb,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid ``(Hs, B)``: the marked entries of a row of ``C`` (0.0: marked, ``-inf``: not), in
    list order, as ``(0.0, i)`` to the first slots of the row's ``W``, then ``(-inf, 0)``: what
    ``lfps_topk_kernel`` gives for a budget of ``W`` when at most ``W`` entries are marked, in
    one pass (a running prefix count) instead of its histogram passes; their count to
    ``Filled[b, hs]``."""
    hs = tl.program_id(0)
    b = tl.program_id(1)
    row = Marks + b * stride_mb + hs * stride_mh
    val = Top_val + b * stride_tb + hs * stride_th
    at = Top_at + b * stride_tb + hs * stride_th
    offs = tl.arange(0, BLOCK)
    written = 0
    for start in range(0, C, BLOCK):
        i = start + offs
        keep = tl.load(row + i, mask=i < C, other=float("-inf")) > float("-inf")
        slot = written + tl.cumsum(keep.to(tl.int32), 0) - 1
        ok = keep & (slot < W)
        tl.store(at + slot, i.to(tl.int64), mask=ok)
        tl.store(val + slot, tl.zeros([BLOCK], tl.float32), mask=ok)
        written += tl.sum(keep.to(tl.int32), 0)
    tl.store(Filled + b * stride_fb + hs, tl.minimum(written, W))
    for start in range(0, W, BLOCK):
        i = start + offs
        pad = (i >= written) & (i < W)
        tl.store(at + i, tl.zeros([BLOCK], tl.int64), mask=pad)
        tl.store(val + i, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)
