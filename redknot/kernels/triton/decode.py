"""SegPagedAttention decode kernels: split-K attention of one new token per request over every
(request, KV head) row of a layer, then a merge of the splits.

Grid of ``segpaged_decode_kernel``: ``(G * num_splits + (H_kv - G) * local_splits, B)`` for a
layer with ``G`` global heads; axis 0 enumerates (head, split) pairs, ``num_splits`` for each
global head and ``local_splits`` for each local one (a local row has at most sink + window
keys, so it needs fewer). A program serves KV head ``h = order[j]`` (global heads first, so the
long rows start first) of request ``b`` and all ``GRP`` query heads of that KV head, reading
each key once.

A row's visible keys, numbered ``v = 0 .. cnt - 1`` (``n = seq_lens[b]``):

| row    | ``v`` -> position                                   | ``cnt``             |
| ------ | --------------------------------------------------- | ------------------- |
| global | ``v``                                               | ``n``               |
| local  | ``v`` if ``v < ns`` else ``ws + v - ns``, with      | ``ns + n - ws``     |
|        | ``ns = min(sink, n)``, ``ws = max(n - window, ns)`` |                     |

Split ``s`` takes ``v`` in ``[s * chunk, (s + 1) * chunk)`` with ``chunk`` from
``split_chunk`` (over the row's own split count); ``nvalid = cdiv(cnt, chunk)`` splits hold keys. A row with ``nvalid <= 1``
is finished by its split 0 (written to ``Out``); other rows write partial outputs and base-2
log-sum-exps that ``segpaged_decode_merge_kernel`` (grid ``(B, Hq)``) combines.

Adaptive restore (``RESTORE > 0``): a local head request ``b`` promoted is a global row of that
request, reading restore column ``num_global + r`` of the global store
(``redknot.kernels.triton.common.restored_head``); the wrapper then gives local heads
``num_splits`` programs too, so that a promoted row has the splits of a global one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import NO_KEY_MAX, mma, restored_head, softmax_step

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def visible_span(n, is_local, sink, window):
    """``(ns, ws, cnt)`` of the module table for a row of ``n`` keys."""
    n = tl.maximum(n, 0)
    ns_local = tl.minimum(sink, n)
    ws_local = tl.maximum(n - window, ns_local)
    ns = tl.where(is_local != 0, ns_local, n)
    ws = tl.where(is_local != 0, ws_local, n)
    return ns, ws, ns + n - ws


@triton.jit
def split_chunk(cnt, is_local, num_splits, local_splits, BLOCK_N: tl.constexpr,
                MIN_CHUNK: tl.constexpr):  # fmt: skip
    """Keys per split of a row of ``cnt`` keys, split ``local_splits`` ways if it is local and
    ``num_splits`` ways if not: rounded up to blocks, at least ``MIN_CHUNK``. The split and the
    merge kernel both take it from here, so they agree on every row."""
    splits = tl.where(is_local != 0, local_splits, num_splits)
    chunk = tl.cdiv(tl.cdiv(cnt, splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, MIN_CHUNK)


@triton.jit
def segpaged_decode_kernel(
    Q, K_g, V_g, K_l, V_l,
    Req_to_token, Req_pool_indices, Seq_lens,
    Is_local, Column, Order, Promoted,
    Out, Lse, Part_o, Part_lse,
    qk_scale, sink, window, ring_len, num_splits, local_splits, num_global,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_lse_b,
    stride_kgs, stride_kgh, stride_vgs, stride_vgh,
    stride_kls, stride_klh, stride_vls, stride_vlh,
    stride_r2t, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_pr,
    GRP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    RING: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    RESTORE: tl.constexpr,
    RESTORE_P2: tl.constexpr,
):  # fmt: skip
    # Axis 0 enumerates (head, split) pairs: ``num_splits`` per global head (the layer's first
    # ``num_global`` heads in ``Order``), then ``local_splits`` per local head, so that no
    # program is launched for a split a local row (at most sink + window keys) cannot have.
    pid = tl.program_id(0)
    b = tl.program_id(1)
    global_programs = num_global * num_splits
    in_global = pid < global_programs
    rest = pid - global_programs
    idx = tl.where(in_global, pid // num_splits, num_global + rest // local_splits)
    split = tl.where(in_global, pid % num_splits, rest % local_splits)
    h = tl.load(Order + idx)
    n = tl.load(Seq_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    is_local, col = restored_head(Promoted, req_row, stride_pr, h, tl.load(Is_local + h),
                                  tl.load(Column + h), num_global, RESTORE,
                                  RESTORE_P2)  # fmt: skip

    ns, ws, cnt = visible_span(n, is_local, sink, window)
    chunk = split_chunk(cnt, is_local, num_splits, local_splits, BLOCK_N, MIN_CHUNK)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, cnt)
    if (split == 0) | (lo < cnt):
        rows = tl.arange(0, BLOCK_H)
        row_ok = rows < GRP
        head = h * GRP + rows
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        if is_local != 0:
            K = K_l + col * stride_klh
            V = V_l + col * stride_vlh
        else:
            K = K_g + col * stride_kgh
            V = V_g + col * stride_vgh
        stride_ks = tl.where(is_local != 0, stride_kls, stride_kgs).to(tl.int64)
        stride_vs = tl.where(is_local != 0, stride_vls, stride_vgs).to(tl.int64)

        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NO_KEY_MAX
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        for start in tl.range(lo, hi, BLOCK_N):
            v_idx = start + tl.arange(0, BLOCK_N)
            valid = v_idx < hi
            pos = tl.where(v_idx < ns, v_idx, ws + v_idx - ns)
            table_mask = valid
            if RING:
                table_mask = valid & (is_local == 0)
            slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=table_mask, other=0)
            slot = slot.to(tl.int64)
            if RING:
                in_ring = tl.where(pos < sink, pos, sink + (pos - sink) % (ring_len - sink))
                slot = tl.where(is_local != 0, req_row * ring_len + in_ring, slot)
            k = tl.load(K + slot[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0.0)
            qk = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            v = tl.load(V + slot[:, None] * stride_vs + d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = softmax_step(qk, m_i, l_i, acc, v, q.dtype, UPCAST)

        nvalid = tl.cdiv(cnt, chunk)
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / safe_l[:, None]
        lse2 = tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("-inf"))
        if nvalid <= 1:
            tl.store(
                Out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
                o.to(Out.dtype.element_ty),
                mask=row_ok[:, None],
            )
            if WRITE_LSE:
                tl.store(Lse + b.to(tl.int64) * stride_lse_b + head, lse2 * LN2, mask=row_ok)
        else:
            part = b.to(tl.int64) * stride_pob + head * stride_poh + split * stride_pos
            tl.store(Part_o + part[:, None] + d[None, :], o, mask=row_ok[:, None])
            tl.store(
                Part_lse + b.to(tl.int64) * stride_plb + head * stride_plh + split,
                lse2,
                mask=row_ok,
            )


@triton.jit
def segpaged_decode_merge_kernel(
    Seq_lens, Req_pool_indices, Is_local, Column, Promoted, Out, Lse, Part_o, Part_lse,
    sink, window, num_splits, local_splits, num_global,
    stride_ob, stride_oh, stride_lse_b,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_pr,
    GRP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    RESTORE: tl.constexpr,
    RESTORE_P2: tl.constexpr,
):  # fmt: skip
    """Program ``(b, qh)``: combine the splits of query head ``qh`` of request ``b``."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.load(Seq_lens + b).to(tl.int32)
    h = head // GRP
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    is_local, _ = restored_head(Promoted, req_row, stride_pr, h, tl.load(Is_local + h),
                               tl.load(Column + h), num_global, RESTORE, RESTORE_P2)  # fmt: skip
    _, _, cnt = visible_span(n, is_local, sink, window)
    nvalid = tl.cdiv(cnt, split_chunk(cnt, is_local, num_splits, local_splits, BLOCK_N, MIN_CHUNK))
    if nvalid > 1:
        lse_base = Part_lse + b.to(tl.int64) * stride_plb + head * stride_plh
        splits = tl.arange(0, SPLITS_P2)
        lse_all = tl.load(lse_base + splits, mask=splits < nvalid, other=float("-inf"))
        m = tl.max(lse_all, 0)
        denom = tl.sum(tl.math.exp2(lse_all - m), 0)
        d = tl.arange(0, HEAD_DIM)
        part = Part_o + b.to(tl.int64) * stride_pob + head * stride_poh
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, nvalid, SPLITS_BLOCK):
            s = s0 + tl.arange(0, SPLITS_BLOCK)
            ok = s < nvalid
            w = tl.math.exp2(tl.load(lse_base + s, mask=ok, other=float("-inf")) - m)
            o_s = tl.load(part + s[:, None] * stride_pos + d[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o_s, 0)
        out = Out + b.to(tl.int64) * stride_ob + head * stride_oh + d
        tl.store(out, (acc / denom).to(Out.dtype.element_ty))
        if WRITE_LSE:
            tl.store(Lse + b.to(tl.int64) * stride_lse_b + head, (m + tl.math.log2(denom)) * LN2)
