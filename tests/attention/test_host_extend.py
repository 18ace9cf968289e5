"""Extends over a host store (``redknot.attention.host_extend``): the prefix slots, and (GPU) the
gathered-prefix attention against dense attention written out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from redknot.attention.host_extend import _indptr, prefix_slots


def test_prefix_slots_are_each_requests_first_tokens_in_batch_order():
    table = torch.arange(40).view(4, 10) + 100
    rpi = torch.tensor([2, 0, 3])
    got = prefix_slots(table, rpi, [3, 0, 2])
    assert got.tolist() == [120, 121, 122, 130, 131] and got.dtype == torch.int64
    assert prefix_slots(table, rpi, [0, 0, 0]).numel() == 0
    assert _indptr([3, 0, 2], "cpu").tolist() == [0, 3, 3, 5]


def _reference(q, k_new, v_new, k_pre, v_pre, extend, prefix, scale):
    """Causal attention of each request's new tokens over its prefix and themselves."""
    out, a, p = [], 0, 0
    grp = q.shape[1] // k_new.shape[1]
    for e, n in zip(extend, prefix):
        keys = torch.cat([k_pre[p : p + n], k_new[a : a + e]]).float().repeat_interleave(grp, 1)
        vals = torch.cat([v_pre[p : p + n], v_new[a : a + e]]).float().repeat_interleave(grp, 1)
        logits = torch.einsum("qhd,khd->hqk", q[a : a + e].float(), keys) * scale
        mask = torch.arange(n + e)[None, :] <= (n + torch.arange(e))[:, None]
        attn = torch.softmax(logits.masked_fill(~mask.to(q.device), float("-inf")), -1)
        out.append(torch.einsum("hqk,khd->qhd", attn, vals))
        a, p = a + e, p + n
    return torch.cat(out)


@pytest.mark.gpu
def test_gathered_prefix_attention_equals_dense_attention():
    """A batch mixing a request without prefix, a long prefix and a short one: the two ragged
    prefills merged equal causal attention over prefix + new tokens (bf16 tolerance), reading
    the prefix from a pinned host store."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.attention.host_extend import HostPrefixExtend
    from redknot.pool.host_memory import pinned_host_tensor

    hq, hkv, d, dev = 32, 8, 128, "cuda"
    extend, prefix = [300, 64, 1000], [0, 5000, 17]
    total = sum(prefix) + sum(extend) + 1
    k_store = pinned_host_tensor((total, hkv, d), torch.bfloat16, dev)
    v_store = pinned_host_tensor((total, hkv, d), torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_store.copy_(torch.randn(total, hkv, d, device=dev, generator=gen, dtype=torch.bfloat16))
    v_store.copy_(torch.randn(total, hkv, d, device=dev, generator=gen, dtype=torch.bfloat16))
    perm = torch.randperm(total - 1, device=dev, generator=gen) + 1
    table = torch.zeros(3, 8192, dtype=torch.int32, device=dev)
    at = 0
    for r, (e, n) in enumerate(zip(extend, prefix)):
        table[r, : n + e] = perm[at : at + n + e].int()
        at += n + e
    rpi = torch.tensor([1, 0, 2], device=dev)
    table = table[[1, 0, 2]]  # request i lives in row rpi[i]
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=extend,
        extend_prefix_lens_cpu=prefix, req_pool_indices=rpi,
    )  # fmt: skip
    ext = HostPrefixExtend(hq, hkv, d, torch.bfloat16, table)
    assert ext.plan(fb)
    q = torch.randn(sum(extend), hq, d, device=dev, generator=gen, dtype=torch.bfloat16)
    new_slots = torch.cat([table[rpi[i], n : n + e] for i, (e, n) in
                           enumerate(zip(extend, prefix))]).long()  # fmt: skip
    k_new, v_new = k_store[new_slots].clone(), v_store[new_slots].clone()
    layer = SimpleNamespace(tp_q_head_num=hq, tp_k_head_num=hkv, head_dim=d, scaling=d**-0.5)
    got = ext.forward(q.view(-1, hq * d), k_new, v_new, layer, k_store, v_store)
    slots = ext.slots
    want = _reference(q, k_new, v_new, k_store[slots], v_store[slots], extend, prefix, d**-0.5)
    torch.testing.assert_close(got.view(-1, hq, d).float(), want, atol=2e-2, rtol=2e-2)
    fresh = SimpleNamespace(extend_prefix_lens_cpu=[0, 0], extend_seq_lens_cpu=[3, 4])
    assert not ext.plan(fresh) and ext.slots is None
