"""RoPE alignment of cached keys: move key rows to new rows, re-rotated from the positions they
were computed at (offline) to the positions they take in the request (online), in one launch.

    K(p_on) = R(p_on) R(p_off)^-1 K(p_off)

>>> spec = alignable_rope(attn.rotary_emb)                 # once per model: checks the variant
>>> for layer in range(num_layers):                       # no allocation, no host sync
...     rope_align(store_k[layer], store_rows, pool_k[layer], pool_rows, pos_off, pos_on,
...                spec.cos_sin_cache, is_neox=spec.is_neox,
...                v_src=store_v[layer], v_dst=pool_v[layer])
>>> stacks = [LayerStack.of(t) for t in (store_k, pool_k, store_v, pool_v)]  # once
>>> rope_align_layers(stacks[0], store_rows, stacks[1], pool_rows, pos_off, pos_on,
...                   spec.cos_sin_cache, is_neox=spec.is_neox,
...                   v_src=stacks[2], v_dst=stacks[3])  # the same, every layer in one launch

Supported RoPE variants (SGLang 0.5.17 classes, matched exactly, not by subclass) are those whose
rotation of position ``p`` is one fixed table row ``cos_sin_cache[p]``, the same for every head and
every token of a batch: ``RotaryEmbedding`` (plain, ``rope_scaling`` absent or ``default``,
including ``partial_rotary_factor``), ``Llama3RotaryEmbedding`` (``llama3``),
``YaRNScalingRotaryEmbedding`` (``yarn``), ``DeepseekScalingRotaryEmbedding`` (``deepseek_yarn``;
an MLA latent cache would be passed as the view ``[rows, 1, rope_dim]`` of its rope dims, which
is not exercised here), ``LinearScalingRotaryEmbedding`` (``linear``, one factor),
``DynamicNTKScalingRotaryEmbedding`` / ``DynamicNTKAlphaRotaryEmbedding`` (``dynamic``: SGLang
builds one static table for every position) and ``Gemma4RotaryEmbedding`` (``proportional``: its
table spans the whole head, rotating the first ``rotary_dim / 2`` frequencies and holding cos 1,
sin 0 for the others). Every one of them is tested against SGLang's own rotation. YaRN-style
tables carry a magnitude ``mscale`` in cos and sin; the delta is computed as a pure rotation (see
``redknot.kernels.triton.rope_align``), so the magnitude the cached key already carries is kept,
not applied again. Refused: multimodal ``MRotaryEmbedding`` and its subclasses (positions are
3-D), ``DualChunkRotaryEmbedding`` (per-chunk tables), ``Phi3LongRoPEScaledRotaryEmbedding``
(the table switches with the batch's longest position), ``FourierRotaryEmbedding`` (mixes
frequencies per head) and ``Llama4VisionRotaryEmbedding`` (2-D patches).

The delta angle comes from SGLang's own table by angle-difference identities in fp32, so an
aligned key matches the key SGLang would have rotated at ``p_on`` directly, including the table's
own fp32 rounding of ``p * inv_freq`` at large positions. Math is fp32 with one rounding to the
key dtype, as SGLang's CUDA RoPE kernel does. Reference: ``redknot.kernels.rope_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from redknot.kernels.triton.rope_align import rope_align_kernel

_KEY_DTYPES = (torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class RopeAlignConfig:
    """Launch constants (not semantics)."""

    tile_elems: int = 4096  # rows per program: about this many rotated key elements per tile
    num_warps: int = 4
    max_block_n: int = 64
    # rope_align_layers: each program moves its rows in every layer in turn (True), or the
    # grid has a program per rows and layer (False, served: the loop measured 0.95x of it at
    # 32K rows x 32 layers on an H200, benchmarks/results/rope_align_layers_h200.json)
    layer_loop: bool = False


@dataclass(frozen=True)
class AlignableRope:
    """What ``rope_align`` needs from an SGLang rotary embedding."""

    cos_sin_cache: torch.Tensor  # [max_pos, rotary_dim] float32: cos half, then sin half
    is_neox: bool
    rotary_dim: int  # == cos_sin_cache.shape[1]
    variant: str  # SGLang class name


_SUPPORTED = (
    "RotaryEmbedding",
    "Llama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
    "Gemma4RotaryEmbedding",
)
_REFUSED = {
    "MRotaryEmbedding": "multimodal RoPE rotates by 3-D (t, h, w) positions",
    "YaRNScalingMRotaryEmbedding": "multimodal RoPE rotates by 3-D (t, h, w) positions",
    "Ernie4_5_VLRotaryEmbedding": "multimodal RoPE rotates by 3-D (t, h, w) positions",
    "DualChunkRotaryEmbedding": "dual-chunk attention uses several tables per position",
    "Phi3LongRoPEScaledRotaryEmbedding": "LongRoPE switches tables with the batch's longest "
    "position, so a position has no single rotation",
    "FourierRotaryEmbedding": "FoPE mixes frequencies per KV head",
    "Llama4VisionRotaryEmbedding": "vision RoPE rotates by 2-D patch positions",
}


def alignable_rope(rope: torch.nn.Module) -> AlignableRope:
    """Check that ``rope`` (an SGLang rotary embedding, e.g. ``attn.rotary_emb``) is a supported
    variant and return its table as fp32. Raises ``NotImplementedError`` naming the reason for
    refused variants. The table is taken by reference; call again if SGLang grows it."""
    name = type(rope).__name__
    module = type(rope).__module__
    if not module.startswith("sglang.srt.layers.rotary_embedding") or name not in _SUPPORTED:
        why = _REFUSED.get(name, "not one of the supported variants " + ", ".join(_SUPPORTED))
        raise NotImplementedError(f"RoPE alignment does not support {module}.{name}: {why}")
    if name == "LinearScalingRotaryEmbedding" and len(rope.scaling_factors) != 1:
        raise NotImplementedError(
            "RoPE alignment of LinearScalingRotaryEmbedding needs one scaling factor "
            f"(got {rope.scaling_factors}); its table stacks one block per factor"
        )
    cache = rope.cos_sin_cache.to(torch.float32)
    if cache.dim() != 2 or cache.shape[1] != rope.rotary_dim:
        raise NotImplementedError(
            f"RoPE alignment needs a [max_pos, rotary_dim] table; {name} has "
            f"{tuple(cache.shape)} with rotary_dim {rope.rotary_dim}"
        )
    return AlignableRope(cache, bool(rope.is_neox_style), cache.shape[1], name)


def _check(ok: bool, message) -> None:
    """Raise ``ValueError(message)`` unless ``ok``; ``message`` may be a callable giving it (so
    that a passing check formats nothing: this runs on the serving path)."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    _check(t.dim() == 3,
           lambda: f"{name} must be [rows, heads, head_dim], got {tuple(t.shape)}")  # fmt: skip
    _check(t.stride(-1) == 1, lambda: f"{name} must have unit stride in head_dim, got {t.stride()}")
    if like is not None:
        _check(t.dtype == like.dtype, lambda: f"{name} dtype {t.dtype} != {like.dtype}")
        _check(t.shape[1:] == like.shape[1:],
               lambda: f"{name} heads/dims {tuple(t.shape[1:])} "
               f"!= {tuple(like.shape[1:])}")  # fmt: skip


