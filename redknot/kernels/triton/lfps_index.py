"""Kernels of LFPS's indexing step (and of the exact Top-k baseline's scoring).

``lfps_score_kernel``, grid ``(cdiv(width, BLOCK_N), Hs, B)``: scaled logits ``q . k * sm_scale``
of a block of listed positions (``DENSE``: entry ``v`` is position ``v``) for the ``ROWS`` query
heads of selection head ``hs`` (all of KV head ``hs * ROWS // GRP``), read through
``req_to_token``; entries outside ``num_sink <= p < n`` score ``-inf``. ``WRITE_LOGITS`` writes
every row's logits, ``WRITE_MAX`` their maximum over the rows (over the rows whose ``Bypass`` flag
is 0 with ``HAS_BYPASS``: LFPS's rank of a shared selection).

Eq. 7-9 of the score tables into a fixed-capacity list (the rule of
``redknot.lfps.fixed_budget.candidates_reference``), in four launches over chunks of ``CHUNK``
table entries, grid ``(chunks, Hs, B)`` each, so that a row is spread over many programs:

| kernel               | reads                        | writes                                    |
| -------------------- | ---------------------------- | ----------------------------------------- |
| ``lfps_moments``     | the chunk of both tables     | its mean and central sums of powers 2-4   |
| ``lfps_mark``        | the row's chunk moments      | Eq. 8 thresholds merged from them; each   |
|                      | (merged), the chunk of both  | entry's code (0, or 1: a candidate) and   |
|                      | tables and its Eq. 9 shifts  | the chunk's count                         |
| ``lfps_hist``        | counts; where the row        | there: each candidate's code 1 + its      |
|                      | overflows, codes and tables  | priority bin, the chunk's bin histogram   |
| ``lfps_write``       | counts, histograms, codes    | the list (newest first) and the count     |

Entries are indexed by ``i = j - num_sink`` for key positions ``j`` in ``[num_sink, n)``
(``m = n - num_sink`` of them): the vertical table is read at position ``j``, the slash table
at distance ``t - j = m - 1 - i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import mma


@triton.jit
def lfps_score_kernel(
    Q, K_buf, Req_to_token, Req_pool_indices, Seq_lens, Idx, Bypass, Out, Out_max,
    sm_scale, num_sink, width,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_r2t, stride_ib, stride_ih,
    stride_ob, stride_oh, stride_mb, stride_mh, stride_yb,
    ROWS: tl.constexpr,
    GRP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DENSE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    WRITE_MAX: tl.constexpr,
    HAS_BYPASS: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(Seq_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    v_idx = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_w = v_idx < width
    if DENSE:
        pos = v_idx
    else:
        idx_row = Idx + b.to(tl.int64) * stride_ib + hs * stride_ih
        pos = tl.load(idx_row + v_idx, mask=in_w, other=-1)
    valid = in_w & (pos >= num_sink) & (pos < n)
    slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    kv_head = (hs * ROWS) // GRP
    k = tl.load(
        K_buf + kv_head.to(tl.int64) * stride_kh + slot[:, None] * stride_ks + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    head = hs * ROWS + rows
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    qk = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST) * sm_scale
    qk = tl.where(valid[None, :], qk, float("-inf"))
    if WRITE_LOGITS:
        out_row = Out + b.to(tl.int64) * stride_ob
        tl.store(out_row + head[:, None] * stride_oh + v_idx[None, :], qk,
                 mask=row_ok[:, None] & in_w[None, :])  # fmt: skip
    if WRITE_MAX:
        ranked = row_ok
        if HAS_BYPASS:
            off = tl.load(Bypass + b * stride_yb + head, mask=row_ok, other=1)
            ranked = row_ok & (off == 0)
        best = tl.max(tl.where(ranked[:, None], qk, float("-inf")), 0)
        tl.store(Out_max + b.to(tl.int64) * stride_mb + hs * stride_mh + v_idx, best, mask=in_w)


@triton.jit
def table_block(Vert_row, Slash_row, i, ok, m, scale):
    """True table values at entries ``i`` of a row of ``m`` (vertical at position
    ``num_sink + i``: ``Vert_row`` points at position ``num_sink``; slash at distance
    ``m - 1 - i``), 0 where not ``ok``."""
    v = tl.load(Vert_row + i, mask=ok, other=0.0) * scale
    sl = tl.load(Slash_row + (m - 1 - i), mask=ok, other=0.0) * scale
    return v, sl


@triton.jit
def candidate_block(
    Vert_row, Slash_row, Offsets, i, m, scale, theta_v, theta_s, mu_v, mu_s,
    NUM_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Eq. 7-9 at entries ``i``: the candidate mask."""
    ok = (i >= 0) & (i < m)
    v, sl = table_block(Vert_row, Slash_row, i, ok, m, scale)
    init = ok & ((v > theta_v) | (sl > theta_s))
    keep = ok & ((v > mu_v) | (sl > mu_s))
    shifted = init & False
    for k in tl.static_range(NUM_OFFSETS):
        o = tl.load(Offsets + k)
        # offset 0 would add ``keep & init``, already in ``init``: its read is skipped
        ok2 = (i - o >= 0) & (i - o < m) & (o != 0)
        v2, sl2 = table_block(Vert_row, Slash_row, i - o, ok2, m, scale)
        shifted = shifted | (ok2 & ((v2 > theta_v) | (sl2 > theta_s)))
    return init | (keep & shifted)


