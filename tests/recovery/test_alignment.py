"""RoPE alignment of cached keys: moving a key equals computing it at the new position."""

from __future__ import annotations

import pytest
import torch

from redknot.headmap import synthetic_map
from redknot.recovery import RecoveryOptions, create_policy
from redknot.reference import LayerContext, ReferenceRunner, Rope

from .conftest import compose, random_ids, tiny_llama


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_realigned_key_equals_key_computed_at_new_position(rope):
    model = tiny_llama(rope=rope)
    r = Rope.from_hf_model(model)
    raw = torch.randn(2, 30, 16, generator=torch.Generator().manual_seed(0))
    src = torch.arange(30)
    for start in (0, 1, 77, 900):
        dst = src + start
        moved = r.realign(r.apply(raw, src), src, dst)
        # fp32 angles: at position ~900 one ulp of the angle is ~6e-5 rad
        torch.testing.assert_close(moved, r.apply(raw, dst), atol=2e-4, rtol=1e-4)


def test_policy_serves_layer0_keys_equal_to_in_context_keys():
    """Layer-0 K/V depend only on token and position: the cached, aligned segment KV a policy
    serves to its local heads equals the KV the composed prompt computes there."""
    runner = ReferenceRunner(tiny_llama(rope="llama3"))
    prefix, segment = random_ids(33, 1), random_ids(25, 2)
    hm = synthetic_map(runner.shape, 0.0, window=8, sink=2)
    prompt = compose(runner, [("new", prefix), ("seg", segment), ("new", random_ids(5, 3))], hm)
    policy = create_policy(
        "redknot", prompt, shape=runner.shape, head_map=hm, options=RecoveryOptions()
    )
    ids = torch.tensor(prompt.ids)
    positions = torch.arange(len(ids))
    ctx = LayerContext(0, positions, 0, "LL", 8, 2, runner.model)
    _, k, v = runner.model.qkv(0, runner.model.embed(ids), positions)
    keys, values = policy.cached_kv(ctx, torch.zeros_like(k), torch.zeros_like(v), [0, 1])
    torch.testing.assert_close(keys[:, 33:58], k[:, 33:58], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[:, 33:58], v[:, 33:58])
    assert keys[:, :33].abs().max() == 0 and keys[:, 58:].abs().max() == 0
