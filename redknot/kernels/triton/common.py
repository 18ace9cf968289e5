"""Device helpers shared by the SegPagedAttention kernels: where a key lives in a store, and one
step of the online softmax (base-2 exponentials; scores arrive pre-scaled by ``log2(e)``)."""

from __future__ import annotations

import triton
import triton.language as tl

# Running max of rows that have seen no key yet: finite, so that exp2(m_old - m_new) stays 1 (not
# NaN) while a block masks every key of a row.
NO_KEY_MAX = tl.constexpr(-1.0e30)


@triton.jit
def store_slots(
    pos,  # [N] int32 key positions
    valid,  # [N] bool, False for positions past the range
    req_row,  # int64 row of req_to_token (= req_pool_indices[b])
    Req_to_token,
    stride_r2t,
    sink,
    ring_len,
    RING: tl.constexpr,
):
    """Slots (int64) of ``pos``: ring addressing if ``RING``, else ``req_to_token``."""
    if RING:
        in_ring = tl.where(pos < sink, pos, sink + (pos - sink) % (ring_len - sink))
        return req_row * ring_len + in_ring.to(tl.int64)
    else:
        slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=valid, other=0)
        return slot.to(tl.int64)


def upcast_dots(dtype) -> bool:
    """True where ``tl.dot`` must see fp32 operands: bf16 under ``TRITON_INTERPRET=1``, whose
    numpy matmul would multiply the raw bf16 bit patterns."""
    import torch

    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulate); operands upcast first if ``UPCAST``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def softmax_step(qk, m_i, l_i, acc, v, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one block of scores ``qk`` [M, N] (log2 units, masked = -inf) and values ``v``
    [N, D] into the running max ``m_i`` [M], sum ``l_i`` [M] and output ``acc`` [M, D]."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = mma(p.to(dtype), v, acc, UPCAST)
    return m_new, l_i, acc


@triton.jit
def restored_head(
    Promoted,  # [rows of req_to_token, RESTORE] int32: KV heads promoted per request (-1: none)
    req_row,  # int64 row of the request (= req_pool_indices[b])
    stride_pr,
    h,  # the program's KV head
    is_local,  # int32, 1 for a head the layer classes local
    col,  # int32, its column in its store
    num_global,  # global heads of the layer: restore columns start there in the global store
    RESTORE: tl.constexpr,  # restore columns per layer (0: adaptive restore off)
    RESTORE_P2: tl.constexpr,  # RESTORE rounded up to a power of two
):
    """``(is_local, col)`` of KV head ``h`` for this request: a local head the request promoted
    (adaptive restore) is a global row reading restore column ``num_global + r`` of the global
    store, where ``r`` is its entry in the request's row of ``Promoted``."""
    if RESTORE > 0:
        r = tl.arange(0, RESTORE_P2)
        heads = tl.load(Promoted + req_row * stride_pr + r, mask=r < RESTORE, other=-1)
        hit = heads == h
        promoted = (tl.sum(hit.to(tl.int32), 0) > 0) & (is_local != 0)
        is_local = tl.where(promoted, 0, is_local)
        col = tl.where(promoted, num_global + tl.sum(tl.where(hit, r, 0), 0), col)
    return is_local, col
