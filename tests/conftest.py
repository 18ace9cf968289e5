"""Test-suite wiring: GPU tests are marked ``gpu`` and skipped on machines without CUDA.

Run them on the GPU machine with ``bash scripts/gpu_check.sh``.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides at kernel-definition time whether to interpret: set it before any test module
# imports redknot's kernels (CPU machines have no GPU to compile for).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_check.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
