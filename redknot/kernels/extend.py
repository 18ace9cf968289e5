"""SegPagedAttention extend (chunked prefill over a cached prefix): plan once per batch on the
host, run once per layer.

>>> plan = plan_extend(geo, req_pool_indices_gpu, extend_prefix_lens_cpu, extend_seq_lens_cpu)
>>> for layer in range(num_layers):
...     run_extend(plan, q, k_new, v_new, kg[layer], vg[layer], kl[layer], vl[layer],
...                req_to_token, heads[layer], sm_scale, out=out)

Request ``b`` has ``P_b`` cached keys (positions ``< P_b``, read from the stores) and ``E_b`` new
tokens at positions ``P_b .. P_b + E_b - 1`` (rows ``qo_indptr[b] ..`` of ``q``, ``k_new``,
``v_new``). In ``ring`` mode the local store must still hold the sink and the last ``window``
positions before ``P_b`` when ``run_extend`` reads it: write the new tokens into the ring after
the layer's attention, or size the ring for them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from redknot.kernels.decode import check_layer_io, check_promoted
from redknot.kernels.geometry import LayerHeads, SegGeometry, num_sms
from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.extend import segpaged_extend_kernel

_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_INT32 = 4  # int32 entries in 16 bytes


@dataclass(frozen=True)
class ExtendConfig:
    """Tuning of the extend kernel (constants of the launch, not of the semantics). Defaults:
    the fastest single-launch configuration of the sweep in
    ``benchmarks/results/segpaged_kernels.json`` of commit a7c93dc (H200; that file has been
    re-measured since, without the sweep). Still the fastest for CacheBlend's rows in recovery
    at 8K and 32K on an H200 (``held_rows_sweep_h200.json``, ``held_rows_sweep_32k_h200.json``)."""

    block_m: int = 128  # query rows per tile: (tokens x query heads of one KV head)
    block_n: int = 64  # keys per inner-loop block
    num_warps: int = 8
    num_stages: int = 3
    # Splitting the keys of global rows when few tiles attend long rows (choose_extend_splits)
    # (set from the run counts measured in benchmarks/results/extend_split.json)
    split_programs_per_sm: int = 1  # split until global-head programs fill the SMs this often
    min_split_keys: int = 1024  # keys per run at least
    max_splits: int = 16  # the tile's last run merges every run: more cost it more (measured)
    max_split_bytes: int = 256 << 20  # the runs' outputs (float32) at most

    def block_q(self, group_size: int) -> int:
        """New tokens per tile (a GQA group of 3 uses 126 of 128 rows)."""
        if self.block_m < group_size:
            raise ValueError(
                f"ExtendConfig.block_m={self.block_m} is smaller than the GQA group "
                f"({group_size} query heads per KV head): raise block_m"
            )
        return self.block_m // group_size


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device`` without a host synchronisation (through pinned
    memory on CUDA)."""
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@dataclass(frozen=True)
class ExtendPlan:
    geometry: SegGeometry
    config: ExtendConfig
    num_tokens: int  # T = sum of extend lengths
    req_pool_indices_gpu: torch.Tensor  # [B] int32/int64
    prefix_lens_cpu: torch.Tensor  # [B] int32, cached keys per request (P_b)
    qo_indptr_cpu: torch.Tensor  # [B + 1] int32, new tokens of request b: rows qo_indptr[b]..
    tile_req_cpu: torch.Tensor  # [NT] int32, request of each query tile
    tile_start_cpu: torch.Tensor  # [NT] int32, first new-token index of the tile in its request
    prefix_lens_gpu: torch.Tensor  # [B] int32
    qo_indptr_gpu: torch.Tensor  # [B + 1] int32
    tile_req_gpu: torch.Tensor  # [NT] int32
    tile_start_gpu: torch.Tensor  # [NT] int32
    extra: dict = field(default_factory=dict)  # per-backend state (see redknot.kernels.flashinfer)
    # A plan over some rows only (gather_tiles): tile t holds entries tile_start[t].. of request
    # tile_req[t]'s part rows[rows_indptr[b] : rows_indptr[b + 1]] of the listed batch rows
    # (ascending); q and the output then hold the listed rows only, entry i at row i
    rows_gpu: torch.Tensor | None = None  # [A] int64 batch rows
    rows_indptr_gpu: torch.Tensor | None = None  # [B + 1] int32
    rows_indptr_cpu: torch.Tensor | None = None  # [B + 1] int32
    max_keys: int = 0  # keys (cached and new tokens) of the longest request

    def __post_init__(self) -> None:
        B = self.batch_size
        assert self.req_pool_indices_gpu.shape == (B,)
        assert self.prefix_lens_cpu.shape == (B,) and self.qo_indptr_cpu.shape == (B + 1,)
        assert int(self.qo_indptr_cpu[-1]) == self.num_tokens
        assert bool((self.qo_indptr_cpu[1:] >= self.qo_indptr_cpu[:-1]).all())
        assert bool((self.prefix_lens_cpu >= 0).all())
        assert self.tile_req_cpu.shape == self.tile_start_cpu.shape
        assert (self.rows_gpu is None) == (self.rows_indptr_gpu is None)
        names = ("prefix_lens_gpu", "qo_indptr_gpu", "tile_req_gpu", "tile_start_gpu")
        if self.gathered:
            names += ("rows_indptr_gpu",)
            assert self.rows_gpu.dtype == torch.int64 and self.rows_gpu.dim() == 1
            assert self.rows_indptr_cpu.shape == (B + 1,)
            assert int(self.rows_indptr_cpu[-1]) == self.rows_gpu.shape[0]
        for name in names:
            t = getattr(self, name)
            assert t.dtype == torch.int32 and t.device == self.req_pool_indices_gpu.device, name

    @property
    def gathered(self) -> bool:
        """Whether the tiles hold listed rows (:func:`gather_tiles`), not consecutive ones."""
        return self.rows_gpu is not None

    @property
    def num_rows(self) -> int:
        """Rows of ``q`` and of the output: the listed rows of a gathered plan, else every
        new token."""
        return self.rows_gpu.shape[0] if self.gathered else self.num_tokens

    @property
    def batch_size(self) -> int:
        return self.prefix_lens_cpu.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_req_cpu.shape[0]


