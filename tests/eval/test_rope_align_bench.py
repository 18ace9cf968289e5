"""``benchmarks/rope_align.py --layers`` on the CPU: its two launches over layers (a program per
rows and layer, as served, and each program looping over the layers) write the same keys and
values, under the Triton interpreter at a small row count."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import rope_align as bench


def test_the_two_launches_over_layers_write_the_same(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    methods = bench.layered_methods("cpu", layers=3, rows=24)
    assert set(methods) == {"grid", "loop"}
    for call, _ in methods.values():
        call()
    (_, grid), (_, loop) = methods["grid"], methods["loop"]
    for kind in range(2):  # K, then V
        for a, b in zip(grid[kind], loop[kind]):
            assert a.abs().sum() > 0  # rows were written
            assert torch.equal(a, b)
