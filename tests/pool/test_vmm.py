"""``redknot.pool.vmm``: its driver structures match ``cuda.h`` (x86-64), a boundary between the
two memories falls on whole granules, a missing driver is an error that says so, and on a GPU
one tensor spans GPU and host memory."""

from __future__ import annotations

import ctypes

import pytest
import torch

from redknot.pool import vmm


def test_the_structures_have_the_drivers_sizes_and_fields():
    # cuda.h: CUmemLocation {int type; int id} 8 bytes, CUmemAllocationProp 32 (with the
    # pointer aligned to 8), CUmemAccessDesc 12
    assert ctypes.sizeof(vmm.MemLocation) == 8
    assert ctypes.sizeof(vmm.AllocFlags) == 8
    assert ctypes.sizeof(vmm.AllocationProp) == 32
    assert vmm.AllocationProp.location.offset == 8
    assert vmm.AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(vmm.AccessDesc) == 12
    host = vmm.prop_of(vmm.LOCATION_HOST, 3)
    assert (host.type, host.location.type, host.location.id) == (1, 2, 0)  # id unused on host
    dev = vmm.prop_of(vmm.LOCATION_DEVICE, 3)
    assert (dev.location.type, dev.location.id, dev.requestedHandleTypes) == (1, 3, 0)
    assert vmm.round_up(5, 4) == 8 and vmm.round_up(8, 4) == 8


@pytest.mark.parametrize(
    "rows,row_bytes,asked,want",
    [
        (10_000, 2048, 5000, 4096),  # 2 MiB = 1024 rows of 2 KiB: whole granules only
        (10_000, 2048, 20_000, 9216),  # never past the tensor, still whole granules
        (10_000, 3072, 5000, 4096),  # 3 KiB rows: 2048 rows (6 MiB) make whole granules
        (10_000, 2048, 1000, 0),  # less than a granule: all in host memory
    ],
)
def test_the_gpu_part_is_whole_granules_within_the_tensor(rows, row_bytes, asked, want):
    got = vmm.device_part(rows, row_bytes, asked, 2 << 20)
    assert got == want and got * row_bytes % (2 << 20) == 0


def test_without_a_driver_the_error_says_so(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(vmm.ctypes, "CDLL", missing)
    with pytest.raises(vmm.VmmError, match="no CUDA driver library: libcuda"):
        vmm.Driver()


@pytest.mark.gpu
def test_one_tensor_over_gpu_and_host_memory_on_a_gpu():
    """A store of 3,000 rows of 8 x 128 bf16 with 2,048 rows asked for on the GPU: those rows
    are GPU memory and the rest host memory, the tensor starts zeroed, PyTorch writes and reads
    it across the boundary, and the host sees what the GPU wrote."""
    shape, dtype = (3000, 8, 128), torch.bfloat16
    store, on_gpu = vmm.tiered_tensor(shape, dtype, torch.cuda.current_device(), 2048)
    assert store.is_cuda and store.shape == shape and on_gpu == 2048
    assert int(store.count_nonzero()) == 0
    pattern = torch.randn(shape, device="cuda").to(dtype)
    store.copy_(pattern)
    assert torch.equal(store, pattern)
    assert torch.equal(store[on_gpu - 4 : on_gpu + 4].cpu(), pattern[on_gpu - 4 : on_gpu + 4].cpu())
    index = torch.tensor([0, on_gpu - 1, on_gpu, 2999], device="cuda")
    assert torch.equal(store[index], pattern[index])
