"""Importance of every key of one request for the sparse FFN of deep layers: the attention mass
its probed (newest) queries put on it, summed over them and over the query heads of the layer's
global KV heads, in one launch that reads the keys where they are stored.

>>> run_extend(plan, q, ..., lse=lse)            # the layer's attention, with its LSE
>>> mass = key_mass(q, lse, k_global[layer], req_to_token, req_row, q_row0, pos0, num_probe,
...                 end, q_heads, scale)        # [end] float32

The probabilities are the layer's own attention (softmax over every key a probed query sees,
from the extend kernel's LSE), so no second pass over the keys is needed. Reference:
:func:`redknot.kernels.reference.key_mass_reference` (PyTorch, from the queries and keys alone).
"""

from __future__ import annotations

import math

import torch
import triton

from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.key_mass import key_mass_kernel

BLOCK_M = 64  # probed (query, head) rows per inner block
BLOCK_N = 64  # keys per program


def query_heads(global_heads: list[int], group_size: int, device) -> torch.Tensor:
    """``[G * group]`` int32: the query heads of the global KV heads, in store-column order."""
    return torch.tensor(
        [h * group_size + j for h in global_heads for j in range(group_size)],
        dtype=torch.int32,
        device=device,
    )


def key_mass(
    q: torch.Tensor,
    lse: torch.Tensor,
    k_store: torch.Tensor,
    req_to_token: torch.Tensor,
    req_row: int,
    q_row0: int,
    pos0: int,
    num_probe: int,
    end: int,
    q_heads: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[end]`` float32: mass on each key position ``0 .. end - 1`` of the request in row
    ``req_row`` of ``req_to_token``.

    Parameters
    ----------
    q : [rows, Hq, D] fp16/bf16; the probed queries are rows ``q_row0 .. q_row0 + num_probe``,
        at positions ``pos0 ..`` (a query sees the keys at or before its position).
    lse : [rows, Hq] float32, natural-log log-sum-exp of each row's scaled scores over every
        key it attends (``run_extend(..., lse=...)``).
    k_store : [slots, G, D] the layer's global store (column ``c`` = the ``c``-th global head).
    req_to_token : [R, max_ctx] int32.
    q_heads : [G * group] int32 (:func:`query_heads`).
    scale : the softmax scale the attention used.
    """
    rows, num_q_heads, D = q.shape
    G = k_store.shape[1]
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(2) == 1, (q.dtype, q.stride())
    assert lse.shape == (rows, num_q_heads) and lse.dtype == torch.float32, lse.shape
    assert k_store.dim() == 3 and k_store.shape[2] == D and k_store.stride(2) == 1, k_store.shape
    assert k_store.dtype == q.dtype, (k_store.dtype, q.dtype)
    assert q_heads.dtype == torch.int32 and q_heads.numel() % max(G, 1) == 0, q_heads.shape
    assert 0 <= q_row0 and q_row0 + num_probe <= rows, (q_row0, num_probe, rows)
    assert 0 <= pos0 and pos0 + num_probe <= end <= req_to_token.shape[1], (pos0, end)
    group = q_heads.numel() // max(G, 1)
    out = torch.empty(end, dtype=torch.float32, device=q.device)
    if end == 0:
        return out
    if G == 0 or num_probe == 0:
        return out.zero_()
    assert BLOCK_M >= group, f"a GQA group of {group} does not fit {BLOCK_M} rows"
    key_mass_kernel[(triton.cdiv(end, BLOCK_N),)](
        q, lse, k_store, req_to_token, q_heads, out,
        req_row * req_to_token.stride(0), q_row0, pos0, num_probe, end, G,
        scale * math.log2(math.e), q.stride(0), q.stride(1), lse.stride(0), lse.stride(1),
        k_store.stride(0), k_store.stride(1),
        GRP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, UPCAST=upcast_dots(q.dtype),
    )  # fmt: skip
    return out
