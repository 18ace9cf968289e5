"""Named ranges of the redknot forward for the torch profiler (``benchmarks/profile_prefill.py``).

A range costs nothing unless a profiler is recording: then it appears in the trace as a CPU range
and, around the kernels it launched, as a GPU range of the same name."""

from __future__ import annotations

import contextlib

import torch


def phase(name: str) -> contextlib.AbstractContextManager:
    """``with phase("redknot.reuse_kv"): ...`` names the work inside in a profiler trace."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
