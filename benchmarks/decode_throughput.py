"""Decode throughput when 64 sessions of 32K tokens are offered at once: flashinfer vs redknot.

Each variant serves the 8B shape (dummy weights, same ``--mem-fraction-static``); all sessions
are submitted together and each generates ``--new-tokens`` tokens. Reported per variant:

- ``peak_running``: the most sessions the scheduler decoded in one batch (from its log);
- ``decode_tokens_per_s``: SGLang's logged generation throughput while the most sessions
  decode (median of those log lines), the steady-state decode rate;
- ``end_to_end_tokens_per_s``: generated tokens over the wall time from submission to the last
  token, prefill included.

The flashinfer backend cannot hold 64 such sessions, so it decodes them in waves.

    python benchmarks/decode_throughput.py --out benchmarks/results/decode_throughput.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

VARIANTS = {"flashinfer": None, "redknot-g0.125": 0.125}
RUNNING = re.compile(r"#running-req:\s*(\d+)")
GEN = re.compile(r"gen throughput \(token/s\):\s*([0-9.]+)")


def child(args) -> None:
    import sglang as sgl

    fraction = VARIANTS[args.child]
    extra = {
        "mem_fraction_static": args.mem_fraction_static,
        "disable_prefill_cuda_graph": True,
        "cuda_graph_max_bs_decode": args.sessions,
        "log_level": "info",
        "decode_log_interval": 10,
    }
    if fraction is None:
        extra["attention_backend"] = "flashinfer"
    else:
        extra["attention_backend"] = "redknot"
        extra["redknot_head_map"] = common.synthetic_map_file(args.model, fraction, "/tmp")
        extra["max_running_requests"] = args.slots
    engine = sgl.Engine(
        **common.engine_kwargs(args.model, args.prompt_len + args.new_tokens + 64, **extra)
    )
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
        for _ in range(args.sessions)
    ]
    sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    try:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sampling)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outs)
    print(
        "RESULT "
        + json.dumps(
            {
                "wall_seconds": wall,
                "generated_tokens": tokens,
                "end_to_end_tokens_per_s": tokens / wall,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--slots", type=int, default=80, help="redknot request slots")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/decode_throughput.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    base = common.forward_args(
        args, "model", "sessions", "prompt_len", "new_tokens", "mem_fraction_static", "slots"
    )
    results = {}
    for name in args.variants.split(","):
        res = common.run_child(__file__, base + ["--child", name], log_grep="gen throughput")
        lines = res.pop("log_lines", [])
        samples = [
            (int(RUNNING.search(x).group(1)), float(GEN.search(x).group(1)))
            for x in lines
            if RUNNING.search(x) and GEN.search(x)
        ]
        if samples:
            peak = max(n for n, _ in samples)
            res["peak_running"] = peak
            res["decode_tokens_per_s"] = statistics.median(g for n, g in samples if n == peak)
            res["decode_log_samples"] = samples
        results[name] = res
        print(name, {k: v for k, v in res.items() if k != "decode_log_samples"}, flush=True)
    ratios = {}
    ref = results.get("flashinfer", {})
    for name, res in results.items():
        if name != "flashinfer" and "decode_tokens_per_s" in res and "decode_tokens_per_s" in ref:
            ratios[name] = {
                "decode_speedup": res["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                "end_to_end_speedup": res["end_to_end_tokens_per_s"]
                / ref["end_to_end_tokens_per_s"],
            }
    common.write_json(args.out, common.record(
        model=args.model, load_format="dummy", sessions=args.sessions, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, mem_fraction_static=args.mem_fraction_static,
        redknot_slots=args.slots, variants=results, ratios=ratios,
    ))  # fmt: skip
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
