"""Hooks that expose the segment store to SGLang's scheduler (SGLang 0.5.17).

``Scheduler.get_internal_state`` (behind ``GET /server_info`` and the engine's
``get_server_info``) gains, when the scheduler's tree cache is redknot's (not with
``--disable-radix-cache``, where SGLang's chunk cache has none):

- ``"redknot_segments"``: ``SegmentStore.stats()`` of the cache's segment store;
- ``"redknot_pool"``: what is held in the KV pool (token and request slots free of their totals,
  ring snapshots, pending captures and segment reads/writes: ``RedknotRadixCache.pool_state``),
  so that a load test can show that an idle, flushed server holds nothing;
- ``"redknot_config"``: the redknot options this server resolved at launch (head map path,
  window, sink, dense layers, ...), so that a result taken from a server names its setting;
- ``"redknot_process"``: the scheduler process's garbage collections so far, per generation
  (count and summed pause, ``redknot.integration.gc_clock``), with or without a segment store.

The hooks are registered and verified by ``redknot.integration.plugin`` with the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from redknot import envs

STATS_KEY = "redknot_segments"
POOL_KEY = "redknot_pool"
CONFIG_KEY = "redknot_config"
GATE_KEY = "redknot_reuse_gate"
PROCESS_KEY = "redknot_process"


def pool_state(scheduler: Any) -> dict[str, int]:
    """Slots free of their totals in SGLang's allocators, and what redknot's cache holds."""
    cache = scheduler.tree_cache
    allocator, req_pool = scheduler.token_to_kv_pool_allocator, scheduler.req_to_token_pool
    state = {
        "token_slots_total": int(scheduler.max_total_num_tokens),
        "token_slots_free": int(allocator.available_size()),
        "request_slots_total": int(req_pool.size),
        "request_slots_free": int(req_pool.available_size()),
        "running_requests": len(scheduler.running_batch.reqs),
        "waiting_requests": len(scheduler.waiting_queue),
    }
    state.update(cache.pool_state())
    return state


def _after_get_internal_state(result: Any, self: Any, recv_req: Any) -> Any:
    from redknot.integration import gc_clock

    counted = gc_clock.installed()  # in a redknot scheduler (its tree cache installed it)
    if counted:
        result.internal_state[PROCESS_KEY] = {"gc": gc_clock.snapshot()}
    cache = getattr(self, "tree_cache", None)
    store = getattr(cache, "segments", None)
    if store is None:
        return result if counted else None  # None: SGLang's result as it is
    result.internal_state[STATS_KEY] = store.stats()
    if hasattr(cache, "pool_state"):
        result.internal_state[POOL_KEY] = pool_state(self)
    gate = getattr(getattr(cache, "pool", None), "reuse_gate", None)
    if gate is not None:  # requests the reuse gate served with and without their hits
        result.internal_state[GATE_KEY] = {
            "served_with_reuse": gate.served_with_reuse,
            "served_without_reuse": gate.served_without_reuse,
            "served_inert": gate.served_inert,
            "host_scale": gate.host_scale,
        }
        timer = getattr(gate, "timer", None)
        if timer is not None:  # its correction by measured forwards: what it holds so far
            timer.harvest()
            fix = timer.correction
            result.internal_state[GATE_KEY]["measured"] = {
                "forwards": fix.counts(),
                "dropped": fix.dropped,
                "ratios": {  # (reuse, recompute) factors on the record at these prompt sizes
                    str(n): fix.ratios(n) for n in (1024, 2048, 4096, 8192, 16384, 32768)
                },
            }
    if envs.REDKNOT_RESOLVED_CONFIG.get() is not None:  # always, in a launched server
        from redknot.integration.server_args import published_config

        result.internal_state[CONFIG_KEY] = dataclasses.asdict(published_config())
    return result


# (target, HookType name, function), turned into plugin.Hook entries by the plugin.
HOOKS: tuple[tuple[str, str, Any], ...] = (
    (
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        "AFTER",
        _after_get_internal_state,
    ),
)
