"""Builds the tree cache of a redknot server.

Exact-prefix reuse is SGLang's own radix cache over the token-slot pool (or its chunk cache
with ``--disable-radix-cache``); SGLang's hybrid variants (SWA, Mamba, hierarchical) do not
apply because the server arguments reject those configurations for redknot.
"""

from __future__ import annotations

from typing import Any


def create_tree_cache(ctx: Any):
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "redknot's cache does not support hybrid SWA/SSM models or the hierarchical cache"
        )
    if ctx.disable_radix_cache and ctx.effective_chunked_prefill_size is not None:
        return ChunkCache(ctx.params)
    return RadixCache(ctx.params)  # ctx.params.disable turns matching off
