"""The key-mass kernel (importance of the sparse FFN) against the PyTorch reference
``redknot.kernels.reference.key_mass_reference``, from the same queries and keys, on the CPU under
the Triton interpreter and at the Llama shape on the GPU."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.key_mass import key_mass, query_heads
from redknot.kernels.reference import key_mass_reference, probe_lse

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy, in the interpreter


def _case(num_kv, glob, grp, dim, end, probe_start, q_row0, dtype, device, seed):
    """A request of ``end`` tokens whose keys lie at scattered slots of a global store, probed
    from ``probe_start``; its queries are rows ``q_row0 ..`` of a larger ``q``. Returns the
    kernel's mass and the reference's."""
    g = torch.Generator().manual_seed(seed)
    G, Hq = len(glob), num_kv * grp
    num_probe = end - probe_start
    rows = q_row0 + num_probe + 3
    q = torch.randn(rows, Hq, dim, generator=g).to(dtype)
    slots = torch.randperm(end + 40, generator=g)[:end]
    store = torch.randn(end + 40, G, dim, generator=g).to(dtype)
    req_to_token = torch.zeros(3, end + 8, dtype=torch.int32)
    req_to_token[1, :end] = slots.to(torch.int32)
    scale = dim**-0.5
    heads = query_heads(glob, grp, "cpu")
    probe_q = q[q_row0 : q_row0 + num_probe][:, heads.long()].view(num_probe, G, grp, dim)
    keys = store[slots]  # [end, G, D]
    positions = torch.arange(probe_start, end)
    lse = torch.full((rows, Hq), 5.0)  # rows other than the probed ones are never read
    probed = probe_lse(probe_q, keys, positions, scale)  # what the layer's attention writes
    lse[q_row0 : q_row0 + num_probe, heads.long()] = probed.view(num_probe, -1)
    want = key_mass_reference(probe_q, keys, positions, scale)
    to = lambda t: t.to(device)
    got = key_mass(to(q), to(lse), to(store), to(req_to_token), 1, q_row0, probe_start,
                   num_probe, end, to(heads), scale)  # fmt: skip
    return got.cpu(), want


@pytest.mark.parametrize(
    "num_kv,glob,grp,dim,end,probe_start,q_row0,dtype",
    [
        (4, [1], 4, 64, 150, 131, 7, torch.bfloat16),  # keys over several blocks, 19 probes
        (3, [0, 2], 3, 64, 70, 5, 0, torch.float16),  # a group of 3 (SmolLM2), 65 probes
        (2, [0, 1], 1, 128, 64, 63, 2, torch.bfloat16),  # one probe, keys = one block
    ],
)
def test_key_mass_matches_reference(num_kv, glob, grp, dim, end, probe_start, q_row0, dtype):
    got, want = _case(num_kv, glob, grp, dim, end, probe_start, q_row0, dtype, "cpu", seed=end)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3)
    # every probed (query, head) row spreads a mass of one over the keys
    num_heads = len(glob) * grp
    torch.testing.assert_close(got.sum(), torch.tensor((end - probe_start) * num_heads * 1.0),
                               atol=1e-2, rtol=1e-3)  # fmt: skip


def test_no_global_column_gives_zero_mass():
    q = torch.randn(5, 4, 64).bfloat16()
    lse = torch.zeros(5, 4)
    store = torch.zeros(10, 0, 64).bfloat16()
    r2t = torch.arange(10, dtype=torch.int32)[None]
    heads = torch.zeros(0, dtype=torch.int32)
    out = key_mass(q, lse, store, r2t, 0, 0, 5, 5, 10, heads, 0.125)
    assert out.shape == (10,) and (out == 0).all()


@pytest.mark.gpu
def test_key_mass_gpu_llama_shape():
    """Llama-3.1-8B's importance probe: 1 global of 8 KV heads, 4 query heads each, D=128, a 32K
    request probed by its last 128 tokens."""
    got, want = _case(8, [0], 4, 128, 32768, 32768 - 128, 11, torch.bfloat16, "cuda", seed=3)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3)
