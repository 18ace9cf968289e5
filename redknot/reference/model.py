"""The pieces of a Hugging Face Llama-family decoder, exposed one operation at a time.

Supported: Llama (SmolLM2 included), Mistral, Qwen2 and Qwen3 (Qwen3's per-head ``q_norm`` /
``k_norm``, Qwen2's projection biases), all with full attention in every layer. The adapter
reuses the model's own modules (projections, norms, MLP); only attention and RoPE are done by
the reference path.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from redknot.headmap import ModelShape
from redknot.reference.rope import Rope

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """A model the reference path cannot run exactly."""


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the reference path; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    uses_sliding = getattr(config, "use_sliding_window", model_type == "mistral")
    if "sliding_attention" in layer_types or (sliding is not None and uses_sliding):
        raise UnsupportedModelError(
            f"this {model_type} model uses sliding-window attention ({sliding} tokens); the "
            "reference path implements models with full attention in every layer"
        )


class LlamaFamily:
    """Operations of one decoder, on a single sequence (no batch dimension).

    Shapes: ``T`` tokens, ``D`` hidden size, ``Hq`` / ``Hkv`` query / KV heads, ``d`` head dim.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        config = hf_model.config
        _check_supported(config)
        self.hf_model = hf_model
        self.config = config
        shape = ModelShape.from_hf_config(config)
        if shape.architecture == "unknown":  # GGUF checkpoints carry no `architectures`
            shape = dataclasses.replace(shape, architecture=type(hf_model).__name__)
        self.shape = shape
        self.decoder = hf_model.model
        self.layers = self.decoder.layers
        self.rope = Rope.from_hf_model(hf_model)
        attn = self.layers[0].self_attn
        self.scale = float(attn.scaling)
        assert self.rope.head_dim == self.shape.head_dim, (self.rope.head_dim, self.shape)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def group_size(self) -> int:
        return self.shape.num_attention_heads // self.shape.num_kv_heads

    def embed(self, input_ids: Tensor) -> Tensor:
        """``[T]`` int64 -> ``[T, D]``."""
        return self.decoder.embed_tokens(input_ids)

    def qkv(self, layer: int, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Input norm, projections, per-head norms (Qwen3) and RoPE at ``positions`` ``[T]``.

        ``hidden``: ``[T, D]`` (the residual stream). Returns ``q`` ``[Hq, T, d]``, ``k`` and
        ``v`` ``[Hkv, T, d]``.
        """
        block = self.layers[layer]
        attn = block.self_attn
        h = block.input_layernorm(hidden)
        d = self.shape.head_dim
        q = attn.q_proj(h).view(h.shape[0], -1, d)
        k = attn.k_proj(h).view(h.shape[0], -1, d)
        v = attn.v_proj(h).view(h.shape[0], -1, d)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        return self.rope.apply(q, positions), self.rope.apply(k, positions), v.contiguous()

    def attn_output(self, layer: int, o: Tensor) -> Tensor:
        """``o``: ``[Hq, T, d]`` attention output -> ``[T, D]`` (the output projection)."""
        attn = self.layers[layer].self_attn
        return attn.o_proj(o.transpose(0, 1).reshape(o.shape[1], -1))

    def ffn(self, layer: int, hidden: Tensor) -> Tensor:
        """The FFN update (post-attention norm, then MLP) of ``hidden`` ``[R, D]`` -> ``[R, D]``;
        the caller adds it to the residual stream."""
        block = self.layers[layer]
        return block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: ``[R, D]`` -> ``[R, vocab]``."""
        return self.hf_model.lm_head(self.decoder.norm(hidden))
