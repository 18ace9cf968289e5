"""The attention of the rows a reusing extend still computes, on FlashInfer, cut into runs.

A token-level policy (EPIC, CacheBlend, SparseX, naive) computes only some rows of a reusing
prompt in its deep layers (the rows in recovery, ``HeldRows``); each attends every key of its
request up to its own position. FlashInfer's prefill kernels take a causal query block that
ends where its key range ends, so the held rows are cut into runs, the maximal stretches of
consecutive rows of one request, and each run is one FlashInfer request over its request's
token slots up to the run's last position (page size 1: the pages are ``req_to_token``'s
slots). The result is exact: each row attends the keys at or before its position, no other.

A run reads its request's keys up to its end, so runs pay when they are few and long: EPIC's
recomputed segment heads and the question, about nine runs per request. Rows chosen one by one
(CacheBlend's deviation choice) would read a request's keys once per row, where the Triton
extend kernel reads them once per tile of ``block_q`` rows: :func:`runs_pay` keeps such a
batch on the Triton kernel (no more keys read than its tiles read).

Why this exists next to ``segpaged_extend_kernel``: at 32K x 8 that kernel took 0.52 ms a layer
for EPIC's ~200 rows (``benchmarks/results/profile_epic_h100_db7fbc3.json``), the largest part
of the reusing prompt's GPU time; FlashInfer splits each run's keys over the SMs.

>>> runs = row_runs(keep_cpu, qo_indptr_cpu, prefix_lens_cpu)
>>> if runs_pay(runs, counts, qo_indptr_cpu, prefix_lens_cpu, block_q):
...     fi = RunsAttention(workspace, num_q_heads, num_kv_heads, head_dim, torch.bfloat16)
...     fi.plan(runs, req_pool_indices_gpu, req_to_token)
...     out = fi.run(q_held, k_pool, v_pool, scale)  # per layer
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowRuns:
    """The held rows of an extend batch as runs (all on the host)."""

    qo_indptr: torch.Tensor  # [R + 1] int32: run r is held rows qo_indptr[r] .. qo_indptr[r + 1]
    kv_lens: torch.Tensor  # [R] int32: keys run r attends (its request's, up to its last row)
    request: torch.Tensor  # [R] int64: the batch index of run r's request

    @property
    def num_runs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def keys_read(self) -> int:
        """Keys (per KV head) the runs read: each run its request's up to its end."""
        return int(self.kv_lens.sum())

    @property
    def kv_indptr(self) -> torch.Tensor:
        """[R + 1] int32: run r's keys are entries kv_indptr[r] .. of the key list."""
        out = torch.zeros(self.num_runs + 1, dtype=torch.int32)
        torch.cumsum(self.kv_lens, 0, out=out[1:])
        return out


def row_runs(keep: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: torch.Tensor) -> RowRuns:
    """The runs of the rows ``keep`` marks (``[T]`` bool over the batch rows; request ``b`` has
    rows ``qo_indptr[b] ..`` after ``prefix_lens[b]`` cached tokens). Held rows are taken in
    ascending order, as ``HeldRows.rows`` lists them."""
    rows = np.flatnonzero(keep.numpy())
    qo = qo_indptr.numpy().astype(np.int64)
    prefix = prefix_lens.numpy().astype(np.int64)
    req = np.searchsorted(qo, rows, side="right") - 1
    starts_run = np.ones(rows.shape[0], dtype=bool)
    starts_run[1:] = (rows[1:] != rows[:-1] + 1) | (req[1:] != req[:-1])
    starts = np.flatnonzero(starts_run)
    ends = np.append(starts[1:], rows.shape[0])
    run_req = req[starts]
    last = rows[ends - 1] if rows.shape[0] else rows
    kv_lens = prefix[run_req] + last - qo[run_req] + 1
    return RowRuns(
        torch.from_numpy(np.append(starts, rows.shape[0]).astype(np.int32)),
        torch.from_numpy(kv_lens.astype(np.int32)),
        torch.from_numpy(run_req.astype(np.int64)),
    )


