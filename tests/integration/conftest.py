from __future__ import annotations

import json
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "models"


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's plugin loader, run once as the launcher runs it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from redknot.integration import plugin

    return plugin


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A model directory with the Llama-3.1-8B config (no weights: --load-format dummy)."""
    src = MODELS / "llama-3.1-8b" / "config.json"
    if src.is_file():
        config = json.loads(src.read_text())
    else:  # the same shape, so the tests also run from a checkout without ../shared
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "vocab_size": 128256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "torch_dtype": "bfloat16",
        }
    d = tmp_path_factory.mktemp("llama-3.1-8b")
    (d / "config.json").write_text(json.dumps(config))
    return d
