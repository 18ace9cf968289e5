"""``benchmarks/vmm_probe.py`` says so when no driver is present (its mapping is
``redknot.pool.vmm``'s, tested in ``tests/pool/test_vmm.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vmm_probe


def test_without_a_driver_the_probe_records_why(tmp_path, monkeypatch):
    def no_driver(*args, **kwargs):
        raise vmm_probe.VmmError("no CUDA driver library: libcuda.so.1: cannot open")

    monkeypatch.setattr(vmm_probe, "probe", no_driver)
    out = tmp_path / "vmm.json"
    monkeypatch.setattr(sys, "argv", ["vmm_probe.py", "--out", str(out)])
    vmm_probe.main()
    assert "libcuda" in json.loads(out.read_text())["error"]
