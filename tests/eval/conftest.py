"""A tiny random Llama with a character tokenizer: the reference backend without downloads."""

from __future__ import annotations

import pytest
import torch

from redknot.eval.reference_backend import ReferenceBackend
from redknot.headmap import synthetic_map


class CharTokenizer:
    """Characters as ids 3..127 (no chat template, no special tokens added); 2 is EOS."""

    eos_token_id = 2
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + (ord(ch) % 125) for ch in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def convert_tokens_to_ids(self, token: str) -> int:
        return -1


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def backend() -> ReferenceBackend:
    model = tiny_llama()
    from redknot.reference import ReferenceRunner

    shape = ReferenceRunner(model).shape
    hm = synthetic_map(shape, 0.5, window=16, sink=4, seed=0)
    return ReferenceBackend(model, CharTokenizer(), hm, model_name="tiny", max_new_tokens=4)
