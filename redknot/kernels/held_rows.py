"""The attention of the rows a reusing extend still computes (the rows in recovery), on
FlashInfer's paged prefill over the KV pool.

A token-level policy (EPIC, CacheBlend, SparseX, naive) computes only some rows of a reusing
prompt in its deep layers (``HeldRows``); each attends every key of its request up to its own
position. FlashInfer's prefill kernels take a causal query block that ends where its key range
ends, and the held rows are cut to fit that, one of two ways, chosen per batch:

- **runs** (:func:`row_runs`): the maximal stretches of consecutive rows of one request, each
  a FlashInfer request over its request's token slots up to its last position (page size 1,
  the pages are ``req_to_token``'s slots), causal. One launch a layer. They pay when they are
  few and long (EPIC's recomputed segment heads and the question: about nine per request):
  each run reads its request's keys up to its end.
- **blocks** (:func:`row_blocks`), for rows chosen one by one (CacheBlend's deviation choice,
  SparseX's set): a request's held rows in groups of ``block_rows`` (the Triton extend kernel's
  tile, so as many keys are read), each group a FlashInfer request twice: over the keys before
  its first row, every row sees all of them (``before``, no mask), and over the keys from its
  first row to its last, each row up to its own position (``within``, a custom mask of
  ``rows x span`` bits). The two partial results are merged by their log-sum-exp (FlashInfer's
  ``merge_state_in_place``). Three launches a layer.

Both are exact: each row attends the keys at or before its position and no other. The server
plans runs only (``blocks=False``: rows that runs do not suit stay on the Triton extend kernel).
Blocks were measured slower there: CacheBlend's reusing prompt of 32K x 8 took 374 ms with its
rows in recovery in blocks on FlashInfer's FA2 paged prefill, against 305 ms on the Triton
kernel (one H100 each, two calls: ``benchmarks/results/archive/
ttft_held_rows_blocks_h100_cb2607e.json`` and ``ttft_token_policies_flashinfer_h100.json``).

:func:`held_rows_reference` is the PyTorch reference; :class:`PagedPrefillReference` stands in
for FlashInfer's wrapper (its semantics, in PyTorch) so that the decomposition, the masks and
the merge run on the CPU in the tests; the GPU tests compare FlashInfer itself.

Why this exists next to ``segpaged_extend_kernel``: at 32K x 8 that kernel took 0.52 ms a
layer for EPIC's ~200 rows (``benchmarks/results/profile_epic_h100_db7fbc3.json``), the largest
part of the reusing prompt's GPU time, where FlashInfer splits each request's keys over the SMs.
As runs, EPIC's 32K x 8 prompt went from 55.2 to 44.6 ms on one H100
(``benchmarks/results/ttft_ab_epic_runs_h100.json``).

>>> held = HeldRowsAttention.on_flashinfer(workspace, num_q_heads, num_kv_heads, head_dim, dtype)
>>> held.plan(keep_cpu, qo_indptr_cpu, prefix_lens_cpu, req_pool_indices, req_to_token, 32)
>>> out = held.run(q_held, k_pool, v_pool, scale)  # per layer, every held row's K/V stored
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

LN2 = math.log(2.0)  # FlashInfer's log-sum-exp is base 2


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
        return _indptr(self.kv_lens)

    def describe(self) -> str:
        return f"the rows in recovery as {self.num_runs} runs"


@dataclass(frozen=True)
class RowBlocks:
    """The held rows of an extend batch in blocks of at most ``block_rows`` rows of one
    request (all on the host)."""

    qo_indptr: torch.Tensor  # [NB + 1] int32: block c is held rows qo_indptr[c] ..
    first: torch.Tensor  # [NB] int64: the position of block c's first row
    last: torch.Tensor  # [NB] int64: the position of its last row
    request: torch.Tensor  # [NB] int64: the batch index of its request
    row_pos: torch.Tensor  # [A] int64: each held row's position
    block_rows: int

    @property
    def num_blocks(self) -> int:
        return self.first.shape[0]

    @property
    def keys_read(self) -> int:
        """Keys (per KV head) the blocks read: each block its request's up to its last row."""
        return int((self.last + 1).sum())

    def describe(self) -> str:
        return f"the rows in recovery in {self.num_blocks} blocks of at most {self.block_rows}"

    def within_mask(self) -> torch.Tensor:
        """``[sum(rows x span)]`` bool, block after block, row-major: row ``i`` of block ``c``
        sees key ``first[c] + j`` of the block's span iff that is at most its position."""
        qo = self.qo_indptr.numpy().astype(np.int64)
        rows_per = qo[1:] - qo[:-1]
        span = (self.last - self.first + 1).numpy()
        row_span = np.repeat(span, rows_per)  # each row's span
        row_rel = self.row_pos.numpy() - np.repeat(self.first.numpy(), rows_per)
        total = int(row_span.sum())
        starts = np.zeros(row_span.shape[0], dtype=np.int64)
        np.cumsum(row_span[:-1], out=starts[1:])
        j = np.arange(total, dtype=np.int64) - np.repeat(starts, row_span)
        return torch.from_numpy(j <= np.repeat(row_rel, row_span))


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def _held(keep: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: torch.Tensor):
    """Held rows ascending, each one's request and position (NumPy, int64)."""
    rows = np.flatnonzero(keep.numpy())
    qo = qo_indptr.numpy().astype(np.int64)
    req = np.searchsorted(qo, rows, side="right") - 1
    pos = prefix_lens.numpy().astype(np.int64)[req] + rows - qo[req]
    return rows, req, pos


