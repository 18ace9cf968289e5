"""The profiling run: calibration prompts -> per-prompt scores -> per-head scores -> head map.

>>> runner = ReferenceRunner(hf_model)
>>> run = profile(runner, HFTextEncoder(tokenizer), ProfileConfig(model="m", out="m.json"))
>>> run.head_map.save("m.json")
"""

from __future__ import annotations

import hashlib
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from redknot.headmap import HeadMap
from redknot.headmap.provenance import tool_provenance
from redknot.headmap.ranking import map_from_scores
from redknot.profiler.calibration import (
    CALIBRATION_VERSION,
    NeedlePrompt,
    SegmentCase,
    TextEncoder,
    needle_prompt,
    segment_case,
)
from redknot.profiler.config import ProfileConfig, ProfileError
from redknot.profiler.scores import SCORES_VERSION, needle_scores, prefix_scores, standalone_kv
from redknot.profiler.workdir import ScoreCache
from redknot.reference import ReferenceRunner

TOOL = "redknot-profile"


@dataclass
class ProfileRun:
    """The map and what the run did: prompts scored now, prompts reused from the work dir."""

    head_map: HeadMap
    computed: int
    reused: int
    seconds: float


def calibration_set(
    config: ProfileConfig, encoder: TextEncoder
) -> tuple[list[NeedlePrompt], list[SegmentCase]]:
    """The run's prompts: ``calib_size`` needle prompts (lengths in turn, needle depths spread
    evenly over [0.05, 0.85]) and ``num_segments`` segment cases."""
    rng = random.Random(config.seed)
    n = config.calib_size
    needles = [
        needle_prompt(
            rng,
            encoder,
            config.calib_lengths[i % len(config.calib_lengths)],
            depth=0.05 + 0.8 * (i + 0.5) / n,
        )
        for i in range(n)
    ]
    segments = [
        segment_case(rng, encoder, config.segment_length, config.prefix_lengths)
        for _ in range(config.num_segments)
    ]
    return needles, segments


def _check_context(runner: ReferenceRunner, config: ProfileConfig) -> None:
    limit = getattr(runner.model.config, "max_position_embeddings", None)
    longest = max(max(config.calib_lengths), max(config.prefix_lengths) + config.segment_length)
    if limit is not None and longest > int(limit):
        raise ProfileError(
            f"the model's context is {limit} tokens but the calibration asks for {longest} "
            "(--calib-lengths, or --prefix-lengths + --segment-length): choose shorter lengths"
        )


def _prompts_digest(needles: list[NeedlePrompt], segments: list[SegmentCase]) -> str:
    h = hashlib.sha256()
    for p in needles:
        h.update(repr((p.ids, p.needle)).encode())
    for c in segments:
        h.update(repr((c.segment, c.prefixes)).encode())
    return h.hexdigest()[:16]


def _aggregate(
    needle: list[dict[str, Tensor]], prefix: list[dict[str, Tensor]], num_kv_heads: int
) -> dict[str, list[list[float]]]:
    """Query-head scores: mean over prompts, then max over each KV head's group.
    KV-head scores: mean over (segment, prefix) pairs."""
    out = {}
    for name in ("long_range_mass", "needle_mass", "local_output_error"):
        mean = torch.stack([r[name] for r in needle]).mean(dim=0)  # [L, Hq]
        out[name] = mean.view(mean.shape[0], num_kv_heads, -1).amax(dim=2).tolist()
    out["prefix_kv_deviation"] = (
        torch.stack([r["prefix_kv_deviation"] for r in prefix]).mean(dim=0).tolist()
    )
    return out


