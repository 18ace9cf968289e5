"""The SGLang plugin: every registration and hook redknot makes in SGLang lives here.

Written against SGLang 0.5.17 (``redknot.SGLANG_VERSION``); any other version is refused.
SGLang runs :func:`register` (the ``sglang.srt.plugins`` entry point) in the launching process
and again in every scheduler process, then applies the registered hooks. SGLang only logs a
plugin or hook failure, so redknot records what went wrong and :func:`verify` (called when the
backend is built, and by the tests) turns it into an error that stops the server.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redknot import SGLANG_VERSION
from redknot.api import hooks as api_hooks
from redknot.attention import ffn_schedule
from redknot.integration import capture_order
from redknot.integration import segments as segment_hooks
from redknot.integration import server_args as sa_hooks
from redknot.segcache import registration, reuse
from redknot.segcache import samkv as samkv_hooks

logger = logging.getLogger(__name__)

BACKEND_NAME = sa_hooks.BACKEND_NAME


@dataclass(frozen=True)
class Hook:
    target: str
    kind: str  # a sglang HookType name
    fn: Callable


def _after_add_cli_args(result, parser):
    sa_hooks.add_cli_flags(parser)


def _around_from_cli_args(original, cls, args):
    sa_hooks.take_cli_options(args)
    return original(cls, args)


def _before_init(self, *args, **kwargs):
    return (self, *args), sa_hooks.take_engine_options(kwargs)


def _after_post_init(result, self):
    sa_hooks.resolve(self)


# The KV pool: SGLang's configurator sizes and builds it; for redknot, a token slot holds only
# the global heads and each request slot reserves a ring for the local heads.


def _around_cell_size(original, self, kvc, num_layers):
    from redknot.pool import sizing

    return sizing.cell_size(kvc) if sizing.is_redknot(kvc) else original(self, kvc, num_layers)


def _after_available_bytes(result, self, pre_model_load_memory):
    from redknot.pool import sizing

    return sizing.reserve_local_bytes(self, result) if sizing.is_redknot(self) else None


def _after_max_num_reqs(result, self, token_capacity):
    from redknot.pool import sizing

    return sizing.cap_requests(self, result) if sizing.is_redknot(self) else None


def _around_build_pool(original, self, **kwargs):
    from redknot.pool import sizing

    if not sizing.is_redknot(self):
        return original(self, **kwargs)
    sizes = kwargs["sizes"]
    return sizing.build_pool(self, sizes.max_total_num_tokens, kwargs["req_to_token_pool"])


def _around_req_slot_alloc(original, self, reqs):
    """A new request slot: restore its ring from the snapshot of its cached prefix, plan the
    capture of its branch point (see redknot.segcache.radix), and start filling the segment a
    registration request carries (redknot.segcache.registration) or take the stored segments a
    marked request reuses (redknot.segcache.reuse)."""
    fresh = [r for r in reqs if r.req_pool_idx is None]
    result = original(self, reqs)
    cache = getattr(self, "redknot_cache", None)
    if result is not None and cache is not None:
        timer = getattr(getattr(cache.pool, "reuse_gate", None), "timer", None)
        for req in fresh:
            if timer is not None:  # the span the gate times starts before the lookups
                req.redknot_t0 = timer.start()
            if cache.pool.layout.restore:  # no head promoted by the slot's last request
                cache.pool.promoted_resets.append(req.req_pool_idx)
            if cache.uses_snapshots:
                if len(req.prefix_indices) > 0:
                    cache.queue_restore(req.req_pool_idx, req.last_node)
                cache.plan_capture(req)
            if cache.segments.enabled:
                registration.start(cache, req)
                reuse.start(cache, req)
    return result


def _after_req_slot_free(result, self, req):
    """A request slot freed (its request finished, was aborted or retracted): its LFPS state
    row is free for the next request (redknot.lfps.serving)."""
    lfps = getattr(self, "redknot_lfps", None)
    if lfps is not None:
        lfps.release(req.rid)


def _after_req_slots_clear(result, self):
    lfps = getattr(self, "redknot_lfps", None)
    if lfps is not None:
        lfps.release_all()


def _around_prefill_can_run_graph(original, self, forward_batch):
    """SGLang's prefill CUDA graph replays no extend batch whose rows vary per request under
    redknot (:meth:`redknot.attention.backend.RedknotAttnBackend.needs_eager_extend`): such a
    batch runs eagerly, every other one as SGLang decides."""
    eager = getattr(getattr(self.model_runner, "attn_backend", None), "needs_eager_extend", None)
    if eager is not None and eager(forward_batch):
        return False
    return original(self, forward_batch)


def _around_decode_can_run_graph(original, self, forward_batch):
    """SGLang's decode CUDA graphs replay no batch with a request that decodes with LFPS
    (:meth:`redknot.attention.backend.RedknotAttnBackend.needs_eager_decode`)."""
    eager = getattr(getattr(self.model_runner, "attn_backend", None), "needs_eager_decode", None)
    if eager is not None and eager(forward_batch):
        return False
    return original(self, forward_batch)


def _around_model_forward(original, self, forward_batch, *args, **kwargs):
    """Under ``--redknot-reuse-gate auto`` (one GPU) the reuse gate times each extend forward it
    can predict (:mod:`redknot.costmodel.measured`): from a CUDA event recorded when the batch's
    first request got its slot (a request's first extend; else at the forward's start) to one
    after the forward, read back on a later call once reached (never waited for)."""
    pool = getattr(self, "token_to_kv_pool", None)
    gate = getattr(pool, "reuse_gate", None)
    timer = getattr(gate, "timer", None)
    if timer is None:
        return original(self, forward_batch, *args, **kwargs)
    timer.harvest()
    forward = gate.describe(forward_batch, pool)
    if forward is None:
        return original(self, forward_batch, *args, **kwargs)
    begin = getattr(forward_batch, "redknot_t0", None) or timer.start()
    result = original(self, forward_batch, *args, **kwargs)
    timer.finish(begin, forward)
    return result


def _after_batch_result(result, self, batch, *args, **kwargs):
    """A prefill batch's answers are out: the reuse gate reads its forwards' times back now and
    works out its correction at their sizes (:meth:`ForwardTimer.harvest` with ``warm``), so
    that the next marked request of a size served before finds them instead of computing them
    on its way to its prefill."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return
    gate = getattr(getattr(getattr(self, "tree_cache", None), "pool", None), "reuse_gate", None)
    timer = getattr(gate, "timer", None)
    if timer is not None:
        timer.harvest(warm=True)


