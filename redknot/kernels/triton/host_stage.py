"""Copy the listed keys (and values) of every (request, KV head) into a dense staging store.

Grid ``(cdiv(num_sink + width, BLOCK_T), H, B)``. Row ``t`` of head ``h`` of request ``b``
(``n = seq_lens[b]``) is, as ``sparse_decode_kernel`` numbers its keys:

| ``t``          | position                 | copied when             | staged list entry  |
| -------------- | ------------------------ | ----------------------- | ------------------ |
| ``< num_sink`` | ``t``                    | ``SINKS`` and ``t < n`` | (sinks not listed) |
| ``>= num_sink``| ``p = Idx[b, h, t - S]`` | ``S <= p < n``          | ``t``, else ``-1`` |

It goes to row ``b * (num_sink + width) + t`` of ``K_out`` (and ``V_out``), KV head ``h``. The
source store may be in pinned host memory: each copied row is one read over PCIe.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def host_stage_kernel(
    K_src, V_src, Req_to_token, Req_pool_indices, Seq_lens, Idx,
    K_out, V_out, Idx_out,
    num_sink, width,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t, stride_ib, stride_ih,
    stride_os, stride_oh, stride_pos, stride_poh,
    SINKS: tl.constexpr,
    VALUES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(Seq_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    total = num_sink + width
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    in_row = t < total
    listed = in_row & (t >= num_sink)
    j = t - num_sink
    idx_row = Idx + b.to(tl.int64) * stride_ib + h * stride_ih
    p = tl.load(idx_row + j, mask=listed, other=-1).to(tl.int32)
    ok_listed = listed & (p >= num_sink) & (p < n)
    if SINKS:
        ok = ok_listed | (in_row & (t < num_sink) & (t < n))
        pos = tl.where(t < num_sink, t, p)
    else:
        ok = ok_listed
        pos = p
    out_idx = Idx_out + b.to(tl.int64) * stride_pos + h * stride_poh
    tl.store(out_idx + j, tl.where(ok_listed, t, -1), mask=listed)
    slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    dst = (b.to(tl.int64) * total + t)[:, None] * stride_os + h * stride_oh + d[None, :]
    key = tl.load(K_src + slot[:, None] * stride_ks + h * stride_kh + d[None, :],
                  mask=ok[:, None], other=0.0)  # fmt: skip
    tl.store(K_out + dst, key, mask=ok[:, None])
    if VALUES:
        val = tl.load(V_src + slot[:, None] * stride_vs + h * stride_vh + d[None, :],
                      mask=ok[:, None], other=0.0)  # fmt: skip
        tl.store(V_out + dst, val, mask=ok[:, None])
