from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from redknot.reference.model import LlamaFamily
from redknot.reference.rope import Rope, RopeError

from .conftest import tiny_model


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "qwen3"])
def test_apply_matches_hugging_face(arch):
    model = tiny_model(arch)
    rope = Rope.from_hf_model(model)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 1000])
    q, k = torch.randn(2, 3, 7, rope.head_dim).unbind(0)
    cos, sin = model.model.rotary_emb(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    torch.testing.assert_close(rope.apply(q, positions), q_hf[0])
    torch.testing.assert_close(rope.apply(k, positions), k_hf[0])


def _rotation_matrix(theta: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Brute force: the rotate-half RoPE matrix for angles ``theta`` [head_dim // 2]."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for i in range(half):
        c, s = math.cos(theta[i]), math.sin(theta[i])
        r[i, i], r[i, i + half] = c, -s
        r[i + half, i], r[i + half, i + half] = s, c
    return r


def test_realign_is_the_relative_rotation():
    model = tiny_model("llama3-rope")
    rope = Rope.from_hf_model(model)
    d = rope.head_dim
    raw = torch.randn(2, 4, d)
    p_off = torch.tensor([0, 1, 2, 3])
    p_on = torch.tensor([500, 501, 502, 503])
    cached = rope.apply(raw, p_off)
    moved = rope.realign(cached, p_off, p_on)
    torch.testing.assert_close(moved, rope.apply(raw, p_on), atol=2e-5, rtol=1e-4)
    # and against explicit matrices: K(p_on) = R(p_on) R(p_off)^-1 K(p_off)
    inv_freq = rope.inv_freq.double()
    for t in range(4):
        r_on = _rotation_matrix(p_on[t] * inv_freq, d)
        r_off = _rotation_matrix(p_off[t] * inv_freq, d)
        expect = cached[:, t].double() @ (r_on @ r_off.T).T
        torch.testing.assert_close(moved[:, t].double(), expect, atol=1e-5, rtol=1e-4)


def test_dynamic_rope_is_refused():
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    with pytest.raises(RopeError, match="dynamic"):
        LlamaFamily(tf.LlamaForCausalLM(config))
