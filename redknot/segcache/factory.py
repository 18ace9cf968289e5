"""Builds the tree cache of a redknot server.

Exact-prefix reuse is ``RedknotRadixCache`` (SGLang's radix tree plus local-head snapshots), or
SGLang's chunk cache with ``--disable-radix-cache`` (refused next to a segment region: the chunk
cache cannot carry the segment store); SGLang's hybrid variants (SWA, Mamba,
hierarchical) do not apply because the server arguments reject those configurations.

The cache carries the segment store (``cache.segments``), sized from the pool's segment region,
with Prometheus metrics when the server runs with ``--enable-metrics``.
"""

from __future__ import annotations

from typing import Any


def create_tree_cache(ctx: Any):
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    from redknot.integration import gc_clock
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.segcache.radix import RedknotRadixCache

    gc_clock.install()  # this scheduler's collections, for /server_info (redknot_process)

    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "redknot's cache does not support hybrid SWA/SSM models or the hierarchical cache"
        )
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if ctx.disable_radix_cache and ctx.effective_chunked_prefill_size is not None:
        if getattr(pool, "segments", None) is not None:
            raise ValueError(
                "--disable-radix-cache makes SGLang use its chunk cache, which cannot hold "
                "redknot's segment store, while a segment region is reserved "
                "(--redknot-segment-fraction > 0): every segment mark would be ignored. Drop "
                "--disable-radix-cache (a segment wholly inside an exact-prefix hit is served "
                "by the prefix cache, any other is read from the store), or start with "
                "--redknot-segment-fraction 0"
            )
        return ChunkCache(ctx.params)
    if not isinstance(pool, RedknotKVPool):
        raise TypeError(
            f"redknot's cache needs the redknot KV pool, found {type(pool).__name__}: the pool "
            "hook did not run (see the redknot plugin's startup errors)"
        )
    # ctx.params.disable turns prefix matching off
    cache = RedknotRadixCache(ctx.params, pool, segments=create_segment_store(ctx.params, pool))
    ctx.params.req_to_token_pool.redknot_cache = cache
    return cache


def create_segment_store(params: Any, pool: Any):
    """The segment store of ``pool``'s segment region, exporting metrics if they are enabled."""
    from redknot.segcache.metrics import scheduler_metrics
    from redknot.segcache.store import SegmentStore

    store = SegmentStore.for_pool(pool, namespace_fraction=_namespace_fraction())
    if getattr(params, "enable_metrics", False):
        store.observer = scheduler_metrics(store.capacity_bytes)
    return store


def _namespace_fraction() -> float:
    """``--redknot-namespace-fraction`` of this server (1.0 where no configuration was resolved:
    a store built outside a server, as unit tests do)."""
    from redknot import envs
    from redknot.integration.server_args import published_config

    if envs.REDKNOT_RESOLVED_CONFIG.get() is None:
        return 1.0
    return published_config().namespace_fraction
