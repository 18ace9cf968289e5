"""One CUDA tensor whose first rows are GPU memory and the rest pinned host memory.

``--redknot-lfps-offload-gb`` keeps token slots in pinned host memory, which every kernel reads
over PCIe as a CUDA tensor (``redknot.pool.host_memory``). The GPU's own KV budget would then go
unused, because each kernel indexes one store tensor per layer. CUDA's virtual memory
management maps physical memory of both kinds side by side in one reserved address range
(``cuMemAddressReserve``; ``cuMemCreate`` at the device and at ``CU_MEM_LOCATION_TYPE_HOST``;
``cuMemMap``; ``cuMemSetAccess``), so the store stays one tensor: slots below a boundary are in
GPU memory, slots above it in host memory, and no kernel changes. ``benchmarks/vmm_probe.py``
measured such a range on an H100 (``vmm_probe.json``: written and read across the boundary by
PyTorch kernels, the host half at PCIe speed).

The driver is reached through ``ctypes`` (``libcuda.so.1``): PyTorch exposes no driver VMM calls
and the ``cuda-python`` package is not a dependency. The structures follow ``cuda.h`` (x86-64;
``tests/pool/test_vmm.py`` checks their layout).

>>> store, on_gpu = tiered_tensor((slots, heads, dim), torch.bfloat16, device=0, device_rows=n)
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

LOCATION_DEVICE, LOCATION_HOST = 1, 2  # CUmemLocationType
ALLOCATION_PINNED = 1  # CUmemAllocationType
ACCESS_READ_WRITE = 3  # CUmemAccess_flags
GRANULARITY_MINIMUM = 0  # CUmemAllocationGranularity_flags


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class VmmError(RuntimeError):
    """A driver call refused (its name and CUDA error code in the message), or no driver."""


def prop_of(location_type: int, ordinal: int) -> AllocationProp:
    """A pinned allocation's properties at a device (``ordinal``) or on the host (id unused)."""
    prop = AllocationProp()
    prop.type = ALLOCATION_PINNED
    prop.location = MemLocation(location_type, ordinal if location_type == LOCATION_DEVICE else 0)
    return prop


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Driver:
    """The driver calls of a mapping; each result code is kept in ``calls``."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise VmmError(f"no CUDA driver library: {e}") from e
        self.calls: list[dict] = []

    def __call__(self, name: str, *args) -> None:
        code = int(getattr(self.lib, name)(*args))
        self.calls.append({"call": name, "result": code})
        if code:
            raise VmmError(f"{name} returned CUDA error {code}")


@functools.cache
def driver() -> Driver:
    return Driver()


def granularity(cu: Driver, ordinal: int) -> int:
    """Bytes both kinds of allocation are a multiple of (the larger minimum granularity)."""
    unit = 1
    for prop in (prop_of(LOCATION_DEVICE, ordinal), prop_of(LOCATION_HOST, 0)):
        g = ctypes.c_size_t()
        cu("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
           GRANULARITY_MINIMUM)  # fmt: skip
        unit = max(unit, g.value)
    return unit


class MappedRange:
    """A reserved range of ``device_bytes`` of GPU memory then ``host_bytes`` of pinned host
    memory (each a multiple of the granularity, either may be 0), readable and writable from
    device ``ordinal``; ``__cuda_array_interface__`` over its bytes. Unmapped and released when
    the last tensor over it goes away."""

    def __init__(self, cu: Driver, ordinal: int, device_bytes: int, host_bytes: int):
        self.cu, self.total = cu, device_bytes + host_bytes
        self.base = ctypes.c_uint64()
        self.handles: list[ctypes.c_uint64] = []
        self.mapped = False
        unit = granularity(cu, ordinal)
        if device_bytes % unit or host_bytes % unit or not self.total:
            raise ValueError(f"parts of {device_bytes} and {host_bytes} bytes: not multiples "
                             f"of the granularity {unit}, or empty")  # fmt: skip
        cu("cuMemAddressReserve", ctypes.byref(self.base), ctypes.c_size_t(self.total),
           ctypes.c_size_t(unit), ctypes.c_uint64(0), ctypes.c_uint64(0))  # fmt: skip
        try:
            offset = 0
            parts = ((LOCATION_DEVICE, device_bytes), (LOCATION_HOST, host_bytes))
            for kind, size in parts:
                if not size:
                    continue
                h = ctypes.c_uint64()
                cu("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(size),
                   ctypes.byref(prop_of(kind, ordinal)), ctypes.c_uint64(0))  # fmt: skip
                self.handles.append(h)
                cu("cuMemMap", ctypes.c_uint64(self.base.value + offset), ctypes.c_size_t(size),
                   ctypes.c_size_t(0), h, ctypes.c_uint64(0))  # fmt: skip
                self.mapped = True
                offset += size
            access = AccessDesc(MemLocation(LOCATION_DEVICE, ordinal), ACCESS_READ_WRITE)
            cu("cuMemSetAccess", ctypes.c_uint64(self.base.value), ctypes.c_size_t(self.total),
               ctypes.byref(access), ctypes.c_size_t(1))  # fmt: skip
        except VmmError:
            self.release()
            raise
        self.__cuda_array_interface__ = {
            "shape": (self.total,),
            "typestr": "|u1",
            "data": (self.base.value, False),
            "version": 2,
            "strides": None,
        }

    def release(self) -> None:
        """Unmap, release the allocations and free the range (each step at most once)."""
        if self.mapped:
            self.cu.lib.cuMemUnmap(ctypes.c_uint64(self.base.value), ctypes.c_size_t(self.total))
            self.mapped = False
        while self.handles:
            self.cu.lib.cuMemRelease(self.handles.pop())
        if self.base.value:
            self.cu.lib.cuMemAddressFree(ctypes.c_uint64(self.base.value),
                                         ctypes.c_size_t(self.total))  # fmt: skip
            self.base = ctypes.c_uint64()

    def __del__(self):
        # after the kernels that may still read it; at interpreter shutdown CUDA may be gone,
        # and the memory goes with the process
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.release()


def ordinal_of(device: str | torch.device) -> int:
    """The CUDA ordinal of ``device`` (``"cuda"`` alone: the current device)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def check_mapping(device: str | torch.device) -> None:
    """Map one granule of GPU memory and one of pinned host memory side by side on ``device``
    and release them; raises :class:`VmmError` where there is no driver or it refuses."""
    cu = driver()
    ordinal = ordinal_of(device)
    unit = granularity(cu, ordinal)
    MappedRange(cu, ordinal, unit, unit).release()