def tile_keys(
    counts: list[int], qo_indptr: torch.Tensor, prefix_lens: torch.Tensor, block_q: int
) -> int:
    """Keys (per KV head) the Triton extend kernel reads for ``counts[b]`` held rows of each
    request packed into tiles of ``block_q`` (``redknot.kernels.extend.gather_tiles``), each
    tile counted at its request's full length: an upper bound."""
    qo, prefix = qo_indptr.tolist(), prefix_lens.tolist()
    return sum(
        -(-n // block_q) * (prefix[b] + qo[b + 1] - qo[b]) for b, n in enumerate(counts) if n
    )


def runs_pay(
    runs: RowRuns,
    counts: list[int],
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_q: int,
) -> bool:
    """Whether the runs read no more keys than the Triton kernel's tiles would."""
    return runs.num_runs > 0 and runs.keys_read <= tile_keys(
        counts, qo_indptr, prefix_lens, block_q
    )


def run_kv_indices(
    runs: RowRuns, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor
) -> torch.Tensor:
    """``[keys_read]`` int32 on ``req_to_token``'s device: each run's token slots in order,
    ``req_to_token[request's slot, :kv_len]``, one run after the other. No host
    synchronisation (``req_pool_indices``: ``[B]`` on the device)."""
    device = req_to_token.device
    total = runs.keys_read
    lens = runs.kv_lens.to(torch.int64)
    starts = torch.zeros_like(lens)
    starts[1:] = torch.cumsum(lens, 0)[:-1]
    # per run: its request slot and where its keys start, then each key's run
    host = torch.stack([runs.request, lens, starts])
    run_req, run_len, run_start = (x for x in host.to(device, non_blocking=True))
    run_of_key = torch.repeat_interleave(
        torch.arange(runs.num_runs, device=device), run_len, output_size=total
    )
    pos = torch.arange(total, device=device) - run_start[run_of_key]
    slot = req_pool_indices.to(torch.int64)[run_req][run_of_key]
    return req_to_token[slot, pos].to(torch.int32)


def runs_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    runs: RowRuns,
    kv_indices: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """The runs' attention in float32 PyTorch (``q``: ``[A, Hq, D]`` held rows; ``k_cache``,
    ``v_cache``: ``[S, H, D]`` token slots; ``kv_indices`` as :func:`run_kv_indices`):
    the last row of run ``r`` attends all ``kv_lens[r]`` keys, each earlier one a key less."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    qo, kv = runs.qo_indptr.tolist(), runs.kv_indptr.tolist()
    for r in range(runs.num_runs):
        slots = kv_indices[kv[r] : kv[r + 1]].long()
        qr = q[qo[r] : qo[r + 1]].float()  # [L, Hq, D]
        kr = k_cache[slots].float().repeat_interleave(group, dim=1)  # [N, Hq, D]
        vr = v_cache[slots].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("lhd,nhd->hln", qr, kr) * scale
        if logit_cap > 0:
            logits = logit_cap * torch.tanh(logits / logit_cap)
        L, N = qr.shape[0], kr.shape[0]
        key_pos = torch.arange(N, device=q.device)
        row_pos = torch.arange(N - L, N, device=q.device)
        logits = logits.masked_fill(key_pos[None, None, :] > row_pos[None, :, None], -torch.inf)
        out[qo[r] : qo[r + 1]] = torch.einsum("hln,nhd->lhd", logits.softmax(-1), vr).to(q.dtype)
    return out


class RunsAttention:
    """FlashInfer's paged prefill over the runs of one extend batch: planned once per batch
    (:meth:`plan`), run once per layer (:meth:`run`). GPU only.

    ``workspace``: FlashInfer's float workspace, shared with SGLang's FlashInfer backend (its
    kernels run one after another on one stream, as SGLang's own wrappers share it)."""

    def __init__(
        self,
        workspace: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        backend: str = "auto",
    ) -> None:
        import flashinfer

        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend=backend
        )
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.device = workspace.device
        self._last_page = torch.ones(64, dtype=torch.int32)

    def plan(
        self, runs: RowRuns, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor
    ) -> None:
        """Plan the batch's runs (host work, no host synchronisation: the index lists are
        on the host, the key list is built on the device)."""
        if self._last_page.shape[0] < runs.num_runs:
            self._last_page = torch.ones(1 << (runs.num_runs - 1).bit_length(), dtype=torch.int32)
        self.wrapper.plan(
            runs.qo_indptr, runs.kv_indptr, run_kv_indices(runs, req_pool_indices, req_to_token),
            self._last_page[: runs.num_runs], self.num_q_heads, self.num_kv_heads,
            self.head_dim, 1, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
            non_blocking=True,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """``[A, Hq, D]`` attention of the held rows ``q`` over the token slots ``k_cache``,
        ``v_cache`` (``[S, H, D]``, every run's keys written)."""
        return self.wrapper.forward(
            q.contiguous(), (k_cache.unsqueeze(1), v_cache.unsqueeze(1)), causal=True,
            sm_scale=scale, logits_soft_cap=logit_cap if logit_cap > 0 else None,
        )  # fmt: skip
