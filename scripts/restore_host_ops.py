"""PyTorch ops one layer of a reusing prefill dispatches in the SegPaged runner, with adaptive
restore on and off (host work: deep layers of a long reusing prompt are host-bound, so each op
costs time). Counts every op that reaches the dispatcher (``TorchDispatchMode``), Triton
launches excluded, on the toy decoder stack of ``tests/attention/test_restore_server.py`` (CPU).

    TRITON_INTERPRET=1 python scripts/restore_host_ops.py --out benchmarks/results/restore_host_ops.json
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(restore: bool) -> dict:
    from redknot.segcache.reuse import SegmentUse
    from tests.attention import test_restore_server as t
    from tests.attention.test_skipped_cached import served

    w, _, layers, tokens, entry, _ = t.world_with_stored_segment(t.CLASSES, 3, t.N, restore=1)
    w.runner.recent_n = t.RECENT
    if restore:
        w.runner.restore_thresh, w.runner.restore_edge = 0.2, t.EDGE
    w.pool.cache.segments.acquire(entry)
    w.pool.segment_reads[2] = [SegmentUse(t.NEW, entry, prompt_len=t.N)]
    real = w.runner.extend
    per_layer = []
    first = collections.Counter()

    def counted(*args, **kwargs):
        with Count() as c:
            out = real(*args, **kwargs)
        per_layer.append(sum(c.ops.values()))
        if len(per_layer) == 1:
            first.update(c.ops)
        return out

    w.runner.extend = counted
    served(w, layers, 2, tokens, hooked=False)
    return {"ops_per_layer": per_layer, "ops_by_name_layer_0": dict(first)}


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fidelity_agreement import run_record

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"benchmark": "restore_host_ops", **run_record("../scripts/restore_host_ops.py",
              sys.argv[1:]), "device": "CPU (Triton interpreter: its own ops are counted alike "
              "in both)", "restore_off": count(False), "restore_on": count(True)}  # fmt: skip
    on, off = result["restore_on"]["ops_per_layer"], result["restore_off"]["ops_per_layer"]
    result["extra_ops_per_layer"] = [a - b for a, b in zip(on, off)]
    print(json.dumps({k: result[k] for k in ("extra_ops_per_layer",)}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
