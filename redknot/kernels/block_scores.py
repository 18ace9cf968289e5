"""SamKV's score of every middle block of the served documents, in one launch per layer:

    score[c] = sum_h < Q[doc(c), h], mean_t R(-p_t) K[rows[c, t], h] >

the block's keys turned back from their positions in the stored segment to position 0 (their
content before RoPE), averaged over the block, dotted with the document's query per KV head.
Each key is read once, in the model's dtype, and rotated in registers; the PyTorch reference
(:func:`block_scores_reference`) materialises the rotated keys in fp32: at 32K document tokens
the choice's kernels took 1.2 ms a layer with it and 0.4 ms with this kernel
(``benchmarks/results``: ``archive/profile_samkv_graph_32768x8_bf2a679.json`` against
``profile_samkv_32768x8.json``).

>>> score = block_scores(region_k, block_rows.flatten(), k_cos, k_sin, queries, block_doc,
...                      block, is_neox=True)          # [C] float32
"""

from __future__ import annotations

import torch
import triton

from redknot.kernels.rope_reference import rotate_by
from redknot.kernels.triton.block_scores import block_scores_kernel

BLOCK_T = 4  # tokens of a block per tile (x every head)


def block_scores(
    keys: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    queries: torch.Tensor, block_doc: torch.Tensor, block: int, *, is_neox: bool,
) -> torch.Tensor:  # fmt: skip
    """``[C]`` float32 block scores (module docstring).

    ``keys`` ``[rows, H, D]`` fp16/bf16/fp32 (a layer's segment region); ``rows`` ``[C * block]``
    int64, the row of each middle token, blocks in order; ``cos``, ``sin`` ``[C * block, R/2]``
    fp32, each token's rotation back to position 0 (``redknot.recovery.samkv.served.turn_back``);
    ``queries`` ``[Dn, H, D]`` fp32, each document's query per KV head; ``block_doc`` ``[C]``
    int64. No host synchronisation (CUDA-graph capturable)."""
    num_blocks = block_doc.numel()
    _, num_heads, dim = keys.shape
    half = cos.shape[1]
    assert keys.stride(2) == 1 and queries.stride(2) == 1, (keys.stride(), queries.stride())
    assert queries.dtype == torch.float32 and queries.shape[1:] == (num_heads, dim), queries.shape
    assert rows.shape == (num_blocks * block,) and cos.shape == sin.shape, (rows.shape, cos.shape)
    assert cos.shape[0] == rows.numel() and cos.dtype == torch.float32 and 2 * half <= dim
    out = torch.empty(num_blocks, dtype=torch.float32, device=keys.device)
    if num_blocks == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    block_scores_kernel[(num_blocks,)](
        keys, rows, cos, sin, queries, block_doc, out, block, half, dim - 2 * half,
        keys.stride(0), keys.stride(1), queries.stride(0), queries.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, BLOCK_T=BLOCK_T, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_R=triton.next_power_of_2(max(half, 1)),
        BLOCK_U=triton.next_power_of_2(max(dim - 2 * half, 1)), IS_NEOX=is_neox,
    )  # fmt: skip
    return out


def block_scores_reference(
    keys: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    queries: torch.Tensor, block_doc: torch.Tensor, block: int, *, is_neox: bool,
) -> torch.Tensor:  # fmt: skip
    """:func:`block_scores` in PyTorch: the keys gathered, rotated in fp32, averaged per block."""
    gathered = keys[rows]  # [C * block, H, D]
    turned = rotate_by(gathered, cos, sin, is_neox=is_neox)  # dims past the rotary ones kept
    means = turned.view(-1, block, *gathered.shape[1:]).mean(dim=1)  # [C, H, D]
    return (queries[block_doc] * means).sum(dim=(1, 2))
