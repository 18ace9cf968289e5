"""PyTorch references for RoPE alignment (``redknot.kernels.rope_align``).

- ``delta_cos_sin`` / ``delta_rotate`` / ``rope_align_reference``: the delta rotation
  ``R(p_on) R(p_off)^-1`` from SGLang's ``cos_sin_cache``, in fp32, with the kernel's semantics.
- ``sglang_rope`` / ``sglang_rope_keys``: SGLang's own rotary embedding (built by its ``get_rope``)
  applied to raw keys at given positions, so that "rotate at ``p_off``, then align to ``p_on``"
  can be compared with "rotate at ``p_on``".
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch


def delta_cos_sin(
    pos_off: torch.Tensor, pos_on: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angle ``theta(pos_on) - theta(pos_off)`` per frequency, in fp32.

    Parameters
    ----------
    pos_off, pos_on : [N] integer positions.
    cos_sin_cache : [max_pos, R] SGLang table (cos half, then sin half), possibly scaled by a
        magnitude (YaRN's mscale), which the normalisation by the radii removes.

    Returns
    -------
    cos, sin : [N, R/2] float32; exactly (1, 0) where ``pos_on == pos_off``.
    """
    table = cos_sin_cache.to(torch.float32)
    c_on, s_on = table[pos_on.long()].chunk(2, dim=-1)
    c_off, s_off = table[pos_off.long()].chunk(2, dim=-1)
    radii = torch.sqrt((c_on * c_on + s_on * s_on) * (c_off * c_off + s_off * s_off))
    cos = (c_on * c_off + s_on * s_off) / radii
    sin = (s_on * c_off - c_on * s_off) / radii
    same = (pos_on == pos_off)[:, None]
    return torch.where(same, 1.0, cos), torch.where(same, 0.0, sin)


