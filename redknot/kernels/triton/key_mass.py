"""Attention mass each key of one request receives from its probed queries, summed over the
probed queries and the query heads of the global KV heads (importance of the sparse FFN).

Grid ``(cdiv(end, BLOCK_N),)``; program ``k`` owns keys ``[k * BLOCK_N, (k + 1) * BLOCK_N)`` of
the request (read from the global store through its ``req_to_token`` row) and, for each global
column ``c`` and each block of probed rows, adds ``exp2(q . k * qk_scale - lse)`` over the
visible (row, key) pairs. ``lse`` is each probed row's log-sum-exp over every key it sees
(natural log, as the extend kernel writes it), so the terms are the softmax probabilities of the
layer's own attention. Row ``r`` of a block is probed query ``r // GRP`` of query head
``Q_heads[c * GRP + r % GRP]``; rows from ``BLOCK_P * GRP`` on are idle.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import mma

LOG2E = tl.constexpr(1.4426950408889634)


# Offsets and counts change with every request: one compiled kernel for all of them (Triton
# would otherwise compile again whenever one of them turns 1 or a multiple of 16).
@triton.jit(do_not_specialize=["req_offset", "q_row0", "pos0", "num_probe", "end"])
def key_mass_kernel(
    Q,  # [rows, Hq, D] fp16/bf16: the probed queries are rows q_row0 .. q_row0 + num_probe
    Lse,  # [rows, Hq] fp32, natural-log LSE of the same rows
    K,  # [slots, G, D] the layer's global store
    Req_to_token,  # [R, max_ctx] int32
    Q_heads,  # [G * GRP] int32: the query heads of global column c are Q_heads[c*GRP:(c+1)*GRP]
    Out,  # [end] fp32
    req_offset,  # the request's row of Req_to_token, as an element offset (row * stride)
    q_row0,
    pos0,  # position of the first probed query (query i is at pos0 + i)
    num_probe,
    end,  # keys of the request: positions [0, end)
    num_cols,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_lt,
    stride_lh,
    stride_ks,
    stride_kh,
    GRP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    BLOCK_P: tl.constexpr = BLOCK_M // GRP
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = keys < end
    slot = tl.load(Req_to_token + req_offset + keys, mask=valid, other=0)
    slot = slot.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_M)
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(num_cols):
        k = tl.load(K + slot[:, None] * stride_ks + c * stride_kh + d[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        head = tl.load(Q_heads + c * GRP + rows % GRP)
        for p0 in range(0, num_probe, BLOCK_P):
            probe = p0 + rows // GRP
            ok = (rows < BLOCK_P * GRP) & (probe < num_probe)
            t = (q_row0 + probe).to(tl.int64)
            q = tl.load(Q + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=ok[:, None], other=0.0)  # fmt: skip
            lse = tl.load(Lse + t * stride_lt + head * stride_lh, mask=ok, other=0.0)
            s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
            s = s * qk_scale - lse[:, None] * LOG2E
            vis = ok[:, None] & valid[None, :] & (keys[None, :] <= (pos0 + probe)[:, None])
            mass += tl.sum(tl.where(vis, tl.math.exp2(s), 0.0), 0)
    tl.store(Out + keys, mass, mask=valid)