def _check_index(name: str, t: torch.Tensor, n: int) -> None:
    _check(t.dim() == 1 and t.shape[0] == n, lambda: f"{name} must be [{n}], got {tuple(t.shape)}")
    _check(t.dtype in _INDEX_DTYPES, lambda: f"{name} must be int32 or int64, got {t.dtype}")


def rope_align(
    k_src: torch.Tensor,
    src_rows: torch.Tensor,
    k_dst: torch.Tensor,
    dst_rows: torch.Tensor,
    pos_off: torch.Tensor,
    pos_on: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool,
    rotary_dim: int | None = None,
    v_src: torch.Tensor | None = None,
    v_dst: torch.Tensor | None = None,
    src_heads: torch.Tensor | None = None,
    dst_heads: torch.Tensor | None = None,
    config: RopeAlignConfig = RopeAlignConfig(),
) -> None:
    """``k_dst[dst_rows[i]] = R(pos_on[i]) R(pos_off[i])^-1 k_src[src_rows[i]]`` for every ``i``,
    every head; ``v_dst[dst_rows[i]] = v_src[src_rows[i]]`` if values are given. One launch, no
    host sync. With head maps, head ``src_heads[j]`` of a source row goes to head
    ``dst_heads[j]`` of its destination row (keys and values), and no other head is touched.

    Parameters
    ----------
    k_src : [rows_src, H, D] float16/bfloat16, keys as rotated at ``pos_off`` (any row/head
        strides, unit stride in D; a head slice of a pool is fine).
    src_rows : [N] int32/int64, rows of ``k_src`` (and ``v_src``) to read.
    k_dst : [rows_dst, H, D] same dtype as ``k_src``; may be ``k_src`` itself. Written in place.
    dst_rows : [N] int32/int64, rows of ``k_dst`` (and ``v_dst``) to write; distinct, and none
        equal to a row that another entry reads (``dst_rows[i] == src_rows[i]`` in the same
        tensor, an in-place re-rotation, is allowed).
    pos_off, pos_on : [N] int32/int64, positions in ``[0, max_pos)`` (not checked on the device).
        ``pos_on < pos_off`` moves a key earlier; ``pos_on == pos_off`` copies it bit for bit.
    cos_sin_cache : [max_pos, R] float32, SGLang's ``RotaryEmbedding.cos_sin_cache`` (cos of the
        ``R/2`` frequencies, then sin), e.g. ``alignable_rope(rope).cos_sin_cache``.
    is_neox : NeoX (rotate halves) or GPT-J (rotate interleaved pairs) style, as SGLang's
        ``is_neox_style``.
    rotary_dim : R, the rotated leading dims of each head; defaults to ``cos_sin_cache.shape[1]``
        and must equal it if given. Dims ``[R, D)`` are copied unchanged.
    v_src, v_dst : optional [rows_src, Hv, Dv] / [rows_dst, Hv, Dv] values (any dtype, the same
        for both, unit stride in Dv), copied row for row in the same launch.
    src_heads, dst_heads : optional [Hm] int32 head maps (both or neither), on the device:
        heads of ``k_src``/``v_src`` and of ``k_dst``/``v_dst`` (destination heads distinct).
        Without them, ``k_src`` and ``k_dst`` have the same heads and every head moves.
    """
    _launch(k_src, src_rows, k_dst, dst_rows, pos_off, pos_on, cos_sin_cache, is_neox,
            rotary_dim, v_src, v_dst, src_heads, dst_heads, config)  # fmt: skip


