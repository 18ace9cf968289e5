"""Host time of ``redknot.segcache.reuse.start`` for one marked prompt, on the CPU.

``start`` is what the scheduler runs for a marked request when it gets its slot: the marks
decoded and their ids checked against the prompt, each looked up in the segment store and held,
the reuse gate's decision, and the report. It runs between SGLang's forward entry and the
prefill, so its time adds to the TTFT of a marked prompt whether reused or recomputed. Here a
CPU pool with a segment region (the real store, no model) holds ``--segments`` stored segments
of ``--length / --segments`` tokens; a prompt of one fresh token, those segments and a
``--question`` is started ``--reps`` times marked and as many unmarked, with the gate of
``--policy`` under the shipped record of ``--device`` (the 8B shape), and the median of each is
reported. A marked prompt is timed twice: with its layout's reuse time remembered by the gate
(``marked``: a server's repeated prompt shape) and predicted afresh (``marked_new_layout``).
With ``--measured`` the gate's correction by measured forward times is on, as under
``--redknot-reuse-gate auto`` on one GPU: its windows full of forwards of the prompt's size,
and before every prompt one more forward read back the way the server does once a batch's
answers are out (not timed; stand-in clock markers, no CUDA).

    python benchmarks/reuse_start_cost.py --out benchmarks/results/reuse_start_cost.json
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_common as common

CFG_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072,
}  # fmt: skip


def world(doc_tokens: int, segments: int):
    """A CPU pool whose segment region holds ``segments`` stored segments; (cache, docs)."""
    import torch

    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.headmap import ModelShape, synthetic_map
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.pool.layout import HeadLayout
    from redknot.pool.segment_region import plan_segments
    from redknot.segcache import registration
    from redknot.segcache.entry import segment_id
    from redknot.segcache.store import SegmentStore

    shape = ModelShape(
        "LlamaForCausalLM", num_layers=2, num_kv_heads=2, num_attention_heads=4, head_dim=8
    )
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.5, window=8, sink=2))
    budget = 4 * segments * doc_tokens * 2 * 2 * 2 * 8 * 4 + (1 << 20)
    plan = plan_segments([layout], torch.float32, budget, 0.5, "all", page_tokens=16)
    pool = RedknotKVPool(
        64, 1, torch.float32, layout, num_rings=4, num_snapshots=1, device="cpu", segment_plan=plan
    )
    cache = pool.cache = SimpleNamespace(segments=SegmentStore.for_pool(pool), pool=pool)
    rng = random.Random(0)
    docs = [[rng.randrange(100, 120000) for _ in range(doc_tokens)] for _ in range(segments)]
    for i, doc in enumerate(docs):
        mark = SegmentMark(0, len(doc), "bench", segment_id("bench", doc))
        params = encode_marks([mark], register=True, pin=True)
        req = SimpleNamespace(origin_input_ids=doc, rid=f"reg{i}", req_pool_idx=10 + i,
                              sampling_params=SimpleNamespace(custom_params=params))  # fmt: skip
        registration.start(cache, req)
        writes = registration.plan_writes(pool, [10 + i], [0], [len(doc)], "cpu")
        kv = torch.zeros(len(doc), shape.num_kv_heads, shape.head_dim)
        for layer in range(shape.num_layers):
            pool.segments.write(
                layer, writes.rows_gpu, kv[writes.tokens_gpu], kv[writes.tokens_gpu]
            )
    return cache, docs


class _Marker:
    """A stand-in for the gate's CUDA event: reached at once, ``at`` ms."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return True

    def elapsed_ms(self, end: _Marker) -> float:
        return end.at - self.at


