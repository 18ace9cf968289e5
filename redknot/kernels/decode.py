"""SegPagedAttention decode: plan once per batch on the host, run once per layer.

>>> geo = SegGeometry.from_layout(layout, local_mode="ring", ring_len=384)
>>> ws = DecodeWorkspace(geo, max_batch_size=256, max_splits=128, device="cuda",
...                      max_request_splits=4096)
>>> plan = plan_decode(geo, ws, seq_lens_gpu, req_pool_indices_gpu, seq_lens_cpu=seq_lens_cpu)
>>> for layer in range(num_layers):                      # no allocation, no host sync
...     run_decode(plan, q[layer], kg[layer], vg[layer], kl[layer], vl[layer],
...                req_to_token, heads[layer], sm_scale, out=out[layer])

CUDA graphs: capture with a plan whose ``seq_lens_gpu`` / ``req_pool_indices_gpu`` are the
graph's static buffers and whose ``num_splits`` is fixed for the batch size (pass it, e.g. from
``choose_num_splits(bs, max_context_len, ...)``); before each replay, fill those buffers (padded
rows: any ``seq_len >= 0`` and a valid ``req_pool_index``). Each program derives its share from
the row length, so the same plan serves every replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from redknot.kernels.geometry import LayerHeads, SegGeometry, store_readable
from redknot.kernels.geometry import num_sms as device_sms
from redknot.kernels.triton.common import upcast_dots
from redknot.kernels.triton.decode import segpaged_decode_kernel, segpaged_decode_merge_kernel

_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernels (constants of the launch, not of the semantics). Defaults:
    the fastest of the sweep in ``benchmarks/results/segpaged_kernels.json`` of commit a7c93dc
    (H200; that file has been re-measured since, without the sweep)."""

    block_n: int = 128  # keys per inner-loop block
    num_warps: int = 4
    num_stages: int = 3
    min_chunk: int = 256  # fewest keys a split takes (short rows are not split finely)
    programs_per_sm: int = 8  # split target: global-row programs per SM
    # Local rows (at most sink + window keys) are split into pieces of at least this many
    # keys, and no more programs than that are launched for them.
    local_min_chunk: int = 1024


