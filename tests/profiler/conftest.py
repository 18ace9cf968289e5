"""Tiny random models, a byte-level encoder and a word-level tokenizer: everything offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from redknot.profiler import words as W


class ByteEncoder:
    """UTF-8 bytes as tokens (ids 3..258); prompts start with BOS id 1."""

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode()

    def prompt_parts(self) -> tuple[list[int], list[int]]:
        return [1], []


def tiny_llama(*, layers: int = 2, vocab: int = 300, seed: int = 0, max_positions: int = 4096):
    """A float32 Llama with 4 query / 2 KV heads of dim 16, eager attention."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).eval()


def word_tokenizer():
    """A word-level fast tokenizer over the calibration vocabulary, with a chat template."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from redknot.profiler import calibration as C

    splitter = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    rng = random.Random(0)
    text = " ".join(
        [C.filler_sentence(rng) for _ in range(400)]
        + [C.record_sentence(rng, i) for i in range(400)]
        + [" ".join(C._needle_fact(rng)) for _ in range(200)]
        + [
            " ".join(g)
            for g in (
                W.ADJECTIVES,
                W.NOUNS,
                W.VERBS,
                W.PLACES,
                W.FIRST_NAMES,
                W.FAMILY_NAMES,
                W.OBJECTS,
                W.COLOURS,
            )
        ]
    )
    words = sorted({w for w, _ in splitter.pre_tokenize_str(text)})
    specials = ["[UNK]", "<s>", "</s>", "<user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = splitter
    tok.add_special_tokens(["<s>", "</s>", "<user>", "<assistant>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A saved tiny Llama checkpoint with the word-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = word_tokenizer()
    model = tiny_llama(vocab=len(tokenizer) + 8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