def row_runs(keep: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: torch.Tensor) -> RowRuns:
    """The runs of the rows ``keep`` marks (``[T]`` bool over the batch rows; request ``b`` has
    rows ``qo_indptr[b] ..`` after ``prefix_lens[b]`` cached tokens). Held rows are taken in
    ascending order, as ``HeldRows.rows`` lists them."""
    rows, req, pos = _held(keep, qo_indptr, prefix_lens)
    starts_run = np.ones(rows.shape[0], dtype=bool)
    starts_run[1:] = (rows[1:] != rows[:-1] + 1) | (req[1:] != req[:-1])
    starts = np.flatnonzero(starts_run)
    ends = np.append(starts[1:], rows.shape[0])
    kv_lens = pos[ends - 1] + 1 if rows.shape[0] else pos
    return RowRuns(
        torch.from_numpy(np.append(starts, rows.shape[0]).astype(np.int32)),
        torch.from_numpy(kv_lens.astype(np.int32)),
        torch.from_numpy(req[starts].astype(np.int64)),
    )


def row_blocks(
    keep: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: torch.Tensor, block_rows: int
) -> RowBlocks:
    """The rows ``keep`` marks in blocks: each request's held rows, ascending, in groups of
    ``block_rows`` (its last group smaller)."""
    rows, req, pos = _held(keep, qo_indptr, prefix_lens)
    new_req = np.ones(rows.shape[0], dtype=bool)
    new_req[1:] = req[1:] != req[:-1]
    req_start = np.maximum.accumulate(np.where(new_req, np.arange(rows.shape[0]), 0))
    starts = np.flatnonzero((np.arange(rows.shape[0]) - req_start) % block_rows == 0)
    ends = np.append(starts[1:], rows.shape[0])
    return RowBlocks(
        torch.from_numpy(np.append(starts, rows.shape[0]).astype(np.int32)),
        torch.from_numpy(pos[starts]),
        torch.from_numpy(pos[ends - 1] if rows.shape[0] else pos),
        torch.from_numpy(req[starts].astype(np.int64)),
        torch.from_numpy(pos),
        block_rows,
    )


RUNS_READ_FACTOR = 2  # runs may read this many times the blocks' keys (see runs_pay)


def runs_pay(runs: RowRuns, blocks: RowBlocks) -> bool:
    """Whether the rows go as runs: when the runs read at most ``RUNS_READ_FACTOR`` times the
    keys the blocks read (as many as the Triton kernel's tiles of the same rows). A run is one
    causal launch a layer where blocks take three and a mask, so runs may read somewhat more
    (EPIC's prompt of 32K x 8 as served: 9 runs read 148K keys a KV head, 7 blocks of 32 rows
    164K); rows chosen one by one make a run per row and read their request's keys once per
    row, far over the factor."""
    return runs.num_runs > 0 and runs.keys_read <= RUNS_READ_FACTOR * blocks.keys_read


