"""A tiny random Llama and composed prompts with cached segments, all offline."""

from __future__ import annotations

import pytest
import torch

from redknot.recovery import RecoveryOptions, ReusePrompt, Segment, cache_kv, create_policy, serve
from redknot.reference import ReferenceRunner


def tiny_llama(*, layers: int = 3, seed: int = 0, rope: str = "default") -> torch.nn.Module:
    """float32 Llama: 4 query / 2 KV heads of dim 16, hidden 64, FFN 128, vocab 128."""
    import transformers as tf

    extra = {}
    if rope == "llama3":
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).eval()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compose(runner: ReferenceRunner, pieces, head_map=None) -> ReusePrompt:
    """``pieces``: list of ``("new" | "seg", ids)``; segments are cached alone under
    ``head_map``."""
    ids, segments = [], []
    for kind, part in pieces:
        if kind == "seg":
            cache = cache_kv(runner, part, head_map)
            segments.append(Segment(len(ids), len(ids) + len(part), cache))
        ids.extend(part)
    return ReusePrompt(tuple(ids), tuple(segments))


@pytest.fixture(scope="module")
def runner() -> ReferenceRunner:
    return ReferenceRunner(tiny_llama())


@pytest.fixture(scope="module")
def pieces():
    """new 10, segment 40, new 6, segment 50, question 12: 118 rows."""
    return [
        ("new", random_ids(10, 1)),
        ("seg", random_ids(40, 2)),
        ("new", random_ids(6, 3)),
        ("seg", random_ids(50, 4)),
        ("new", random_ids(12, 5)),
    ]


def serve_policy(runner: ReferenceRunner, name: str, prompt: ReusePrompt, head_map=None, **knobs):
    """``(policy, its served output)`` of policy ``name`` with ``knobs``, 6 new tokens."""
    policy = create_policy(
        name, prompt, shape=runner.shape, head_map=head_map, options=RecoveryOptions(**knobs)
    )
    return policy, serve(runner, policy, max_new_tokens=6)


@pytest.fixture(scope="module")
def prompt(runner, pieces):
    return compose(runner, pieces)


@pytest.fixture(scope="module")
def full(runner, prompt):
    return serve_policy(runner, "full", prompt)[1]
