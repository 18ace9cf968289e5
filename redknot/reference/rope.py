"""Explicit rotary position embedding (RoPE) in the Hugging Face "rotate half" convention.

The reference runner rotates queries and keys itself instead of calling the model's attention
module, so that cached keys can be moved between positions:
``K(p_on) = R(p_on) R(p_off)^-1 K(p_off) = R(p_on - p_off) K(p_off)`` (RedKnot §4.2,
SparseX §3.1). Values carry no position and are never rotated.
"""

from __future__ import annotations

import torch
from torch import Tensor

# RoPE variants whose frequencies do not depend on the sequence length: a rotation by a
# position delta is then exact. "dynamic" (NTK) and "longrope" switch frequencies with the
# length and are refused.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class RopeError(ValueError):
    """A RoPE configuration the reference path cannot reproduce exactly."""


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """RoPE of one model: ``inv_freq`` (``[head_dim // 2]``, float32) and the model's
    ``attention_scaling`` (1.0 except for YaRN-like variants, which scale cos and sin).

    >>> rope = Rope.from_hf_model(model)
    >>> k_rot = rope.apply(k, positions)              # k: [H, T, head_dim], positions: [T]
    >>> k_moved = rope.realign(k_rot, positions, positions + 100)
    """

    def __init__(self, inv_freq: Tensor, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.attention_scaling = float(attention_scaling)

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module) -> Rope:
        """Take the frequencies of a Hugging Face decoder (``model.model.rotary_emb``)."""
        rotary = model.model.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise RopeError(
                f"RoPE type {rope_type!r} changes its frequencies with the sequence length; the "
                f"reference path supports {', '.join(STATIC_ROPE_TYPES)}"
            )
        return cls(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))

    def cos_sin(
        self, positions: Tensor, *, scaled: bool = True, dtype: torch.dtype = torch.float32
    ) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of shape ``[T, head_dim]`` for integer ``positions`` ``[T]``.

        Computed in float32 as Hugging Face does, then cast to ``dtype``. ``scaled=False``
        leaves out ``attention_scaling`` (a pure rotation, used for re-alignment).
        """
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if scaled:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x`` (``[..., T, head_dim]``) to ``positions`` (``[T]``)."""
        assert x.shape[-1] == self.head_dim, (x.shape, self.head_dim)
        assert positions.shape == (x.shape[-2],), (positions.shape, x.shape)
        cos, sin = self.cos_sin(positions, dtype=x.dtype)
        return x * cos + _rotate_half(x) * sin

    def realign(self, k: Tensor, from_positions: Tensor, to_positions: Tensor) -> Tensor:
        """Move rotated keys ``k`` (``[..., T, head_dim]``) from ``from_positions`` to
        ``to_positions`` (both ``[T]``): one rotation by the delta, in float32."""
        assert from_positions.shape == to_positions.shape == (k.shape[-2],)
        delta = to_positions.to(torch.int64) - from_positions.to(torch.int64)
        cos, sin = self.cos_sin(delta, scaled=False)
        k32 = k.to(torch.float32)
        return (k32 * cos + _rotate_half(k32) * sin).to(k.dtype)