def device_part(rows: int, row_bytes: int, device_rows: int, unit: int) -> int:
    """Rows of a tensor of ``rows`` rows of ``row_bytes`` that can be GPU memory when
    ``device_rows`` are asked for: at most ``rows``, and a whole number of granules."""
    step = unit // math.gcd(unit, row_bytes)
    return min(device_rows, rows) // step * step


def tiered_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: int, device_rows: int
) -> tuple[torch.Tensor, int]:
    """A zeroed CUDA tensor of ``shape`` on ``device`` whose first rows (dim 0) are GPU memory
    and the others pinned host memory, and how many rows are GPU memory: ``device_rows``
    rounded down by :func:`device_part` (the host part is rounded up to the granularity; the
    range's tail past the tensor is unused). Raises :class:`VmmError` where the driver
    refuses."""
    cu = driver()
    unit = granularity(cu, device)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    on_device = device_part(shape[0], row_bytes, device_rows, unit)
    host_bytes = round_up((shape[0] - on_device) * row_bytes, unit)
    mapped = MappedRange(cu, device, on_device * row_bytes, host_bytes)
    flat = torch.as_tensor(mapped, device=f"cuda:{device}")
    if flat.data_ptr() != mapped.base.value:
        raise VmmError("PyTorch did not view the mapped range at its address")
    out = flat[: shape[0] * row_bytes].view(dtype).view(shape)
    out.zero_()
    return out, on_device
