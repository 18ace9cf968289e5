"""RoPE alignment kernel against its fp32 reference and against SGLang's own RoPE.

Tolerances (u = unit roundoff of the key dtype: 2^-8 for bf16, 2^-11 for fp16):

- kernel vs fp32 reference: one ulp of the key dtype plus 16 fp32 units (2^-24) of the rotated
  pair's norm. Both evaluate the same fp32 expressions and round once; only the fp32 evaluation
  order may differ (FMA contraction on GPUs; the interpreter is bit-exact), which moves the fp32
  value by a few units of the pair's norm: enough to flip a rounding by one ulp, or, for an
  element much smaller than its pair (cancellation in ``x1 cos - x2 sin``), to move it by that
  absolute amount.
- aligned vs direct (key rotated by SGLang at ``p_off``, stored, aligned to ``p_on``; against the
  key rotated by SGLang at ``p_on``, stored): per rotated pair, ``|aligned - direct| <= 3u |direct|
  + 1e-6 |direct|``. Three roundings to the key dtype separate them (the stored key at ``p_off``,
  the aligned key, the direct key), each at most ``u`` of the pair's norm; the rotation between
  them preserves norms, so the first is not amplified; ``1e-6`` covers fp32 arithmetic. Dims past
  ``rotary_dim`` are never rotated and must match bit for bit.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from redknot.kernels.rope_align import (
    LayerStack,
    RopeAlignConfig,
    alignable_rope,
    rope_align,
    rope_align_layers,
)
from redknot.kernels.rope_reference import (
    alignment_tolerance,
    rope_align_reference,
    rotary_pairs,
    sglang_rope,
    sglang_rope_keys,
)

MAX_POS = 4096
NUM_HEADS = 3
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
VARIANTS = {  # name: (base, rope_scaling, max_position given to get_rope)
    "plain": (10000, None, MAX_POS),
    "llama3": (500000, LLAMA3, MAX_POS),
    "yarn": (10000, YARN, MAX_POS // 4),  # SGLang's table: original max x factor rows
}
SHAPES = [(64, 1.0), (128, 1.0), (128, 0.5)]  # head_dim, partial_rotary_factor


def make_rope(variant: str, head_dim: int, partial: float, is_neox: bool):
    base, scaling, max_position = VARIANTS[variant]
    return sglang_rope(head_dim, head_dim, max_position, base, is_neox, scaling, partial)


def positions(n: int, gen: torch.Generator, num_same: int = 4) -> tuple[torch.Tensor, ...]:
    """Random offline/online positions: the first rows keep their position (delta 0), one row
    moves from the first to the last position and one back, the rest at random (both signs)."""
    p_off = torch.randint(0, MAX_POS, (n,), generator=gen)
    p_on = torch.randint(0, MAX_POS, (n,), generator=gen)
    p_on[:num_same] = p_off[:num_same]
    p_off[num_same], p_on[num_same] = 0, MAX_POS - 1
    p_off[num_same + 1], p_on[num_same + 1] = MAX_POS - 1, 0
    delta = p_on - p_off
    assert (delta > 0).any() and (delta < 0).any() and (delta == 0).sum() == num_same
    return p_off, p_on


def assert_matches_reference(actual, expected, rotary_dim: int, is_neox: bool) -> None:
    """Keys [..., H, D]: one ulp of each element, plus 16 fp32 units of its pair's norm."""
    bound = alignment_tolerance(expected, rotary_dim, is_neox)
    diff = (actual.float() - expected.float()).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"
    assert torch.equal(actual[..., rotary_dim:], expected[..., rotary_dim:])


def pair_errors(a: torch.Tensor, d: torch.Tensor, rotary_dim: int, is_neox: bool):
    """Per rotated pair: |a - d| and |d| (fp32 [N, H, R/2])."""
    d1, d2 = rotary_pairs(rotary_dim, is_neox)
    a, d = a.float(), d.float()
    err = torch.hypot(a[..., d1] - d[..., d1], a[..., d2] - d[..., d2])
    return err, torch.hypot(d[..., d1], d[..., d2])


