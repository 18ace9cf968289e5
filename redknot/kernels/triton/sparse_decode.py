"""Sparse decode attention: one new token per request attends its sink tokens plus a list of key
positions, read through ``req_to_token`` from SGLang's paged store; then a merge of the splits.

Grid of ``sparse_decode_kernel``: ``(num_splits, Hs, B)``. A program serves selection head ``hs``
of request ``b``: the ``ROWS`` query heads ``hs * ROWS .. hs * ROWS + ROWS - 1`` (``ROWS = GRP``:
one list per KV head shared by its query heads; ``ROWS = 1``: one list per query head), all of
KV head ``hs * ROWS // GRP``. Each key is read once per program.

The keys of a row, numbered ``v = 0 .. num_sink + width - 1`` (``n = seq_lens[b]``):

| ``v``             | position                               | attended when                  |
| ----------------- | -------------------------------------- | ------------------------------ |
| ``< num_sink``    | ``v``                                  | ``v < n``                      |
| ``>= num_sink``   | ``p = Idx[b, hs, v - num_sink]``       | ``num_sink <= p < n``          |

so padding (``-1``), positions past the row and sink positions in the list are skipped, and a
position listed twice is attended twice (the caller deduplicates). With ``HAS_FILLED`` only the
first ``Filled[b, hs]`` entries of a list are read (the rest is padding: same result, fewer
iterations). Split ``s`` takes ``v`` in ``[s * chunk, (s + 1) * chunk)``, ``chunk =
cdiv(num_sink + width, num_splits)`` rounded up to ``BLOCK_N``. With one split the program
writes ``Out`` (and ``Lse``); otherwise every split writes its normalised output and base-2
log-sum-exp (``-inf`` if it attended nothing) to ``Part_o`` / ``Part_lse``, and
``sparse_decode_merge_kernel`` (grid ``(B, Hq)``) combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import NO_KEY_MAX, mma, softmax_step

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def sparse_decode_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Idx, Filled,
    Out, Lse, Part_o, Part_lse,
    qk_scale, num_sink, width,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_ib, stride_ih, stride_fb, stride_ob, stride_oh, stride_lse_b,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    HAS_FILLED: tl.constexpr,
    ROWS: tl.constexpr,
    GRP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(0)
    n = tl.load(Seq_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    total = num_sink + width
    chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, total)
    if HAS_FILLED:  # entries past the list's filled ones are padding: not read
        hi = tl.minimum(hi, num_sink + tl.load(Filled + b * stride_fb + hs))

    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    head = hs * ROWS + rows
    kv_head = (hs * ROWS) // GRP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    K = K_buf + kv_head.to(tl.int64) * stride_kh
    V = V_buf + kv_head.to(tl.int64) * stride_vh
    idx_row = Idx + b.to(tl.int64) * stride_ib + hs * stride_ih

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NO_KEY_MAX
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start in tl.range(lo, hi, BLOCK_N):
        v_idx = start + tl.arange(0, BLOCK_N)
        in_range = v_idx < hi
        is_sink = v_idx < num_sink
        listed = tl.load(idx_row + (v_idx - num_sink), mask=in_range & ~is_sink, other=-1)
        pos = tl.where(is_sink, v_idx, listed)
        valid = in_range & (pos < n) & (is_sink | (pos >= num_sink))
        slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=valid, other=0)
        slot = slot.to(tl.int64)
        k = tl.load(K + slot[:, None] * stride_ks + d[None, :], mask=valid[:, None], other=0.0)
        qk = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        v = tl.load(V + slot[:, None] * stride_vs + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = softmax_step(qk, m_i, l_i, acc, v, q.dtype, UPCAST)

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / safe_l[:, None]
    lse2 = tl.where(l_i > 0.0, m_i + tl.math.log2(safe_l), float("-inf"))
    if SPLIT:
        part = b.to(tl.int64) * stride_pob + head * stride_poh + split * stride_pos
        tl.store(Part_o + part[:, None] + d[None, :], o, mask=row_ok[:, None])
        tl.store(Part_lse + b.to(tl.int64) * stride_plb + head * stride_plh + split, lse2,
                 mask=row_ok)  # fmt: skip
    else:
        tl.store(
            Out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
            o.to(Out.dtype.element_ty),
            mask=row_ok[:, None],
        )
        if WRITE_LSE:
            tl.store(Lse + b.to(tl.int64) * stride_lse_b + head, lse2 * LN2, mask=row_ok)


@triton.jit
def sparse_decode_merge_kernel(
    Out, Lse, Part_o, Part_lse, num_splits,
    stride_ob, stride_oh, stride_lse_b, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    SPLITS_BLOCK: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program ``(b, qh)``: combine the ``num_splits`` partial outputs of query head ``qh`` of
    request ``b``; a row that attended nothing gets output 0 and log-sum-exp ``-inf``."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    ok = splits < num_splits
    lse_all = tl.load(Part_lse + b * stride_plb + head * stride_plh + splits, mask=ok,
                      other=float("-inf"))  # fmt: skip
    m = tl.max(lse_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.math.exp2(lse_all - m_safe), 0)
    d = tl.arange(0, HEAD_DIM)
    part = Part_o + b * stride_pob + head * stride_poh
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLITS_BLOCK):
        s = s0 + tl.arange(0, SPLITS_BLOCK)
        s_ok = s < num_splits
        w_s = tl.math.exp2(tl.load(Part_lse + b * stride_plb + head * stride_plh + s, mask=s_ok,
                                   other=float("-inf")) - m_safe)  # fmt: skip
        o_s = tl.load(part + s[:, None] * stride_pos + d[None, :], mask=s_ok[:, None], other=0.0)
        acc += tl.sum(w_s[:, None] * o_s, 0)
    safe = tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + b * stride_ob + head * stride_oh + d, (acc / safe).to(Out.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(denom > 0.0, (m_safe + tl.math.log2(safe)) * LN2, float("-inf"))
        tl.store(Lse + b * stride_lse_b + head, lse)
