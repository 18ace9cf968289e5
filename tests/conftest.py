"""Test-suite wiring: GPU tests are marked ``gpu`` and skipped on machines without CUDA.

Run them on the GPU machine with ``python3 benchmarks/gpu_run.py tests`` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

# Triton decides at kernel-definition time whether to interpret: set it before any test module
# imports redknot's kernels (CPU machines have no GPU to compile for).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("REDKNOT_RECORD_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    # tests/kernels/test_triton_lowering.py: note every kernel launch's argument types
    from kernels.launch_specs import install

    install(os.environ["REDKNOT_RECORD_LAUNCHES"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: python3 benchmarks/gpu_run.py tests on the GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def gate_log():
    """The startup check's log lines, from a handler on its own logger (SGLang's argument
    parsing may reconfigure the root logger in the same test session)."""
    lg = logging.getLogger("redknot.attention.startup_check")
    handler, level = _Lines(), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    yield handler.lines
    lg.removeHandler(handler)
    lg.setLevel(level)