@triton.jit
def priority_level(v, sl, mu_v, mu_s, NBINS: tl.constexpr, BINS_PER_OCTAVE: tl.constexpr):
    """An entry's priority bin (``redknot.lfps.fixed_budget.priority_bins``)."""
    r_v = tl.where(mu_v > 0.0, v / tl.where(mu_v > 0.0, mu_v, 1.0), 0.0)
    r_s = tl.where(mu_s > 0.0, sl / tl.where(mu_s > 0.0, mu_s, 1.0), 0.0)
    level = tl.math.log2(tl.maximum(tl.maximum(r_v, r_s), 1e-30)) * BINS_PER_OCTAVE
    level = tl.minimum(tl.maximum(level, 0.0), NBINS - 1.0)
    return level.to(tl.int32)


@triton.jit
def kurtosis_threshold(mean, var, m4, lam):
    """Eq. 8 from a table's moments (``redknot.lfps.candidates.kurtosis_threshold``)."""
    kurt = m4 / tl.maximum(var * var, 1e-30)
    scaled = tl.where(kurt > 0.0, 3.0 / tl.maximum(kurt, 1e-30), 0.0)
    return mean + lam * tl.sqrt(var) * scaled


@triton.jit
def merged_threshold(Moments_row, field, stride_mc, chunk, cnt, act, total, lam):
    """Mean and Eq. 8 threshold of one table of a row from its chunks' means and central sums
    (``field`` 0: vertical, 4: slash): ``M_k = sum_c M_k,c + (terms of d_c = mean_c - mean)``."""
    mean_c = tl.load(Moments_row + chunk * stride_mc + field, mask=act, other=0.0)
    m2_c = tl.load(Moments_row + chunk * stride_mc + field + 1, mask=act, other=0.0)
    m3_c = tl.load(Moments_row + chunk * stride_mc + field + 2, mask=act, other=0.0)
    m4_c = tl.load(Moments_row + chunk * stride_mc + field + 3, mask=act, other=0.0)
    mean = tl.sum(cnt * mean_c, 0) / total
    d = tl.where(act, mean_c - mean, 0.0)
    m2 = tl.sum(m2_c + cnt * d * d, 0)
    m4 = tl.sum(m4_c + 4.0 * d * m3_c + 6.0 * d * d * m2_c + cnt * d * d * d * d, 0)
    return mean, kurtosis_threshold(mean, m2 / total, m4 / total, lam)


