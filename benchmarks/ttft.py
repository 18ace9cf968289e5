"""Time to first token of a prompt made of cached segments: flashinfer vs redknot, one GPU.

The prompt is one unique token (so no two measured prompts share a cached prefix), ``--segments``
documents of ``L / segments`` tokens each, and a ``--question``-token question; ``L`` runs over
``--lengths``. Variants (each an ``sgl.Engine`` on the 8B shape with dummy weights):

- ``flashinfer``: full prefill with the flashinfer backend;
- ``redknot-all-global``: every head global (the dense computation through redknot);
- ``redknot-g0.125``: the synthetic 1/8 map, plain prompt (head-class prefill, no reuse);
- ``redknot-g0.125-reuse``: the same map; the documents are registered first (standalone
  prefill, not timed) and the prompt marks them as segments, so local heads take the cached,
  re-aligned K/V (``redknot.segcache.reuse``).

TTFT is the wall time of ``engine.generate(max_new_tokens=1)`` for one prompt (median of
``--reps`` after one warm-up at each length). ``flops`` is the analytical prefill FLOPs of the
schedule each variant runs (projections and FFN of every token, attention over the keys each
head sees); for ``redknot-g0.125-reuse-sparse-ffn`` (``--redknot-dense-layers 8``: the FFN of
deeper layers runs only on the segment tokens the question attends to most) minus the FFNs the
server reports it skipped.

    python benchmarks/ttft.py --out benchmarks/results/ttft.json
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

SINK, WINDOW = 64, 256
DENSE_LAYERS = 8  # a quarter of Llama-3.1-8B's 32 layers, the paper's proportion (20 of 80)
SKIPPED = re.compile(r"redknot sparse FFN: (\d+) token-layer FFNs skipped")

VARIANTS = {  # name -> (global fraction or None for flashinfer, all-global, reuse, dense layers)
    "flashinfer": (None, False, False, None),
    "redknot-all-global": (1.0, True, False, None),
    "redknot-g0.125": (0.125, False, False, None),
    "redknot-g0.125-reuse": (0.125, False, True, None),
    "redknot-g0.125-reuse-sparse-ffn": (0.125, False, True, DENSE_LAYERS),
}


def prefill_flops(cfg: dict, length: int, global_fraction: float | None) -> float:
    """Analytical prefill FLOPs of one ``length``-token prompt (multiply-add = 2 FLOPs)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    proj = 2 * h * d * (2 * hq + 2 * hkv)  # q, k, v, o per token
    ffn = 2 * 3 * h * cfg["intermediate_size"]
    full_keys = length * (length + 1) / 2  # causal (query, key) pairs of one head
    ring = SINK + WINDOW
    local_keys = (
        sum(min(j + 1, ring) for j in range(min(length, ring))) + max(length - ring, 0) * ring
    )
    g = 1.0 if global_fraction is None else global_fraction
    attn_pairs = hq * (g * full_keys + (1 - g) * local_keys)
    return layers * (length * (proj + ffn) + 4 * d * attn_pairs)