def profile(
    runner: ReferenceRunner,
    encoder: TextEncoder,
    config: ProfileConfig,
    *,
    model_name: str,
    model_source: str = "",
    progress: bool = True,
) -> ProfileRun:
    """Score every (layer, KV head) of ``runner``'s model and classify them (see module doc)."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    _check_context(runner, config)
    shape = runner.shape
    needles, segments = calibration_set(config, encoder)
    fingerprint = {
        **config.fingerprint(),
        "model": model_name,
        "model_source": model_source,
        "shape": shape.to_json(),
        "calibration_version": CALIBRATION_VERSION,
        "scores_version": SCORES_VERSION,
        "prompts": _prompts_digest(needles, segments),
    }
    work_root = config.work_dir or str(Path(config.out).with_suffix("")) + ".work"
    cache = ScoreCache(work_root, fingerprint)

    tasks: list[tuple[str, Callable[[], dict[str, Tensor]]]] = []
    for i, prompt in enumerate(needles):
        tasks.append(
            (
                f"needle-{i:04d}",
                lambda p=prompt: needle_scores(
                    runner, p, window=config.window, sink=config.sink, probe_last=config.probe_last
                ),
            )
        )
    alone: dict[int, object] = {}
    for i, case in enumerate(segments):
        for j, prefix in enumerate(case.prefixes):

            def run(i=i, case=case, prefix=prefix):
                if i not in alone:
                    alone.clear()  # keep one segment's standalone KV in memory at a time
                    alone[i] = standalone_kv(runner, case.segment)
                return prefix_scores(runner, case.segment, prefix, alone[i])

            tasks.append((f"segment-{i:04d}-prefix-{j}", run))

    results: dict[str, dict[str, Tensor]] = {}
    computed = reused = 0
    bar = tqdm(tasks, desc=f"profiling {model_name}", unit="prompt", disable=not progress)
    for name, fn in bar:
        stored = cache.get(name)
        if stored is None:
            stored = fn()
            cache.put(name, stored)
            computed += 1
        else:
            reused += 1
        results[name] = stored
    scores = _aggregate(
        [results[n] for n, _ in tasks if n.startswith("needle")],
        [results[n] for n, _ in tasks if n.startswith("segment")],
        shape.num_kv_heads,
    )
    dense_layers = (
        config.dense_layers if config.dense_layers is not None else round(shape.num_layers / 4)
    )
    seconds = time.perf_counter() - started
    provenance = {
        **tool_provenance(TOOL),
        "synthetic": False,
        "model_source": model_source,
        "config": config.to_json(),
        "calibration": {
            "version": CALIBRATION_VERSION,
            "description": (
                f"{len(needles)} needle prompts of {sorted(set(map(len, needles)))} tokens "
                "(template prose from redknot.profiler.words, one fact at depths spread over "
                "5-85%, question and answer start at the end); "
                f"{len(segments)} record documents of about {config.segment_length} tokens, each "
                f"placed after {len(config.prefix_lengths)} prefixes of {list(config.prefix_lengths)} "
                f"tokens; seed {config.seed}"
            ),
            "prompts_digest": fingerprint["prompts"],
        },
        "scores": {
            "long_range_mass": "mean over needle prompts and their last probe_last queries of the "
            "dense attention mass outside sink + window; max over the KV head's query heads",
            "needle_mass": "same queries, mass on the needle tokens; max over query heads",
            "local_output_error": "same queries, relative L2 error of the head's attention "
            "output when restricted to sink + window; max over query heads",
            "prefix_kv_deviation": "segment tokens after a prefix vs standalone (keys re-aligned "
            "by RoPE): mean relative L2 deviation of K and V, mean over segments and prefixes",
        },
        "dense_layers_source": (
            "given"
            if config.dense_layers is not None
            else "default: a quarter of the layers (RedKnot's 20 of 80), not tuned"
        ),
        "device": str(runner.model.device),
        "host": platform.platform(),
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
    }
    head_map = map_from_scores(
        shape,
        scores,
        global_fraction=config.global_fraction,
        weights=dict(config.weights),
        window=config.window,
        sink=config.sink,
        dense_layers=dense_layers,
        model_name=model_name,
        provenance=provenance,
    )
    return ProfileRun(head_map=head_map, computed=computed, reused=reused, seconds=seconds)
