"""SegPagedAttention extend (chunked prefill over a cached prefix), causal.

Grid ``(num_tiles, num_head_slots)``; program ``(t, j)`` serves KV head ``h = order[j +
head_slot_offset]`` and query tile ``t`` = new tokens ``[t0, t0 + BLOCK_Q)`` of request ``b``
(``Tile_req[t]``, ``Tile_start[t]``). Its ``BLOCK_M = BLOCK_Q * GRP`` query rows are the
(token, query head) pairs of the tile (row ``r``: token ``t0 + r // GRP``, head
``h * GRP + r % GRP``; ``BLOCK_Q = BLOCK_M // GRP``, rows from ``BLOCK_Q * GRP`` on are idle when
``GRP`` does not divide ``BLOCK_M``), so the GQA group reads each key once.

With ``GATHER`` the tile's tokens are not consecutive: tile ``t`` holds entries ``[t0, t0 +
BLOCK_Q)`` of request ``b``'s part ``Rows[Rows_indptr[b] ..]`` of the ascending list of batch rows
the plan computes, so a plan over scattered rows costs their number of tiles, not the tiles they
fall in; ``Q``, ``Out`` and ``Lse`` then hold those rows only, entry ``i`` of the list at row
``i`` (``K_new`` / ``V_new`` keep every batch row). Below, ``t_lo`` and ``t_hi`` are the tile's
first and last new-token index (``t0`` and ``min(t0 + BLOCK_Q, E) - 1`` without ``GATHER``); every
bound holds for any tokens between them.

Keys are visited in four loops (``a = P + t_lo`` first query position, ``e = P + t_hi + 1`` one
past the last; positions ``< P`` come from a store, the others from ``K_new``/``V_new``):

| loop        | global row             | local row                                  | masked    |
| ----------- | ---------------------- | ------------------------------------------ | --------- |
| cache       | ``[0, P)`` global store | empty                                     | tail only |
| sink + edge | empty                  | ``[0, min(sink, e))`` and ``[w0, c_lo)``   | yes       |
| new         | ``[P, u)``             | ``[c_lo, d_lo)``                           | no        |
| diagonal    | ``[u, e)``             | ``[d_lo, e)``                              | yes       |

with ``u = P + (t_lo + 1) // BLOCK_N * BLOCK_N`` (new keys below ``u`` precede every query of the
tile), ``w0 = max(sink, a - window + 1)`` (the window's first key), ``d_lo = max(u, w0)`` and
``c_lo`` the lowest key ``>= max(P, e - window, w0)`` a whole number of blocks below ``d_lo``
(keys in ``[c_lo, d_lo)`` are visible to every row). ``sink + edge`` reads positions below
``P`` from the local store. A local row thus costs ``O(BLOCK_Q + sink + window)`` keys whatever
``P`` is. No branch on the head class: it only sets loop bounds, so each loop is compiled once.
Under ``GATHER`` a tile's rows may lie far apart, so its diagonal run spans them all; a local
head then skips each block that no row's window reaches.

Adaptive restore (``RESTORE > 0``): a request may promote up to ``RESTORE`` local KV heads of
the layer (``Promoted[req_pool_indices[b]]``); the programs of a promoted head are global rows
of that request that read the cache from restore column ``num_global + r`` of the global store
(``redknot.kernels.triton.common.restored_head``). Other requests see the layer's classes.

Splitting a global row's keys. A tile of a global head visits ``O(P + E)`` keys in one program,
which leaves the GPU idle when few tiles attend long rows (a short question over a long prefix,
or the few rows segment reuse keeps in deep layers). With ``num_splits > 1`` the grid's third
axis splits the key blocks of a global row (the cache, new and diagonal loops in that order, as
one list of blocks) into ``num_splits`` runs; program ``(t, j, s)`` of a global head writes its
run's normalised output and base-2 log-sum-exp to ``Part_o`` / ``Part_lse`` (``[S, rows, global
query heads, D]`` / ``[S, rows, global query heads]``), then counts itself done on its tile's
counter (``Counters[t * slots + j]``, acquire-release); the run that finds every other run done
merges the tile's parts, writes the rows and zeroes the counter for the next launch. One launch,
as unsplit. A local row stays whole in split 0 (its keys are few); its programs with ``s > 0`` do
nothing. ``num_splits`` is not specialised, so one compiled kernel serves every split count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import (
    NO_KEY_MAX,
    mma,
    restored_head,
    softmax_step,
    store_slots,
)

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _block(m_i, l_i, acc, q, k, v, qk_scale, vis, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           MASKED: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """One key block: scores, optional visibility mask, online-softmax update."""
    qk = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
    if MASKED:
        qk = tl.where(vis, qk, float("-inf"))
    return softmax_step(qk, m_i, l_i, acc, v, q.dtype, UPCAST)


@triton.jit
def _sink_window_keys(start, n1, n, w0, P, q_pos, req_row, Req_to_token, stride_r2t, Kl, Vl, Kn,
                      Vn, stride_kls, stride_vls, stride_knt, stride_vnt, sink, window, ring_len,
                      d, BLOCK_N: tl.constexpr, RING: tl.constexpr):  # fmt: skip
    """Block ``[start, start + BLOCK_N)`` of a local row's key run: ``n1`` sink keys from
    position 0, then window keys from ``w0`` (``n`` in all); positions below ``P`` from the
    local store, the others from the new keys. Returns ``k``, ``v`` and the visibility of each
    key from each query row (causal, sink or within the window)."""
    idx = start + tl.arange(0, BLOCK_N)
    valid = idx < n
    pos = tl.where(idx < n1, idx, w0 + idx - n1)
    cached = valid & (pos < P)
    slot = store_slots(pos, cached, req_row, Req_to_token, stride_r2t, sink, ring_len, RING)
    row = (pos - P).to(tl.int64)
    k_ptr = tl.where(cached[:, None], Kl + slot[:, None] * stride_kls,
                     Kn + row[:, None] * stride_knt)  # fmt: skip
    v_ptr = tl.where(cached[:, None], Vl + slot[:, None] * stride_vls,
                     Vn + row[:, None] * stride_vnt)  # fmt: skip
    k = tl.load(k_ptr + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + d[None, :], mask=valid[:, None], other=0.0)
    vis = valid[None, :] & (pos[None, :] <= q_pos[:, None])
    vis = vis & ((pos[None, :] < sink) | (q_pos[:, None] - pos[None, :] < window))
    return k, v, vis


@triton.jit
def _diagonal_block(m_i, l_i, acc, q, start, e, P, q_pos, Kn, Vn, stride_knt, stride_vnt, d,
                    is_global, window, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr):  # fmt: skip
    """New keys ``[start, start + BLOCK_N)`` (below ``e``), causal, and within the window for a
    local row."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < e
    row = (pos - P).to(tl.int64)
    k = tl.load(Kn + row[:, None] * stride_knt + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(Vn + row[:, None] * stride_vnt + d[None, :], mask=valid[:, None], other=0.0)
    vis = valid[None, :] & (pos[None, :] <= q_pos[:, None])
    vis = vis & (is_global | (q_pos[:, None] - pos[None, :] < window))
    return _block(m_i, l_i, acc, q, k, v, qk_scale, vis, BLOCK_M, BLOCK_N, True, UPCAST)


@triton.jit
def _store_rows(Out, Lse, acc, m_i, l_i, q_row, rows, row_ok, h, d, stride_ot, stride_oh,
                stride_lse_t, GRP: tl.constexpr, WRITE_LSE: tl.constexpr):  # fmt: skip
    """Normalise and store the tile's output rows ``q_row`` (and their natural-log LSE)."""
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / safe_l[:, None]
    out_rows = q_row * stride_ot + (h * GRP + rows % GRP) * stride_oh
    tl.store(Out + out_rows[:, None] + d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(safe_l)) * LN2, float("-inf"))
        lse_rows = q_row * stride_lse_t + h * GRP + rows % GRP
        tl.store(Lse + lse_rows, lse, mask=row_ok)


