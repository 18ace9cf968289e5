"""Head maps from per-head scores: rank-normalise each score, combine, mark the top global.

A profiled map keeps its scores (``scores`` in the file, among them the ``combined`` ranking
it was thresholded on), so maps of other global fractions can be derived from it without
profiling again (:func:`reclassify`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from redknot.headmap.map import GLOBAL, LOCAL, HeadMap, HeadMapError, ModelShape

Grid = Sequence[Sequence[float]]
COMBINED = "combined"


def rank_normalize(grid: Grid) -> list[list[float]]:
    """Percentile rank of every entry among all entries of ``grid``, in [0, 1]; ties share
    their mean rank. A grid of one entry maps to 0.5."""
    flat = [(float(x), i, j) for i, row in enumerate(grid) for j, x in enumerate(row)]
    n = len(flat)
    out = [[0.0] * len(row) for row in grid]
    order = sorted(flat)
    k = 0
    while k < n:
        end = k
        while end + 1 < n and order[end + 1][0] == order[k][0]:
            end += 1
        rank = (k + end) / 2 / (n - 1) if n > 1 else 0.5
        for _, i, j in order[k : end + 1]:
            out[i][j] = rank
        k = end + 1
    return out


def combine_scores(scores: Mapping[str, Grid], weights: Mapping[str, float]) -> list[list[float]]:
    """Weighted mean of the rank-normalised scores named in ``weights``."""
    missing = sorted(set(weights) - set(scores))
    if missing:
        raise HeadMapError(
            f"ranking weights name unknown scores {missing}; known: {sorted(scores)}"
        )
    total = sum(weights.values())
    if total <= 0:
        raise HeadMapError(f"ranking weights must have a positive sum, got {dict(weights)}")
    names = [n for n, w in weights.items() if w > 0]
    ranks = {n: rank_normalize(scores[n]) for n in names}
    first = ranks[names[0]]
    return [
        [sum(weights[n] * ranks[n][i][j] for n in names) / total for j in range(len(row))]
        for i, row in enumerate(first)
    ]


def select_global(ranking: Grid, global_fraction: float) -> tuple[tuple[str, ...], dict]:
    """Class strings marking the ``round(global_fraction * heads)`` highest-ranked heads global
    (ties broken towards lower layer, then lower head), and the thresholds that resulted."""
    if not 0.0 <= global_fraction <= 1.0:
        raise HeadMapError(f"global_fraction must lie in [0, 1], got {global_fraction}")
    flat = [(-float(x), i, j) for i, row in enumerate(ranking) for j, x in enumerate(row)]
    count = round(global_fraction * len(flat))
    chosen = sorted(flat)[:count]
    rest = sorted(flat)[count:]
    picked = {(i, j) for _, i, j in chosen}
    classes = tuple(
        "".join(GLOBAL if (i, j) in picked else LOCAL for j in range(len(row)))
        for i, row in enumerate(ranking)
    )
    thresholds = {
        "global_fraction": global_fraction,
        "num_global": count,
        "num_heads": len(flat),
        "lowest_global_score": -chosen[-1][0] if chosen else None,
        "highest_local_score": -rest[0][0] if rest else None,
    }
    return classes, thresholds


def map_from_scores(
    model: ModelShape,
    scores: Mapping[str, Grid],
    *,
    global_fraction: float,
    weights: Mapping[str, float],
    window: int,
    sink: int,
    dense_layers: int,
    model_name: str = "",
    provenance: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
) -> HeadMap:
    """A head map whose global heads are the top ``global_fraction`` by the weighted
    rank-combination of ``scores`` (each an ``num_layers x num_kv_heads`` grid)."""
    combined = combine_scores(scores, weights)
    classes, thresholds = select_global(combined, global_fraction)
    prov = dict(provenance or {})
    prov["ranking"] = {
        "score": COMBINED,
        "weights": dict(weights),
        "normalisation": "percentile rank of each score over all heads, then weighted mean",
    }
    prov["thresholds"] = thresholds
    return HeadMap(
        model=model,
        classes=classes,
        window=window,
        sink=sink,
        dense_layers=dense_layers,
        model_name=model_name,
        scores={
            **{k: [list(map(float, r)) for r in v] for k, v in scores.items()},
            COMBINED: combined,
        },
        recovery=dict(recovery or {}),
        provenance=prov,
    )


def reclassify(head_map: HeadMap, global_fraction: float, *, score: str = COMBINED) -> HeadMap:
    """The same map thresholded at another global fraction on its stored ``score``."""
    if score not in head_map.scores:
        raise HeadMapError(
            f"the map has no {score!r} score to rank by (it has {sorted(head_map.scores)}); "
            "only profiled maps can be re-thresholded"
        )
    classes, thresholds = select_global(head_map.scores[score], global_fraction)
    prov = dict(head_map.provenance)
    prov["thresholds"] = {**thresholds, "derived_from_fraction": head_map.global_fraction}
    return dataclasses.replace(head_map, classes=classes, provenance=prov)
