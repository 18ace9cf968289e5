"""KV stores in pinned host memory that every GPU kernel reads and writes as CUDA tensors.

``--redknot-lfps-offload-gb`` keeps the pool's global store in the host's memory. Such a store
must be readable by every kernel that touches the pool: SGLang's K+V store kernel, FlashInfer's
prefill and decode, and redknot's Triton kernels. They all take CUDA tensors. Page-locked host
memory registered with ``cudaHostRegister`` is mapped into the GPU's address space at the same
address (CUDA's unified addressing), and loads and stores to it cross PCIe
(``benchmarks/host_kv_probe.py`` measured such reads at the link's speed). So the store is a
CPU tensor, registered, and handed to the kernels as a CUDA tensor over the same memory through
``__cuda_array_interface__`` (the protocol PyTorch, CuPy and Numba share): no kernel needs a host
path of its own, and no copy is made.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned allocator rounds every block up
to a power of two, which would waste up to half of a store sized to the host's memory.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context may use it, mapped into the
# device's address space
REGISTER_FLAGS = 1 | 2
HOST_MARGIN_GB = 8.0  # host memory left to the processes besides the store


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``) in bytes; None where the file
    does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_budget(
    want_bytes: int, ranks: int, total: int | None, available: int | None,
    margin_gb: float = HOST_MARGIN_GB,
) -> None:  # fmt: skip
    """Refuse a store the host cannot hold, leaving ``margin_gb`` to the server's processes:
    the ``ranks`` stores together within the host's memory (``total``), and this rank's own
    within what is available now (``available``; under tensor parallelism the other ranks may
    already have pinned theirs, which the first check has counted)."""
    margin = int(margin_gb * (1 << 30))
    gib = 1 << 30
    flag = "--redknot-lfps-offload-gb"
    if total is not None and want_bytes * ranks > total - margin:
        raise ValueError(
            f"redknot: {flag} asks for {want_bytes * ranks / gib:.1f} GiB of pinned host memory "
            f"({ranks} rank(s) x {want_bytes / gib:.1f} GiB), but the host has "
            f"{total / gib:.1f} GiB and {margin_gb:g} GiB must stay free for the server's "
            f"processes: pass at most {max(total - margin, 0) / ranks / gib:.1f}"
        )
    if available is not None and want_bytes > available - margin:
        raise ValueError(
            f"redknot: {flag} asks for {want_bytes / gib:.1f} GiB of pinned host memory on this "
            f"rank, but only {available / gib:.1f} GiB are available now and {margin_gb:g} GiB "
            "must stay free for the server's processes: free host memory or pass at most "
            f"{max(available - margin, 0) / gib:.1f}"
        )
    if total is None or available is None:
        logger.warning(
            "redknot: the host's memory is not fully known (no MemTotal or MemAvailable in "
            "/proc/meminfo); pinning %.1f GiB of KV per rank without that check",
            want_bytes / gib,
        )


class _HostBuffer:
    """``__cuda_array_interface__`` of a registered CPU tensor's bytes; unregisters it when the
    last CUDA view over it goes away."""

    def __init__(self, cpu: torch.Tensor):
        self.cpu = cpu
        nbytes = cpu.numel() * cpu.element_size()
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (cpu.data_ptr(), False),
            "version": 2,
            "strides": None,
        }

    def __del__(self):
        # before the CPU tensor's memory is freed; at interpreter shutdown the module may be
        # gone, and the memory goes with the process
        unregister = getattr(getattr(torch._C, "_cudart", None), "cudaHostUnregister", None)
        if unregister is not None:
            unregister(self.cpu.data_ptr())


def pinned_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed tensor of ``shape`` in page-locked host memory, as a CUDA tensor on ``device``
    (the current device of the process must be that one)."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"host-offloaded KV is read by GPU kernels; the pool is on {device}")
    cpu = torch.zeros(shape, dtype=dtype)
    nbytes = cpu.numel() * cpu.element_size()
    err = torch._C._cudart.cudaHostRegister(cpu.data_ptr(), nbytes, REGISTER_FLAGS)
    if err != torch._C._cudart.cudaError.success:
        raise RuntimeError(
            f"redknot: cudaHostRegister of {nbytes / (1 << 30):.2f} GiB failed "
            f"({torch._C._cudart.cudaGetErrorString(err)}): lower --redknot-lfps-offload-gb, or "
            "raise the locked-memory limit (ulimit -l)"
        )
    view = torch.as_tensor(_HostBuffer(cpu), device=device)
    if not view.is_cuda or view.data_ptr() != cpu.data_ptr():
        raise RuntimeError(
            "redknot: PyTorch did not map the pinned host KV into the GPU's address space "
            f"(got a {view.device} tensor at {view.data_ptr():#x} for {cpu.data_ptr():#x}); "
            "host offload needs CUDA's unified addressing"
        )
    return view.view(dtype).view(shape)
