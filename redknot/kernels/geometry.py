"""What SegPagedAttention needs to know about the heads and the stores, apart from the tensors.

``SegGeometry`` is fixed for a server (head counts, head dim, the local heads' visible span and
how the local store is addressed); ``LayerHeads`` is one layer's row of the head tables of
``redknot.pool.layout.HeadLayout`` plus its head counts on the host.

Visibility (query at absolute position ``i``, key at position ``j``, both 0-based):

| head class | visible keys                                   |
| ---------- | ---------------------------------------------- |
| global     | ``j <= i``                                     |
| local      | ``j <= i`` and (``j < sink`` or ``i - j < window``) |

Local-store addressing (``local_mode``):

| mode            | slot of position ``p`` of request ``b``                              |
| --------------- | -------------------------------------------------------------------- |
| ``token_table`` | ``req_to_token[req_pool_indices[b], p]`` (same as the global store)  |
| ``ring``        | ``req_pool_indices[b] * ring_len + ring_index(p)`` with              |
|                 | ``ring_index(p) = p if p < sink else sink + (p - sink) % (ring_len - sink)`` |
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from redknot.pool.layout import HeadLayout


@functools.cache
def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of ``device``, which the kernels' split choices fill (8 off
    CUDA: the Triton interpreter runs any count)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def store_readable(store: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether a kernel launched for ``q`` can read ``store``: on ``q``'s device, or in pinned
    host memory while ``q`` is on a GPU (KV offloaded to the host: the kernel's loads go over
    PCIe through CUDA's unified addressing, ``benchmarks/host_kv_probe.py``)."""
    if store.device == q.device:
        return True
    return q.device.type == "cuda" and store.device.type == "cpu" and store.is_pinned()


LOCAL_MODES = ("token_table", "ring")


@dataclass(frozen=True)
class SegGeometry:
    """Server-wide shape of SegPagedAttention (rank-local heads)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    sink: int
    window: int
    local_mode: str = "token_table"  # one of LOCAL_MODES
    ring_len: int = 0  # slots per request in the local store; used only when local_mode == "ring"

    def __post_init__(self) -> None:
        assert (
            self.num_kv_heads >= 1 and self.num_q_heads % self.num_kv_heads == 0
        ), f"{self.num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
        assert self.head_dim in (64, 128, 256), f"head_dim {self.head_dim} is not supported"
        assert self.sink >= 0 and self.window >= 1, (self.sink, self.window)
        assert self.local_mode in LOCAL_MODES, f"local_mode must be one of {LOCAL_MODES}"
        if self.local_mode == "ring":
            assert (
                self.ring_len - self.sink >= self.window
            ), f"ring_len {self.ring_len} must hold sink {self.sink} + window {self.window}"

    @classmethod
    def from_layout(
        cls, layout: HeadLayout, *, local_mode: str = "token_table", ring_len: int = 0
    ) -> SegGeometry:
        return cls(
            num_q_heads=layout.num_q_heads,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            sink=layout.sink,
            window=layout.window,
            local_mode=local_mode,
            ring_len=ring_len,
        )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def ring(self) -> bool:
        return self.local_mode == "ring"


@dataclass(frozen=True)
class LayerHeads:
    """One layer's head tables (device rows) and head counts (host)."""

    is_local_gpu: torch.Tensor  # [num_kv_heads] int32, 1 for a local head
    column_gpu: torch.Tensor  # [num_kv_heads] int32, column of the head in its store
    order_gpu: torch.Tensor  # [num_kv_heads] int32, heads of the layer, global ones first
    global_heads: tuple[int, ...]  # host copy: the layer's global KV heads, ascending

    def __post_init__(self) -> None:
        n = self.is_local_gpu.shape[0]
        for name in ("is_local_gpu", "column_gpu", "order_gpu"):
            t = getattr(self, name)
            assert t.shape == (n,) and t.dtype == torch.int32, f"{name}: {t.shape} {t.dtype}"
            assert t.is_contiguous(), f"{name} must be contiguous"
        assert list(self.global_heads) == sorted(set(self.global_heads)), self.global_heads
        assert all(0 <= h < n for h in self.global_heads), (self.global_heads, n)

    @property
    def num_kv_heads(self) -> int:
        return self.is_local_gpu.shape[0]

    @property
    def num_global(self) -> int:
        return len(self.global_heads)

    @property
    def num_local(self) -> int:
        return self.num_kv_heads - self.num_global

    @property
    def device(self) -> torch.device:
        return self.is_local_gpu.device

    @classmethod
    def from_layout(cls, layout: HeadLayout, layer: int, device: torch.device | str) -> LayerHeads:
        return cls.all_layers(layout, device)[layer]

    @classmethod
    def all_layers(cls, layout: HeadLayout, device: torch.device | str) -> list[LayerHeads]:
        """One ``LayerHeads`` per layer, sharing the tables of ``layout.tables(device)``."""
        tables = layout.tables(device)
        return [
            cls(
                is_local_gpu=tables["is_local"][layer],
                column_gpu=tables["column"][layer],
                order_gpu=tables["order"][layer],
                global_heads=tuple(layout.global_heads(layer)),
            )
            for layer in range(layout.num_layers)
        ]
