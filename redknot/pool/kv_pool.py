"""SegPaged KV pool: memory proportional to what each (layer, KV head) keeps.

Two stores per layer ``l`` (``G_l`` global and ``L_l`` local KV heads on this rank; columns
follow ``HeadLayout.tables()['column']``):

| buffer                       | shape                                   | row index                 |
| ---------------------------- | --------------------------------------- | ------------------------- |
| ``k_global[l]``/``v_global`` | ``[size + page_size, G_l + R, D]``      | token slot (SGLang's      |
|                              |                                         | ``out_cache_loc`` / ``req_to_token``) |
| ``k_local[l]``/``v_local``   | ``[(rings + snapshots) * ring_len, L_l, D]`` | ``slot * ring_len + ring_index(pos)`` |

``R`` restore columns (``layout.restore``, 0 unless adaptive restore is on) follow a layer's
global heads: a local head a request promoted (``promoted[req_pool_idx, l, r]``, -1 where none)
keeps the request's K/V in column ``G_l + r`` at its token slots.

Global heads keep every token in token slots handed out by SGLang's own allocator, so the
scheduler's token accounting counts exactly the global KV (``bytes_per_token``). Local heads
keep ``ring_len = sink + window`` positions per request in a ring indexed by the request's
``req_pool_idx``: ``ring_index(p) = p`` for ``p < sink`` and ``sink + (p - sink) % window``
otherwise, so a position that leaves the window is overwritten in place (its memory is reused
as the request decodes, never held). Rings are a fixed reservation of
``fixed_bytes`` (one per request slot, plus snapshot slots that keep the local KV of cached
prefixes); the token budget is what remains. Cached segments keep their K/V in a third store,
``segments`` (``redknot.pool.segment_region``), also reserved out of the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import KVCache, unwrap_write_loc

from redknot.pool.layout import HeadLayout
from redknot.pool.segment_region import SegmentPlan, SegmentRegion

logger = logging.getLogger(__name__)
GB = 1 << 30


def _store_cache():
    """SGLang's fused K+V store kernel (the one its own pools write with; CUDA only)."""
    from sglang.kernels.ops.kvcache.kvcache import store_cache

    return store_cache


def bytes_per_token(layout: HeadLayout, dtype: torch.dtype) -> int:
    """Global-store bytes (K and V) one token costs over all layers of this rank (restore
    columns included)."""
    heads = sum(layout.global_columns(layer) for layer in range(layout.num_layers))
    return 2 * heads * layout.head_dim * torch.empty((), dtype=dtype).element_size()


def bytes_per_ring(layout: HeadLayout, dtype: torch.dtype) -> int:
    """Local-store bytes (K and V) of one ring or snapshot slot over all layers of this rank."""
    heads = sum(layout.num_local(layer) for layer in range(layout.num_layers))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * heads * layout.local_span * layout.head_dim * itemsize