def measured_forwards(gate, computed: int, rng: random.Random):
    """Turn ``gate``'s correction on with its windows full of recomputing and reusing forwards
    of ``computed`` tokens (0.9-1.1x the record); the callable returned times one more
    recomputing forward and reads it back as the server does after a batch's answers
    (``harvest(warm=True)`` where the timer has it)."""
    import inspect

    from redknot.costmodel.measured import WINDOW, ForwardTimer, MeasuredCorrection, TimedForward
    from redknot.costmodel.model import PromptWork

    now = [0.0]
    timer = gate.timer = ForwardTimer(MeasuredCorrection(), gate.predict, lambda: _Marker(now[0]))
    warm = "warm" in inspect.signature(timer.harvest).parameters
    plain = TimedForward("recompute", (PromptWork(computed),), computed)
    reused = TimedForward("reuse", (PromptWork(computed, 0, ((1, computed - 1),)),), computed)

    def forward(timed) -> None:
        begin = timer.start()
        now[0] += gate.predict(timed) * rng.uniform(0.9, 1.1)
        timer.finish(begin, timed)

    for timed in (plain, reused):
        for _ in range(WINDOW + 1):  # the first of a size is dropped
            forward(timed)
    timer.harvest()

    def between() -> None:
        forward(plain)
        timer.harvest(warm=True) if warm else timer.harvest()

    return between


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="segment tokens in the prompt")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--policy", default="cacheblend")
    ap.add_argument("--device", default="NVIDIA H200", help="whose shipped cost record")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument(
        "--measured",
        action="store_true",
        help="the gate's correction by measured forwards on (module docstring)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    # the per-request decision lines are written, as a server writes them, to nowhere
    logger = logging.getLogger("redknot")
    level, sink = logger.level, logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115
    logger.setLevel(logging.INFO)
    logger.addHandler(sink)
    try:
        return measure(args)
    finally:
        logger.removeHandler(sink)
        sink.stream.close()
        logger.setLevel(level)


def measure(args) -> int:
    from benchmarks.reuse_cost import variant_model
    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.costmodel.gate import ReuseGate
    from redknot.costmodel.model import ReuseCostModel
    from redknot.costmodel.record import record_for
    from redknot.segcache import reuse
    from redknot.segcache.entry import segment_id

    cache, docs = world(args.length // args.segments, args.segments)
    record, _ = record_for(args.device)
    costs, recovery, _, _ = variant_model(args.policy, CFG_8B, None)
    cache.pool.reuse_gate = ReuseGate(ReuseCostModel(costs, recovery, record))
    cache.pool.reuse_policy = args.policy
    rng = random.Random(1)
    between = measured_forwards(cache.pool.reuse_gate, 1 + args.length + args.question, rng) if (
        args.measured) else (lambda: None)  # fmt: skip

    def request(marked: bool):
        ids, marks = [rng.randrange(100, 120000)], []
        for doc in docs:
            marks.append(SegmentMark(len(ids), len(ids) + len(doc), "bench",
                                     segment_id("bench", doc)))  # fmt: skip
            ids += doc
        ids += [rng.randrange(100, 120000) for _ in range(args.question)]
        params = encode_marks(marks) if marked else None
        return SimpleNamespace(origin_input_ids=ids, rid="r", prefix_indices=[], req_pool_idx=2,
                               sampling_params=SimpleNamespace(custom_params=params))  # fmt: skip

    # "marked": a layout the gate has seen (its reuse time remembered, as for a server's repeated
    # prompt shapes); "marked_new_layout": one it has not (its reuse time predicted afresh)
    times: dict[str, list[float]] = {"marked": [], "marked_new_layout": [], "unmarked": []}
    decisions, hits = set(), set()
    gate = cache.pool.reuse_gate
    for rep in range(args.reps + 20):  # the first 20 of each warm up, not counted
        for kind, samples in times.items():
            req = request(kind != "unmarked")
            if kind == "marked_new_layout":
                gate._reuse_ms.cache_clear()
            between()
            t0 = time.perf_counter()
            reuse.start(cache, req)
            took = time.perf_counter() - t0
            reuse.finish(cache, req.req_pool_idx)
            if rep >= 20:
                samples.append(took)
            decision = getattr(req, "redknot_reuse", None)
            if decision is not None:
                decisions.add("reuse" if decision.reuse else "recompute")
            if kind != "unmarked":  # the answer's report: every segment found stored
                hits.add(req.customized_info[reuse.REPORT_KEY][0]["segments_hit"])
    figures = {
        "start_ms_p50": {k: round(1e3 * statistics.median(v), 4) for k, v in times.items()},
        "gate_decisions": sorted(decisions),
        "segments_hit": sorted(hits),
    }
    common.write_json(args.out, common.record(
        length=args.length, segments=args.segments, question=args.question, policy=args.policy,
        cost_record=args.device, reps=args.reps, measured=args.measured, **figures,
    ))  # fmt: skip
    print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
