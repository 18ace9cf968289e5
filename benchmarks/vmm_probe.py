"""Can one KV store span GPU memory and pinned host memory? A probe of CUDA's virtual memory
management, for a store that fills the GPU first and spills to the host (docs/lfps.md).

The offloaded server (``--redknot-lfps-offload-gb``) keeps every token slot in host memory and
leaves the GPU's KV budget unused (65 GB on an H200, ``lfps_capacity_h200.json``), because every
kernel indexes one store tensor per layer. CUDA's driver can map physical allocations of both
kinds side by side in one reserved address range (``cuMemAddressReserve``, ``cuMemCreate`` with
a device location and with ``CU_MEM_LOCATION_TYPE_HOST``, ``cuMemMap``, ``cuMemSetAccess``).
This probe builds such a range of ``--device-mib`` then ``--host-mib``, views it as one CUDA
tensor (``__cuda_array_interface__``), writes a pattern across it with PyTorch kernels and reads
it back on the GPU and from the host (checked equal to the pattern), and times a read of each
part with CUDA events. Every driver call's result is recorded; a refused call ends the probe
with its error code in the JSON instead of an exception.

The driver is reached through ``ctypes`` (``libcuda.so.1``), so the probe depends on no
particular ``cuda-python`` release matching the machine's driver.

    python3 benchmarks/vmm_probe.py --out $OUT/vmm_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_common as common

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


def prop_of(location_type: int, ordinal: int) -> AllocationProp:
    """A pinned allocation's properties at a device (``ordinal``) or on the host (id unused)."""
    prop = AllocationProp()
    prop.type = ALLOCATION_PINNED
    prop.location = MemLocation(location_type, ordinal if location_type == LOCATION_DEVICE else 0)
    return prop


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class Driver:
    """The few driver calls the probe makes; each result code is kept in ``calls``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.calls: list[dict] = []

    def __call__(self, name: str, *args) -> int:
        code = int(getattr(self.lib, name)(*args))
        self.calls.append({"call": name, "result": code})
        if code:
            raise RuntimeError(f"{name} returned CUDA error {code}")
        return code


def probe(device_mib: int, host_mib: int, reps: int) -> dict:
    import torch

    torch.cuda.init()
    ordinal = torch.cuda.current_device()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cu = Driver()
    out: dict = {"device_mib": device_mib, "host_mib": host_mib, "calls": cu.calls}
    try:
        mapped(torch, cu, ordinal, device_mib, host_mib, reps, out)
    except RuntimeError as e:  # a refused call: its code is the last of ``calls``
        out["error"] = str(e)
    return out


def mapped(torch, cu: Driver, ordinal: int, device_mib: int, host_mib: int, reps: int,
           out: dict) -> None:  # fmt: skip
    """Reserve, create, map and open the range, exercise it, and release it (into ``out``)."""
    version = ctypes.c_int()
    cu("cuDriverGetVersion", ctypes.byref(version))
    out["driver_version"] = version.value
    props = {LOCATION_DEVICE: prop_of(LOCATION_DEVICE, ordinal),
             LOCATION_HOST: prop_of(LOCATION_HOST, 0)}  # fmt: skip
    grain = {}
    for kind, prop in props.items():
        g = ctypes.c_size_t()
        cu("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
           GRANULARITY_MINIMUM)  # fmt: skip
        grain[kind] = g.value
    unit = max(grain.values())
    out["granularity"] = {"device": grain[LOCATION_DEVICE], "host": grain[LOCATION_HOST]}
    sizes = {LOCATION_DEVICE: round_up(device_mib << 20, unit),
             LOCATION_HOST: round_up(host_mib << 20, unit)}  # fmt: skip
    total = sum(sizes.values())
    base = ctypes.c_uint64()
    cu("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(total), ctypes.c_size_t(unit),
       ctypes.c_uint64(0), ctypes.c_uint64(0))  # fmt: skip
    handles, offset = [], 0
    for kind in (LOCATION_DEVICE, LOCATION_HOST):
        h = ctypes.c_uint64()
        cu("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(sizes[kind]),
           ctypes.byref(props[kind]), ctypes.c_uint64(0))  # fmt: skip
        cu("cuMemMap", ctypes.c_uint64(base.value + offset), ctypes.c_size_t(sizes[kind]),
           ctypes.c_size_t(0), h, ctypes.c_uint64(0))  # fmt: skip
        handles.append(h)
        offset += sizes[kind]
    access = AccessDesc(MemLocation(LOCATION_DEVICE, ordinal), ACCESS_READ_WRITE)
    cu("cuMemSetAccess", ctypes.c_uint64(base.value), ctypes.c_size_t(total),
       ctypes.byref(access), ctypes.c_size_t(1))  # fmt: skip
    try:
        out.update(exercise(torch, base.value, sizes[LOCATION_DEVICE], total, reps))
    finally:
        torch.cuda.synchronize()
        cu("cuMemUnmap", ctypes.c_uint64(base.value), ctypes.c_size_t(total))
        for h in handles:
            cu("cuMemRelease", h)
        cu("cuMemAddressFree", ctypes.c_uint64(base.value), ctypes.c_size_t(total))


def exercise(torch, base: int, device_bytes: int, total: int, reps: int) -> dict:
    """Write a pattern over the whole range on the GPU, check it on the GPU and from the host,
    and time a read of each part."""

    view = types.SimpleNamespace(__cuda_array_interface__={
        "shape": (total // 4,), "typestr": "<i4", "data": (base, False), "version": 3,
    })  # fmt: skip
    store = torch.as_tensor(view, device="cuda")
    assert store.is_cuda and store.data_ptr() == base, (store.device, store.data_ptr(), base)
    n, split = store.numel(), device_bytes // 4
    store.copy_(torch.arange(n, device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    want = n * (n - 1) // 2
    got_gpu = int(store.to(torch.int64).sum())
    got_host = int(store[split - 1024 : split + 1024].cpu().to(torch.int64).sum())
    want_host = sum(range(split - 1024, split + 1024))
    times = {}
    for name, part in (("device", store[:split]), ("host", store[split:])):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        part.sum()  # warm-up
        start.record()
        for _ in range(reps):
            part.sum()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / reps
        times[name] = {"ms": ms, "gb_per_s": part.numel() * 4 / ms / 1e6}
    return {
        "one_tensor_over_both": True,
        "gpu_sum_matches": got_gpu == want,
        "host_read_across_the_boundary_matches": got_host == want_host,
        "read": times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-mib", type=int, default=1024)
    ap.add_argument("--host-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/vmm_probe.json"))
    args = ap.parse_args()
    try:
        figures = probe(args.device_mib, args.host_mib, args.reps)
    except OSError as e:  # no driver on this machine
        figures = {"error": str(e)}
    common.write_json(args.out, common.record(**figures))
    print(figures)


if __name__ == "__main__":
    main()