def rotary_pairs(
    rotary_dim: int, is_neox: bool, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dims rotated together, ``[R/2]`` each: NeoX ``(j, j + R/2)``, GPT-J ``(2j, 2j + 1)``."""
    j = torch.arange(rotary_dim // 2, device=device)
    return (j, j + rotary_dim // 2) if is_neox else (2 * j, 2 * j + 1)


def alignment_tolerance(expected: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    """Allowed |kernel - reference| per element of aligned keys ``[..., H, D]`` (fp32).

    One ulp of the key dtype, plus 16 fp32 units (2^-24) of the rotated pair's norm: both sides
    evaluate the same fp32 expressions and round once, and only the evaluation order differs,
    which can flip a rounding or, for an element much smaller than its pair (cancellation in
    ``x1 cos - x2 sin``), move it by a few units of the pair's norm.
    """
    finfo = torch.finfo(expected.dtype)
    e = expected.float()
    d1, d2 = rotary_pairs(rotary_dim, is_neox, e.device)
    pair_norm = torch.zeros_like(e)
    pair_norm[..., d1] = pair_norm[..., d2] = torch.hypot(e[..., d1], e[..., d2])
    return finfo.eps * e.abs() + 16 * 2.0**-24 * pair_norm + finfo.tiny * finfo.eps


def delta_rotate(
    keys: torch.Tensor,
    pos_off: torch.Tensor,
    pos_on: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool,
) -> torch.Tensor:
    """Keys [N, H, D] (any float dtype) rotated by ``R(pos_on) R(pos_off)^-1``: [N, H, D] fp32.
    The first ``R = cos_sin_cache.shape[1]`` dims of each head are rotated, the rest kept."""
    return rotate_by(keys, *delta_cos_sin(pos_off, pos_on, cos_sin_cache), is_neox=is_neox)


def rotate_by(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, is_neox: bool
) -> torch.Tensor:
    """Keys [N, H, D] rotated per row by the angles whose ``cos``, ``sin`` [N, R/2] are given
    (:func:`delta_cos_sin`; tables built once can serve many calls): [N, H, D] fp32."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    d1, d2 = rotary_pairs(2 * cos.shape[-1], is_neox, keys.device)
    x = keys.to(torch.float32)
    out = x.clone()
    x1, x2 = x[..., d1], x[..., d2]
    out[..., d1] = x1 * cos - x2 * sin
    out[..., d2] = x2 * cos + x1 * sin
    return out


def rope_align_reference(
    k_src: torch.Tensor,
    src_rows: torch.Tensor,
    k_dst: torch.Tensor,
    dst_rows: torch.Tensor,
    pos_off: torch.Tensor,
    pos_on: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool,
    v_src: torch.Tensor | None = None,
    v_dst: torch.Tensor | None = None,
    src_heads: torch.Tensor | None = None,
    dst_heads: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``rope_align`` leaves in ``k_dst`` / ``v_dst``, as new tensors (inputs untouched).
    Every source row is read before any destination row is written. Rows with equal positions
    are copied bit for bit; others are rotated in fp32 and rounded once to the key dtype. Head
    maps: head ``src_heads[j]`` of a source row to head ``dst_heads[j]`` of its destination."""
    src, dst = src_rows.long(), dst_rows.long()
    mapped = src_heads is not None
    if not mapped:
        src_heads = dst_heads = torch.arange(k_src.shape[1], device=k_src.device)
    src_at = (src[:, None], src_heads.long()[None, :])  # [N, Hm] (row, head) pairs
    dst_at = (dst[:, None], dst_heads.long()[None, :])
    k_in = k_src[src_at]
    rotated = delta_rotate(k_in, pos_off, pos_on, cos_sin_cache, is_neox=is_neox).to(k_src.dtype)
    same = (pos_on == pos_off)[:, None, None]
    k_out = k_dst.clone()
    k_out[dst_at] = torch.where(same, k_in, rotated)
    v_out = None
    if v_src is not None:
        v_out = v_dst.clone()
        if mapped:
            v_out[dst_at] = v_src[src_at]
        else:  # values may have their own head count
            v_out[dst] = v_src[src]
    return k_out, v_out


@contextlib.contextmanager
def _sglang_construction_context():
    """SGLang reads its published runtime config while building a rotary embedding; publish a
    default one if none is (tests, scripts). On a machine without CUDA, the base class would
    import vLLM's kernel for the non-CUDA fallback, which ``forward_native`` never uses: build
    it as for SGLang's CPU engine instead (the table is computed the same way)."""
    from sglang.srt.layers.rotary_embedding import base
    from sglang.srt.runtime_context import get_context, get_exec

    with contextlib.ExitStack() as stack:
        try:
            get_exec()
        except ValueError:
            stack.enter_context(get_context().override_server_args())
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch.object(base, "_is_cpu", True))
        yield


def sglang_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    is_neox_style: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    partial_rotary_factor: float = 1.0,
) -> torch.nn.Module:
    """SGLang's ``get_rope(...)`` with an fp32 table (as SGLang keeps it on CUDA), built on the
    CPU (``deepseek_yarn`` through SGLang's ``get_rope_cpu``)."""
    from sglang.srt.layers.rotary_embedding.factory import get_rope, get_rope_cpu

    args = (head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, torch.float32)
    with _sglang_construction_context():
        if rope_scaling is not None and rope_scaling.get("rope_type") == "deepseek_yarn":
            return get_rope_cpu(*args, partial_rotary_factor, device="cpu")
        return get_rope(*args, partial_rotary_factor)


def sglang_rope_keys(
    rope: torch.nn.Module, keys: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Raw keys [N, H, D] rotated at ``positions`` [N] by SGLang's ``RotaryEmbedding`` math
    (``forward_native`` of the base class on fp32 keys, which is what SGLang's CUDA kernel
    computes for every supported variant: fp32 table, fp32 math). Returns [N, H, D] float32;
    round it to the key dtype for what SGLang stores."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    table = rope.cos_sin_cache
    assert table.dtype == torch.float32, f"build the rope with an fp32 table, got {table.dtype}"
    x = keys.to(device=table.device, dtype=torch.float32)
    pos = positions.to(table.device)
    _, out = RotaryEmbedding.forward_native(rope, pos, x.clone(), x)
    return out.view_as(x).to(keys.device)
