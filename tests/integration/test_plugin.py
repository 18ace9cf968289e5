"""The SGLang plugin: entry point, registrations, hook verification, spawned processes."""

from __future__ import annotations

import multiprocessing as mp
from importlib.metadata import entry_points

import pytest


def test_entry_point_is_declared_in_sglang_plugin_group():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "redknot" in eps
    from redknot.integration.plugin import register

    assert eps["redknot"].load() is register


def test_plugin_registers_backend_cache_and_cli_choice(sglang_plugins):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    sglang_plugins.verify()
    assert ATTENTION_BACKENDS["redknot"] is sglang_plugins.create_attention_backend
    assert "redknot" in ATTENTION_BACKEND_CHOICES
    assert get_radix_cache_factory("redknot") is sglang_plugins.create_tree_cache


def test_verify_fails_loudly_when_a_hook_is_missing(sglang_plugins):
    from sglang.srt.server_args import ServerArgs

    patched = ServerArgs.__post_init__
    ServerArgs.__post_init__ = patched.__wrapped__  # as if SGLang had failed to apply it
    try:
        with pytest.raises(RuntimeError, match=r"hook on .*__post_init__ is not applied"):
            sglang_plugins.verify()
    finally:
        ServerArgs.__post_init__ = patched
    sglang_plugins.verify()


def test_register_is_idempotent(sglang_plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {k: len(v) for k, v in HookRegistry._hooks.items()}
    sglang_plugins.register()
    assert {k: len(v) for k, v in HookRegistry._hooks.items()} == before


def _scheduler_like_process(queue):
    # What run_scheduler_process does first: load the plugins, then build the backend
    # from the configuration the launcher published.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from redknot.integration import plugin, server_args

    try:
        plugin.verify()
        queue.put(("ok", server_args.published_config().to_json()))
    except Exception as e:  # noqa: BLE001 -- report to the parent, which asserts
        queue.put(("error", repr(e)))


def test_spawned_process_sees_plugin_and_published_config(sglang_plugins, llama_dir):
    from sglang.srt.server_args import prepare_server_args

    prepare_server_args(
        [
            "--model-path",
            str(llama_dir),
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--attention-backend",
            "redknot",
            "--redknot-all-global",
            "--redknot-window",
            "128",
        ]
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_scheduler_like_process, args=(queue,))
    proc.start()
    status, payload = queue.get(timeout=300)
    proc.join(timeout=60)
    assert status == "ok", payload
    assert '"all_global": true' in payload and '"window": 128' in payload


def test_a_chunk_cache_is_refused_next_to_a_segment_region(monkeypatch):
    """``--disable-radix-cache`` (with chunked prefill) gives SGLang's chunk cache, which holds
    no segment store: with a segment region reserved the server would ignore every mark, so it
    does not start; without a region the chunk cache serves as SGLang's."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import chunk_cache

    from redknot.segcache.factory import create_tree_cache

    monkeypatch.setattr(chunk_cache, "ChunkCache", lambda params: ("chunk cache", params))

    def ctx(segments):
        pool = SimpleNamespace(segments=segments)
        allocator = SimpleNamespace(get_kvcache=lambda: pool)
        return SimpleNamespace(
            is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
            disable_radix_cache=True, effective_chunked_prefill_size=8192,
            params=SimpleNamespace(token_to_kv_pool_allocator=allocator),
        )  # fmt: skip

    with pytest.raises(ValueError, match="chunk cache.*--redknot-segment-fraction 0"):
        create_tree_cache(ctx(segments=object()))
    plain = ctx(segments=None)
    assert create_tree_cache(plain) == ("chunk cache", plain.params)


def test_the_plugin_attaches_the_slots_of_the_batch_requests_in_order(sglang_plugins):
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from redknot.attention.slots import request_slots
    from redknot.integration.plugin import _after_forward_batch_init, _hook_applied

    target = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
    assert _hook_applied(target, _after_forward_batch_init)
    batch = SimpleNamespace(reqs=[SimpleNamespace(req_pool_idx=i) for i in (4, 1, 9)])
    fb = SimpleNamespace(req_pool_indices=torch.tensor([4, 1, 9]))
    assert _after_forward_batch_init(fb, ForwardBatch, batch, None) is None  # keeps the result
    assert fb.redknot_req_slots == [4, 1, 9] and request_slots(fb) == [4, 1, 9]


def test_the_published_configuration_is_parsed_once_per_text(monkeypatch):
    """The scheduler reads the configuration for every request it queues: the same published
    text gives the same (frozen) configuration without parsing it again; a new text, its own."""
    import dataclasses
    import json

    from redknot import envs
    from redknot.config import RedknotConfig
    from redknot.integration import server_args

    parsed = []
    real = RedknotConfig.from_json
    monkeypatch.setattr(
        RedknotConfig, "from_json", classmethod(lambda cls, t: parsed.append(t) or real(t))
    )
    server_args._parsed.cache_clear()
    texts = [
        json.dumps(dataclasses.asdict(RedknotConfig(policy=p, all_global=True)))
        for p in ("cacheblend", "epic")
    ]
    try:
        for text in (texts[0], texts[0], texts[1], texts[0]):
            monkeypatch.setenv(envs.REDKNOT_RESOLVED_CONFIG.name, text)
            config = server_args.published_config()
            assert config == RedknotConfig.from_mapping(json.loads(text), source="test")
        assert parsed == texts
    finally:
        server_args._parsed.cache_clear()
