"""``benchmarks/scaled_record.py`` writes, without importing redknot, what
``CostRecord.scaled`` computes: the two must not drift apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaled_record

from redknot.costmodel.record import CostRecord


@pytest.mark.parametrize("factor", [0.3, 2.5])
def test_the_script_scales_what_the_record_scales(tmp_path, factor):
    shipped = scaled_record.SHIPPED / "nvidia-h100-80gb-hbm3.json"
    out = tmp_path / "r.json"
    assert scaled_record.main(["--record", str(shipped), "--host-factor", str(factor),
                               "--out", str(out)]) == 0  # fmt: skip
    got = CostRecord.read(out)
    want = CostRecord.read(shipped).scaled(factor)
    assert got.host_probe_ms is None  # a server uses the constants as written
    for field in ("host_ms", "choose_ms", "plan_ms", "plan_ms_per_ktok", "fixed_ms",
                  "gemm_tflops", "attn_tflops", "bandwidth_gbs", "margin"):  # fmt: skip
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    assert json.loads(out.read_text())["provenance"]["host_factor"] == factor
