"""How fast this machine's host issues GPU work, against the machine a cost record was fitted on.

A reusing prompt of a few thousand tokens is host-bound: its time is the host's, issuing some
16 operations per decoder layer, not the GPU's. The same commit on two H100 machines spent 1.2
and 2.2 ms of host time per EPIC layer for the same 0.29 ms of kernels (profiles
``profile_epic_h100_db7fbc3.json`` and ``profile_epic_h100_add1453.json``): every host range
was 1.7-1.9x slower on the second, and EPIC's 2K prompt, predicted by the H100 record at 39 ms
against 50 ms recomputing, took 63 ms against 59. A record's host constants hold only on a host
as fast as the one it was fitted on.

:func:`probe_ms` times a fixed loop of the operations a decoder layer issues (allocations,
views, index writes and reads, small elementwise launches) on the serving device; a record
fitted with the probe beside it (``host_probe_ms``) lets the server scale the record's host
constants by this machine's probe over the record's (:func:`host_scale`). Every
tensor-parallel rank must take the same decision, so the ranks take the largest of their
factors (the slowest host), one all-reduce at startup. A record without a probe is used as it
is, and the machine is not probed.
"""

from __future__ import annotations

import statistics
import time

import torch

ITERS = 200  # loop iterations per timed repeat
REPEATS = 7  # timed repeats (the median is taken), after one untimed
SCALE_RANGE = (0.5, 4.0)  # a factor outside it is clamped (and said so by the caller)


def _layer_like(x: torch.Tensor, idx: torch.Tensor) -> None:
    """One iteration: the kinds of host calls one decoder layer of a reusing extend makes."""
    full = x.new_zeros(x.shape)
    full[idx] = x[idx]
    y = torch.empty_like(x).view(x.shape[0], -1, x.shape[-1])
    y.copy_(full.view_as(y))
    y.add_(1.0)
    z = y.reshape(x.shape).index_select(0, idx)
    z.mul_(0.5)


def probe_ms(device: torch.device | str, iters: int = ITERS, repeats: int = REPEATS) -> float:
    """Median host time of one probe iteration in ms on ``device`` (tiny tensors: the GPU
    finishes each launch before the host issues the next, so the time is the host's)."""
    device = torch.device(device)
    x = torch.randn(64, 8, 16, device=device)
    idx = torch.arange(0, 64, 2, device=device)
    cuda = device.type == "cuda"
    times = []
    for r in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            _layer_like(x, idx)
        if cuda:
            torch.cuda.synchronize(device)
        if r:  # the first repeat warms the allocator and the launch paths
            times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def host_scale(probe: float | None, recorded: float | None) -> tuple[float, str]:
    """The factor for a record's host constants and a sentence saying where it comes from:
    ``probe / recorded`` clamped to :data:`SCALE_RANGE`; 1 when the record has no probe (this
    machine's is then not needed)."""
    if not recorded or probe is None:
        return 1.0, "the record has no host probe: its host constants are used as they are"
    raw = probe / recorded
    lo, hi = SCALE_RANGE
    factor = min(max(raw, lo), hi)
    said = f"host probe {probe:.4f} ms against {recorded:.4f} ms on the record's machine"
    if factor != raw:
        said += f" ({raw:.2f}x, clamped to {factor:g}x)"
    return factor, f"{said}: host constants x{factor:.2f}"