def slot_lists(
    request: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
) -> torch.Tensor:
    """``[sum(length)]`` int32 on ``req_to_token``'s device: for each entry ``e`` (host
    tensors), the token slots ``req_to_token[slot of request[e], start[e] : start[e] +
    length[e]]``, one after the other. No host synchronisation (``req_pool_indices``: ``[B]``
    on the device)."""
    device = req_to_token.device
    lens = length.to(torch.int64)
    total = int(lens.sum())
    offset = torch.zeros_like(lens)
    offset[1:] = torch.cumsum(lens, 0)[:-1]
    host = torch.stack([request.to(torch.int64), lens, offset, start.to(torch.int64)])
    e_req, e_len, e_off, e_start = (x for x in host.to(device, non_blocking=True))
    entry = torch.repeat_interleave(
        torch.arange(lens.shape[0], device=device), e_len, output_size=total
    )
    pos = torch.arange(total, device=device) - e_off[entry] + e_start[entry]
    slot = req_pool_indices.to(torch.int64)[e_req][entry]
    return req_to_token[slot, pos].to(torch.int32)


def held_rows_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    keep: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """The held rows' attention in float32 PyTorch, row by row of each request (``q``:
    ``[A, Hq, D]`` the rows ``keep`` marks; ``k_cache``, ``v_cache``: ``[S, H, D]`` token
    slots): each row over its request's keys at or before its position."""
    _, req, pos = _held(keep, qo_indptr, prefix_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rpi = req_pool_indices.tolist()
    for b in np.unique(req).tolist():
        mine = np.flatnonzero(req == b)
        p = torch.from_numpy(pos[mine]).to(q.device)
        slots = req_to_token[rpi[b], : int(p.max()) + 1].long()
        visible = torch.arange(slots.shape[0], device=q.device)[None, :] <= p[:, None]
        o, _ = _attend(q[mine], k_cache[slots], v_cache[slots], visible, scale, logit_cap)
        out[mine] = o.to(q.dtype)
    return out


def _attend(q, k, v, seen, scale: float, cap: float | None):
    """Float32 attention of ``q`` ``[L, Hq, D]`` over ``k``, ``v`` ``[N, H, D]`` (query head
    ``i`` reads KV head ``i // (Hq / H)``) where ``seen`` ``[L, N]`` is True, the logits capped
    at ``cap * tanh(x / cap)`` when ``cap``; returns the output ``[L, Hq, D]`` and the natural
    log-sum-exp ``[L, Hq]``."""
    group = q.shape[1] // k.shape[1]
    x = torch.einsum("lhd,nhd->hln", q.float(), k.float().repeat_interleave(group, dim=1))
    x = x * scale
    if cap:
        x = cap * torch.tanh(x / cap)
    x = x.masked_fill(~seen[None], -torch.inf)
    out = torch.einsum("hln,nhd->lhd", x.softmax(-1), v.float().repeat_interleave(group, dim=1))
    return out, torch.logsumexp(x, -1).T


class PagedPrefillReference:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (page size 1) as
    :class:`HeldRowsAttention` uses it, in float32 PyTorch: requests of query rows over listed
    token slots, causal (rows end where the keys end), without a mask, or with a custom mask
    (row-major bits per request); the log-sum-exp in base 2, as FlashInfer's."""

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, causal=False, custom_mask=None, sm_scale=None,
             logits_soft_cap=None, **_):  # fmt: skip
        assert page_size == 1 and bool((last_page_len == 1).all())
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        self.kv_indices = kv_indices
        self.mask = None if custom_mask is None else custom_mask.to(torch.bool).cpu()
        self.planned = (causal, head_dim**-0.5 if sm_scale is None else sm_scale, logits_soft_cap)

    def run(self, q, paged_kv, out=None):
        """With what was planned (as FlashInfer's ``run``), into ``out`` if given."""
        o = self.forward_return_lse(q, paged_kv, *self.planned)[0]
        return o if out is None else out.copy_(o)

    def forward_return_lse(self, q, paged_kv, causal=False, sm_scale=None, logits_soft_cap=None):
        k_cache, v_cache = (x.squeeze(1) for x in paged_kv)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        at = 0
        for r in range(len(self.qo) - 1):
            rows = slice(self.qo[r], self.qo[r + 1])
            slots = self.kv_indices[self.kv[r] : self.kv[r + 1]].long()
            L, N = rows.stop - rows.start, slots.shape[0]
            if self.mask is not None:
                seen = self.mask[at : at + L * N].view(L, N).to(q.device)
                at += L * N
            elif causal:
                seen = (
                    torch.arange(N, device=q.device)[None, :]
                    <= torch.arange(N - L, N, device=q.device)[:, None]
                )
            else:
                seen = torch.ones(L, N, dtype=torch.bool, device=q.device)
            o, natural = _attend(
                q[rows], k_cache[slots], v_cache[slots], seen, sm_scale, logits_soft_cap
            )
            out[rows], lse[rows] = o.to(q.dtype), natural / LN2
        return out, lse

    def forward(self, q, paged_kv, causal=False, sm_scale=None, logits_soft_cap=None):
        """Restates the plan's causality, scale and cap, as FlashInfer's (deprecated)
        ``forward`` does, for this call and every ``run`` after it."""
        self.planned = (causal, sm_scale, logits_soft_cap)
        return self.forward_return_lse(q, paged_kv, causal, sm_scale, logits_soft_cap)[0]


