"""``benchmarks/vmm_probe.py``'s driver structures match the CUDA driver's ABI (x86-64), and the
probe says so when no driver is present."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vmm_probe


def test_the_structures_have_the_drivers_sizes_and_fields():
    # cuda.h: CUmemLocation {int type; int id} 8 bytes, CUmemAllocationProp 32 (with the
    # pointer aligned to 8), CUmemAccessDesc 12
    assert ctypes.sizeof(vmm_probe.MemLocation) == 8
    assert ctypes.sizeof(vmm_probe.AllocFlags) == 8
    assert ctypes.sizeof(vmm_probe.AllocationProp) == 32
    assert vmm_probe.AllocationProp.location.offset == 8
    assert vmm_probe.AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(vmm_probe.AccessDesc) == 12
    host = vmm_probe.prop_of(vmm_probe.LOCATION_HOST, 3)
    assert (host.type, host.location.type, host.location.id) == (1, 2, 0)  # id unused on host
    dev = vmm_probe.prop_of(vmm_probe.LOCATION_DEVICE, 3)
    assert (dev.location.type, dev.location.id, dev.requestedHandleTypes) == (1, 3, 0)
    assert vmm_probe.round_up(5, 4) == 8 and vmm_probe.round_up(8, 4) == 8


def test_without_a_driver_the_probe_records_why(tmp_path, monkeypatch):
    def no_driver(*args, **kwargs):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(vmm_probe, "probe", no_driver)
    out = tmp_path / "vmm.json"
    monkeypatch.setattr(sys, "argv", ["vmm_probe.py", "--out", str(out)])
    vmm_probe.main()
    assert "libcuda" in json.loads(out.read_text())["error"]
