"""LFPS's score tables from the end of a prefill (Eq. 4), two launches per layer and request.

Notation (one request, one query head ``h`` of KV head ``h // GROUP``): ``m`` queries at
positions ``t_i = n - m + i``, keys ``j < n`` read through ``Slots[j]``; a query attends the
keys ``num_sink <= j <= t_i`` (the sinks are left out of the tables, as in
``redknot.lfps.serving.build_tables``).

- ``lfps_build_lse_kernel``, grid ``(Hq, splits)``: each program takes a run of
  ``keys_per_split`` keys and writes, per query, the maximum logit and the sum of
  ``exp(logit - max)`` over its allowed keys (merged into a log-sum-exp on the host side). The
  programs of a KV head's first query head also sum that run's keys and values (their means).
- ``lfps_build_tables_kernel``, grid ``(Hq, cdiv(n, BLOCK_N))``: each program takes a tile of
  keys, recomputes its logits, and with ``p = W_i * exp(logit - lse_i)`` writes
  ``Vert[h, j] = sum_i p[i, j]`` and adds ``p[i, j]`` to ``Slash[h, t_i - j]`` (atomics: the
  distances of a tile overlap its neighbours').
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _queries(Q, h, n, m, stride_qm, stride_qh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Query head ``h``'s ``m`` queries ([BLOCK_M, D], zero past ``m``) and their positions."""
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + i[:, None] * stride_qm + h * stride_qh + d[None, :], mask=(i < m)[:, None],
                other=0.0)  # fmt: skip
    return q, n - m + i, i < m


@triton.jit
def _logits(q, t, valid_i, K, Slots, kvh, j, valid_j, num_sink, sm_scale, stride_ks, stride_kh,
            HEAD_DIM: tl.constexpr):  # fmt: skip
    """Keys ``j`` (through their slots, [BLOCK_N, D]), the scaled logits of ``q`` over them
    and which (query, key) pairs the tables count (``num_sink <= j <= t_i``)."""
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(Slots + j, mask=valid_j, other=0).to(tl.int64)
    k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=valid_j[:, None], other=0.0)  # fmt: skip
    logits = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
    allowed = valid_i[:, None] & valid_j[None, :] & (j[None, :] >= num_sink)
    return k, slot, logits, allowed & (j[None, :] <= t[:, None])


@triton.jit
def lfps_build_lse_kernel(
    Q, K, V, Slots, Part_max, Part_sum, Part_k, Part_v,
    n, m, num_sink, keys_per_split, sm_scale,
    stride_qm, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    kvh = h // GROUP
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q, t, valid_i = _queries(Q, h, n, m, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    k_sum = tl.zeros([HEAD_DIM], tl.float32)
    v_sum = tl.zeros([HEAD_DIM], tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, n)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid_j = j < end
        k, slot, logits, allowed = _logits(q, t, valid_i, K, Slots, kvh, j, valid_j, num_sink,
                                           sm_scale, stride_ks, stride_kh, HEAD_DIM)  # fmt: skip
        logits = tl.where(allowed, logits, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(logits, 1))
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        p = tl.where(allowed, tl.exp(logits - new_max[:, None]), 0.0)
        run_sum = run_sum * scale + tl.sum(p, 1)
        run_max = new_max
        if h % GROUP == 0:  # the KV head's key and value sums, once per KV head
            listed = valid_j & (j >= num_sink)
            k_sum += tl.sum(tl.where(listed[:, None], k.to(tl.float32), 0.0), 0)
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=listed[:, None], other=0.0)  # fmt: skip
            v_sum += tl.sum(v.to(tl.float32), 0)
    out = (h * splits + split) * BLOCK_M + i
    tl.store(Part_max + out, run_max)
    tl.store(Part_sum + out, run_sum)
    if h % GROUP == 0:
        row = (kvh * splits + split) * HEAD_DIM + d
        tl.store(Part_k + row, k_sum)
        tl.store(Part_v + row, v_sum)


@triton.jit
def lfps_build_tables_kernel(
    Q, K, Slots, Lse, W, Vert, Slash,
    n, m, num_sink, sm_scale,
    stride_qm, stride_qh, stride_ks, stride_kh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    tile = tl.program_id(1)
    i = tl.arange(0, BLOCK_M)
    q, t, valid_i = _queries(Q, h, n, m, stride_qm, stride_qh, BLOCK_M, HEAD_DIM)
    lse = tl.load(Lse + h * BLOCK_M + i)  # +inf for a query without keys: p = 0
    w = tl.load(W + i, mask=valid_i, other=0.0)
    j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_j = j < n
    _, _, logits, allowed = _logits(q, t, valid_i, K, Slots, h // GROUP, j, valid_j, num_sink,
                                    sm_scale, stride_ks, stride_kh, HEAD_DIM)  # fmt: skip
    p = tl.where(allowed, tl.exp(logits - lse[:, None]) * w[:, None], 0.0)
    row = h.to(tl.int64) * n
    tl.store(Vert + row + j, tl.sum(p, 0), mask=valid_j)
    dist = t[:, None] - j[None, :]
    tl.atomic_add(Slash + row + dist, p, mask=allowed)