def check_aligned_vs_direct(aligned, direct, cached, delta, rotary_dim, is_neox) -> None:
    u = torch.finfo(direct.dtype).eps / 2
    err, norm = pair_errors(aligned, direct, rotary_dim, is_neox)
    bound = (3 * u + 1e-6) * norm + torch.finfo(torch.float32).tiny
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()} (u={u})"
    assert torch.equal(aligned[..., rotary_dim:], direct[..., rotary_dim:])
    # The bound discriminates: every moved key, left unaligned, violates it.
    unaligned, _ = pair_errors(cached, direct, rotary_dim, is_neox)
    moved = delta != 0
    assert ((unaligned > bound).flatten(1).any(1) == moved).all()


def scenario(rope, dtype, gen, n=24, rows_src=37, rows_dst=41):
    """Raw keys rotated by SGLang at p_off and stored at random rows of a source tensor; a
    destination tensor of other random keys; random destination rows."""
    head_dim = rope.head_size
    raw = torch.randn(n, NUM_HEADS, head_dim, generator=gen).to(dtype)
    p_off, p_on = positions(n, gen)
    cached = sglang_rope_keys(rope, raw, p_off).to(dtype)
    direct = sglang_rope_keys(rope, raw, p_on).to(dtype)
    k_src = torch.randn(rows_src, NUM_HEADS, head_dim, generator=gen).to(dtype)
    src_rows = torch.randperm(rows_src, generator=gen)[:n]
    k_src[src_rows] = cached
    k_dst = torch.randn(rows_dst, NUM_HEADS, head_dim, generator=gen).to(dtype)
    dst_rows = torch.randperm(rows_dst, generator=gen)[:n].to(torch.int32)
    return raw, p_off, p_on, cached, direct, k_src, src_rows, k_dst, dst_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,partial", SHAPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_align_matches_reference_and_sglang(is_neox, variant, head_dim, partial, dtype):
    gen = torch.Generator().manual_seed(
        zlib.crc32(f"{is_neox}{variant}{head_dim}{partial}".encode())
    )
    rope = make_rope(variant, head_dim, partial, is_neox)
    spec = alignable_rope(rope)
    assert spec.rotary_dim == int(head_dim * partial) and spec.is_neox == is_neox
    _, p_off, p_on, cached, direct, k_src, src_rows, k_dst, dst_rows = scenario(rope, dtype, gen)
    k_before = k_dst.clone()
    expected, _ = rope_align_reference(
        k_src, src_rows, k_dst, dst_rows, p_off, p_on, spec.cos_sin_cache, is_neox=is_neox
    )
    rope_align(k_src, src_rows, k_dst, dst_rows, p_off, p_on, spec.cos_sin_cache,
               is_neox=is_neox, rotary_dim=spec.rotary_dim)  # fmt: skip

    untouched = torch.ones(k_dst.shape[0], dtype=torch.bool)
    untouched[dst_rows.long()] = False
    assert torch.equal(k_dst[untouched], k_before[untouched])
    assert_matches_reference(k_dst, expected, spec.rotary_dim, is_neox)
    aligned = k_dst[dst_rows.long()]
    same = p_on == p_off
    assert torch.equal(aligned[same].view(torch.int16), cached[same].view(torch.int16))
    check_aligned_vs_direct(aligned, direct, cached, p_on - p_off, spec.rotary_dim, is_neox)