class RedknotKVPool(KVCache):
    """KV pool of the redknot backend (see the module docstring for the layout)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layout: HeadLayout,
        num_rings: int,
        num_snapshots: int,
        device: str,
        enable_memory_saver: bool = False,
        segment_plan: SegmentPlan | None = None,
        host_kv: bool = False,
        device_rows: int = 0,
    ):
        super().__init__(
            size,
            page_size,
            dtype,
            layout.num_layers,
            device,
            enable_memory_saver,
            allocation_label="redknot",
        )
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
            UnquantizedKVCacheMethod,
        )

        self.quant_method = UnquantizedKVCacheMethod()
        self.layout = layout
        self.head_num = layout.num_kv_heads
        self.head_dim = self.v_head_dim = layout.head_dim
        self.ring_len = 0 if layout.all_global else layout.local_span
        self.num_rings = num_rings
        self.num_snapshots = num_snapshots
        tables = layout.tables("cpu")
        # Rank-local indices of the global / local heads of each layer, for gathers.
        self.global_index = [
            torch.tensor(layout.global_heads(i), dtype=torch.long, device=device)
            for i in range(layout.num_layers)
        ]
        self.local_index = [
            torch.tensor(layout.local_heads(i), dtype=torch.long, device=device)
            for i in range(layout.num_layers)
        ]
        self.pending = PendingCopies()
        self._store_widths: dict[int, bool] = {}  # row bytes -> SGLang's store kernel serves it
        self.capture_jobs: dict[int, CaptureJob] = {}  # req_pool_idx -> job
        # req_pool_idx -> redknot.segcache.registration.WriteJob (segments being registered)
        self.segment_jobs: dict[int, Any] = {}
        # req_pool_idx -> [redknot.segcache.reuse.SegmentUse] (stored segments a request reuses)
        self.segment_reads: dict[int, list[Any]] = {}
        # the recovery policy a reusing request is served with (--redknot-policy; meta_info)
        self.reuse_policy = "redknot"
        self.is_local = tables["is_local"].to(device)
        self.column = tables["column"].to(device)
        d = layout.head_dim
        rows = (num_rings + num_snapshots) * self.ring_len
        # --redknot-lfps-offload-gb: the global store in pinned host memory, as CUDA tensors
        # every kernel reads over PCIe (redknot.pool.host_memory)
        # (device_rows > 0: the store's first slots in GPU memory, the rest in host memory, one
        # tensor per layer mapped by redknot.pool.vmm)
        self.host_kv = host_kv
        self.device_rows = 0  # slots [0, device_rows) of a host store in GPU memory
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            n = size + page_size
            shapes = [(n, layout.global_columns(i), d) for i in range(layout.num_layers)]
            if host_kv and device_rows > 0:
                from redknot.pool.vmm import ordinal_of, tiered_tensor

                index = ordinal_of(device)
                k = [tiered_tensor(s, dtype, index, device_rows) for s in shapes]
                v = [tiered_tensor(s, dtype, index, device_rows) for s in shapes]
                self.k_global, self.v_global = [t for t, _ in k], [t for t, _ in v]
                self.device_rows = min(rows for _, rows in k + v)
            elif host_kv:
                from redknot.pool.host_memory import pinned_host_tensor

                self.k_global = [pinned_host_tensor(s, dtype, device) for s in shapes]
                self.v_global = [pinned_host_tensor(s, dtype, device) for s in shapes]
            else:
                self.k_global = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
                self.v_global = [torch.zeros_like(t) for t in self.k_global]
            self.k_local = [
                torch.zeros((rows, layout.num_local(i), d), dtype=dtype, device=device)
                for i in range(layout.num_layers)
            ]
            self.v_local = [torch.zeros_like(t) for t in self.k_local]
            # Cached segments' K/V (redknot.pool.segment_region); None when segments are off.
            self.segments = (
                SegmentRegion(layout, segment_plan, dtype, device)
                if segment_plan is not None and segment_plan.num_pages > 0
                else None
            )
        # LFPS decode's score tables (redknot.lfps.serving.LfpsStore); set by the pool's
        # builder under --redknot-lfps, whose budget it is taken from
        self.lfps_store = None
        # Adaptive restore: the local KV heads each request promoted, per layer (-1: none); a
        # request's row is reset when it gets its slot (every slot of the batch's rings)
        self.promoted = torch.full(
            (num_rings, layout.num_layers, max(layout.restore, 1)), -1, dtype=torch.int32,
            device=device,
        )  # fmt: skip
        self.promoted_resets: list[int] = []  # request slots given to new requests
        self._finalize_allocation_log(size)
        logger.info(
            "redknot pool: %d token slots for %d global heads + %d restore columns per layer, "
            "%d rings + %d snapshots of %d positions for %d local heads (%.2f GB global%s, "
            "%.2f GB local)",
            size,
            sum(layout.num_global(i) for i in range(layout.num_layers)),
            layout.restore,
            num_rings,
            num_snapshots,
            self.ring_len,
            sum(layout.num_local(i) for i in range(layout.num_layers)),
            sum(2 * t.numel() * t.element_size() for t in self.k_global) / GB,
            self._store_place(),
            sum(2 * t.numel() * t.element_size() for t in self.k_local) / GB,
        )

    def _store_place(self) -> str:
        """Where the global store is, for the startup log."""
        if self.device_rows:
            return f", slots below {self.device_rows} in GPU memory, the rest in pinned host memory"
        return " in pinned host memory" if self.host_kv else ""

    # ---- SGLang's KVCache contract (the global store) ----------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_global[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_global[layer_id]

    def get_kv_buffer(self, layer_id: int):
        return self.k_global[layer_id], self.v_global[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, **kwargs):
        """Store the global heads' K/V of new tokens; ``cache_k``: [T, H_kv, D]."""
        loc, _, _ = unwrap_write_loc(loc)
        layer_id = kwargs.get("layer_id_override") or layer.layer_id
        self.write_global(layer_id, loc, cache_k, cache_v)

    def get_kv_size_bytes(self):
        seg_k = self.segments.k if self.segments is not None else []
        seg_v = self.segments.v if self.segments is not None else []
        k = sum(t.numel() * t.element_size() for t in self.k_global + self.k_local + seg_k)
        v = sum(t.numel() * t.element_size() for t in self.v_global + self.v_local + seg_v)
        return k, v

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("redknot's pool does not support PD disaggregation transfer")

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError("redknot's pool does not support CPU offload of KV")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError("redknot's pool does not support CPU offload of KV")

    # ---- redknot's own accessors ---------------------------------------------------------

    def write_global(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``k``, ``v``: [T, H_kv, D] for all rank-local heads; keeps the global ones."""
        g = self.layout.num_global(layer_id)
        if g == 0:
            return
        if self.layout.num_local(layer_id):
            idx = self.global_index[layer_id]
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        k_buf, v_buf = self.k_global[layer_id], self.v_global[layer_id]
        if k_buf.shape[1] == g and self._fused_store(k, v):
            # whole rows: SGLang's K+V store kernel, one launch a layer where two index_puts
            # made a SmolLM2 prefill 60 launches and 1-2 ms of host time longer than a dense
            # server's (benchmarks/results/profile_side_by_side_smollm2_cea9016.json)
            row = g * self.head_dim
            _store_cache()(
                k.reshape(-1, row), v.reshape(-1, row), k_buf.view(-1, row), v_buf.view(-1, row),
                loc, row_bytes=row * k_buf.element_size(), size_limit=k_buf.shape[0],
                reserved_skip_index=-1,
            )  # fmt: skip
            return
        # the global heads' columns (restore columns, if any, follow them)
        k_buf[loc, :g] = k.to(self.dtype)
        v_buf[loc, :g] = v.to(self.dtype)

    def _fused_store(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether SGLang's store kernel can write these rows: on CUDA, in the pool's dtype,
        with a row width the kernel was built for (decided once per width)."""
        if not (k.is_cuda and k.dtype == v.dtype == self.dtype):
            return False
        row_bytes = k.shape[1] * self.head_dim * k.element_size()
        if row_bytes not in self._store_widths:
            from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache

            self._store_widths[row_bytes] = bool(can_use_store_cache(row_bytes))
        return self._store_widths[row_bytes]

    def write_restored(
        self, layer_id: int, loc: torch.Tensor, rpi: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Restore columns of token slots ``loc`` (``[T]``; row ``i`` belongs to the request in
        slot ``rpi[i]``): the K/V of the heads that request promoted in this layer, from ``k``,
        ``v`` ([T, H_kv, D], every rank-local head). Entries without a promoted head take head
        0's (never read). No host synchronisation."""
        g, r = self.layout.num_global(layer_id), self.layout.restore
        heads = self.promoted[rpi, layer_id].clamp_min(0).long()  # [T, R]
        index = heads[:, :, None].expand(-1, -1, k.shape[2])
        self.k_global[layer_id][loc, g : g + r] = k.gather(1, index).to(self.dtype)
        self.v_global[layer_id][loc, g : g + r] = v.gather(1, index).to(self.dtype)

    def reset_promoted(self) -> None:
        """Clear the promoted heads of the request slots handed out since the last forward
        (run by the backend on the forward stream, before the slots' first extend)."""
        if self.promoted_resets:
            slots, self.promoted_resets = self.promoted_resets, []
            self.promoted[torch.tensor(slots, dtype=torch.int64).to(self.promoted.device)] = -1

    def promoted_of(self, layer_id: int) -> torch.Tensor | None:
        """``[rings, R]`` int32 view of the layer's promoted heads (None: restore off)."""
        return self.promoted[:, layer_id] if self.layout.restore else None

    def local_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the local store holding ``positions`` of the rings/snapshots ``slots``."""
        sink, window = self.layout.sink, self.layout.window
        ring = torch.where(positions < sink, positions, sink + (positions - sink) % window)
        return slots.to(torch.long) * self.ring_len + ring.to(torch.long)

    def write_local(self, layer_id: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``k``, ``v``: [T, H_kv, D] for all rank-local heads; keeps the local ones at ``rows``."""
        if self.layout.num_local(layer_id) == 0:
            return
        idx = self.local_index[layer_id]
        self.k_local[layer_id][rows] = k.index_select(1, idx).to(self.dtype)
        self.v_local[layer_id][rows] = v.index_select(1, idx).to(self.dtype)

    def copy_local_rows(self, layer_id: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``k_local[layer][dst] = k_local[layer][src]`` (and V): rows of one layer."""
        if self.layout.num_local(layer_id):
            self.k_local[layer_id][dst] = self.k_local[layer_id][src]
            self.v_local[layer_id][dst] = self.v_local[layer_id][src]

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy whole rings/snapshots ``src[i] -> dst[i]`` in every layer (int64 [n])."""
        if self.ring_len == 0 or dst.numel() == 0:
            return
        for buf in self.k_local + self.v_local:
            if buf.shape[1] == 0:
                continue
            view = buf.view(-1, self.ring_len, buf.shape[1], buf.shape[2])
            view[dst] = view[src]

    def snapshot_slot(self, index: int) -> int:
        """Slot number of snapshot ``index`` (snapshots follow the request rings)."""
        assert 0 <= index < self.num_snapshots
        return self.num_rings + index

    @property
    def post_capture_backed_bytes(self) -> int:
        return sum(self.get_kv_size_bytes())

    def describe(self) -> str | None:
        return f"RedknotKVPool(size={self.size}, rings={self.num_rings}, ring_len={self.ring_len})"


class PendingCopies:
    """Ring/snapshot copies queued by the scheduler, run by the backend on the forward stream.

    The scheduler decides when a request's local KV is saved to a snapshot (its prefix was
    cached) or restored from one (a new request hit a cached prefix); the copies must run in
    stream order with the forward passes that write the rings, so the backend runs them at
    the start of the next forward, before any layer writes a ring. Order is kept: a restore
    queued after a save reads the saved data.
    """

    def __init__(self) -> None:
        self._ops: list[tuple[int, int]] = []  # (dst slot, src slot)

    def queue(self, dst: int, src: int) -> None:
        self._ops.append((dst, src))

    def drop_writes_to(self, slot: int) -> None:
        """Forget queued copies into ``slot`` (its snapshot was evicted before they ran)."""
        self._ops = [op for op in self._ops if op[0] != slot]

    def clear(self) -> None:
        """Forget every queued copy (a cache reset: snapshots are gone, no request is live)."""
        self._ops = []

    def __len__(self) -> int:
        return len(self._ops)

    def run(self, pool: RedknotKVPool) -> None:
        """Issue the queued copies in order; consecutive independent copies share a launch."""
        ops, self._ops = self._ops, []
        batch_dst: list[int] = []
        batch_src: list[int] = []
        for dst, src in ops:
            if dst in batch_src or src in batch_dst or dst in batch_dst:
                self._flush(pool, batch_dst, batch_src)
                batch_dst, batch_src = [], []
            batch_dst.append(dst)
            batch_src.append(src)
        self._flush(pool, batch_dst, batch_src)

    @staticmethod
    def _flush(pool: RedknotKVPool, dst: list[int], src: list[int]) -> None:
        if dst:
            device = pool.k_local[0].device
            pool.copy_slots(
                torch.tensor(dst, dtype=torch.long, device=device),
                torch.tensor(src, dtype=torch.long, device=device),
            )


@dataclass(frozen=True)
class CaptureJob:
    """Save, during a request's prefill, its local KV as it stands at ``position`` tokens."""

    position: int  # the prefix length the snapshot will represent
    slot: int  # destination snapshot slot (a slot number of the local store)


def capture_rows(
    pool: RedknotKVPool, job: CaptureJob, ring_slot: int, prefix_len: int, token_offset: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Rows to copy so that snapshot ``job.slot`` holds positions ``< job.position``.

    The request extends positions ``[prefix_len, ...)`` whose new K/V are rows
    ``token_offset + (p - prefix_len)`` of the batch; positions before ``prefix_len`` are still in
    its ring (the ring is written after the layer's attention). Returns
    ``(dst_from_ring, src_ring_rows, dst_from_new, src_token_rows)``.
    """
    sink, window, ring_len = pool.layout.sink, pool.layout.window, pool.ring_len
    end = job.position
    keep = list(range(min(sink, end))) + list(range(max(sink, end - window), end))

    def ring_row(slot: int, p: int) -> int:
        return slot * ring_len + (p if p < sink else sink + (p - sink) % window)

    dst_r, src_r, dst_n, src_n = [], [], [], []
    for p in keep:
        if p < prefix_len:
            dst_r.append(ring_row(job.slot, p))
            src_r.append(ring_row(ring_slot, p))
        else:
            dst_n.append(ring_row(job.slot, p))
            src_n.append(token_offset + p - prefix_len)
    return dst_r, src_r, dst_n, src_n
