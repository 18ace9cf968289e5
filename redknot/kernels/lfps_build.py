"""LFPS's tables from the end of a prefill in two Triton launches (``build_tables_kernels``).

The same figures as ``redknot.lfps.serving.build_tables`` (its reference, which the tests hold
it to), read straight from the paged store through the request's slots: no gathered copy of
its keys and values, no ``m x n`` attention matrix per KV head, no by-distance gather.
Kernels: ``redknot.kernels.triton.lfps_build``. The server runs it when the store is in GPU
memory (3.1-3.2x the PyTorch build at 32K and 128K, ``lfps_build.json``, H100); over a store in
host memory it reads every key across PCIe twice and was 0.39-0.41x, so there the server keeps
the PyTorch build, which gathers them once.
"""

from __future__ import annotations

import torch
import triton

from redknot.kernels.triton.lfps_build import lfps_build_lse_kernel, lfps_build_tables_kernel
from redknot.lfps.params import LfpsParams
from redknot.lfps.state import table_norm

BLOCK_N = 64
KEYS_PER_SPLIT = 4096  # keys per program of the log-sum-exp launch


def build_tables_kernels(
    queries: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    slots: torch.Tensor,
    params: LfpsParams,
    rows: int,
    sm_scale: float,
    keys_per_split: int = KEYS_PER_SPLIT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4 and the priors of one request, as ``build_tables`` returns them.

    Args:
        queries: [m', Hq, D], the last prompt positions' post-RoPE queries (the last
            ``params.history_steps`` are used).
        k_store, v_store: [slots, Hkv, D], the layer's paged store.
        slots: [n] int, the request's slots of positions ``0 .. n - 1`` (``n > num_sink``).
    Returns:
        vertical, slash [Hq / rows, n], mean_key, mean_value [Hkv, D], query_stat [Hq], float32.
    """
    queries = queries[-params.history_steps :]
    m, hq, d = queries.shape
    n = slots.shape[0]
    hkv = k_store.shape[1]
    s = params.num_sink
    dev = queries.device
    assert m <= n and n > s and hq % hkv == 0 and (hq // hkv) % rows == 0, (m, n, hq, hkv, rows)
    assert queries.stride(2) == k_store.stride(2) == v_store.stride(2) == 1
    block_m = max(16, triton.next_power_of_2(m))
    keys_per_split = max(BLOCK_N, keys_per_split // BLOCK_N * BLOCK_N)
    splits = triton.cdiv(n, keys_per_split)
    part_max = torch.empty(hq, splits, block_m, dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    part_k = torch.zeros(hkv, splits, d, dtype=torch.float32, device=dev)
    part_v = torch.zeros_like(part_k)
    slots = slots.contiguous()
    common = {"GROUP": hq // hkv, "BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "HEAD_DIM": d}
    lfps_build_lse_kernel[(hq, splits)](
        queries, k_store, v_store, slots, part_max, part_sum, part_k, part_v,
        n, m, s, keys_per_split, sm_scale,
        queries.stride(0), queries.stride(1), k_store.stride(0), k_store.stride(1),
        v_store.stride(0), v_store.stride(1), **common,
    )  # fmt: skip
    top = part_max.amax(1, keepdim=True)
    total = (part_sum * torch.exp(part_max - top).nan_to_num(0.0)).sum(1)  # [Hq, block_m]
    lse = torch.where(total > 0, top.squeeze(1) + torch.log(total), float("inf")).contiguous()
    weight = torch.zeros(block_m, dtype=torch.float32, device=dev)
    weight[:m] = params.decay ** torch.arange(m - 1, -1, -1, dtype=torch.float32, device=dev)
    weight *= table_norm(params, m)
    vertical = torch.empty(hq, n, dtype=torch.float32, device=dev)
    slash = torch.zeros(hq, n, dtype=torch.float32, device=dev)
    lfps_build_tables_kernel[(hq, triton.cdiv(n, BLOCK_N))](
        queries, k_store, slots, lse, weight, vertical, slash,
        n, m, s, sm_scale,
        queries.stride(0), queries.stride(1), k_store.stride(0), k_store.stride(1), **common,
    )  # fmt: skip
    q_last = queries[-1].float()
    query_stat = q_last.var(dim=-1, unbiased=False) / q_last.square().sum(-1).clamp_min(1e-30)
    return (
        vertical.view(hq // rows, rows, n).mean(1),
        slash.view(hq // rows, rows, n).mean(1),
        part_k.sum(1) / (n - s),
        part_v.sum(1) / (n - s),
        query_stat,
    )
