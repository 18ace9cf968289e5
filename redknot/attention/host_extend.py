"""Extends over a KV store in pinned host memory (``--redknot-lfps-offload-gb``).

An extend whose requests have earlier tokens in the pool (a later chunk of a long prompt, a
prefix-cache hit, a follow-up turn) attends those tokens' K/V. SGLang's FlashInfer path reads
them with the paged prefill kernel, whose programs each read a request's whole prefix: from GPU
memory the L2 cache absorbs the repeats, across PCIe every program's read crosses the link.
Measured (``benchmarks/results/offload_probe.json``, H100, 8B shape, one layer): an 8K-token
chunk over a 32K-token request took 6.6 ms with the store in GPU memory and 964 ms over host
memory; gathering the request's K/V to the GPU took 2.8 ms.

So such an extend gathers each layer's prefix K/V once into GPU memory (one read of every
byte, at the link's speed) and runs FlashInfer's ragged prefill twice, as SGLang's own path
does with its paged part: the new tokens causally over themselves, and over the gathered
prefix; the two are merged by their log-sum-exp (SGLang's ``_safe_merge_state``). Extends
without a prefix keep SGLang's path (they read only the new K/V, in GPU memory).
"""

from __future__ import annotations

import torch

WORKSPACE_BYTES = 128 << 20  # per wrapper, as SGLang's FlashInfer workspace


class HostPrefixExtend:
    """Plans (once per batch) and runs (per layer) an extend with a prefix over a host store."""

    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype, req_to_token: torch.Tensor
    ):
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

        device = req_to_token.device
        self.req_to_token = req_to_token  # SGLang's request -> token-slot table
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype = dtype

        def wrapper():
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            return BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")

        self.new = wrapper()  # the new tokens over themselves, causal
        self.prefix = wrapper()  # the new tokens over the gathered prefix
        self.slots: torch.Tensor | None = None  # the batch's prefix slots, request by request

    def plan(self, forward_batch) -> bool:
        """Plan an extend batch; False (nothing planned) when no request has a prefix."""
        self.slots = None
        prefix = forward_batch.extend_prefix_lens_cpu
        if prefix is None or not any(prefix):
            return False
        extend = forward_batch.extend_seq_lens_cpu
        self.slots = prefix_slots(self.req_to_token, forward_batch.req_pool_indices, list(prefix))
        device = forward_batch.req_pool_indices.device
        qo = _indptr(extend, device)
        heads = (self.num_q_heads, self.num_kv_heads, self.head_dim)
        self.new.begin_forward(qo, qo, *heads, q_data_type=self.dtype)
        self.prefix.begin_forward(qo, _indptr(prefix, device), *heads, q_data_type=self.dtype)
        return True

    def forward(self, q, k, v, layer, k_buffer, v_buffer) -> torch.Tensor:
        """Attention of the planned batch in ``layer``; ``k_buffer``/``v_buffer``: the layer's
        store. Returns ``[T, Hq * D]``."""
        from sglang.srt.layers.attention.flashinfer_backend import _safe_merge_state

        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q = q.view(-1, hq, d)
        o1, s1 = self.new.forward_return_lse(
            q, k.view(-1, hkv, d), v.view(-1, hkv, d), causal=True, sm_scale=layer.scaling
        )
        o2, s2 = self.prefix.forward_return_lse(
            q, k_buffer[self.slots], v_buffer[self.slots], causal=False, sm_scale=layer.scaling
        )
        o, _ = _safe_merge_state(o1, s1, o2, s2)
        return o.view(-1, hq * d)


def prefix_slots(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: list[int]
) -> torch.Tensor:
    """The pool slots of every request's first ``prefix_lens[i]`` tokens, request by request
    (int64, on the table's device)."""
    rows = [
        req_to_token[req_pool_indices[i], :n] for i, n in enumerate(prefix_lens) if n
    ]  # fmt: skip
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(rows).long()


def _indptr(lens, device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.as_tensor(list(lens), dtype=torch.int32), 0)
    return out.to(device)
