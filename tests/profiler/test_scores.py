"""Profiler scores on a tiny random model against brute force from Hugging Face's own
attention weights and KV cache."""

from __future__ import annotations

import math
import random

import torch

from redknot.profiler.calibration import needle_prompt, segment_case
from redknot.profiler.scores import needle_scores, prefix_scores, standalone_kv
from redknot.reference import ReferenceRunner

from .conftest import ByteEncoder, tiny_llama

WINDOW, SINK, LAST = 64, 8, 12


def hf_run(model, ids):
    with torch.no_grad():
        out = model(torch.tensor(ids)[None], output_attentions=True, use_cache=True)
    attentions = [a[0].double() for a in out.attentions]  # [Hq, T, T]
    cache = out.past_key_values.layers
    return attentions, [c.keys[0].double() for c in cache], [c.values[0].double() for c in cache]


def test_needle_scores_match_brute_force():
    model = tiny_llama(layers=3)
    prompt = needle_prompt(random.Random(4), ByteEncoder(), 400, depth=0.4)
    got = needle_scores(ReferenceRunner(model), prompt, window=WINDOW, sink=SINK, probe_last=LAST)
    attentions, _, values = hf_run(model, prompt.ids)
    T = len(prompt)
    start, end = prompt.needle
    group = attentions[0].shape[0] // values[0].shape[0]
    for layer, att in enumerate(attentions):
        for h in range(att.shape[0]):
            outside = needle = error = 0.0
            v = values[layer][h // group]
            for p in range(T - LAST, T):
                row = att[h, p]
                far = [j for j in range(SINK, p + 1) if p - j >= WINDOW]
                near = [j for j in range(p + 1) if j < SINK or p - j < WINDOW]
                outside += float(row[far].sum())
                needle += float(row[start:end].sum())
                full = row[: p + 1] @ v[: p + 1]
                local = (row[near] / row[near].sum()) @ v[near]
                error += float((full - local).norm() / full.norm())
            assert math.isclose(got["long_range_mass"][layer, h], outside / LAST, abs_tol=2e-5)
            assert math.isclose(got["needle_mass"][layer, h], needle / LAST, abs_tol=2e-5)
            assert math.isclose(got["local_output_error"][layer, h], error / LAST, abs_tol=1e-4)
    assert float(got["long_range_mass"].max()) > 0.05  # the check is not vacuous


def _rotate(k: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE by per-frequency ``angle``, written out pair by pair."""
    half = k.shape[-1] // 2
    out = torch.empty_like(k)
    for i in range(half):
        c, s = torch.cos(angle[i]), torch.sin(angle[i])
        out[..., i] = k[..., i] * c - k[..., i + half] * s
        out[..., i + half] = k[..., i] * s + k[..., i + half] * c
    return out


def test_prefix_kv_deviation_matches_brute_force():
    model = tiny_llama(layers=3)
    runner = ReferenceRunner(model)
    case = segment_case(random.Random(5), ByteEncoder(), 150, (90,))
    prefix = case.prefixes[0]
    got = prefix_scores(runner, case.segment, prefix, standalone_kv(runner, case.segment))
    score = got["prefix_kv_deviation"]
    _, keys_alone, values_alone = hf_run(model, case.segment)
    _, keys_ctx, values_ctx = hf_run(model, prefix + case.segment)
    p, s = len(prefix), len(case.segment)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    for layer in range(3):
        aligned = _rotate(keys_alone[layer], p * inv_freq)
        for h in range(keys_ctx[layer].shape[0]):
            total = 0.0
            for t in range(s):
                kc, vc = keys_ctx[layer][h, p + t], values_ctx[layer][h, p + t]
                dk = (kc - aligned[h, t]).norm() / kc.norm()
                dv = (vc - values_alone[layer][h, t]).norm() / vc.norm()
                total += float(dk + dv) / 2
            assert math.isclose(score[layer, h], total / s, rel_tol=1e-4, abs_tol=1e-6)
    assert float(score[0].abs().max()) < 1e-5  # layer 0 sees only token and position
    assert float(score[1:].min()) > 1e-3  # deeper layers see the prefix
