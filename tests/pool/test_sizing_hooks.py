"""The pool-sizing hooks on SGLang's real KV-cache configurator class (it has __slots__)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from redknot import envs
from redknot.config import RedknotConfig
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool import sizing
from redknot.pool.kv_pool import bytes_per_ring, bytes_per_token

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


@pytest.fixture
def configurator(tmp_path, monkeypatch):
    from sglang.srt.runtime_context import get_parallel

    path = tmp_path / "map.json"
    synthetic_map(ModelShape.from_hf_config(CONFIG), 0.25).save(path)
    monkeypatch.setenv(
        envs.REDKNOT_RESOLVED_CONFIG.name, RedknotConfig(head_map=str(path)).to_json()
    )
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        yield bare_configurator()


def bare_configurator():
    """SGLang's KV-cache configurator for ``CONFIG`` without its own initialisation: what the
    sizing hooks read of it (redknot's backend, the model config, bf16 KV)."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    kvc = object.__new__(KVCacheConfigurator)
    kvc.server_args = SimpleNamespace(attention_backend="redknot", max_running_requests=None)
    kvc.model_config = SimpleNamespace(hf_config=CONFIG, context_len=4096)
    kvc.kv_cache_dtype = torch.bfloat16
    kvc.device = "cuda"
    return kvc


def test_hooks_size_the_pool_from_global_bytes_and_rings(configurator):
    from redknot.integration import plugin

    layout = sizing.layout_of(configurator)
    per_token = bytes_per_token(layout, torch.bfloat16)
    assert plugin._around_cell_size(None, None, configurator, 4) == per_token
    budget = 10**9
    left = plugin._after_available_bytes(budget, configurator, 0)
    plan = sizing.state_of(configurator)["slots"]
    segments = sizing.state_of(configurator)["segments"].reserved_bytes  # default fraction
    ring = bytes_per_ring(layout, torch.bfloat16)
    assert 0 < segments <= 0.05 * budget
    assert (
        left
        == budget - segments - plan.fixed_bytes
        == budget - segments - (plan.request_slots + 1 + plan.snapshots) * ring
    )
    assert plugin._after_max_num_reqs(4096, configurator, left // per_token) == plan.request_slots


def test_hooks_leave_other_backends_alone(configurator):
    from redknot.integration import plugin

    configurator.server_args.attention_backend = "flashinfer"
    assert plugin._around_cell_size(lambda self, kvc, n: 123, None, configurator, 4) == 123
    assert plugin._after_available_bytes(10**9, configurator, 0) is None
    assert plugin._after_max_num_reqs(4096, configurator, 10) is None


def test_every_tp_rank_plans_the_costliest_ranks_slots(tmp_path, monkeypatch):
    """A map whose ranks hold different numbers of global heads: both ranks get the token cell
    size and request/snapshot slots of the costlier rank, so their schedulers agree."""
    import dataclasses

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import get_parallel

    from redknot.integration import plugin

    base = synthetic_map(ModelShape.from_hf_config(CONFIG), 0.25)
    head_map = dataclasses.replace(base, classes=("GGLL", "GLLL", "GLLL", "LLLL"))
    path = tmp_path / "unbalanced.json"
    head_map.save(path)
    monkeypatch.setenv(
        envs.REDKNOT_RESOLVED_CONFIG.name, RedknotConfig(head_map=str(path)).to_json()
    )
    cells, plans, own = [], [], []
    for rank in range(2):
        kvc = object.__new__(KVCacheConfigurator)
        kvc.server_args = SimpleNamespace(attention_backend="redknot", max_running_requests=None)
        kvc.model_config = SimpleNamespace(hf_config=CONFIG, context_len=4096)
        kvc.kv_cache_dtype = torch.bfloat16
        with get_parallel().override(attn_tp_size=2, attn_tp_rank=rank):
            cells.append(plugin._around_cell_size(None, None, kvc, 4))
            sizing.reserve_local_bytes(kvc, 10**9)
            own.append(bytes_per_token(sizing.layout_of(kvc), torch.bfloat16))
        plans.append(sizing.state_of(kvc)["slots"])
    assert own[0] != own[1]  # rank 0 holds 4 global heads, rank 1 none
    assert cells == [max(own)] * 2
    assert plans[0] == plans[1] and plans[0].request_slots is not None
