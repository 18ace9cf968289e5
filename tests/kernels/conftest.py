"""Kernel tests run the Triton kernels under the interpreter on machines without CUDA.

The variable must be set before any ``@triton.jit`` kernel is defined, so this file sets it
before the test modules import ``redknot.kernels``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