def _after_forward_batch_init(result, cls, batch, *args, **kwargs):
    """Every forward batch carries its requests' slots on the host (``redknot_req_slots``, read
    by :func:`redknot.attention.slots.request_slots`): the backend plans a batch's segment work
    without reading ``req_pool_indices`` back from the device."""
    reqs = getattr(batch, "reqs", None)
    if result is not None and reqs is not None:
        result.redknot_req_slots = [req.req_pool_idx for req in reqs]
        # the reuse gate's timing (redknot.costmodel.measured): a request's first extend is
        # timed from its slot's allocation, when its segments were looked up
        result.redknot_t0 = None
        mode = getattr(result, "forward_mode", None)
        if mode is not None and mode.is_extend():
            for req in reqs:
                start = getattr(req, "redknot_t0", None)
                if start is not None:
                    result.redknot_t0 = result.redknot_t0 or start
                    req.redknot_t0 = None


_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
HOOKS: tuple[Hook, ...] = (
    Hook(f"{_SERVER_ARGS}.add_cli_args", "AFTER", _after_add_cli_args),
    Hook(f"{_SERVER_ARGS}.from_cli_args", "AROUND", _around_from_cli_args),
    Hook(f"{_SERVER_ARGS}.__init__", "BEFORE", _before_init),
    Hook(f"{_SERVER_ARGS}.__post_init__", "AFTER", _after_post_init),
    Hook(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "AROUND",
        _around_cell_size,
    ),
    Hook(f"{_KVC}._profile_available_bytes", "AFTER", _after_available_bytes),
    Hook(f"{_KVC}.resolve_max_num_reqs", "AFTER", _after_max_num_reqs),
    Hook(f"{_KVC}._build_token_to_kv_pool", "AROUND", _around_build_pool),
    Hook(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        "AFTER",
        _after_forward_batch_init,
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        "AROUND",
        _around_model_forward,
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result", "AFTER", _after_batch_result
    ),
    Hook("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", "AROUND", _around_req_slot_alloc),
    Hook("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", "AFTER", _after_req_slot_free),
    Hook("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.clear", "AFTER", _after_req_slots_clear),
    Hook(
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
        ".can_run_graph",
        "AROUND",
        _around_prefill_can_run_graph,
    ),
    Hook(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
        ".can_run_graph",
        "AROUND",
        _around_decode_can_run_graph,
    ),
    # Segment reuse's sparse FFN (redknot.attention.ffn_schedule) on the served MLP classes
    Hook("sglang.srt.models.llama.LlamaMLP.forward", "AROUND", ffn_schedule.around_mlp),
    Hook("sglang.srt.models.qwen2.Qwen2MLP.forward", "AROUND", ffn_schedule.around_mlp),
    # ... and its skipped="cached" rows, which leave the decoder layers
    Hook(
        "sglang.srt.models.llama.LlamaDecoderLayer.forward",
        "AROUND",
        ffn_schedule.around_decoder_layer,
    ),
    Hook(
        "sglang.srt.models.qwen2.Qwen2DecoderLayer.forward",
        "AROUND",
        ffn_schedule.around_decoder_layer,
    ),
    # Captures on miss wait while user requests do (redknot.integration.capture_order)
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
        "AROUND",
        capture_order.around_get_new_batch_prefill,
    ),
    *(Hook(*h) for h in segment_hooks.HOOKS),
    *(Hook(*h) for h in samkv_hooks.HOOKS),
    *(Hook(*h) for h in api_hooks.HOOKS),
)