def child(args) -> None:
    import sglang as sgl

    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.segcache.entry import segment_id

    fraction, all_global, reuse, dense_layers = VARIANTS[args.child]
    lengths = [int(x) for x in args.lengths.split(",")]
    extra = {
        "mem_fraction_static": args.mem_fraction_static,
        "disable_prefill_cuda_graph": True,
        "chunked_prefill_size": args.chunked_prefill_size,
    }
    if fraction is None:
        extra["attention_backend"] = "flashinfer"
    else:
        extra["attention_backend"] = "redknot"
        if dense_layers is not None:
            extra["redknot_dense_layers"] = dense_layers
            extra["log_level"] = "info"  # the sparse-FFN log lines count what was skipped
        if all_global:
            extra["redknot_all_global"] = True
        else:
            extra["redknot_head_map"] = common.synthetic_map_file(args.model, fraction, "/tmp")
    context = max(lengths) + args.question + 64
    engine = sgl.Engine(**common.engine_kwargs(args.model, context, **extra))
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    one = {"temperature": 0.0, "max_new_tokens": 1}
    out = {}
    try:
        for length in lengths:
            docs = [rand(length // args.segments) for _ in range(args.segments)]
            if reuse:
                for doc in docs:
                    mark = SegmentMark(0, len(doc), "bench", segment_id("bench", doc))
                    params = encode_marks([mark], register=True, pin=False)
                    engine.generate(
                        input_ids=doc,
                        sampling_params={"max_new_tokens": 0, "custom_params": params},
                    )
            times = []
            for rep in range(args.reps + 1):
                ids, marks = [rand(1)[0]], []
                for doc in docs:
                    marks.append(SegmentMark(len(ids), len(ids) + len(doc), "bench",
                                             segment_id("bench", doc)))  # fmt: skip
                    ids += doc
                ids += rand(args.question)
                sampling = dict(one)
                if reuse:
                    sampling["custom_params"] = encode_marks(marks)
                t0 = time.perf_counter()
                engine.generate(input_ids=ids, sampling_params=sampling)
                if rep:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            stats = {}
            if reuse:
                stats = engine.get_server_info()["internal_states"][0].get("redknot_segments", {})
            out[str(length)] = {
                "prompt_tokens": len(ids),
                "ttft_s": statistics.median(times),
                "ttft_samples_s": times,
                "segment_store": {k: stats.get(k) for k in ("hits", "misses", "hit_tokens")},
            }
            print(args.child, length, out[str(length)]["ttft_s"], flush=True)
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"lengths": out}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=-1,
        help="SGLang's prefill chunk (-1: one chunk per prompt; the sparse FFN acts on the chunk "
        "that ends the prompt, so chunking limits it to that chunk)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/ttft.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    cfg = json.loads(Path(args.model, "config.json").read_text())
    base = common.forward_args(
        args,
        "model",
        "lengths",
        "segments",
        "question",
        "reps",
        "mem_fraction_static",
        "chunked_prefill_size",
    )
    results = {}
    for name in args.variants.split(","):
        results[name] = common.run_child(
            __file__, base + ["--child", name], log_grep="redknot sparse FFN"
        )
        lines = results[name].pop("log_lines", [])
        # per measured prompt (warm-up included), in order: token-layer FFNs skipped
        results[name]["ffn_skipped_per_prompt"] = [
            int(m.group(1)) for m in map(SKIPPED.search, lines) if m
        ]
        print(name, json.dumps(results[name])[:400], flush=True)
    summary = {}
    ref = results.get("flashinfer", {}).get("lengths", {})
    for name, res in results.items():
        fraction = VARIANTS[name][0]
        skipped = res.get("ffn_skipped_per_prompt", [])
        per_length = args.reps + 1
        for i, (length, row) in enumerate(res.get("lengths", {}).items()):
            n = row["prompt_tokens"]
            flops = prefill_flops(cfg, n, fraction)
            mine = skipped[i * per_length : (i + 1) * per_length][1:]  # the measured prompts
            if mine:
                ffn = 2 * 3 * cfg["hidden_size"] * cfg["intermediate_size"]
                flops -= statistics.median(mine) * ffn
            entry = summary.setdefault(name, {})[length] = {
                "ttft_s": row["ttft_s"],
                "flops": flops,
            }
            if mine:
                layers = cfg["num_hidden_layers"]
                entry["ffn_token_layers_skipped"] = statistics.median(mine)
                entry["ffn_fraction_run"] = 1 - statistics.median(mine) / (n * layers)
            if length in ref:
                entry["speedup_vs_flashinfer"] = ref[length]["ttft_s"] / row["ttft_s"]
                entry["flop_ratio_vs_flashinfer"] = prefill_flops(cfg, n, None) / flops
                entry["fraction_of_flop_ratio"] = (
                    entry["speedup_vs_flashinfer"] / entry["flop_ratio_vs_flashinfer"]
                )
    common.write_json(args.out, common.record(
        model=args.model, load_format="dummy", segments=args.segments, question=args.question,
        reps=args.reps, chunked_prefill_size=args.chunked_prefill_size, sink=SINK,
        window=WINDOW, mem_fraction_static=args.mem_fraction_static,
        dense_layers_of_sparse_variant=DENSE_LAYERS,
        note="reuse: cached, re-aligned local-head K/V for segment tokens, every FFN run; "
        "reuse-sparse-ffn: also FFN only on important segment tokens above the dense layers "
        "(dummy weights give nearly uniform attention, so importance selects about mass_thresh "
        "of the candidates); flops of that variant subtract the FFNs it skipped",
        variants=results, summary=summary,
    ))  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
