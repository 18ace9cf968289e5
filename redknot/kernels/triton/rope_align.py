"""Fused copy + delta-RoPE: move cached key rows to new rows, rotated from their offline to their
online positions (``K(p_on) = R(p_on) R(p_off)^-1 K(p_off)``), values copied alongside.

One program moves ``BLOCK_N`` rows, every head of each row. The rotation of a row is computed once
per frequency from SGLang's ``cos_sin_cache`` (``[max_pos, R]`` fp32: cos of the ``R/2``
frequencies, then their sin) by the angle-difference identities

    cos(a - b) = (cos a cos b + sin a sin b) / (r_a r_b)
    sin(a - b) = (sin a cos b - cos a sin b) / (r_a r_b),   r = sqrt(cos^2 + sin^2),

where dividing by the radii removes a magnitude the cache carries (YaRN's mscale), so that the
delta is a pure rotation. Rows whose two positions are equal are copied bit for bit.

With ``LAYERED`` the grid's second axis is the layer: layer ``l`` reads and writes the tensors
that start ``K_src_layers[l]`` (etc.) elements after ``K_src`` (etc.), one launch for several
layers' tensors of the same shape and strides (``redknot.kernels.rope_align.LayerStack``). With
``LAYER_LOOP`` as well, the grid has one layer and each program moves its rows in every one of
the ``num_layers`` layers in turn: the rows' indices, positions and rotation are then read and
computed once, not once a layer (the table rows of a 32K prompt are 34 MB, read again by every
layer otherwise).

With ``HEAD_MAP`` the program moves head ``Src_heads[i]`` of a source row to head
``Dst_heads[i]`` of its destination row, for ``i < num_heads`` (keys and values alike); without
it, head ``i`` to head ``i``.

Pairs rotated together (frequency ``j`` of ``R/2``): NeoX style ``(j, j + R/2)``, GPT-J style
``(2j, 2j + 1)``; dims ``[R, D)`` are copied.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dtype``. ``BF16_BY_BITS``: by integer arithmetic
    on the bits (for ``TRITON_INTERPRET=1``, whose fp32 -> bf16 cast truncates)."""
    if BF16_BY_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit(do_not_specialize=["num_rows", "num_layers"])  # one kernel for all row/layer counts