# What went wrong while registering in this process; empty when all is well.
_failures: list[str] = []
_registered = False


def _check_sglang_version() -> None:
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"redknot {__import__('redknot').__version__} is built for sglang=={SGLANG_VERSION}, "
            f"found sglang=={sglang.__version__}: install sglang=={SGLANG_VERSION}"
        )


def create_attention_backend(model_runner: Any):
    """Factory registered as SGLang attention backend ``redknot``."""
    verify()
    from redknot.attention.backend import RedknotAttnBackend

    return RedknotAttnBackend(model_runner, sa_hooks.published_config())


def create_tree_cache(ctx: Any):
    """Factory registered as SGLang radix-cache backend ``redknot``: exact-prefix reuse."""
    verify()
    from redknot.segcache.factory import create_tree_cache as create

    return create(ctx)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group. Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        _check_sglang_version()
        _register_all()
    except Exception as e:  # noqa: BLE001 -- SGLang would only log it; keep it for verify()
        _failures.append(f"{type(e).__name__}: {e}")
        logger.error("redknot plugin failed to register: %s", e)


def _register_all() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_attention_backend:
        register_attention_backend(BACKEND_NAME)(create_attention_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create_tree_cache)
    api_hooks.register_types()
    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])


def _hook_applied(target: str, fn: Callable) -> bool:
    """True when ``fn`` is part of the wrapper chain now installed at ``target``."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    return wraps(current, fn)


def wraps(current: Any, fn: Callable) -> bool:
    """True when ``fn`` is part of the wrapper chain of the callable ``current``."""
    current = getattr(current, "__func__", current)  # classmethod / staticmethod
    seen = 0
    while current is not None and seen < 32:
        cells = getattr(current, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is fn for c in cells):
            return True
        current, seen = getattr(current, "__wrapped__", None), seen + 1
    return False


def verify() -> None:
    """Raise unless every redknot registration and hook is in effect in this process."""
    problems = list(_failures)
    if not _registered:
        problems.append("the redknot plugin never ran in this process")
    else:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.mem_cache.registry import get_radix_cache_factory
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

        if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_attention_backend:
            problems.append("attention backend 'redknot' is not registered")
        if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
            problems.append("'redknot' is not a --attention-backend choice")
        if get_radix_cache_factory(BACKEND_NAME) is not create_tree_cache:
            problems.append("radix-cache backend 'redknot' is not registered")
        problems += [
            f"hook on {h.target} is not applied" for h in HOOKS if not _hook_applied(h.target, h.fn)
        ]
        if not api_hooks.types_registered():
            problems.append("redknot's control messages are not known to SGLang's IPC")
    if problems:
        raise RuntimeError(
            "redknot is not correctly installed in SGLang: "
            + "; ".join(problems)
            + f". redknot needs sglang=={SGLANG_VERSION} with its plugin loader "
            "(sglang.srt.plugins); see the SGLang log for the original error."
        )
