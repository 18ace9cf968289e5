"""What the SegPaged runner keeps for one extend batch (:class:`ExtendState`): the kernels'
plan, where new local K/V goes in the rings, snapshot captures, segment writes and reads, and,
under the layer schedule or a token policy, the rows still in recovery (:class:`HeldRows`); and
what the segment-reuse path of each layer looks up, built once (:class:`LayerConsts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.kernels.key_mass import query_heads
from redknot.pool.layout import HeadLayout
from redknot.segcache.registration import SegmentWrites
from redknot.segcache.reuse import SegmentReads


@dataclass
class ExtendState:
    plan: object  # redknot.kernels.extend.ExtendPlan
    keep_tokens_gpu: torch.Tensor | None  # [K] int64, new tokens whose local K/V a ring keeps
    keep_rows_gpu: torch.Tensor | None  # [K] int64, their rows in the local store
    # Snapshot captures at branch points (see redknot.segcache.radix), local-store rows:
    capture: tuple[torch.Tensor, ...] | None = None  # (dst<-ring, src ring, dst<-new, src tok)
    # Tokens of segments being registered, and their segment-region rows:
    segment_writes: SegmentWrites | None = None
    # Tokens that reuse a stored segment's local K/V (redknot.segcache.reuse):
    segment_reads: SegmentReads | None = None
    # skipped="cached" and token policies: the rows in recovery (rebuilt when rows leave)
    held: HeldRows | None = None
    kept_tokens: int = -1  # token policies: reused segment tokens kept (-1: not chosen yet)
    req_pool_indices: list[int] | None = None  # on the host, when segments are written or read
    # Adaptive restore (redknot.attention.restore): each row's request slot ([T] int64, when
    # the pool has restore columns) and the probes of the requests this extend completes
    row_req: torch.Tensor | None = None
    restore: object | None = None  # redknot.attention.restore.RestorePlan
    keep_cpu: torch.Tensor | None = None  # token policies: [T] bool, rows computed (when some left)
    samkv: object | None = None  # redknot.recovery.samkv.served.BatchChoice
    # Token policies on FlashInfer (SegPagedRunner.use_flashinfer): layers computing every row
    # run SGLang's FlashInfer extend; layers computing the held rows attend them as planned
    # when rows left (redknot.kernels.held_rows: RowRuns or RowBlocks)
    on_flashinfer: bool = False
    held_plan: object | None = None
    out_cache_loc: torch.Tensor | None = None  # [T] the batch rows' token slots
    held_loc: torch.Tensor | None = None  # [A] the held rows' token slots
    left_loc: torch.Tensor | None = None  # [N] the token slots of the rows that left
    # from this layer on, the rows that left hold their cached K/V in the pool already (one
    # launch over the layers when they left: SegPagedRunner._align_left_layers)
    left_from: int | None = None


@dataclass(frozen=True)
class HeldRows:
    """The batch rows still in recovery (``SCHEDULE.held``), as a mask over the batch rows, the
    extend plan over them only (packed into tiles; its queries and outputs are these rows), and
    the segment reads of the tokens that left (every head of theirs takes the cached K/V). Built
    once when rows leave, on the device, from counts read in the layer's one synchronisation."""

    rows: torch.Tensor  # [A] int64 ascending batch rows
    mask: torch.Tensor  # [T] bool
    plan: (
        object | None
    )  # redknot.kernels.extend.ExtendPlan gathered over rows (None: on FlashInfer)
    left: SegmentReads  # the reads whose token left

    def first_row(self, b: int, num_last: int) -> int:
        """Where the last ``num_last`` held rows of request ``b`` start among the held rows."""
        return int(self.plan.rows_indptr_cpu[b + 1]) - num_last


@dataclass(frozen=True)
class AlignedHeads:
    """Heads moved by one RoPE-alignment launch: region column ``cols[i]`` to KV head
    ``heads[i]`` (int32 [n] on the device each)."""

    cols: torch.Tensor
    heads: torch.Tensor

    @classmethod
    def of(cls, pairs: list[tuple[int, int]], device) -> AlignedHeads:
        """``pairs``: (KV head, region column)."""
        heads = [h for h, _ in pairs]
        cols = [c for _, c in pairs]
        return cls(
            torch.tensor(cols, dtype=torch.int32, device=device),
            torch.tensor(heads, dtype=torch.int32, device=device),
        )

    def __len__(self) -> int:
        return self.heads.shape[0]


@dataclass(frozen=True)
class LayerConsts:
    """What the segment-reuse path of one layer looks up per forward, built once."""

    local: AlignedHeads  # the local KV heads and their columns in the segment region
    stored_global: AlignedHeads  # the global KV heads the region keeps, and their columns
    stored: AlignedHeads  # both: every head of a token that left recovery, local_kv="fresh"
    global_queries: torch.Tensor  # int32 [G * group]: the query heads of the global KV heads

    @classmethod
    def of(cls, layout: HeadLayout, stored: tuple[int, ...], lid: int, device) -> LayerConsts:
        """``stored``: the heads the segment region keeps in this layer (``segment_heads``;
        with ``skipped="cached"`` startup requires every global head among them)."""
        glob, grp = layout.global_heads(lid), layout.group_size
        local = [(h, stored.index(h)) for h in layout.local_heads(lid)]
        stored_global = [(h, stored.index(h)) for h in glob if h in stored]
        return cls(
            AlignedHeads.of(local, device),
            AlignedHeads.of(stored_global, device),
            AlignedHeads.of(sorted(local + stored_global), device),
            query_heads(glob, grp, device),
        )


def rows_per_request(keep: torch.Tensor, qo_indptr: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: how many batch rows of each request ``keep`` (``[T]`` bool) keeps;
    ``qo_indptr``: ``[B + 1]``, request ``b``'s rows ``qo_indptr[b] ..``. Where both are."""
    qo = qo_indptr.long()
    below = torch.nn.functional.pad(keep.cumsum(0), (1, 0))  # [T + 1]: kept rows below
    return below[qo[1:]] - below[qo[:-1]]