def rope_align_kernel(
    K_src,  # [rows_src, H, D] fp16/bf16, stride(-1) == 1
    K_dst,  # [rows_dst, H, D] same dtype, stride(-1) == 1
    V_src,  # [rows_src, Hv, Dv] any dtype, stride(-1) == 1 (unused unless HAS_V)
    V_dst,  # [rows_dst, Hv, Dv] same dtype as V_src
    Src_rows,  # [N] int32/int64
    Dst_rows,  # [N] int32/int64
    Pos_off,  # [N] int32/int64, 0 <= pos < max_pos
    Pos_on,  # [N] int32/int64, 0 <= pos < max_pos
    Cos_sin,  # [max_pos, 2 * ROT_HALF] fp32, stride(-1) == 1
    Src_heads,  # [num_heads] int32 (read only with HEAD_MAP)
    Dst_heads,  # [num_heads] int32 (read only with HEAD_MAP)
    K_src_layers,  # [layers] int64 element offsets from K_src (read only with LAYERED)
    K_dst_layers,  # from K_dst
    V_src_layers,  # from V_src
    V_dst_layers,  # from V_dst
    num_rows,
    num_layers,  # read only with LAYER_LOOP
    num_heads,
    num_v_heads,
    stride_ks_row,
    stride_ks_head,
    stride_kd_row,
    stride_kd_head,
    stride_vs_row,
    stride_vs_head,
    stride_vd_row,
    stride_vd_head,
    stride_cache,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_VH: tl.constexpr,
    BLOCK_VD: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
    HEAD_MAP: tl.constexpr,
    LAYERED: tl.constexpr,
    LAYER_LOOP: tl.constexpr,
):
    pid = tl.program_id(0)
    if LAYERED and not LAYER_LOOP:
        layer = tl.program_id(1)
        K_src += tl.load(K_src_layers + layer)
        K_dst += tl.load(K_dst_layers + layer)
        V_src += tl.load(V_src_layers + layer)
        V_dst += tl.load(V_dst_layers + layer)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_rows
    src = tl.load(Src_rows + offs_n, mask=mask_n, other=0).to(tl.int64)
    dst = tl.load(Dst_rows + offs_n, mask=mask_n, other=0).to(tl.int64)
    p_off = tl.load(Pos_off + offs_n, mask=mask_n, other=0).to(tl.int64)
    p_on = tl.load(Pos_on + offs_n, mask=mask_n, other=0).to(tl.int64)

    # ---- delta rotation per (row, frequency): [BLOCK_N, BLOCK_HALF] fp32 ----
    offs_j = tl.arange(0, BLOCK_HALF)
    mask_j = offs_j < ROT_HALF
    mask_nj = mask_n[:, None] & mask_j[None, :]
    cache_on = Cos_sin + p_on[:, None] * stride_cache + offs_j[None, :]
    cache_off = Cos_sin + p_off[:, None] * stride_cache + offs_j[None, :]
    c_on = tl.load(cache_on, mask=mask_nj, other=1.0)
    s_on = tl.load(cache_on + ROT_HALF, mask=mask_nj, other=0.0)
    c_off = tl.load(cache_off, mask=mask_nj, other=1.0)
    s_off = tl.load(cache_off + ROT_HALF, mask=mask_nj, other=0.0)
    radii = tl.sqrt_rn((c_on * c_on + s_on * s_on) * (c_off * c_off + s_off * s_off))
    cos_d = tl.div_rn(c_on * c_off + s_on * s_off, radii)
    sin_d = tl.div_rn(s_on * c_off - c_on * s_off, radii)
    cos_d = cos_d[:, None, :]  # [BLOCK_N, 1, BLOCK_HALF]
    sin_d = sin_d[:, None, :]
    same = (p_on == p_off)[:, None, None]  # [BLOCK_N, 1, 1]: copy bit for bit

    # ---- where each row's heads are read and written (element offsets within a layer) ----
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    mask_nh = mask_n[:, None, None] & mask_h[None, :, None]
    if HEAD_MAP:
        h_src = tl.load(Src_heads + offs_h, mask=mask_h, other=0).to(tl.int64)
        h_dst = tl.load(Dst_heads + offs_h, mask=mask_h, other=0).to(tl.int64)
    else:
        h_src = offs_h
        h_dst = offs_h
    k_src = src[:, None, None] * stride_ks_row + h_src[None, :, None] * stride_ks_head
    k_dst = dst[:, None, None] * stride_kd_row + h_dst[None, :, None] * stride_kd_head
    if IS_NEOX:
        dim_1 = offs_j
        dim_2 = offs_j + ROT_HALF
    else:
        dim_1 = 2 * offs_j
        dim_2 = 2 * offs_j + 1
    mask_rot = mask_nh & mask_j[None, None, :]
    if BLOCK_PASS > 0:
        offs_p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)
        mask_pass = mask_nh & (offs_p < HEAD_DIM)[None, None, :]
    else:  # no pass-through dims: not read
        offs_p = dim_1
        mask_pass = mask_rot
    if HAS_V:
        offs_vh = tl.arange(0, BLOCK_VH)
        offs_vd = tl.arange(0, BLOCK_VD)
        mask_vh = offs_vh < num_v_heads
        mask_v = mask_n[:, None, None] & mask_vh[None, :, None]
        mask_v = mask_v & (offs_vd < V_HEAD_DIM)[None, None, :]
        if HEAD_MAP:  # the same heads as the keys (num_v_heads == num_heads)
            vh_src = tl.load(Src_heads + offs_vh, mask=mask_vh, other=0).to(tl.int64)
            vh_dst = tl.load(Dst_heads + offs_vh, mask=mask_vh, other=0).to(tl.int64)
        else:
            vh_src = offs_vh
            vh_dst = offs_vh
        v_src = src[:, None, None] * stride_vs_row + vh_src[None, :, None] * stride_vs_head
        v_src += offs_vd[None, None, :]
        v_dst = dst[:, None, None] * stride_vd_row + vh_dst[None, :, None] * stride_vd_head
        v_dst += offs_vd[None, None, :]
    else:  # no values: not read
        v_src, v_dst, mask_v = k_src, k_dst, mask_rot

    if LAYER_LOOP:
        for layer in range(num_layers):
            _move_rows(
                K_src + tl.load(K_src_layers + layer) + k_src,
                K_dst + tl.load(K_dst_layers + layer) + k_dst,
                V_src + tl.load(V_src_layers + layer) + v_src,
                V_dst + tl.load(V_dst_layers + layer) + v_dst,
                dim_1, dim_2, offs_p, mask_rot, mask_pass, mask_v, cos_d, sin_d, same, HAS_V,
                BLOCK_PASS, BF16_BY_BITS,
            )  # fmt: skip
    else:
        _move_rows(
            K_src + k_src, K_dst + k_dst, V_src + v_src, V_dst + v_dst, dim_1, dim_2, offs_p,
            mask_rot, mask_pass, mask_v, cos_d, sin_d, same, HAS_V, BLOCK_PASS, BF16_BY_BITS,
        )  # fmt: skip


@triton.jit
def _move_rows(k_src, k_dst, v_src, v_dst, dim_1, dim_2, offs_p, mask_rot, mask_pass, mask_v,
               cos_d, sin_d, same, HAS_V: tl.constexpr, BLOCK_PASS: tl.constexpr,
               BF16_BY_BITS: tl.constexpr):  # fmt: skip
    """One layer's rows of a program: the keys' rotated pairs and pass-through dims, and the
    values (``k_src`` etc.: pointers to each row's heads in the layer's tensors)."""
    x1 = tl.load(k_src + dim_1[None, None, :], mask=mask_rot, other=0.0)
    x2 = tl.load(k_src + dim_2[None, None, :], mask=mask_rot, other=0.0)
    if BLOCK_PASS > 0:
        x_pass = tl.load(k_src + offs_p[None, None, :], mask=mask_pass, other=0.0)
    if HAS_V:
        v = tl.load(v_src, mask=mask_v)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = tl.where(same, x1, round_to(x1f * cos_d - x2f * sin_d, x1.dtype, BF16_BY_BITS))
    o2 = tl.where(same, x2, round_to(x2f * cos_d + x1f * sin_d, x2.dtype, BF16_BY_BITS))
    tl.store(k_dst + dim_1[None, None, :], o1, mask=mask_rot)
    tl.store(k_dst + dim_2[None, None, :], o2, mask=mask_rot)
    if BLOCK_PASS > 0:
        tl.store(k_dst + offs_p[None, None, :], x_pass, mask=mask_pass)
    if HAS_V:
        tl.store(v_dst, v, mask=mask_v)
