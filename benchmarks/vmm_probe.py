"""Can one KV store span GPU memory and pinned host memory? A probe of CUDA's virtual memory
management, for a store that fills the GPU first and spills to the host (docs/lfps.md).

The offloaded server (``--redknot-lfps-offload-gb``) kept every token slot in host memory and
left the GPU's KV budget unused (65 GB on an H200, ``lfps_capacity_h200.json``), because every
kernel indexes one store tensor per layer; it now maps both into one store with
``redknot.pool.vmm``, which this probe exercises on its own. CUDA's driver can map physical
allocations of both kinds side by side in one reserved address range (``cuMemAddressReserve``,
``cuMemCreate`` with a device location and with ``CU_MEM_LOCATION_TYPE_HOST``, ``cuMemMap``,
``cuMemSetAccess``).
This probe builds such a range of ``--device-mib`` then ``--host-mib``, views it as one CUDA
tensor (``__cuda_array_interface__``), writes a pattern across it with PyTorch kernels and reads
it back on the GPU and from the host (checked equal to the pattern), and times a read of each
part with CUDA events. Every driver call's result is recorded; a refused call ends the probe
with its error code in the JSON instead of an exception.

The mapping is the pool's own (``redknot.pool.vmm``, which reaches the driver through
``ctypes``).

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

from redknot.pool.vmm import Driver, MappedRange, VmmError, granularity, round_up


def probe(device_mib: int, host_mib: int, reps: int) -> dict:
    import torch

    torch.cuda.init()
    ordinal = torch.cuda.current_device()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cu = Driver()
    out: dict = {"device_mib": device_mib, "host_mib": host_mib, "calls": cu.calls}
    try:
        mapped(torch, cu, ordinal, device_mib, host_mib, reps, out)
    except VmmError as e:  # a refused call: its code is the last of ``calls``
        out["error"] = str(e)
    return out


def mapped(torch, cu: Driver, ordinal: int, device_mib: int, host_mib: int, reps: int,
           out: dict) -> None:  # fmt: skip
    """Reserve, create, map and open the range (``redknot.pool.vmm.MappedRange``, the pool's
    own), exercise it, and release it (into ``out``)."""
    version = ctypes.c_int()
    cu("cuDriverGetVersion", ctypes.byref(version))
    out["driver_version"] = version.value
    unit = granularity(cu, ordinal)
    out["granularity"] = unit
    device_bytes, host_bytes = round_up(device_mib << 20, unit), round_up(host_mib << 20, unit)
    rng = MappedRange(cu, ordinal, device_bytes, host_bytes)
    try:
        out.update(exercise(torch, rng.base.value, device_bytes, rng.total, reps))
    finally:
        torch.cuda.synchronize()
        rng.release()


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
    except VmmError as e:  # no driver on this machine
        figures = {"error": str(e)}
    common.write_json(args.out, common.record(**figures))
    print(figures)


if __name__ == "__main__":
    main()
