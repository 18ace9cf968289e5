"""Attention of the rows a token-policy extend computes, through FlashInfer's paged prefill.

When every head is global, a row at prompt position ``p`` attends every position ``0..p`` of
its request, whatever of them this extend computes and whatever it takes from the segment
cache. Once every such position's K/V is in the pool, the rows a layer computes split into
*runs*: consecutive positions of one request. A run of ``n`` rows ending at position ``e`` is
exactly one request of FlashInfer's causal paged prefill with ``n`` queries over the ``e + 1``
slots ``req_to_token[request, :e + 1]`` (page size 1): its query ``i`` sees the first
``e + 1 - n + i`` of them, which is its own position.

EPIC's and naive reuse's rows are the first tokens of each reused segment and the new text: a
few runs a request, so FlashInfer computes them at its dense throughput in one launch a layer,
where the SegPaged extend kernel spends half a millisecond a layer on ~300 rows of a 32K
prompt (``benchmarks/results/profile_epic_h100_db7fbc3.json``). Rows chosen one by one
(CacheBlend's, SparseX's after their choice) make about a run per row, each reading its whole
prefix, so those stay on the SegPaged kernel (:func:`worth_runs`).

>>> runs = row_runs(mask_cpu, qo_indptr_cpu, prefix_cpu, req_pool_indices)
>>> fi = FlashInferRuns(num_q_heads, num_kv_heads, head_dim, workspace)
>>> fi.plan(runs, req_to_token, dtype, sm_scale)
>>> for layer in range(num_layers):       # the runs' K/V and every position before them in
...     fi.run(q_rows, k_pool[layer], v_pool[layer], out)   # the pool: [slots, H_kv, D]

:class:`ReferenceRuns` is the same computation in PyTorch (the CPU tests' stand-in and the
startup check's reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Runs cost FlashInfer a read of their whole prefix each: worth it while they average at least
# this many rows (a query tile's worth of a KV head's group), or while there are this few.
MIN_ROWS_PER_RUN = 16
FEW_RUNS = 64


@dataclass(frozen=True)
class RowRuns:
    """Runs of consecutive positions of one request among the rows a layer computes (host)."""

    qo_indptr: torch.Tensor  # int32 [N + 1]: run r is computed rows qo_indptr[r] .. [r + 1]
    kv_lens: torch.Tensor  # int32 [N]: each run's last position + 1 (the slots it attends)
    req_pool_indices: torch.Tensor  # int64 [N]: each run's request slot

    @property
    def num_runs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_rows(self) -> int:
        return int(self.qo_indptr[-1])


def row_runs(
    computed: torch.Tensor | None,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: list[int],
) -> RowRuns:
    """The runs of the computed rows of an extend batch (all on the host): ``computed`` is a
    ``[T]`` bool mask over the batch rows (None: every row), request ``b`` has rows
    ``qo_indptr[b] .. qo_indptr[b + 1]`` at positions from ``prefix_lens[b]``."""
    qo = qo_indptr.to(torch.int64)
    num_rows = int(qo[-1])
    rows = torch.arange(num_rows) if computed is None else computed.nonzero().squeeze(1)
    request = torch.searchsorted(qo[1:], rows, right=True)
    positions = prefix_lens.to(torch.int64)[request] + rows - qo[request]
    starts = torch.ones(rows.shape[0], dtype=torch.bool)
    if rows.numel() > 1:
        starts[1:] = (rows[1:] != rows[:-1] + 1) | (request[1:] != request[:-1])
    first = starts.nonzero().squeeze(1)
    last = torch.cat([first[1:] - 1, torch.tensor([rows.shape[0] - 1])])
    indptr = torch.zeros(first.shape[0] + 1, dtype=torch.int32)
    indptr[:-1] = first.to(torch.int32)
    indptr[-1] = rows.shape[0]
    slots = torch.as_tensor(req_pool_indices, dtype=torch.int64)
    if first.numel() == 0:
        return RowRuns(indptr[:1], torch.zeros(0, dtype=torch.int32), slots[:0])
    return RowRuns(indptr, (positions[last] + 1).to(torch.int32), slots[request[first]])


def worth_runs(runs: RowRuns) -> bool:
    """Whether FlashInfer over ``runs`` beats the SegPaged kernel's query tiles: few runs, or
    runs long enough that each prefix read serves a tile's worth of queries."""
    return runs.num_runs <= FEW_RUNS or runs.num_rows >= MIN_ROWS_PER_RUN * runs.num_runs