def choose_extend_splits(plan: ExtendPlan, num_global: int, num_sms: int) -> int:
    """Runs of a global row's keys (``segpaged_extend_kernel``): enough that the global heads'
    tiles make ``split_programs_per_sm`` programs per SM, each run at least ``min_split_keys``
    keys of the longest request, rounded down to a power of two; 1 (no split) when the tiles
    already fill the GPU."""
    cfg = plan.config
    programs = plan.num_tiles * num_global
    if programs == 0 or programs >= cfg.split_programs_per_sm * num_sms:
        return 1
    want = -(-cfg.split_programs_per_sm * num_sms // programs)
    runs = min(want, plan.max_keys // cfg.min_split_keys, cfg.max_splits)
    per_run = plan.num_rows * num_global * plan.geometry.group_size * (plan.geometry.head_dim + 1)
    runs = max(1, min(runs, cfg.max_split_bytes // max(4 * per_run, 1)))
    return 1 << (runs.bit_length() - 1)  # a power of two, as measured


@functools.cache
def _no_parts(device: torch.device, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Stand-ins for the runs' outputs and counters of an unsplit launch (the dtypes the kernel
    takes)."""
    return (torch.empty((1, 1, 1, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, 1, 1), dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))  # fmt: skip


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _run_counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` zeroed int32 counters of finished runs, one per (tile, head slot) of a split launch:
    kept per device and stream (the kernel zeroes each again when its tile is merged, so one
    buffer serves every launch that stream orders after it)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        have = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


def plan_extend(
    geo: SegGeometry,
    req_pool_indices_gpu: torch.Tensor,
    prefix_lens_cpu: Sequence[int] | torch.Tensor,
    extend_lens_cpu: Sequence[int] | torch.Tensor,
    *,
    config: ExtendConfig = ExtendConfig(),
) -> ExtendPlan:
    """Plan an extend batch: query tiles of ``config.block_q(group_size)`` new tokens, the
    tiles with the most keys to visit first (they finish last otherwise)."""
    device = req_pool_indices_gpu.device
    prefix = torch.as_tensor(prefix_lens_cpu, dtype=torch.int64).cpu()
    lens = torch.as_tensor(extend_lens_cpu, dtype=torch.int64).cpu()
    assert prefix.shape == lens.shape and prefix.dim() == 1, (prefix.shape, lens.shape)
    assert bool((lens >= 0).all()), "extend lengths must be >= 0"
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=indptr[1:])

    bq = config.block_q(geo.group_size)
    tiles = [
        (int(p) + t0 + bq, b, t0)
        for b, (p, e) in enumerate(zip(prefix.tolist(), lens.tolist()))
        for t0 in range(0, e, bq)
    ]
    tiles.sort(key=lambda x: -x[0])
    tile_req = torch.tensor([t[1] for t in tiles], dtype=torch.int32)
    tile_start = torch.tensor([t[2] for t in tiles], dtype=torch.int32)
    prefix32, indptr32 = prefix.to(torch.int32), indptr.to(torch.int32)
    return ExtendPlan(
        geometry=geo,
        config=config,
        num_tokens=int(indptr[-1]),
        max_keys=int((prefix + lens).max()) if lens.numel() else 0,
        req_pool_indices_gpu=req_pool_indices_gpu,
        prefix_lens_cpu=prefix32,
        qo_indptr_cpu=indptr32,
        tile_req_cpu=tile_req,
        tile_start_cpu=tile_start,
        prefix_lens_gpu=to_device(prefix32, device),
        qo_indptr_gpu=to_device(indptr32, device),
        tile_req_gpu=to_device(tile_req, device),
        tile_start_gpu=to_device(tile_start, device),
    )


def gather_tiles(plan: ExtendPlan, rows_gpu: torch.Tensor, counts_cpu: Sequence[int]) -> ExtendPlan:
    """``plan`` computing only the batch rows ``rows_gpu`` (int64 on the device, ascending, in
    ``[0, T)``; ``counts_cpu[b]`` of them in request ``b``), each request's rows packed into tiles
    of ``block_q`` whatever the distance between them, so the attention costs their number, not
    the tiles of ``plan`` they fall in (a CacheBlend choice of every seventh token would otherwise
    run every tile). ``q`` and the output of the gathered plan hold the listed rows only.

    Built from the counts alone, without reading the rows (no host synchronisation): tiles of
    requests with more cached and new tokens first, and a request's later tiles before its
    earlier ones (its rows ascend), as an estimate of which tiles have the most keys to visit."""
    assert not plan.gathered, "gather_tiles takes a plan of every row"
    B = plan.batch_size
    counts = [int(c) for c in counts_cpu]
    assert len(counts) == B and min(counts, default=0) >= 0, counts
    assert rows_gpu.dtype == torch.int64 and rows_gpu.shape == (sum(counts),), rows_gpu.shape
    bq = plan.config.block_q(plan.geometry.group_size)
    prefix, qo = plan.prefix_lens_cpu.tolist(), plan.qo_indptr_cpu.tolist()
    tiles = []  # (estimated keys of the tile's last row, request, first entry)
    for b, n in enumerate(counts):
        for t0 in range(0, n, bq):
            last = qo[b + 1] - qo[b] - (n - min(t0 + bq, n))  # its last row at the latest
            tiles.append((prefix[b] + last, b, t0))
    tiles.sort(key=lambda x: -x[0])
    indptr = [0]
    for n in counts:
        indptr.append(indptr[-1] + n)
    NT = len(tiles)
    # One copy: tile_req | tile_start | indptr, each part at a 16-byte boundary. Triton
    # specialises a kernel on whether each pointer is 16-byte aligned, so unaligned parts would
    # compile a new variant of the kernel per tile count modulo 4 (in a request, not at startup).
    at = _ALIGN_INT32 * -(-NT // _ALIGN_INT32)
    packed = torch.zeros(2 * at + len(indptr), dtype=torch.int32)
    packed[:NT] = torch.tensor([t[1] for t in tiles], dtype=torch.int32)
    packed[at : at + NT] = torch.tensor([t[2] for t in tiles], dtype=torch.int32)
    packed[2 * at :] = torch.tensor(indptr, dtype=torch.int32)
    on_device = to_device(packed, rows_gpu.device)
    return replace(
        plan,
        tile_req_cpu=packed[:NT],
        tile_start_cpu=packed[at : at + NT],
        tile_req_gpu=on_device[:NT],
        tile_start_gpu=on_device[at : at + NT],
        rows_gpu=rows_gpu,
        rows_indptr_gpu=on_device[2 * at :],
        rows_indptr_cpu=packed[2 * at :],
    )


def run_extend(
    plan: ExtendPlan,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    req_to_token: torch.Tensor,
    heads: LayerHeads,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    skip_global: bool = False,
    num_splits: int | None = None,
    promoted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal extend attention of one layer.

    Parameters
    ----------
    q : [T, Hq, D] fp16/bf16, new tokens ragged by the plan's ``qo_indptr``; for a gathered
        plan [A, Hq, D], its listed rows only (``plan.num_rows``).
    k_new, v_new : [T, H_kv, D], the new tokens' keys and values for every rank-local KV head
        (every row, also under a gathered plan).
    k_global, v_global : [S_g, G_l, D] global store (any small tensor if G_l = 0).
    k_local, v_local : [S_l, L_l, D] local store (any small tensor if L_l = 0).
    req_to_token : [R, max_ctx] int32.
    heads : the layer's head tables.
    out : like ``q`` (allocated if None).
    lse : optional [rows of q, Hq] float32, filled with the natural-log log-sum-exp.
    skip_global : leave the query heads of global KV heads untouched (another kernel fills
        them, see ``redknot.kernels.flashinfer``).
    num_splits : runs each global row's keys are split into (None: :func:`choose_extend_splits`).
    promoted : optional [rows of req_to_token, R] int32 (rows of R contiguous), the local KV
        heads each request promoted to global (adaptive restore; -1: none): request ``b``'s
        promoted head in entry ``r`` attends every key, reading the cache from column
        ``G_l + r`` of the global store, which then has ``G_l + R`` columns.

    Returns
    -------
    out : like ``q``
    """
    geo, cfg = plan.geometry, plan.config
    A, Hq, D = q.shape
    T = plan.num_tokens
    assert A == plan.num_rows and Hq == geo.num_q_heads and D == geo.head_dim, q.shape
    assert q.dtype in _DTYPES and q.stride(2) == 1, (q.dtype, q.stride())
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        assert t.shape == (T, geo.num_kv_heads, D), f"{name}: {t.shape}"
        assert t.dtype == q.dtype and t.device == q.device and t.stride(2) == 1, name
    assert q.device == plan.qo_indptr_gpu.device, (q.device, plan.qo_indptr_gpu.device)
    out = check_layer_io(q, (k_global, v_global, k_local, v_local), req_to_token, heads, geo,
                         out, lse)  # fmt: skip

    restore, restore_p2 = check_promoted(promoted, req_to_token, k_global, heads)
    assert not (restore and skip_global), "adaptive restore runs every head in this kernel"
    first_slot = heads.num_global if skip_global else 0
    num_slots = geo.num_kv_heads - first_slot
    if plan.num_tiles == 0 or num_slots == 0:
        return out
    num_global = 0 if skip_global else heads.num_global
    if num_splits is None:
        num_splits = choose_extend_splits(plan, num_global, num_sms(q.device))
    assert num_splits >= 1, num_splits
    if num_global == 0 and not restore:
        num_splits = 1
    # the runs' outputs [S, A, query heads of the rows that may split, D] and base-2 LSEs (a
    # stand-in unsplit); a promoted head's rows split as a global head's
    gq = (geo.num_kv_heads if restore else num_global) * geo.group_size
    if num_splits > 1:
        part_lse = torch.empty((num_splits, A, gq), dtype=torch.float32, device=q.device)
        part_o = torch.empty((num_splits, A, gq, D), dtype=torch.float32, device=q.device)
        counters = _run_counters(q.device, plan.num_tiles * num_slots)
    else:
        part_o, part_lse, counters = _no_parts(q.device, D)
    lse_arg = lse if lse is not None else out
    rows = plan.rows_gpu if plan.gathered else plan.tile_start_gpu  # not read without GATHER
    rows_indptr = plan.rows_indptr_gpu if plan.gathered else plan.qo_indptr_gpu
    segpaged_extend_kernel[(plan.num_tiles, num_slots, num_splits)](
        q, k_new, v_new, k_global, v_global, k_local, v_local,
        req_to_token, plan.req_pool_indices_gpu, plan.prefix_lens_gpu, plan.qo_indptr_gpu,
        plan.tile_req_gpu, plan.tile_start_gpu, rows, rows_indptr,
        heads.is_local_gpu, heads.column_gpu, heads.order_gpu, out, lse_arg, part_o, part_lse,
        counters, promoted if restore else counters,
        sm_scale * math.log2(math.e), geo.sink, geo.window, geo.ring_len, first_slot, num_splits,
        heads.num_global,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), out.stride(0), out.stride(1), lse_arg.stride(0),
        k_global.stride(0), k_global.stride(1), v_global.stride(0), v_global.stride(1),
        k_local.stride(0), k_local.stride(1), v_local.stride(0), v_local.stride(1),
        req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1),
        promoted.stride(0) if restore else 0,
        GRP=geo.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=D,
        RING=geo.ring, WRITE_LSE=lse is not None, UPCAST=upcast_dots(q.dtype),
        GATHER=plan.gathered, RESTORE=restore, RESTORE_P2=restore_p2,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