@dataclass(frozen=True)
class LayerStack:
    """Several layers' tensors of one shape, strides, dtype and device (``[rows, H, D]`` each,
    e.g. a pool's per-layer key buffers), addressed from the first by element offsets, so that
    one :func:`rope_align_layers` launch moves rows of every layer. The tensors themselves are
    kept alive by their owner (the pool)."""

    first: torch.Tensor
    offsets: torch.Tensor  # [L] int64 on the tensors' device: layer l starts this many elements on

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> LayerStack:
        first = tensors[0]
        for i, t in enumerate(tensors):
            _check(
                t.shape == first.shape and t.stride() == first.stride()
                and t.dtype == first.dtype and t.device == first.device,
                lambda i=i, t=t: f"layer {i}: {tuple(t.shape)} {t.stride()} {t.dtype} "
                f"{t.device} differs from layer 0's {tuple(first.shape)} {first.stride()} "
                f"{first.dtype} {first.device}",
            )  # fmt: skip
        size = first.element_size()
        gaps = [t.data_ptr() - first.data_ptr() for t in tensors]
        _check(all(g % size == 0 for g in gaps), "layers must be aligned to their element size")
        offsets = torch.tensor([g // size for g in gaps], dtype=torch.int64)
        return cls(first, offsets.to(first.device))

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def select(self, start: int) -> LayerStack:
        """Layers ``start ..`` only."""
        return LayerStack(self.first, self.offsets[start:])


def rope_align_layers(
    k_src: LayerStack,
    src_rows: torch.Tensor,
    k_dst: LayerStack,
    dst_rows: torch.Tensor,
    pos_off: torch.Tensor,
    pos_on: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool,
    rotary_dim: int | None = None,
    v_src: LayerStack | None = None,
    v_dst: LayerStack | None = None,
    src_heads: torch.Tensor | None = None,
    dst_heads: torch.Tensor | None = None,
    config: RopeAlignConfig = RopeAlignConfig(),
) -> None:
    """:func:`rope_align` of the same rows in every layer of the stacks (layer ``l`` of
    ``k_src`` to layer ``l`` of ``k_dst``, the same positions and heads), in one launch: what
    a per-layer loop of it would do, without a launch per layer."""
    stacks = [k_src, k_dst] + ([v_src, v_dst] if v_src is not None else [])
    _check(len({len(x) for x in stacks}) == 1,
           lambda: f"stacks of {[len(x) for x in stacks]} layers must match")  # fmt: skip
    _check((v_src is None) == (v_dst is None), "give both v_src and v_dst, or neither")
    if not len(k_src):
        return
    offsets = [x.offsets for x in stacks] + [k_src.offsets, k_dst.offsets] * (v_src is None)
    _launch(k_src.first, src_rows, k_dst.first, dst_rows, pos_off, pos_on, cos_sin_cache,
            is_neox, rotary_dim, None if v_src is None else v_src.first,
            None if v_dst is None else v_dst.first, src_heads, dst_heads, config,
            offsets)  # fmt: skip


def _launch(k_src, src_rows, k_dst, dst_rows, pos_off, pos_on, cos_sin_cache, is_neox,
            rotary_dim, v_src, v_dst, src_heads, dst_heads, config: RopeAlignConfig,
            layers: list[torch.Tensor] | None = None) -> None:  # fmt: skip
    """The checks and the launch of :func:`rope_align` (``layers``: the element offsets of
    each layer of k_src, k_dst, v_src, v_dst, for :func:`rope_align_layers`)."""
    n = src_rows.shape[0] if src_rows.dim() == 1 else -1
    _check((src_heads is None) == (dst_heads is None),
           "give both src_heads and dst_heads, or neither")  # fmt: skip
    head_map = src_heads is not None
    _check_rows("k_src", k_src)
    _check_rows("k_dst", k_dst, like=None if head_map else k_src)
    if head_map:
        _check(k_dst.dtype == k_src.dtype and k_dst.shape[2] == k_src.shape[2],
               lambda: f"k_dst {k_dst.dtype} {tuple(k_dst.shape)} must match k_src "
               f"{k_src.dtype} {tuple(k_src.shape)} in dtype and head_dim")  # fmt: skip
        for name, t in (("src_heads", src_heads), ("dst_heads", dst_heads)):
            _check(t.dim() == 1 and t.dtype == torch.int32 and t.shape == src_heads.shape,
                   lambda name=name, t=t: f"{name} must be [Hm] int32 like src_heads, got "
                   f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    _check(k_src.dtype in _KEY_DTYPES,
           lambda: f"keys must be float16 or bfloat16, got {k_src.dtype}")  # fmt: skip
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows), ("pos_off", pos_off),
                    ("pos_on", pos_on)):  # fmt: skip
        _check_index(name, t, n)
    _check(
        cos_sin_cache.dim() == 2 and cos_sin_cache.dtype == torch.float32,
        lambda: f"cos_sin_cache must be [max_pos, rotary_dim] float32, got "
        f"{tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype} (SGLang keeps it in fp32 on CUDA; "
        "see alignable_rope)",
    )
    _check(cos_sin_cache.stride(-1) == 1, "cos_sin_cache must have unit stride in its last dim")
    R = cos_sin_cache.shape[1]
    head_dim = k_src.shape[2]
    _check(rotary_dim is None or rotary_dim == R,
           lambda: f"rotary_dim {rotary_dim} != cos_sin_cache width {R}")  # fmt: skip
    _check(R % 2 == 0 and 0 < R <= head_dim,
           lambda: f"rotary_dim {R} must be even and in (0, {head_dim}]")  # fmt: skip
    _check((v_src is None) == (v_dst is None), "give both v_src and v_dst, or neither")
    if v_src is not None:
        _check_rows("v_src", v_src)
        _check_rows("v_dst", v_dst, like=None if head_map else v_src)
        _check(v_src.shape[0] == k_src.shape[0] and v_dst.shape[0] == k_dst.shape[0],
               "v_src/v_dst must have as many rows as k_src/k_dst")  # fmt: skip
        if head_map:
            _check(v_dst.dtype == v_src.dtype and v_dst.shape[2] == v_src.shape[2],
                   "v_dst must match v_src in dtype and head_dim")  # fmt: skip
    tensors = [k_src, k_dst, src_rows, dst_rows, pos_off, pos_on, cos_sin_cache]
    tensors += [v_src, v_dst] if v_src is not None else []
    tensors += [src_heads, dst_heads] if head_map else []
    tensors += layers or []
    devices = {t.device for t in tensors}
    _check(len(devices) == 1, lambda: f"tensors on several devices: {devices}")
    if n == 0 or (head_map and src_heads.shape[0] == 0):
        return

    num_heads = src_heads.shape[0] if head_map else k_src.shape[1]
    has_v = v_src is not None
    block_h = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(R // 2)
    row_elems = block_h * max(2 * block_half, triton.next_power_of_2(head_dim))
    block_n = config.tile_elems // row_elems
    block_n = max(1, min(config.max_block_n, triton.next_power_of_2(block_n + 1) // 2))
    num_layers = layers[0].shape[0] if layers is not None else 1
    loop = layers is not None and config.layer_loop
    grid = (triton.cdiv(n, block_n), 1 if loop else num_layers)
    v_s = v_src if has_v else k_src
    v_d = v_dst if has_v else k_dst
    rope_align_kernel[grid](
        k_src, k_dst, v_s, v_d,
        src_rows, dst_rows, pos_off, pos_on, cos_sin_cache,
        src_heads if head_map else src_rows, dst_heads if head_map else dst_rows,
        *(layers if layers is not None else [src_rows] * 4),
        n, num_layers, num_heads, num_heads if head_map else v_s.shape[1],
        k_src.stride(0), k_src.stride(1), k_dst.stride(0), k_dst.stride(1),
        v_s.stride(0), v_s.stride(1), v_d.stride(0), v_d.stride(1),
        cos_sin_cache.stride(0),
        HEAD_DIM=head_dim,
        ROT_HALF=R // 2,
        V_HEAD_DIM=v_s.shape[2],
        IS_NEOX=bool(is_neox),
        HAS_V=has_v,
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(head_dim - R) if head_dim > R else 0,
        BLOCK_VH=block_h if head_map else triton.next_power_of_2(v_s.shape[1]),
        BLOCK_VD=triton.next_power_of_2(v_s.shape[2]),
        BF16_BY_BITS=bool(triton.knobs.runtime.interpret) and k_src.dtype == torch.bfloat16,
        HEAD_MAP=head_map,
        LAYERED=layers is not None,
        LAYER_LOOP=loop,
        num_warps=config.num_warps,
    )  # fmt: skip
