"""SegPagedAttention extend (chunked prefill over a cached prefix), causal.

Grid ``(num_tiles, num_head_slots)``; program ``(t, j)`` serves KV head ``h = order[j +
head_slot_offset]`` and query tile ``t`` = new tokens ``[t0, t0 + BLOCK_Q)`` of request ``b``
(``Tile_req[t]``, ``Tile_start[t]``). Its ``BLOCK_M = BLOCK_Q * GRP`` query rows are the
(token, query head) pairs of the tile (row ``r``: token ``t0 + r // GRP``, head
``h * GRP + r % GRP``), so the GQA group reads each key once.

Key ranges a tile visits (``a = P + t0`` first query position, ``e = P + min(t0 + BLOCK_Q, E)``
one past the last; positions ``< P`` come from a store, the others from ``K_new``/``V_new``):

| row    | ranges                                                     | masked blocks             |
| ------ | ---------------------------------------------------------- | ------------------------- |
| global | ``[0, P)``, ``[P, e)``                                     | prefix tail, causal edge  |
| local  | sink ``[0, min(sink, e))``, window ``[max(sink, a - window + 1), e)`` | all (visibility) |

so a local row costs ``O(BLOCK_Q + sink + window)`` keys whatever ``P`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import NO_KEY_MAX, mma, softmax_step, store_slots

LN2 = 0.6931471805599453


@triton.jit
def _visible(pos, q_pos, hi, sink, window, EVEN: tl.constexpr, CAUSAL: tl.constexpr,
             LOCAL: tl.constexpr):  # fmt: skip
    """Boolean [M, N] visibility of keys ``pos`` [N] to rows at ``q_pos`` [M]."""
    vis = (pos < hi)[None, :] | EVEN
    if CAUSAL:
        vis = vis & (pos[None, :] <= q_pos[:, None])
    if LOCAL:
        vis = vis & ((pos[None, :] < sink) | (q_pos[:, None] - pos[None, :] < window))
    return vis


@triton.jit
def _attend_store(
    m_i, l_i, acc, q, q_pos, lo, hi,
    K, V, stride_ks, stride_vs, req_row, Req_to_token, stride_r2t,
    qk_scale, sink, window, ring_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN: tl.constexpr, LOCAL: tl.constexpr, RING: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Attend cached keys at positions ``[lo, hi)`` (all below every query's position)."""
    d = tl.arange(0, HEAD_DIM)
    for start in tl.range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        slot = store_slots(pos, valid, req_row, Req_to_token, stride_r2t, sink, ring_len, RING)
        if EVEN:
            k = tl.load(K + slot[:, None] * stride_ks + d[None, :])
            v = tl.load(V + slot[:, None] * stride_vs + d[None, :])
        else:
            k = tl.load(K + slot[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(V + slot[:, None] * stride_vs + d[None, :], mask=valid[:, None], other=0.0)
        qk = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
        if (not EVEN) or LOCAL:
            vis = _visible(pos, q_pos, hi, sink, window, EVEN, False, LOCAL)
            qk = tl.where(vis, qk, float("-inf"))
        m_i, l_i, acc = softmax_step(qk, m_i, l_i, acc, v, q.dtype, UPCAST)
    return m_i, l_i, acc


@triton.jit
def _attend_new(
    m_i, l_i, acc, q, q_pos, lo, hi, P,
    K, V, stride_kt, stride_vt, qk_scale, sink, window,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    EVEN: tl.constexpr, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Attend new keys at positions ``[lo, hi)``; ``K``/``V`` point at the request's first
    new token (position ``P``) of this KV head."""
    d = tl.arange(0, HEAD_DIM)
    for start in tl.range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        row = (pos - P).to(tl.int64)
        if EVEN:
            k = tl.load(K + row[:, None] * stride_kt + d[None, :])
            v = tl.load(V + row[:, None] * stride_vt + d[None, :])
        else:
            valid = (pos < hi)[:, None]
            k = tl.load(K + row[:, None] * stride_kt + d[None, :], mask=valid, other=0.0)
            v = tl.load(V + row[:, None] * stride_vt + d[None, :], mask=valid, other=0.0)
        qk = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
        if (not EVEN) or CAUSAL or LOCAL:
            vis = _visible(pos, q_pos, hi, sink, window, EVEN, CAUSAL, LOCAL)
            qk = tl.where(vis, qk, float("-inf"))
        m_i, l_i, acc = softmax_step(qk, m_i, l_i, acc, v, q.dtype, UPCAST)
    return m_i, l_i, acc


@triton.jit
def segpaged_extend_kernel(
    Q, K_new, V_new, K_g, V_g, K_l, V_l,
    Req_to_token, Req_pool_indices, Prefix_lens, Qo_indptr, Tile_req, Tile_start,
    Is_local, Column, Order, Out, Lse,
    qk_scale, sink, window, ring_len, head_slot_offset,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_ot, stride_oh, stride_lse_t,
    stride_kgs, stride_kgh, stride_vgs, stride_vgh,
    stride_kls, stride_klh, stride_vls, stride_vlh, stride_r2t,
    GRP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RING: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // GRP
    tile = tl.program_id(0)
    h = tl.load(Order + tl.program_id(1) + head_slot_offset)
    is_local = tl.load(Is_local + h)
    col = tl.load(Column + h)
    b = tl.load(Tile_req + tile)
    t0 = tl.load(Tile_start + tile)
    q_start = tl.load(Qo_indptr + b).to(tl.int64)
    E = (tl.load(Qo_indptr + b + 1) - q_start).to(tl.int32)
    P = tl.load(Prefix_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GRP
    head = h * GRP + rows % GRP
    row_ok = tok < E
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = P + tok
    e = P + tl.minimum(t0 + BLOCK_Q, E)
    Kn = K_new + q_start * stride_knt + h * stride_knh
    Vn = V_new + q_start * stride_vnt + h * stride_vnh

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NO_KEY_MAX
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if is_local == 0:
        K = K_g + col * stride_kgh
        V = V_g + col * stride_vgh
        p_full = (P // BLOCK_N) * BLOCK_N
        m_i, l_i, acc = _attend_store(
            m_i, l_i, acc, q, q_pos, 0, p_full, K, V, stride_kgs, stride_vgs,
            req_row, Req_to_token, stride_r2t, qk_scale, sink, window, ring_len,
            BLOCK_M, BLOCK_N, HEAD_DIM, True, False, False, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _attend_store(
            m_i, l_i, acc, q, q_pos, p_full, P, K, V, stride_kgs, stride_vgs,
            req_row, Req_to_token, stride_r2t, qk_scale, sink, window, ring_len,
            BLOCK_M, BLOCK_N, HEAD_DIM, False, False, False, UPCAST,
        )  # fmt: skip
        # New keys below the tile's first query are visible to every row of the tile.
        n_full = P + ((t0 + 1) // BLOCK_N) * BLOCK_N
        m_i, l_i, acc = _attend_new(
            m_i, l_i, acc, q, q_pos, P, n_full, P, Kn, Vn, stride_knt, stride_vnt,
            qk_scale, sink, window, BLOCK_M, BLOCK_N, HEAD_DIM, True, False, False, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _attend_new(
            m_i, l_i, acc, q, q_pos, n_full, e, P, Kn, Vn, stride_knt, stride_vnt,
            qk_scale, sink, window, BLOCK_M, BLOCK_N, HEAD_DIM, False, True, False, UPCAST,
        )  # fmt: skip
    else:
        K = K_l + col * stride_klh
        V = V_l + col * stride_vlh
        sink_hi = tl.minimum(sink, e)
        win_lo = tl.maximum(sink, P + t0 - window + 1)
        m_i, l_i, acc = _attend_store(
            m_i, l_i, acc, q, q_pos, 0, tl.minimum(sink_hi, P), K, V, stride_kls, stride_vls,
            req_row, Req_to_token, stride_r2t, qk_scale, sink, window, ring_len,
            BLOCK_M, BLOCK_N, HEAD_DIM, False, True, RING, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _attend_new(
            m_i, l_i, acc, q, q_pos, P, sink_hi, P, Kn, Vn, stride_knt, stride_vnt,
            qk_scale, sink, window, BLOCK_M, BLOCK_N, HEAD_DIM, False, True, True, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _attend_store(
            m_i, l_i, acc, q, q_pos, win_lo, tl.minimum(e, P), K, V, stride_kls, stride_vls,
            req_row, Req_to_token, stride_r2t, qk_scale, sink, window, ring_len,
            BLOCK_M, BLOCK_N, HEAD_DIM, False, True, RING, UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _attend_new(
            m_i, l_i, acc, q, q_pos, tl.maximum(win_lo, P), e, P, Kn, Vn, stride_knt,
            stride_vnt, qk_scale, sink, window, BLOCK_M, BLOCK_N, HEAD_DIM, False, True, True,
            UPCAST,
        )  # fmt: skip

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / safe_l[:, None]
    out_rows = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(Out + out_rows + d[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(safe_l)) * LN2, float("-inf"))
        tl.store(Lse + (q_start + tok) * stride_lse_t + head, lse, mask=row_ok)
