"""Host steps per layer of segment reuse's layer schedule, counted on the CPU.

On a GPU the compacted deep layers of ``--redknot-dense-layers N --redknot-skipped cached`` are
host-bound (README, "With fewer host steps per deep layer"): their time follows the number of
PyTorch operations and kernel launches the attention backend issues per layer, not their size.
This script counts both, per layer, for one prompt that reuses a stored segment, through the
toy decoder stack of ``tests/attention/test_skipped_cached.py`` (the SegPaged runner, the
decoder-layer and MLP hooks, Triton kernels under the interpreter). Operations are counted with
a ``TorchDispatchMode`` around the backend's ``extend`` (views included, the interpreter's own
copies excluded); launches are calls of a Triton kernel. Counts, not times: they are the same on
any machine, which makes them a regression check for the host side.

    TRITON_INTERPRET=1 python benchmarks/host_steps.py --out benchmarks/results/host_steps.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRITON_INTERPRET", "1")

import serving_common as common


def count(classes: tuple[str, ...], dense_layers: int, thresh: float) -> list[dict]:
    """Per layer: PyTorch operations and Triton launches of the backend's ``extend``."""
    from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
    from triton.runtime import interpreter

    from redknot.segcache.reuse import SegmentUse
    from tests.attention import test_skipped_cached as toy

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    n = toy.NEW + toy.SEG + toy.QUESTION
    world, _, layers, tokens, entry, _ = toy.world_with_stored_segment(
        classes, 3, n, segment_fraction=0.5
    )
    runner = world.runner
    runner.dense_layers, runner.mass_thresh, runner.recent_n = dense_layers, thresh, toy.RECENT
    runner.skipped = "cached"
    world.pool.cache.segments.acquire(entry)
    world.pool.segment_reads[2] = [SegmentUse(toy.NEW, entry, prompt_len=n)]

    rows: list[dict] = []
    active: list[Ops] = []
    launch = interpreter.InterpretedFunction.run

    def counted_launch(self, *args, **kwargs):
        if not active:
            return launch(self, *args, **kwargs)
        rows[-1]["launches"] += 1
        with _pop_mode_temporarily():  # the interpreter's own tensor copies are not the backend's
            return launch(self, *args, **kwargs)

    extend = runner.extend

    def counted_extend(q, k, v, layer, fb, save):
        rows.append({"layer": layer.layer_id, "rows": q.shape[0], "launches": 0})
        mode = Ops()
        active.append(mode)
        try:
            with mode:
                out = extend(q, k, v, layer, fb, save)
        finally:
            active.pop()
        rows[-1]["ops"] = sum(mode.ops.values())
        rows[-1]["top_ops"] = dict(mode.ops.most_common(8))
        return out

    interpreter.InterpretedFunction.run = counted_launch
    runner.extend = counted_extend
    try:
        toy.served(world, layers, 2, tokens, hooked=True)
    finally:
        interpreter.InterpretedFunction.run = launch
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--classes", default="GLLLLLLL", help="one layer's head classes (8B: 1 of 8)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--mass-thresh", type=float, default=0.5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/host_steps.json"))
    args = ap.parse_args()
    rows = count((args.classes,) * args.layers, args.dense_layers, args.mass_thresh)
    compacted = [r for r in rows if r["layer"] > args.dense_layers]
    figures = {
        "classes": args.classes,
        "layers": args.layers,
        "dense_layers": args.dense_layers,
        "mass_thresh": args.mass_thresh,
        "per_layer": rows,
        "compacted_layer": (
            {
                "ops": max(r["ops"] for r in compacted),
                "launches": max(r["launches"] for r in compacted),
            }
            if compacted
            else None
        ),
    }
    common.write_json(args.out, common.record(**figures))
    for r in rows:
        print(
            f"layer {r['layer']}: {r['rows']:3d} rows, {r['ops']:4d} ops, {r['launches']} launches"
        )


if __name__ == "__main__":
    main()
