"""Time to first token of a follow-up turn: a few new tokens after a long history that is already
in the prefix cache (the next message of a chat or agent session), flashinfer vs redknot.

Per history length ``H`` (``--histories``): the history alone is sent once (its TTFT is kept as
``history_ttft_s``; it fills the prefix cache), then ``--reps`` follow-ups of the history plus
``--new`` fresh tokens each, timed (``engine.generate(max_new_tokens=1)``), with SGLang's count
of cached prompt tokens as proof that the history was reused. Variants, each an ``sgl.Engine``
on the 8B shape with dummy weights: ``flashinfer``; ``redknot-g0.125`` (the synthetic 1/8 map).
Decode CUDA graphs for small batches only and no prefill CUDA graph, as in ``ttft.py``.

    python benchmarks/followup_ttft.py --out benchmarks/results/followup_ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

VARIANTS = {"flashinfer": None, "redknot-g0.125": 0.125}


def child(args) -> None:
    import sglang as sgl

    fraction = VARIANTS[args.child]
    extra = {
        "mem_fraction_static": args.mem_fraction_static,
        "disable_prefill_cuda_graph": True,
        "cuda_graph_max_bs_decode": 8,
        "attention_backend": "flashinfer" if fraction is None else "redknot",
    }
    if fraction is not None:
        extra["redknot_head_map"] = common.synthetic_map_file(args.model, fraction, "/tmp")
    histories = [int(h) for h in args.histories.split(",")]
    context = max(histories) + args.new * (args.reps + 2) + 64
    engine = sgl.Engine(**common.engine_kwargs(args.model, context, **extra))
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def timed(ids: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0.0,
                                                              "max_new_tokens": 1})  # fmt: skip
        return time.perf_counter() - t0, out["meta_info"].get("cached_tokens", -1)

    common.launch_server_warmup(engine)
    points = {}
    try:
        for H in histories:
            history = rand(H)
            history_s, _ = timed(history)
            times, cached = [], []
            for rep in range(args.reps + 1):  # the first follow-up is a warm-up
                t, c = timed(history + rand(args.new))
                if rep:
                    times.append(t)
                    cached.append(c)
            points[str(H)] = {
                "history": H, "new": args.new, "history_ttft_s": history_s,
                "ttft_s": statistics.median(times), "ttft_samples_s": times,
                "cached_tokens": cached,
            }  # fmt: skip
            print(args.child, H, points[str(H)]["ttft_s"], cached, flush=True)
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"points": points}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--histories", default="8192,32768,65536")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/followup_ttft.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    base = common.forward_args(args, "model", "histories", "new", "reps", "mem_fraction_static")
    results = {}
    for name in args.variants.split(","):
        results[name] = common.run_child(__file__, base + ["--child", name])
        print(name, json.dumps(results[name])[:400], flush=True)
    common.write_json(args.out, common.record(new_tokens=args.new, reps=args.reps,
                                              variants=results))  # fmt: skip


if __name__ == "__main__":
    main()