@triton.jit
def _merge_runs(Part_o, Part_lse, o_at, lse_at, row_ok, d, num_splits, stride_pos, stride_pls,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """The ``num_splits`` runs' parts of the tile's rows combined: ``(m, l, acc)`` as the
    online softmax keeps them (base 2). Loads bypass L1: other SMs wrote the parts."""
    m = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_KEY_MAX
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(num_splits):
        lse2 = tl.load(Part_lse + s * stride_pls + lse_at, mask=row_ok, other=float("-inf"),
                       cache_modifier=".cg")  # fmt: skip
        o = tl.load(Part_o + s * stride_pos + o_at[:, None] + d[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, lse2)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse2 - m_new)  # 0 for a run without keys (lse2 = -inf)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    return m, den, acc


_SPLIT_ARGS = ["num_splits", "stride_pos", "stride_pot", "stride_pls", "stride_plt"]


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def segpaged_extend_kernel(
    Q, K_new, V_new, K_g, V_g, K_l, V_l,
    Req_to_token, Req_pool_indices, Prefix_lens, Qo_indptr, Tile_req, Tile_start,
    Rows, Rows_indptr, Is_local, Column, Order, Out, Lse, Part_o, Part_lse, Counters, Promoted,
    qk_scale, sink, window, ring_len, head_slot_offset, num_splits, num_global,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_ot, stride_oh, stride_lse_t,
    stride_kgs, stride_kgh, stride_vgs, stride_vgh,
    stride_kls, stride_klh, stride_vls, stride_vlh, stride_r2t,
    stride_pos, stride_pot, stride_pls, stride_plt, stride_pr,
    GRP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RING: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    GATHER: tl.constexpr,
    RESTORE: tl.constexpr,
    RESTORE_P2: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // GRP
    tile = tl.program_id(0)
    head_slot = tl.program_id(1) + head_slot_offset  # global heads take the first slots
    split = tl.program_id(2)
    h = tl.load(Order + head_slot)
    b = tl.load(Tile_req + tile)
    t0 = tl.load(Tile_start + tile)
    q_start = tl.load(Qo_indptr + b).to(tl.int64)
    E = (tl.load(Qo_indptr + b + 1) - q_start).to(tl.int32)
    P = tl.load(Prefix_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    local_flag, col = restored_head(Promoted, req_row, stride_pr, h, tl.load(Is_local + h),
                                    tl.load(Column + h), num_global, RESTORE,
                                    RESTORE_P2)  # fmt: skip
    is_local = local_flag != 0
    is_global = local_flag == 0

    rows = tl.arange(0, BLOCK_M)
    entry = t0 + rows // GRP
    if GATHER:  # the tile's entries of the request's listed rows; Q / Out hold listed rows only
        r0 = tl.load(Rows_indptr + b)
        n_held = tl.load(Rows_indptr + b + 1) - r0
        row_ok = (rows < BLOCK_Q * GRP) & (entry < n_held)
        tok = (tl.load(Rows + r0 + entry, mask=row_ok, other=q_start) - q_start).to(tl.int32)
        t_lo = (tl.load(Rows + r0 + t0) - q_start).to(tl.int32)
        t_hi = (tl.load(Rows + r0 + tl.minimum(t0 + BLOCK_Q, n_held) - 1) - q_start).to(tl.int32)
        q_row = (r0 + entry).to(tl.int64)
    else:
        row_ok = (rows < BLOCK_Q * GRP) & (entry < E)  # BLOCK_M need not be a multiple of GRP
        tok = entry
        t_lo = t0
        t_hi = tl.minimum(t0 + BLOCK_Q, E) - 1
        q_row = q_start + tok
    d = tl.arange(0, HEAD_DIM)
    active = is_global | (split == 0)  # a local row's keys all go to split 0
    q_rows = q_row * stride_qt + (h * GRP + rows % GRP) * stride_qh
    q = tl.load(Q + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & active, other=0.0)
    q_pos = P + tok
    e = P + t_hi + 1
    u = P + (t_lo + 1) // BLOCK_N * BLOCK_N
    Kn = K_new + q_start * stride_knt + h * stride_knh
    Vn = V_new + q_start * stride_vnt + h * stride_vnh
    Kg = K_g + col * stride_kgh
    Vg = V_g + col * stride_vgh
    Kl = K_l + col * stride_klh
    Vl = V_l + col * stride_vlh

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_KEY_MAX
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Bounds of the module table: window start w0, masked diagonal [d_lo, e), unmasked
    # [c_lo, d_lo) (new keys every row sees), a local row's left window edge [w0, c_lo).
    hi = tl.where(is_local, 0, P)
    w0 = tl.maximum(sink, P + t_lo - window + 1)
    d_lo = tl.where(is_local, tl.maximum(u, w0), u)
    lower = tl.where(is_local, tl.maximum(tl.maximum(P, e - window), w0), P)
    c_lo = tl.where(d_lo > lower, d_lo - (d_lo - lower) // BLOCK_N * BLOCK_N, d_lo)

    # This program's run [b_lo, b_hi) of the row's blocks: nc cache, nn new, nd diagonal
    nc = tl.cdiv(hi, BLOCK_N)
    nn = (d_lo - c_lo) // BLOCK_N
    nd = tl.cdiv(e - d_lo, BLOCK_N)
    nb = nc + nn + nd
    chunk = tl.where(is_local, nb, tl.cdiv(nb, num_splits))
    b_lo = tl.minimum(split * chunk, nb)
    b_hi = tl.minimum(b_lo + chunk, nb)

    # cache: a global row's prefix, from the global store (every key visible to every row)
    for start in tl.range(tl.minimum(b_lo, nc) * BLOCK_N, tl.minimum(b_hi, nc) * BLOCK_N, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        slot = store_slots(pos, valid, req_row, Req_to_token, stride_r2t, sink, ring_len, False)
        k = tl.load(Kg + slot[:, None] * stride_kgs + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(Vg + slot[:, None] * stride_vgs + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _block(m_i, l_i, acc, q, k, v, qk_scale, valid[None, :], BLOCK_M,
                               BLOCK_N, True, UPCAST)  # fmt: skip

    # sink + edge: a local row's sink [0, min(sink, e)) and left window edge [w0, c_lo), as one
    # run of n1 + n2 keys; below P from the local store, above from K_new / V_new
    n1 = tl.where(is_local & (split == 0), tl.minimum(sink, e), 0)
    n2 = tl.where(is_local & (split == 0), c_lo - w0, 0)
    for start in tl.range(0, n1 + n2, BLOCK_N):
        k, v, vis = _sink_window_keys(start, n1, n1 + n2, w0, P, q_pos, req_row, Req_to_token,
                                      stride_r2t, Kl, Vl, Kn, Vn, stride_kls, stride_vls,
                                      stride_knt, stride_vnt, sink, window, ring_len, d, BLOCK_N,
                                      RING)  # fmt: skip
        m_i, l_i, acc = _block(m_i, l_i, acc, q, k, v, qk_scale, vis, BLOCK_M, BLOCK_N, True,
                               UPCAST)  # fmt: skip

    # new: keys every row of the tile sees, from K_new / V_new, no mask
    new_lo = c_lo + tl.minimum(tl.maximum(b_lo - nc, 0), nn) * BLOCK_N
    new_hi = c_lo + tl.minimum(tl.maximum(b_hi - nc, 0), nn) * BLOCK_N
    for start in tl.range(new_lo, new_hi, BLOCK_N):
        row = (start - P + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = tl.load(Kn + row[:, None] * stride_knt + d[None, :])
        v = tl.load(Vn + row[:, None] * stride_vnt + d[None, :])
        m_i, l_i, acc = _block(m_i, l_i, acc, q, k, v, qk_scale, True, BLOCK_M, BLOCK_N, False,
                               UPCAST)  # fmt: skip

    # diagonal: the tile's own new keys, causal (and the window for a local row)
    diag_lo = d_lo + tl.minimum(tl.maximum(b_lo - nc - nn, 0), nd) * BLOCK_N
    diag_hi = tl.minimum(d_lo + tl.minimum(tl.maximum(b_hi - nc - nn, 0), nd) * BLOCK_N, e)
    for start in tl.range(diag_lo, diag_hi, BLOCK_N):
        if GATHER:  # rows far apart: a local row's window covers few of the blocks between
            seen = row_ok & (q_pos >= start) & (q_pos - start < BLOCK_N - 1 + window)
            needed = is_global | (tl.max(seen.to(tl.int32), 0) > 0)
        else:
            needed = True
        if needed:
            m_i, l_i, acc = _diagonal_block(m_i, l_i, acc, q, start, e, P, q_pos, Kn, Vn,
                                            stride_knt, stride_vnt, d, is_global, window,
                                            qk_scale, BLOCK_M, BLOCK_N, UPCAST)  # fmt: skip

    if is_global & (num_splits > 1):  # this run's part; the tile's last run merges them all
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        part = head_slot * GRP + rows % GRP
        o_at = q_row * stride_pot + part * HEAD_DIM
        lse_at = q_row * stride_plt + part
        tl.store(Part_o + split * stride_pos + o_at[:, None] + d[None, :], acc / safe_l[:, None],
                 mask=row_ok[:, None])  # fmt: skip
        lse2 = tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("-inf"))
        tl.store(Part_lse + split * stride_pls + lse_at, lse2, mask=row_ok)
        # release this run's part (every thread's stores, hence the barrier before the one
        # atomic), and learn whether every other run of the tile has released theirs
        counter = Counters + tile * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            m_i, l_i, acc = _merge_runs(Part_o, Part_lse, o_at, lse_at, row_ok, d, num_splits,
                                        stride_pos, stride_pls, BLOCK_M, HEAD_DIM)  # fmt: skip
            _store_rows(Out, Lse, acc, m_i, l_i, q_row, rows, row_ok, h, d, stride_ot,
                        stride_oh, stride_lse_t, GRP, WRITE_LSE)  # fmt: skip
            tl.atomic_xchg(counter, 0)  # zero again for the next launch
    else:
        _store_rows(Out, Lse, acc, m_i, l_i, q_row, rows, row_ok & active, h, d, stride_ot,
                    stride_oh, stride_lse_t, GRP, WRITE_LSE)  # fmt: skip