def merge_state_reference(v, s, v_other, s_other, mask=None) -> None:
    """FlashInfer's ``merge_state_in_place`` in PyTorch (base-2 log-sum-exp; rows where
    ``mask`` is False keep ``(v, s)``)."""
    m = torch.maximum(s, s_other)
    w, w_other = torch.exp2(s - m), torch.exp2(s_other - m)
    merged = (v.float() * w[..., None] + v_other.float() * w_other[..., None]) / (w + w_other)[
        ..., None
    ]
    lse = m + torch.log2(w + w_other)
    if mask is not None:
        merged = torch.where(mask[:, None, None], merged, v.float())
        lse = torch.where(mask[:, None], lse, s)
    v.copy_(merged.to(v.dtype))
    s.copy_(lse)


class HeldRowsAttention:
    """The held rows' attention of one extend batch: :meth:`plan` once per batch (runs when
    they pay, else blocks), :meth:`run` once per layer. ``wrapper`` makes a FlashInfer paged
    prefill wrapper (or :class:`PagedPrefillReference`), ``merge`` is FlashInfer's
    ``merge_state_in_place`` (or :func:`merge_state_reference`)."""

    def __init__(
        self, wrapper, merge, num_q_heads: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, blocks: bool = False, force: str | None = None,
        sm_scale: float | None = None, within_wrapper=None,
    ) -> None:  # fmt: skip
        self.runs_wrapper, self.before = wrapper(), wrapper()
        self.within = (within_wrapper or wrapper)()  # the masked part of blocks
        # the model's softmax scale, planned with the runs (a layer with another scale, or a
        # logit cap, restates them for the rest of the batch: see run)
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self._restated = False
        self.merge = merge
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.blocks = blocks  # plan blocks where runs do not pay (else: None, the caller's kernel)
        self.force = force  # "runs" or "blocks": that decomposition whatever pays (tests)
        self.plan_of: RowRuns | RowBlocks | None = None
        self._merge_mask: torch.Tensor | None = None

    @classmethod
    def on_flashinfer(cls, workspace: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, backend: str = "auto",
                      sm_scale: float | None = None,
                      within_backend: str | None = None):  # fmt: skip
        """On FlashInfer's paged prefill, with ``workspace`` its float workspace (shared with
        SGLang's FlashInfer backend, whose kernels run on the same stream one after another,
        as SGLang's own wrappers share it); ``sm_scale``: the model's attention scale;
        ``within_backend``: another backend for the blocks' masked part (default
        ``backend``; FA3 takes no custom mask)."""
        import flashinfer

        def wrapper(backend=backend):
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)

        within = None if within_backend is None else (lambda: wrapper(within_backend))
        return cls(wrapper, flashinfer.merge_state_in_place, num_q_heads, num_kv_heads,
                   head_dim, dtype, sm_scale=sm_scale, within_wrapper=within)  # fmt: skip

    def plan(
        self,
        keep: torch.Tensor,
        qo_indptr: torch.Tensor,
        prefix_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        block_rows: int,
    ) -> RowRuns | RowBlocks | None:
        """Plan the held rows ``keep`` (``[T]`` bool, host) of a batch (request ``b``: rows
        ``qo_indptr[b] ..`` after ``prefix_lens[b]`` cached tokens, slot
        ``req_pool_indices[b]`` on the device). Host work only; returns the decomposition, or
        None where runs do not pay and blocks are off (the caller attends them itself)."""
        runs = row_runs(keep, qo_indptr, prefix_lens)
        blocks = row_blocks(keep, qo_indptr, prefix_lens, block_rows)
        use_runs = runs_pay(runs, blocks) if self.force is None else self.force == "runs"
        self.plan_of = None
        if not use_runs and not (self.blocks or self.force == "blocks"):
            return None
        Hq, H, D = self.heads
        common = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "non_blocking": True,
                  "sm_scale": self.sm_scale}  # fmt: skip
        self._restated = False
        if use_runs:
            kv = slot_lists(runs.request, torch.zeros_like(runs.request), runs.kv_lens,
                            req_pool_indices, req_to_token)  # fmt: skip
            self.runs_wrapper.plan(runs.qo_indptr, runs.kv_indptr, kv, _ones(runs.num_runs),
                                   Hq, H, D, 1, causal=True, **common)  # fmt: skip
            self.plan_of = runs
            return runs
        # before each block's first row: every row sees every key (a block at position 0
        # gets one key, position 0, and is left out of the merge)
        n_before = torch.clamp(blocks.first, min=1)
        kv = slot_lists(blocks.request, torch.zeros_like(n_before), n_before, req_pool_indices,
                        req_to_token)  # fmt: skip
        nb = blocks.num_blocks
        self.before.plan(blocks.qo_indptr, _indptr(n_before.to(torch.int32)), kv, _ones(nb),
                         Hq, H, D, 1, causal=False, **common)  # fmt: skip
        span = blocks.last - blocks.first + 1
        kv = slot_lists(blocks.request, blocks.first, span, req_pool_indices, req_to_token)
        device = req_to_token.device
        # FlashInfer packs the mask into bits on the device, reading the index lists there
        # (one host synchronisation; blocks are planned where the policy's choice just read
        # its scores back)
        on_device = (x.to(device) for x in (blocks.qo_indptr, _indptr(span.to(torch.int32)),
                                             _ones(nb)))  # fmt: skip
        qo_d, kv_indptr_d, ones_d = on_device
        self.within.plan(qo_d, kv_indptr_d, kv, ones_d, Hq, H, D, 1, causal=False,
                         custom_mask=blocks.within_mask().to(device), **common)  # fmt: skip
        rows_per = blocks.qo_indptr[1:] - blocks.qo_indptr[:-1]
        merge = torch.repeat_interleave(blocks.first > 0, rows_per.to(torch.int64))
        self._merge_mask = merge.to(device, non_blocking=True)
        self.plan_of = blocks
        return blocks

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
            logit_cap: float = 0.0) -> torch.Tensor:  # fmt: skip
        """``[A, Hq, D]`` attention of the held rows ``q`` (any row and head strides) over the
        token slots ``k_cache``, ``v_cache`` (``[S, H, D]``, every key the rows attend
        stored). At the planned scale without a cap (every layer of the models served), runs
        take the planned launch as it is, into an uninitialised output: no per-layer copy of
        ``q``, no zeroed output."""
        kv = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
        cap = logit_cap if logit_cap > 0 else None
        if q.stride(-1) != 1:
            q = q.contiguous()
        self._restated |= scale != self.sm_scale or cap is not None
        if isinstance(self.plan_of, RowRuns):
            if not self._restated:
                return self.runs_wrapper.run(q, kv, out=q.new_empty(q.shape))
            return self.runs_wrapper.forward(q, kv, causal=True, sm_scale=scale,
                                             logits_soft_cap=cap)  # fmt: skip
        out, lse = self.within.forward_return_lse(q, kv, causal=False, sm_scale=scale,
                                                  logits_soft_cap=cap)  # fmt: skip
        before, lse_before = self.before.forward_return_lse(q, kv, causal=False, sm_scale=scale,
                                                            logits_soft_cap=cap)  # fmt: skip
        self.merge(out, lse, before, lse_before, self._merge_mask)
        return out


def _ones(n: int) -> torch.Tensor:
    """Each run or block's last page holds one token (page size 1)."""
    return torch.ones(n, dtype=torch.int32)