class DecodeWorkspace:
    """Preallocated split-K partials. A plan of ``B`` requests and ``S`` splits uses
    ``B * S`` (request, split) slots; size ``max_request_splits`` for the largest such product
    (default ``max_batch_size * max_splits``; with splits from ``choose_num_splits`` it is about
    ``programs_per_sm * num_sms`` for every batch size, far less)."""

    def __init__(
        self,
        geo: SegGeometry,
        max_batch_size: int,
        max_splits: int,
        device: torch.device | str,
        max_request_splits: int | None = None,
    ) -> None:
        self.geo = geo
        self.max_batch_size = max_batch_size
        self.max_splits = max_splits
        self.max_request_splits = max_request_splits or max_batch_size * max_splits
        n = self.max_request_splits * geo.num_q_heads
        self.part_o = torch.empty(n * geo.head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(n, dtype=torch.float32, device=device)

    @classmethod
    def sized_for(
        cls,
        geo: SegGeometry,
        max_batch_size: int,
        num_sms: int,
        device: torch.device | str,
        *,
        max_splits: int = 128,
        config: DecodeConfig = DecodeConfig(),
    ) -> DecodeWorkspace:
        """Room for every plan whose splits come from ``choose_num_splits`` with ``config``:
        ``B * splits <= programs_per_sm * num_sms + B`` for any batch size ``B``."""
        return cls(
            geo, max_batch_size, max_splits, device,
            max_request_splits=config.programs_per_sm * num_sms + max_batch_size,
        )  # fmt: skip

    def views(self, batch_size: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``part_o`` [B, Hq, S, D] and ``part_lse`` [B, Hq, S], contiguous views."""
        assert batch_size <= self.max_batch_size, f"batch {batch_size} > {self.max_batch_size}"
        assert num_splits <= self.max_splits, f"{num_splits} splits > {self.max_splits}"
        assert (
            batch_size * num_splits <= self.max_request_splits
        ), f"{batch_size} requests x {num_splits} splits > {self.max_request_splits}"
        shape = (batch_size, self.geo.num_q_heads, num_splits)
        n = batch_size * self.geo.num_q_heads * num_splits
        return (
            self.part_o[: n * self.geo.head_dim].view(*shape, self.geo.head_dim),
            self.part_lse[:n].view(shape),
        )


def choose_num_splits(
    batch_size: int,
    max_seq_len: int,
    heavy_heads: int,
    *,
    num_sms: int,
    max_splits: int,
    config: DecodeConfig = DecodeConfig(),
) -> int:
    """Splits so that ``batch_size * heavy_heads`` long rows make about ``programs_per_sm``
    programs per SM, each split at least ``config.min_chunk`` keys long."""
    rows = max(1, batch_size * max(1, heavy_heads))
    want = math.ceil(config.programs_per_sm * num_sms / rows)
    longest = max(1, math.ceil(max_seq_len / config.min_chunk))
    return max(1, min(want, longest, max_splits))


@dataclass(frozen=True)
class DecodePlan:
    geometry: SegGeometry
    config: DecodeConfig
    num_splits: int  # static per captured batch size
    local_splits: int  # splits of a local row (<= num_splits), static with num_splits
    seq_lens_gpu: torch.Tensor  # [B] int32/int64, keys per request including the new token
    req_pool_indices_gpu: torch.Tensor  # [B] int32/int64, row of req_to_token / ring
    part_o_gpu: torch.Tensor  # [B, Hq, num_splits, D] float32, split outputs
    part_lse_gpu: torch.Tensor  # [B, Hq, num_splits] float32, split log2-sum-exp2

    def __post_init__(self) -> None:
        B = self.batch_size
        geo = self.geometry
        assert self.seq_lens_gpu.shape == (B,) and self.seq_lens_gpu.dtype in _INDEX_DTYPES
        assert self.req_pool_indices_gpu.shape == (B,)
        assert self.req_pool_indices_gpu.dtype in _INDEX_DTYPES
        assert self.num_splits >= 1 and 1 <= self.local_splits <= self.num_splits
        assert self.part_o_gpu.shape == (B, geo.num_q_heads, self.num_splits, geo.head_dim)
        assert self.part_o_gpu.stride(-1) == 1
        assert self.part_lse_gpu.shape == (B, geo.num_q_heads, self.num_splits)
        assert self.part_lse_gpu.stride(-1) == 1
        devices = {
            self.seq_lens_gpu.device,
            self.req_pool_indices_gpu.device,
            self.part_o_gpu.device,
        }
        assert len(devices) == 1, f"plan tensors on several devices: {devices}"

    @property
    def batch_size(self) -> int:
        return self.seq_lens_gpu.shape[0]


def plan_decode(
    geo: SegGeometry,
    workspace: DecodeWorkspace,
    seq_lens_gpu: torch.Tensor,
    req_pool_indices_gpu: torch.Tensor,
    *,
    seq_lens_cpu: torch.Tensor | None = None,
    num_splits: int | None = None,
    heavy_heads: int | None = None,
    num_sms: int | None = None,
    config: DecodeConfig = DecodeConfig(),
) -> DecodePlan:
    """Plan a decode batch of ``B = len(seq_lens_gpu)`` requests.

    Parameters
    ----------
    seq_lens_gpu, req_pool_indices_gpu : [B] int32/int64 device tensors, kept by reference
        (for CUDA graphs: the static buffers that are refilled before each replay).
    seq_lens_cpu : [B] host tensor, the same lengths; needed unless ``num_splits`` is given.
    num_splits : split count; fix it per batch size for CUDA graphs.
    heavy_heads : most global heads in any layer (default: every KV head).
    """
    B = seq_lens_gpu.shape[0]
    if num_splits is None:
        assert seq_lens_cpu is not None, "give seq_lens_cpu or num_splits"
        if num_sms is None:
            num_sms = device_sms(seq_lens_gpu.device)
        max_len = int(seq_lens_cpu.max()) if B else 1
        heavy = geo.num_kv_heads if heavy_heads is None else heavy_heads
        num_splits = choose_num_splits(
            B, max_len, heavy, num_sms=num_sms, max_splits=workspace.max_splits, config=config
        )
    part_o, part_lse = workspace.views(B, num_splits)
    local_span = geo.sink + geo.window
    return DecodePlan(
        geometry=geo,
        config=config,
        num_splits=num_splits,
        local_splits=min(num_splits, max(1, math.ceil(local_span / config.local_min_chunk))),
        seq_lens_gpu=seq_lens_gpu,
        req_pool_indices_gpu=req_pool_indices_gpu,
        part_o_gpu=part_o,
        part_lse_gpu=part_lse,
    )


def check_store(name: str, store: torch.Tensor, q: torch.Tensor, min_columns: int) -> None:
    """A store ``[S, columns, D]`` usable with ``q``: same dtype, readable from its device (the
    same device, or pinned host memory), rows of D contiguous."""
    assert store.dim() == 3 and store.shape[2] == q.shape[2], f"{name}: shape {store.shape}"
    assert store.dtype == q.dtype, f"{name}: dtype {store.dtype}, q has {q.dtype}"
    assert store_readable(store, q), f"{name}: on {store.device} (not pinned), q on {q.device}"
    assert store.stride(2) == 1, f"{name}: head_dim must be contiguous"
    assert store.shape[1] >= min_columns, f"{name}: {store.shape[1]} columns < {min_columns}"


def check_promoted(
    promoted: torch.Tensor | None,
    req_to_token: torch.Tensor,
    k_global: torch.Tensor,
    heads: LayerHeads,
) -> tuple[int, int]:
    """Checks of the table of promoted heads (adaptive restore) shared by the decode and extend
    wrappers: ``(R, R rounded up to a power of two)``, ``(0, 1)`` without a table."""
    if promoted is None:
        return 0, 1
    restore = promoted.shape[1]
    assert promoted.dtype == torch.int32 and promoted.stride(1) == 1, promoted.dtype
    assert promoted.shape[0] == req_to_token.shape[0], (promoted.shape, req_to_token.shape)
    assert k_global.shape[1] >= heads.num_global + restore, (k_global.shape, restore)
    return restore, triton_next_pow2(restore)


def check_layer_io(
    q: torch.Tensor,
    stores: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    req_to_token: torch.Tensor,
    heads: LayerHeads,
    geo: SegGeometry,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> torch.Tensor:
    """Checks shared by the decode and extend wrappers; returns ``out`` (allocated if None).

    ``stores`` is ``(k_global, v_global, k_local, v_local)``; ``q`` is ``[rows, Hq, D]``.
    """
    assert heads.num_kv_heads == geo.num_kv_heads and heads.device == q.device
    for name, store, columns in zip(
        ("k_global", "v_global", "k_local", "v_local"),
        stores,
        (heads.num_global, heads.num_global, heads.num_local, heads.num_local),
    ):
        check_store(name, store, q, columns)
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if lse is not None:
        assert lse.shape == q.shape[:2] and lse.dtype == torch.float32 and lse.stride(1) == 1
    return out


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,
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
    promoted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one layer.

    Parameters
    ----------
    q : [B, Hq, D] fp16/bf16, the new token of every request.
    k_global, v_global : [S_g, G_l, D] global store of the layer (any small tensor if G_l = 0).
    k_local, v_local : [S_l, L_l, D] local store of the layer (any small tensor if L_l = 0).
    req_to_token : [R, max_ctx] int32.
    heads : the layer's head tables.
    out : [B, Hq, D] like ``q`` (allocated if None; pass it under CUDA graphs).
    lse : optional [B, Hq] float32, filled with the natural-log log-sum-exp.
    promoted : optional [rows of req_to_token, R] int32, the local KV heads each request
        promoted to global (adaptive restore; -1: none), read from column ``G_l + r`` of the
        global store (see ``redknot.kernels.extend.run_extend``).

    Returns
    -------
    out : [B, Hq, D]
    """
    geo, cfg = plan.geometry, plan.config
    B, Hq, D = q.shape
    assert B == plan.batch_size and Hq == geo.num_q_heads and D == geo.head_dim, q.shape
    assert q.dtype in _DTYPES and q.stride(2) == 1, (q.dtype, q.stride())
    assert q.device == plan.seq_lens_gpu.device, (q.device, plan.seq_lens_gpu.device)
    out = check_layer_io(q, (k_global, v_global, k_local, v_local), req_to_token, heads, geo,
                         out, lse)  # fmt: skip
    restore, restore_p2 = check_promoted(promoted, req_to_token, k_global, heads)
    if B == 0:
        return out

    grp = geo.group_size
    block_h = max(16, grp)
    lse_arg = lse if lse is not None else plan.part_lse_gpu
    po, pl = plan.part_o_gpu, plan.part_lse_gpu
    num_global = heads.num_global
    # a promoted local head's row is as long as a global one's: it needs as many splits
    local_splits = plan.num_splits if restore else plan.local_splits
    programs = num_global * plan.num_splits + (geo.num_kv_heads - num_global) * local_splits
    promoted_arg = promoted if restore else heads.column_gpu
    stride_pr = promoted.stride(0) if restore else 0
    segpaged_decode_kernel[(programs, B)](
        q, k_global, v_global, k_local, v_local,
        req_to_token, plan.req_pool_indices_gpu, plan.seq_lens_gpu,
        heads.is_local_gpu, heads.column_gpu, heads.order_gpu, promoted_arg,
        out, lse_arg, po, pl,
        sm_scale * math.log2(math.e), geo.sink, geo.window, geo.ring_len, plan.num_splits,
        local_splits, num_global,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse_arg.stride(0),
        k_global.stride(0), k_global.stride(1), v_global.stride(0), v_global.stride(1),
        k_local.stride(0), k_local.stride(1), v_local.stride(0), v_local.stride(1),
        req_to_token.stride(0), po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1), stride_pr,
        GRP=grp, BLOCK_H=block_h, BLOCK_N=cfg.block_n, HEAD_DIM=D,
        MIN_CHUNK=cfg.min_chunk, RING=geo.ring,
        WRITE_LSE=lse is not None, UPCAST=upcast_dots(q.dtype),
        RESTORE=restore, RESTORE_P2=restore_p2,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if plan.num_splits > 1:
        splits_p2 = triton_next_pow2(plan.num_splits)
        segpaged_decode_merge_kernel[(B, Hq)](
            plan.seq_lens_gpu, plan.req_pool_indices_gpu, heads.is_local_gpu, heads.column_gpu,
            promoted_arg, out, lse_arg, po, pl,
            geo.sink, geo.window, plan.num_splits, local_splits, num_global,
            out.stride(0), out.stride(1), lse_arg.stride(0),
            po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), stride_pr,
            GRP=grp, BLOCK_N=cfg.block_n, HEAD_DIM=D, SPLITS_P2=splits_p2,
            SPLITS_BLOCK=min(splits_p2, 16), MIN_CHUNK=cfg.min_chunk,
            WRITE_LSE=lse is not None, RESTORE=restore, RESTORE_P2=restore_p2, num_warps=4,
        )  # fmt: skip
    return out


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