def kv_indptr_of(runs: RowRuns) -> torch.Tensor:
    """int32 ``[N + 1]`` offsets of each run's slots in the flat index (host)."""
    indptr = torch.zeros(runs.num_runs + 1, dtype=torch.int32)
    torch.cumsum(runs.kv_lens, 0, out=indptr[1:])
    return indptr


def kv_indices_of(
    runs: RowRuns, kv_indptr: torch.Tensor, req_to_token: torch.Tensor
) -> torch.Tensor:
    """int32 ``[sum(kv_lens)]``: each run's slots ``req_to_token[request, :kv_len]`` one after
    the other, built on ``req_to_token``'s device by SGLang's kernel for FlashInfer's indices."""
    from sglang.kernels.ops.kvcache.kv_indices import create_flashinfer_kv_indices_triton

    device = req_to_token.device
    total = int(kv_indptr[-1])
    out = torch.empty(total, dtype=torch.int32, device=device)
    if runs.num_runs:
        create_flashinfer_kv_indices_triton[(runs.num_runs,)](
            req_to_token, runs.req_pool_indices.to(device, non_blocking=True),
            runs.kv_lens.to(device, non_blocking=True),
            kv_indptr.to(device, non_blocking=True), None, out, req_to_token.stride(0),
        )  # fmt: skip
    return out


class FlashInferRuns:
    """FlashInfer's causal paged prefill over the runs of a batch: planned once per row set
    (host work), run once per layer (one launch)."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        workspace: torch.Tensor,
    ) -> None:
        import flashinfer

        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(
        self, runs: RowRuns, req_to_token: torch.Tensor, dtype: torch.dtype, sm_scale: float
    ) -> None:
        kv_indptr = kv_indptr_of(runs)
        kv_indices = kv_indices_of(runs, kv_indptr, req_to_token)
        last_page = torch.ones(runs.num_runs, dtype=torch.int32, device=req_to_token.device)
        self.wrapper.plan(
            runs.qo_indptr, kv_indptr, kv_indices, last_page, self.num_q_heads,
            self.num_kv_heads, self.head_dim, 1, causal=True, sm_scale=sm_scale,
            q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip

    def run(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """``q``: ``[R, Hq, D]`` the runs' rows in order; ``k_buf``/``v_buf``: the layer's
        ``[slots, H_kv, D]`` store; writes and returns ``out`` (``[R, Hq, D]``)."""
        return self.wrapper.run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)), out=out)


class ReferenceRuns:
    """:class:`FlashInferRuns` in PyTorch (float32 softmax), one run at a time."""

    def __init__(self) -> None:
        self.runs: RowRuns | None = None
        self.slots: list[torch.Tensor] = []
        self.sm_scale = 1.0

    def plan(
        self, runs: RowRuns, req_to_token: torch.Tensor, dtype: torch.dtype, sm_scale: float
    ) -> None:
        self.runs, self.sm_scale = runs, sm_scale
        self.slots = [
            req_to_token[int(r), : int(n)].long()
            for r, n in zip(runs.req_pool_indices, runs.kv_lens)
        ]

    def run(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        runs = self.runs
        for r, slots in enumerate(self.slots):
            a, b = int(runs.qo_indptr[r]), int(runs.qo_indptr[r + 1])
            out[a:b] = runs_attention_reference(q[a:b], k_buf[slots], v_buf[slots], self.sm_scale)
        return out


def runs_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """One run: queries ``[n, Hq, D]`` at the last ``n`` of the ``L`` positions of ``k``/``v``
    (``[L, H_kv, D]``), causal, grouped heads; float32 softmax, the queries' dtype out."""
    n, hq, _ = q.shape
    length, hk = k.shape[0], k.shape[1]
    kf = k.float().repeat_interleave(hq // hk, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale
    pos_q = torch.arange(length - n, length, device=q.device)[:, None]
    mask = torch.arange(length, device=q.device)[None, :] > pos_q  # [n, L]
    scores = scores.masked_fill(mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vf).to(q.dtype)
