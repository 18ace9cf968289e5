"""SamKV's block scores: each middle block's keys turned back to position 0, averaged, and dotted
with its document's query, in one pass over the keys.

Grid ``(C,)``; program ``c`` reads the ``block`` keys of block ``c`` (rows ``Rows[c * block ..]``
of ``K``) in tiles of ``BLOCK_T`` tokens x every head, rotates each pair of rotary dims by its
token's turn-back angle (``Cos``/``Sin``: fp32 tables, one row per token) and accumulates its dot
with the document's query ``Q[Doc[c]]`` (fp32, one vector per KV head); dims past the rotary
ones are dotted unrotated. The mean over the block is the sum over ``block``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["block", "half", "rest"])
def block_scores_kernel(
    K,  # [rows, H, D] fp16/bf16/fp32 keys
    Rows,  # [C * block] int64: the row of K of each middle token, blocks in order
    Cos,  # [C * block, half] fp32: turn-back rotation of each token
    Sin,
    Q,  # [Dn, H, D] fp32: each document's query, per KV head
    Doc,  # [C] int64: each block's document
    Out,  # [C] fp32
    block,
    half,  # rotary dims / 2
    rest,  # dims past the rotary ones (D - 2 * half)
    stride_kr,
    stride_kh,
    stride_qd,
    stride_qh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_U: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    c = tl.program_id(0)
    doc = tl.load(Doc + c)
    th = tl.arange(0, BLOCK_T * BLOCK_H)  # (token, head) pairs of a tile
    t_in, h = th // BLOCK_H, th % BLOCK_H
    h_ok = h < NUM_HEADS
    j = tl.arange(0, BLOCK_R)
    j_ok = j < half
    if IS_NEOX:
        d1, d2 = j, j + half
    else:
        d1, d2 = 2 * j, 2 * j + 1
    u = 2 * half + tl.arange(0, BLOCK_U)
    u_ok = tl.arange(0, BLOCK_U) < rest
    q_at = Q + doc * stride_qd + h[:, None] * stride_qh
    qm = h_ok[:, None] & j_ok[None, :]
    q1 = tl.load(q_at + d1[None, :], mask=qm, other=0.0)
    q2 = tl.load(q_at + d2[None, :], mask=qm, other=0.0)
    qu = tl.load(q_at + u[None, :], mask=h_ok[:, None] & u_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_R], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_U], dtype=tl.float32)
    for t0 in range(0, block, BLOCK_T):
        t = t0 + t_in
        ok = (t < block) & h_ok
        tok = c.to(tl.int64) * block + t
        row = tl.load(Rows + tok, mask=ok, other=0)
        k_at = K + row[:, None] * stride_kr + h[:, None] * stride_kh
        m = ok[:, None] & j_ok[None, :]
        x1 = tl.load(k_at + d1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(k_at + d2[None, :], mask=m, other=0.0).to(tl.float32)
        cos = tl.load(Cos + tok[:, None] * stride_cs + j[None, :], mask=m, other=0.0)
        sin = tl.load(Sin + tok[:, None] * stride_cs + j[None, :], mask=m, other=0.0)
        acc += (x1 * cos - x2 * sin) * q1 + (x2 * cos + x1 * sin) * q2
        xu = tl.load(k_at + u[None, :], mask=ok[:, None] & u_ok[None, :], other=0.0)
        acc_u += xu.to(tl.float32) * qu
    total = tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc_u, 1), 0)
    tl.store(Out + c, total / block)
