"""Per-(layer, head) scores of one calibration prompt, computed on the reference path.

| score                 | from            | per prompt shape | definition                              |
| --------------------- | --------------- | ---------------- | --------------------------------------- |
| ``long_range_mass``   | NeedlePrompt    | [L, Hq]          | mean over the last ``probe_last`` queries of the dense attention mass on keys outside sink + window |
| ``needle_mass``       | NeedlePrompt    | [L, Hq]          | mean over the same queries of the mass on the needle's tokens |
| ``local_output_error``| NeedlePrompt    | [L, Hq]          | mean over the same queries of ``|o - o_loc| / |o|``, ``o`` the dense attention output and ``o_loc`` the output restricted to sink + window |
| ``prefix_kv_deviation`` | SegmentCase   | [L, Hkv]         | for the segment's tokens placed after a prefix: mean over tokens of ``(|K_ctx - K_al| / |K_ctx| + |V_ctx - V_al| / |V_ctx|) / 2``, where ``K_al`` is the standalone key re-aligned to the online position |

Query-head scores become KV-head scores when aggregated (:func:`redknot.profiler.pipeline.profile`).
Bump ``SCORES_VERSION`` when a definition changes: cached per-prompt scores are then ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from redknot.headmap import HeadMap
from redknot.profiler.calibration import NeedlePrompt
from redknot.reference import ReferenceKV, ReferenceRunner
from redknot.reference.attention import visible

SCORES_VERSION = 1


def needle_scores(
    runner: ReferenceRunner, prompt: NeedlePrompt, *, window: int, sink: int, probe_last: int
) -> dict[str, Tensor]:
    """``long_range_mass``, ``needle_mass`` and ``local_output_error``, each ``[L, Hq]``
    float32, of a dense forward."""
    # Dense attention; window and sink only define the statistics' regions.
    dense = HeadMap.every_head_global(runner.shape, window=window, sink=sink)
    out = runner.forward(
        prompt.ids,
        head_map=dense,
        probe_last=probe_last,
        keep_probs=True,
        logits_rows="none",
        keep_kv=True,
    )
    assert out.kv is not None
    start, end = prompt.needle
    long_range, needle, error = [], [], []
    for layer, probe in enumerate(out.probes):
        assert probe is not None and probe.probs is not None
        long_range.append(probe.outside_mass)
        needle.append(probe.key_mass[:, start:end].sum(dim=1) / probe.rows.numel())
        error.append(
            local_output_error(
                probe.probs, out.kv.values[layer], probe.positions, window=window, sink=sink
            )
        )
    return {
        "long_range_mass": torch.stack(long_range).float().cpu(),
        "needle_mass": torch.stack(needle).float().cpu(),
        "local_output_error": torch.stack(error).float().cpu(),
    }


def local_output_error(
    probs: Tensor, values: Tensor, positions: Tensor, *, window: int, sink: int
) -> Tensor:
    """``[Hq]``: mean over rows of ``|o - o_loc| / |o|`` where ``o = probs @ V`` and ``o_loc``
    uses ``probs`` restricted to sink + window and renormalised.

    ``probs``: ``[Hq, P, Tk]`` dense attention of ``P`` rows at ``positions`` ``[P]``;
    ``values``: ``[Hkv, Tk, d]``."""
    group = probs.shape[0] // values.shape[0]
    v = values.float().repeat_interleave(group, dim=0)  # [Hq, Tk, d]
    keep = visible(
        positions, torch.arange(v.shape[1], device=v.device), local=True, window=window, sink=sink
    )
    local = probs * keep
    local = local / local.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    full_out, local_out = probs @ v, local @ v
    return relative_deviation(full_out, local_out)


def standalone_kv(runner: ReferenceRunner, segment: tuple[int, ...]) -> ReferenceKV:
    """The segment's KV computed alone, at positions ``0 .. S-1`` (as a segment cache holds it)."""
    out = runner.forward(segment, logits_rows="none", keep_kv=True)
    assert out.kv is not None
    return out.kv


def relative_deviation(actual: Tensor, approx: Tensor) -> Tensor:
    """``[H, T, d]`` pair -> ``[H]``: mean over tokens of ``|actual - approx| / |actual|``."""
    num = (actual.float() - approx.float()).norm(dim=-1)
    den = actual.float().norm(dim=-1).clamp_min(1e-12)
    return (num / den).mean(dim=-1)


def prefix_scores(
    runner: ReferenceRunner,
    segment: tuple[int, ...],
    prefix: tuple[int, ...],
    alone: ReferenceKV,
) -> dict[str, Tensor]:
    """``prefix_kv_deviation`` ``[L, Hkv]`` float32 of ``segment`` placed after ``prefix``;
    ``alone`` is :func:`standalone_kv` of the segment."""
    p, s = len(prefix), len(segment)
    out = runner.forward(tuple(prefix) + tuple(segment), logits_rows="none", keep_kv=True)
    assert out.kv is not None
    in_context = out.kv.rows(p, p + s)
    aligned = alone.realigned(runner.model.rope, 0, p)
    rows = []
    for layer in range(in_context.num_layers):
        dk = relative_deviation(in_context.keys[layer], aligned.keys[layer])
        dv = relative_deviation(in_context.values[layer], aligned.values[layer])
        rows.append((dk + dv) / 2)
    return {"prefix_kv_deviation": torch.stack(rows).float().cpu()}
