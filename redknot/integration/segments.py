"""Hooks that expose the segment store to SGLang's scheduler (SGLang 0.5.17).

``Scheduler.get_internal_state`` (behind ``GET /server_info`` and the engine's
``get_server_info``) gains a ``"redknot_segments"`` key holding ``SegmentStore.stats()`` of the
scheduler's tree cache, when that cache carries a segment store (the redknot cache; not with
``--disable-radix-cache``, where SGLang's chunk cache has none). The hooks are registered and
verified by ``redknot.integration.plugin`` with the others.
"""

from __future__ import annotations

from typing import Any

STATS_KEY = "redknot_segments"


def _after_get_internal_state(result: Any, self: Any, recv_req: Any) -> Any:
    store = getattr(getattr(self, "tree_cache", None), "segments", None)
    if store is None:
        return None  # keep SGLang's result as is
    result.internal_state[STATS_KEY] = store.stats()
    return result


# (target, HookType name, function), turned into plugin.Hook entries by the plugin.
HOOKS: tuple[tuple[str, str, Any], ...] = (
    (
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        "AFTER",
        _after_get_internal_state,
    ),
)