@triton.jit
def row_thresholds(Moments_row, stride_mc, m, lam, CHUNK: tl.constexpr,
                   CHUNKS_P2: tl.constexpr):  # fmt: skip
    """``(mean_v, theta_v, mean_s, theta_s)`` of a row of ``m`` entries from its chunks'
    moments, all chunks at once."""
    chunk = tl.arange(0, CHUNKS_P2)
    act = chunk < tl.cdiv(m, CHUNK)
    cnt = tl.where(act, tl.minimum(m - chunk * CHUNK, CHUNK), 0).to(tl.float32)
    total = tl.maximum(tl.sum(cnt, 0), 1.0)
    mean_v, theta_v = merged_threshold(Moments_row, 0, stride_mc, chunk, cnt, act, total, lam)
    mean_s, theta_s = merged_threshold(Moments_row, 4, stride_mc, chunk, cnt, act, total, lam)
    return mean_v, theta_v, mean_s, theta_s


@triton.jit
def lfps_moments_kernel(
    Vert, Slash, Scale, State_rows, Seq_lens, Moments,
    num_sink,
    stride_vb, stride_vh, stride_sb, stride_sh, stride_cb, stride_mb, stride_mh, stride_mc,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(c, hs, b)``: mean and central sums of powers 2-4 of both tables over the row's
    entries ``[c * CHUNK, (c + 1) * CHUNK)``: ``Moments[b, hs, c] = (mean_v, M2_v, M3_v, M4_v,
    mean_s, M2_s, M3_s, M4_s)`` (zeros for a chunk past the row). The tables of request ``b``
    are row ``State_rows[b]`` of the state. With ``BLOCK == CHUNK`` the chunk is read once and
    both passes run on registers; else it is read once per pass."""
    c = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    sb = tl.load(State_rows + b).to(tl.int64)
    m = tl.maximum(tl.load(Seq_lens + b).to(tl.int32) - num_sink, 0)
    scale = tl.load(Scale + sb * stride_cb + hs)
    vert_row = Vert + sb * stride_vb + hs * stride_vh + num_sink
    slash_row = Slash + sb * stride_sb + hs * stride_sh
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, m)
    lanes = tl.arange(0, BLOCK)
    cnt = tl.maximum(hi - lo, 1).to(tl.float32)
    # sums of differences from the chunk's first entry: a constant chunk's are exactly 0
    pv, ps = table_block(vert_row, slash_row, lo, lo < hi, m, scale)
    if BLOCK == CHUNK:  # the chunk read once, held in registers for both passes
        ok = lo + lanes < hi
        v, sl = table_block(vert_row, slash_row, lo + lanes, ok, m, scale)
        dv = tl.where(ok, v - pv, 0.0)
        ds = tl.where(ok, sl - ps, 0.0)
        shift_v = tl.sum(dv, 0) / cnt
        shift_s = tl.sum(ds, 0) / cnt
        cv = tl.where(ok, dv - shift_v, 0.0)
        cs = tl.where(ok, ds - shift_s, 0.0)
        p2_v = cv * cv
        p3_v = p2_v * cv
        p4_v = p2_v * p2_v
        p2_s = cs * cs
        p3_s = p2_s * cs
        p4_s = p2_s * p2_s
    else:
        sum_v = tl.zeros([BLOCK], dtype=tl.float32)
        sum_s = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            ok = start + lanes < hi
            v, sl = table_block(vert_row, slash_row, start + lanes, ok, m, scale)
            sum_v += tl.where(ok, v - pv, 0.0)
            sum_s += tl.where(ok, sl - ps, 0.0)
        shift_v = tl.sum(sum_v, 0) / cnt
        shift_s = tl.sum(sum_s, 0) / cnt
        p2_v = tl.zeros([BLOCK], dtype=tl.float32)
        p3_v = tl.zeros([BLOCK], dtype=tl.float32)
        p4_v = tl.zeros([BLOCK], dtype=tl.float32)
        p2_s = tl.zeros([BLOCK], dtype=tl.float32)
        p3_s = tl.zeros([BLOCK], dtype=tl.float32)
        p4_s = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            ok = start + lanes < hi
            v, sl = table_block(vert_row, slash_row, start + lanes, ok, m, scale)
            cv = tl.where(ok, (v - pv) - shift_v, 0.0)
            cs = tl.where(ok, (sl - ps) - shift_s, 0.0)
            p2_v += cv * cv
            p3_v += cv * cv * cv
            p4_v += cv * cv * cv * cv
            p2_s += cs * cs
            p3_s += cs * cs * cs
            p4_s += cs * cs * cs * cs
    mean_v = pv + shift_v
    mean_s = ps + shift_s
    out = Moments + b.to(tl.int64) * stride_mb + hs * stride_mh + c * stride_mc
    tl.store(out, mean_v)
    tl.store(out + 1, tl.sum(p2_v, 0))
    tl.store(out + 2, tl.sum(p3_v, 0))
    tl.store(out + 3, tl.sum(p4_v, 0))
    tl.store(out + 4, mean_s)
    tl.store(out + 5, tl.sum(p2_s, 0))
    tl.store(out + 6, tl.sum(p3_s, 0))
    tl.store(out + 7, tl.sum(p4_s, 0))


@triton.jit
def lfps_mark_kernel(
    Vert, Slash, Scale, State_rows, Seq_lens, Offsets, Moments, Codes, Chunk_count,
    lam, num_sink,
    stride_vb, stride_vh, stride_sb, stride_sh, stride_cb, stride_mb, stride_mh, stride_mc,
    stride_db, stride_dh, stride_nb, stride_nh,
    NUM_OFFSETS: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr = False,
    HALO_L: tl.constexpr = 0,
    HALO_R: tl.constexpr = 0,
):  # fmt: skip
    """Program ``(c, hs, b)``: Eq. 7-9 on the chunk's entries: ``Codes[b, hs, i]`` = 0 (not a
    candidate) or 1; the chunk's candidate count. (Priority bins are needed only where a row
    overflows its capacity: ``lfps_hist`` codes them there.)

    ``GATHER``: each entry's tables are read once; the windows of ``BLOCK`` entries overlap by
    the offsets' reach (``HALO_L`` = the largest positive offset, ``HALO_R`` = minus the most
    negative), and Eq. 9's shifted marks are gathered from the window's own (``tl.gather``),
    not read again at every offset. Else (the default) every offset reads the tables again."""
    c = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    sb = tl.load(State_rows + b).to(tl.int64)
    m = tl.maximum(tl.load(Seq_lens + b).to(tl.int32) - num_sink, 0)
    scale = tl.load(Scale + sb * stride_cb + hs)
    vert_row = Vert + sb * stride_vb + hs * stride_vh + num_sink
    slash_row = Slash + sb * stride_sb + hs * stride_sh
    moments_row = Moments + b.to(tl.int64) * stride_mb + hs * stride_mh
    mean_v, theta_v, mean_s, theta_s = row_thresholds(moments_row, stride_mc, m, lam, CHUNK,
                                                      CHUNKS_P2)  # fmt: skip
    codes_row = Codes + b.to(tl.int64) * stride_db + hs * stride_dh
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, m)
    lanes = tl.arange(0, BLOCK)
    count = tl.sum(lanes * 0, 0)
    if GATHER:
        step: tl.constexpr = BLOCK - HALO_L - HALO_R  # entries coded per window
        for start in range(lo, hi, step):
            i = start - HALO_L + lanes  # the window: the coded entries and their halo
            ok = (i >= 0) & (i < m)
            v, sl = table_block(vert_row, slash_row, i, ok, m, scale)
            init = (ok & ((v > theta_v) | (sl > theta_s))).to(tl.int32)
            keep = ok & ((v > mean_v) | (sl > mean_s))
            shifted = lanes * 0
            for k in tl.static_range(NUM_OFFSETS):
                o = tl.load(Offsets + k)
                # entry i's shift by o is the window's lane - o; clamped for the halo's lanes,
                # which are not coded here
                at = tl.minimum(tl.maximum(lanes - o, 0), BLOCK - 1)
                shifted = shifted | tl.where(o != 0, tl.gather(init, at, 0), 0)
            cand = (init != 0) | (keep & (shifted != 0))
            coded = (lanes >= HALO_L) & (lanes < HALO_L + step) & (i < hi)
            tl.store(codes_row + i, cand.to(tl.uint8), mask=coded)
            count += tl.sum((cand & coded).to(tl.int32), 0)
    else:
        for start in range(lo, hi, BLOCK):
            i = start + lanes
            cand = candidate_block(vert_row, slash_row, Offsets, i, m, scale, theta_v, theta_s,
                                   mean_v, mean_s, NUM_OFFSETS)  # fmt: skip
            tl.store(codes_row + i, cand.to(tl.uint8), mask=i < hi)
            count += tl.sum(cand.to(tl.int32), 0)
    tl.store(Chunk_count + b * stride_nb + hs * stride_nh + c, count)


@triton.jit
def lfps_hist_kernel(
    Vert, Slash, Scale, State_rows, Seq_lens, Moments, Codes, Chunk_count, Chunk_hist,
    lam, num_sink, capacity,
    stride_vb, stride_vh, stride_sb, stride_sh, stride_cb, stride_mb, stride_mh, stride_mc,
    stride_db, stride_dh, stride_nb, stride_nh, stride_hb, stride_hh, stride_hc,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    BINS_PER_OCTAVE: tl.constexpr,
):  # fmt: skip
    """Program ``(c, hs, b)``, only where the row's candidates overflow ``capacity`` (elsewhere
    it returns after reading the counts; the write kernel reads bins only there): each of the
    chunk's candidates coded 1 + its priority bin, and the chunk's histogram of them by bin."""
    c = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    m = tl.maximum(tl.load(Seq_lens + b).to(tl.int32) - num_sink, 0)
    chunk = tl.arange(0, CHUNKS_P2)
    counts = tl.load(Chunk_count + b * stride_nb + hs * stride_nh + chunk,
                     mask=chunk < tl.cdiv(m, CHUNK), other=0)  # fmt: skip
    if tl.sum(counts, 0) > capacity:
        sb = tl.load(State_rows + b).to(tl.int64)
        scale = tl.load(Scale + sb * stride_cb + hs)
        vert_row = Vert + sb * stride_vb + hs * stride_vh + num_sink
        slash_row = Slash + sb * stride_sb + hs * stride_sh
        moments_row = Moments + b.to(tl.int64) * stride_mb + hs * stride_mh
        mean_v, _, mean_s, _ = row_thresholds(moments_row, stride_mc, m, lam, CHUNK, CHUNKS_P2)
        codes_row = Codes + b.to(tl.int64) * stride_db + hs * stride_dh
        lanes = tl.arange(0, BLOCK)
        hist = tl.zeros([NBINS], dtype=tl.int32)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, m)
        for start in range(lo, hi, BLOCK):
            i = start + lanes
            cand = tl.load(codes_row + i, mask=i < hi, other=0) > 0
            v, sl = table_block(vert_row, slash_row, i, cand, m, scale)
            level = priority_level(v, sl, mean_v, mean_s, NBINS, BINS_PER_OCTAVE)
            tl.store(codes_row + i, (level + 1).to(tl.uint8), mask=cand)
            hist += tl.histogram(level, NBINS, mask=cand)
        bins = tl.arange(0, NBINS)
        out = Chunk_hist + b.to(tl.int64) * stride_hb + hs * stride_hh + c * stride_hc
        tl.store(out + bins, hist)


@triton.jit
def lfps_write_kernel(
    Seq_lens, Codes, Chunk_count, Chunk_hist, Out, Count,
    num_sink, capacity,
    stride_db, stride_dh, stride_nb, stride_nh, stride_hb, stride_hh, stride_hc,
    stride_ob, stride_oh, stride_tb,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
):  # fmt: skip
    """Program ``(c, hs, b)``: the chunk's listed candidates at their place in the row's list
    (newest first: chunks from the last, entries from the newest); over capacity, the rule of
    ``redknot.lfps.fixed_budget`` from the chunks' histograms. Chunk 0 also writes the padding
    and the row's count."""
    c = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    m = tl.maximum(tl.load(Seq_lens + b).to(tl.int32) - num_sink, 0)
    active = tl.cdiv(m, CHUNK)
    count_row = Chunk_count + b * stride_nb + hs * stride_nh
    hist_row = Chunk_hist + b.to(tl.int64) * stride_hb + hs * stride_hh
    codes_row = Codes + b.to(tl.int64) * stride_db + hs * stride_dh
    out_row = Out + b.to(tl.int64) * stride_ob + hs * stride_oh
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBINS)
    chunk = tl.arange(0, CHUNKS_P2)
    act = chunk < active
    counts = tl.load(count_row + chunk, mask=act, other=0)
    total = tl.sum(counts, 0)
    newer = tl.sum(tl.where(chunk > c, counts, 0), 0)  # candidates listed before this chunk's
    over = total > capacity
    cut = tl.sum(counts * 0, 0)
    quota = tl.sum(counts * 0, 0)
    cut_newer = tl.sum(counts * 0, 0)  # cut-bin candidates in newer chunks
    if over:
        hists = tl.load(hist_row + chunk[:, None] * stride_hc + bins[None, :], mask=act[:, None],
                        other=0)  # fmt: skip
        hist = tl.sum(hists, 0)
        at_or_above = total - tl.cumsum(hist, 0) + hist
        cut = tl.max(tl.where(at_or_above >= capacity, bins, 0), 0)
        quota = capacity - tl.sum(tl.where(bins > cut, hist, 0), 0)
        above_c = tl.sum(tl.where(bins[None, :] > cut, hists, 0), 1)  # [CHUNKS_P2]
        cut_c = tl.sum(tl.where(bins[None, :] == cut, hists, 0), 1)
        cut_after = tl.sum(cut_c, 0) - tl.cumsum(cut_c, 0)  # in chunks newer than each
        room = tl.minimum(tl.maximum(quota - cut_after, 0), cut_c)
        newer = tl.sum(tl.where(chunk > c, above_c + room, 0), 0)  # kept before this chunk's
        cut_newer = tl.sum(tl.where(chunk > c, cut_c, 0), 0)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, m)
    written = newer
    taken = cut_newer
    for start in range(0, hi - lo, BLOCK):
        i = hi - 1 - start - lanes  # newest first
        code = tl.load(codes_row + i, mask=i >= lo, other=0).to(tl.int32)
        kept = code > 0
        if over:  # the cut bin's candidates in order: a second scan, only for such rows
            at_cut = kept & (code - 1 == cut)
            a = at_cut.to(tl.int32)
            rank = taken + tl.cumsum(a, 0) - a
            kept = kept & ((code - 1 > cut) | (at_cut & (rank < quota)))
            taken += tl.sum(a, 0)
        k = kept.to(tl.int32)
        slot = written + tl.cumsum(k, 0) - k
        tl.store(out_row + slot, num_sink + i, mask=kept & (slot < capacity))
        written += tl.sum(k, 0)
    if c == 0:
        for start in range(tl.minimum(total, capacity), capacity, BLOCK):
            tl.store(out_row + start + lanes, -1, mask=start + lanes < capacity)
        tl.store(Count + b * stride_tb + hs, total)