DEEPSEEK_YARN = {"rope_type": "deepseek_yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                 "original_max_position_embeddings": 1024}  # fmt: skip
OTHER_VARIANTS = {  # (is_neox, head_dim, partial, base, rope_scaling, max_position)
    "linear": (True, 64, 1.0, 10000, {"rope_type": "linear", "factor": 2.0}, MAX_POS // 2),
    "dynamic": (False, 64, 1.0, 10000, {"rope_type": "dynamic", "factor": 2.0}, MAX_POS // 2),
    "dynamic_alpha": (True, 64, 1.0, 10000, {"rope_type": "dynamic", "alpha": 2.0}, MAX_POS),
    "deepseek_yarn": (False, 64, 1.0, 10000, DEEPSEEK_YARN, 1024),
    "gemma4_proportional": (True, 128, 0.5, 10000, {"rope_type": "proportional"}, MAX_POS),
}


@pytest.mark.parametrize("name", list(OTHER_VARIANTS))
def test_other_supported_variants_match_sglang(name):
    is_neox, head_dim, partial, base, scaling, max_position = OTHER_VARIANTS[name]
    rope = sglang_rope(head_dim, head_dim, max_position, base, is_neox, scaling, partial)
    spec = alignable_rope(rope)
    assert spec.cos_sin_cache.shape[0] >= MAX_POS
    gen = torch.Generator().manual_seed(7)
    _, p_off, p_on, cached, direct, k_src, src_rows, k_dst, dst_rows = scenario(
        rope, torch.bfloat16, gen
    )
    rope_align(k_src, src_rows, k_dst, dst_rows, p_off, p_on, spec.cos_sin_cache,
               is_neox=spec.is_neox)  # fmt: skip
    aligned = k_dst[dst_rows.long()]
    check_aligned_vs_direct(aligned, direct, cached, p_on - p_off, spec.rotary_dim, is_neox)


def test_same_tensor_disjoint_rows_head_slice_and_values():
    """One pool for source and destination (disjoint rows), keys as a head slice of a wider
    pool (non-contiguous), values of another head count and width copied in the same launch."""
    gen = torch.Generator().manual_seed(3)
    rope = make_rope("llama3", 128, 0.5, True)
    spec = alignable_rope(rope)
    rows, n = 64, 20
    pool_k = torch.randn(rows, NUM_HEADS + 2, 128, generator=gen).bfloat16()
    k = pool_k[:, 1 : 1 + NUM_HEADS]
    v = torch.randn(rows, 2, 96, generator=gen).bfloat16()
    perm = torch.randperm(rows, generator=gen)
    src_rows, dst_rows = perm[:n], perm[n : 2 * n]
    p_off, p_on = positions(n, gen)
    pool_before, v_before = pool_k.clone(), v.clone()
    expected_k, expected_v = rope_align_reference(
        k, src_rows, k, dst_rows, p_off, p_on, spec.cos_sin_cache, is_neox=True, v_src=v, v_dst=v
    )
    rope_align(k, src_rows, k, dst_rows, p_off, p_on, spec.cos_sin_cache, is_neox=True,
               v_src=v, v_dst=v)  # fmt: skip

    assert_matches_reference(k, expected_k, spec.rotary_dim, True)
    assert torch.equal(v, expected_v)
    assert torch.equal(v[dst_rows], v_before[src_rows])
    for h in (0, NUM_HEADS + 1):  # heads outside the slice
        assert torch.equal(pool_k[:, h], pool_before[:, h])
    assert torch.equal(k[src_rows], pool_before[:, 1 : 1 + NUM_HEADS][src_rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_maps_move_listed_heads_only(dtype):
    """A segment region of 3 stored heads into a layer's K/V of 4 heads: heads (2, 0) of the
    region go to heads (1, 3), keys rotated and values copied; every other head and row of the
    destination, and the whole source, are untouched."""
    gen = torch.Generator().manual_seed(9)
    rope = make_rope("llama3", 128, 1.0, True)
    spec = alignable_rope(rope)
    n = 24
    region_k = torch.randn(40, 3, 128, generator=gen).to(dtype)
    region_v = torch.randn(40, 3, 128, generator=gen).to(dtype)
    k = torch.randn(n + 5, 4, 128, generator=gen).to(dtype)
    v = torch.randn(n + 5, 4, 128, generator=gen).to(dtype)
    src_rows = torch.randperm(40, generator=gen)[:n]
    dst_rows = torch.randperm(n + 5, generator=gen)[:n]
    p_off, p_on = positions(n, gen)
    src_heads = torch.tensor([2, 0], dtype=torch.int32)
    dst_heads = torch.tensor([1, 3], dtype=torch.int32)
    before = (region_k.clone(), region_v.clone(), k.clone(), v.clone())
    args = (region_k, src_rows, k, dst_rows, p_off, p_on, spec.cos_sin_cache)
    expected_k, expected_v = rope_align_reference(
        *args, is_neox=True, v_src=region_v, v_dst=v, src_heads=src_heads, dst_heads=dst_heads
    )
    rope_align(*args, is_neox=True, v_src=region_v, v_dst=v, src_heads=src_heads,
               dst_heads=dst_heads)  # fmt: skip

    assert_matches_reference(k, expected_k, spec.rotary_dim, True)
    assert torch.equal(v, expected_v)
    for h in (0, 2):  # heads no map names
        assert torch.equal(k[:, h], before[2][:, h]) and torch.equal(v[:, h], before[3][:, h])
    untouched = torch.ones(n + 5, dtype=torch.bool)
    untouched[dst_rows] = False
    assert torch.equal(k[untouched], before[2][untouched])
    assert torch.equal(v[dst_rows][:, [1, 3]], region_v[src_rows][:, [2, 0]])
    assert torch.equal(region_k, before[0]) and torch.equal(region_v, before[1])
    # the mapped reference is the unmapped one on the heads taken apart
    plain_k, _ = rope_align_reference(
        before[0][:, [2, 0]], src_rows, before[2][:, [1, 3]], dst_rows, p_off, p_on,
        spec.cos_sin_cache, is_neox=True,
    )  # fmt: skip
    assert torch.equal(expected_k[:, [1, 3]], plain_k)


def test_in_place_rerotation_and_back():
    """Rows re-rotated in place (src_rows == dst_rows) equal the reference; moving them back to
    their offline positions restores them within the same three-rounding bound."""
    gen = torch.Generator().manual_seed(5)
    rope = make_rope("yarn", 64, 1.0, False)
    spec = alignable_rope(rope)
    raw = torch.randn(16, NUM_HEADS, 64, generator=gen)
    p_off, p_on = positions(16, gen)
    k = sglang_rope_keys(rope, raw, p_off).half()
    original = k.clone()
    rows = torch.arange(16)
    expected, _ = rope_align_reference(k, rows, k, rows, p_off, p_on, spec.cos_sin_cache,
                                       is_neox=False)  # fmt: skip
    rope_align(k, rows, k, rows, p_off, p_on, spec.cos_sin_cache, is_neox=False)
    assert_matches_reference(k, expected, 64, False)
    rope_align(k, rows, k, rows, p_on, p_off, spec.cos_sin_cache, is_neox=False)
    check_aligned_vs_direct(k, original, expected, p_on - p_off, 64, False)


def test_empty_batch_is_a_no_op():
    spec = alignable_rope(make_rope("plain", 64, 1.0, True))
    k = torch.randn(4, NUM_HEADS, 64).bfloat16()
    before = k.clone()
    empty = torch.empty(0, dtype=torch.int64)
    rope_align(k, empty, k, empty, empty, empty, spec.cos_sin_cache, is_neox=True)
    assert torch.equal(k, before)


@pytest.mark.parametrize("layer_loop", [False, True])
@pytest.mark.parametrize("head_map", [False, True])
def test_one_launch_over_layers_equals_a_launch_per_layer(head_map, layer_loop):
    """``rope_align_layers`` over separately allocated layers (a region's and a pool's, as the
    server keeps them) writes, in one launch, what ``rope_align`` writes layer by layer: keys,
    values, and nothing else; over ``select(2)`` only layers 2 and 3 change. The same with a
    program per rows and layer and with each program looping over the layers."""
    config = RopeAlignConfig(layer_loop=layer_loop)
    gen = torch.Generator().manual_seed(3)
    spec = alignable_rope(make_rope("llama3", 64, 1.0, True))
    n, layers = 20, 4

    def layer_tensors(rows):
        return [torch.randn(rows, NUM_HEADS, 64, generator=gen).bfloat16() for _ in range(layers)]

    region_k, region_v, pool_k, pool_v = (layer_tensors(r) for r in (30, 30, 50, 50))
    src_rows = torch.randperm(30, generator=gen)[:n]
    dst_rows = torch.randperm(50, generator=gen)[:n].to(torch.int32)
    p_off, p_on = positions(n, gen)
    heads = {}
    if head_map:
        heads = {"src_heads": torch.tensor([2, 0], dtype=torch.int32),
                 "dst_heads": torch.tensor([0, 1], dtype=torch.int32)}  # fmt: skip
    expect_k, expect_v = [t.clone() for t in pool_k], [t.clone() for t in pool_v]
    for lid in range(layers):
        rope_align(region_k[lid], src_rows, expect_k[lid], dst_rows, p_off, p_on,
                   spec.cos_sin_cache, is_neox=True, v_src=region_v[lid], v_dst=expect_v[lid],
                   **heads)  # fmt: skip
    before_k = [t.clone() for t in pool_k]
    stacks = [LayerStack.of(t) for t in (region_k, pool_k, region_v, pool_v)]
    rope_align_layers(stacks[0], src_rows, stacks[1], dst_rows, p_off, p_on, spec.cos_sin_cache,
                      is_neox=True, v_src=stacks[2], v_dst=stacks[3], config=config,
                      **heads)  # fmt: skip
    for lid in range(layers):
        assert torch.equal(pool_k[lid], expect_k[lid]) and torch.equal(pool_v[lid], expect_v[lid])
        assert not torch.equal(pool_k[lid], before_k[lid])
    fresh_k = [t.clone() for t in before_k]
    rope_align_layers(stacks[0].select(2), src_rows, LayerStack.of(fresh_k).select(2), dst_rows,
                      p_off, p_on, spec.cos_sin_cache, is_neox=True, config=config,
                      **heads)  # fmt: skip
    assert all(torch.equal(fresh_k[i], before_k[i]) for i in (0, 1))
    assert all(torch.equal(fresh_k[i], expect_k[i]) for i in (2, 3))


def test_a_layer_stack_refuses_layers_unlike_the_first():
    k = [torch.zeros(8, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    with pytest.raises(ValueError, match="layer 2: .* differs from layer 0's"):
        LayerStack.of(k[:2] + [torch.zeros(8, 2, 64, dtype=torch.float16)])
    with pytest.raises(ValueError, match="layer 1: "):
        LayerStack.of([k[0], torch.zeros(9, 2, 64, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="stacks of"):
        idx = torch.arange(2)
        rope_align_layers(LayerStack.of(k), idx, LayerStack.of(k[:2]), idx, idx, idx,
                          torch.zeros(16, 64), is_neox=True)  # fmt: skip


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
            "original_max_position_embeddings": 1024}  # fmt: skip
REFUSED = {  # rope_scaling, words of the reason given
    "mrope": ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "3-D"),
    "longrope": (LONGROPE, "switches tables"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_unsupported_variants(name):
    scaling, reason = REFUSED[name]
    rope = sglang_rope(128, 128, MAX_POS, 10000, True, scaling)
    with pytest.raises(NotImplementedError, match=reason):
        alignable_rope(rope)


def _bad_calls():
    k = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    idx = torch.arange(4)
    cache = torch.zeros(16, 64)
    ok = {
        "k_src": k,
        "src_rows": idx,
        "k_dst": k.clone(),
        "dst_rows": idx + 4,
        "pos_off": idx,
        "pos_on": idx,
        "cos_sin_cache": cache,
        "is_neox": True,
    }
    yield "float16 or bfloat16", {**ok, "k_src": k.float(), "k_dst": k.float()}
    yield "k_dst dtype", {**ok, "k_dst": k.half()}
    yield "heads/dims", {**ok, "k_dst": torch.zeros(8, 2, 128, dtype=torch.bfloat16)}
    yield "cos_sin_cache must be .* float32", {**ok, "cos_sin_cache": cache.bfloat16()}
    yield "rotary_dim", {**ok, "rotary_dim": 32}
    yield "rotary_dim", {**ok, "cos_sin_cache": torch.zeros(16, 128)}
    yield "int32 or int64", {**ok, "pos_on": idx.float()}
    yield r"must be \[4\]", {**ok, "dst_rows": torch.arange(3)}
    yield "unit stride", {**ok, "k_src": k.transpose(0, 2).contiguous().transpose(0, 2)}
    yield "both v_src and v_dst", {**ok, "v_src": k}
    one = torch.tensor([1], dtype=torch.int32)
    yield "both src_heads and dst_heads", {**ok, "src_heads": one}
    yield "dst_heads must be", {**ok, "src_heads": one, "dst_heads": one.long()}


@pytest.mark.parametrize("match,kwargs", list(_bad_calls()))
def test_rejects_bad_arguments(match, kwargs):
    with pytest.raises(ValueError, match=match):
        rope_align(**kwargs)


@pytest.mark.gpu
def test_llama31_8b_shape_on_gpu():
    """Llama-3.1-8B: 8 KV heads, D=128, llama3 scaling, 131072 positions; 32K rows moved from a
    snapshot store into a pool, half forward by 90000 positions, half back to the start."""
    dev = "cuda"
    scaling = {**LLAMA3, "original_max_position_embeddings": 8192}
    rope = sglang_rope(128, 128, 131072, 500000, True, scaling)
    spec = alignable_rope(rope)
    cache = spec.cos_sin_cache.to(dev)
    gen = torch.Generator().manual_seed(11)
    n, heads = 32768, 8
    raw = torch.randn(n, heads, 128, generator=gen).bfloat16()
    seg = torch.arange(n // 2)
    p_off = torch.cat([seg, seg + 100000])
    p_on = torch.cat([seg + 90000, seg])
    cached = sglang_rope_keys(rope, raw, p_off).bfloat16()
    direct = sglang_rope_keys(rope, raw, p_on).bfloat16()
    store_rows = torch.randperm(n + 1000, generator=gen)[:n]
    pool_rows = torch.randperm(2 * n, generator=gen)[:n]
    store_k = torch.zeros(n + 1000, heads, 128, dtype=torch.bfloat16)
    store_k[store_rows] = cached
    store_v = torch.randn(n + 1000, heads, 128, generator=gen).bfloat16()
    store_k, store_v = store_k.to(dev), store_v.to(dev)
    pool_k = torch.zeros(2 * n, heads, 128, dtype=torch.bfloat16, device=dev)
    pool_v = torch.zeros_like(pool_k)
    args = [store_rows.to(dev), pool_k, pool_rows.to(dev), p_off.to(dev), p_on.to(dev), cache]
    expected_k, expected_v = rope_align_reference(
        store_k, *args, is_neox=True, v_src=store_v, v_dst=pool_v
    )
    rope_align(store_k, *args, is_neox=True, v_src=store_v, v_dst=pool_v)
    assert_matches_reference(pool_k, expected_k, 128, True)
    assert torch.equal(pool_v, expected_v)
    aligned = pool_k[pool_rows.to(dev)].cpu()
    check_aligned_vs_direct(aligned, direct, cached, p_on - p_off, 128, True)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_loop", [False, True])
def test_one_launch_over_32_layers_on_gpu(layer_loop):
    """The 8B shape's 32 layers (8 KV heads, D 128, bf16, llama3 RoPE), a region's and a pool's
    layers allocated one by one as the server does: one launch equals a launch per layer (a
    program per rows and layer, or each looping over the layers)."""
    dev = "cuda"
    spec = alignable_rope(sglang_rope(128, 128, 131072, 500000, True,
                                      {**LLAMA3, "original_max_position_embeddings": 8192}))  # fmt: skip
    cache = spec.cos_sin_cache.to(dev)
    gen = torch.Generator(device=dev).manual_seed(4)
    n, layers = 4096, 32

    def layer_tensors(rows):
        return [torch.randn(rows, 8, 128, device=dev, generator=gen).bfloat16()
                for _ in range(layers)]  # fmt: skip

    region_k, region_v, pool_k, pool_v = (layer_tensors(r) for r in (8192, 8192, 20000, 20000))
    src_rows = torch.randperm(8192, device=dev, generator=gen)[:n]
    dst_rows = torch.randperm(20000, device=dev, generator=gen)[:n].to(torch.int32)
    p_off = torch.randint(0, 8192, (n,), device=dev, generator=gen)
    p_on = p_off + torch.randint(0, 100000, (n,), device=dev, generator=gen)
    expect_k, expect_v = [t.clone() for t in pool_k], [t.clone() for t in pool_v]
    for lid in range(layers):
        rope_align(region_k[lid], src_rows, expect_k[lid], dst_rows, p_off, p_on, cache,
                   is_neox=True, v_src=region_v[lid], v_dst=expect_v[lid])  # fmt: skip
    stacks = [LayerStack.of(t) for t in (region_k, pool_k, region_v, pool_v)]
    rope_align_layers(stacks[0], src_rows, stacks[1], dst_rows, p_off, p_on, cache,
                      is_neox=True, v_src=stacks[2], v_dst=stacks[3],
                      config=RopeAlignConfig(layer_loop=layer_loop))  # fmt: skip
    for lid in range(layers):
        assert torch.equal(pool_k[lid], expect_k[lid]) and torch.equal(pool_v[lid], expect_v[lid])
