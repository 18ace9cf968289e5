"""Synthetic head maps for model shapes without real weights (``--load-format dummy``).

They place a requested fraction of global heads evenly over the layers so that memory and
speed can be measured at a known global fraction. They say nothing about quality and are
labelled ``"synthetic": true`` in their provenance.
"""

from __future__ import annotations

import random

from redknot.headmap.map import GLOBAL, LOCAL, HeadMap, ModelShape


def synthetic_map(
    model: ModelShape,
    global_fraction: float,
    *,
    window: int = 256,
    sink: int = 64,
    dense_layers: int | None = None,
    seed: int = 0,
    model_name: str = "",
) -> HeadMap:
    """A map with ``round(global_fraction * layers * kv_heads)`` global heads.

    Every layer gets ``floor`` or ``ceil`` of the per-layer share (layers with the extra head
    are spread evenly); which head of a layer is global is drawn from ``seed``.
    """
    if not 0.0 <= global_fraction <= 1.0:
        raise ValueError(f"global_fraction must lie in [0, 1], got {global_fraction}")
    layers, heads = model.num_layers, model.num_kv_heads
    total = round(global_fraction * layers * heads)
    base, extra = divmod(total, layers)
    rng = random.Random(seed)
    classes = []
    for layer in range(layers):
        # Bresenham spread: layer gets one extra head when the running share crosses an integer.
        n = base + ((layer + 1) * extra // layers - layer * extra // layers)
        chosen = set(rng.sample(range(heads), n))
        classes.append("".join(GLOBAL if h in chosen else LOCAL for h in range(heads)))
    return HeadMap(
        model=model,
        classes=tuple(classes),
        window=window,
        sink=sink,
        dense_layers=layers if dense_layers is None else dense_layers,
        model_name=model_name,
        provenance={
            "tool": "redknot.headmap.synthetic",
            "synthetic": True,
            "global_fraction": global_fraction,
            "seed": seed,
            "note": "placement is arbitrary; use only for memory and speed measurements",
        },
    )
