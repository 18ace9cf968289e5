"""Greedy tokens of redknot under SGLang's default prefill CUDA graph against the same server
with ``--disable-prefill-cuda-graph``, on the GPU machine.

Both servers: the 8B shape (dummy weights), a synthetic 1/8 map, segment reuse with the layer
schedule (``--redknot-dense-layers 8``, ``--redknot-skipped cached``). Sent to each, in order:
a batch of plain prompts short enough for the prefill graph (100-1900 tokens), two segments
registered, two prompts that reuse both (one at a time), and a batch of a reusing and a plain
prompt. The graph server must replay the plain batches and run every batch that reuses segments
eagerly (redknot's gate on ``PrefillCudaGraphRunner.can_run_graph``), with the same tokens as the
eager server. Writes ``benchmarks/results/prefill_graph_check.json`` (or ``--out``).

    python scripts/prefill_graph_check.py --out $OUT/prefill_graph_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serving_common as common

VARIANTS = {"graph": False, "eager": True}  # name -> --disable-prefill-cuda-graph
PLAIN = (100, 700, 1500, 1900)
SEGMENT, QUESTION, NEW_TOKENS = 384, 64, 8
GRAPH_LABEL = re.compile(r"Prefill batch.*#new-seq: (\d+), #new-token: (\d+).*graph: (True|False)")


def child(args) -> None:
    import sglang as sgl

    extra = {
        "attention_backend": "redknot",
        "redknot_head_map": common.synthetic_map_file(args.model, 0.125, "/tmp"),
        "redknot_dense_layers": 8,
        "redknot_skipped": "cached",
        "redknot_segment_fraction": 0.25,
        "mem_fraction_static": 0.8,
        "cuda_graph_max_bs_decode": 8,
        "log_level": "info",  # the prefill batches' graph verdicts, the sparse-FFN lines
    }
    if VARIANTS[args.child]:
        extra["disable_prefill_cuda_graph"] = True
    engine = sgl.Engine(**common.engine_kwargs(args.model, 4096, **extra))
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}

    def tokens(outs) -> list[list[int]]:
        return [o["output_ids"] for o in (outs if isinstance(outs, list) else [outs])]

    out: dict[str, list[list[int]]] = {}
    try:
        out["plain"] = tokens(
            engine.generate(input_ids=[rand(n) for n in PLAIN], sampling_params=greedy)
        )
        docs = [rand(SEGMENT) for _ in range(2)]
        common.register_segments(engine, docs, "check")

        def reusing() -> tuple[list[int], dict]:
            ids, marks = common.reusing_prompt(rand(1), docs, rand(QUESTION), "check")
            return ids, dict(greedy, custom_params=marks)

        out["reuse"] = []
        for _ in range(2):
            ids, params = reusing()
            out["reuse"] += tokens(engine.generate(input_ids=ids, sampling_params=params))
        ids, params = reusing()
        out["mixed"] = tokens(
            engine.generate(input_ids=[ids, rand(600)], sampling_params=[params, greedy])
        )
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_graph_check.json"))
    ap.add_argument("--child", default=None, choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    runs = {}
    for name in VARIANTS:
        res = common.run_child(
            __file__, ["--child", name, "--model", args.model], log_grep="Prefill batch"
        )
        if "error" in res:
            print(name, "failed:", res["error"], res["log_tail"], flush=True)
            runs[name] = res
            continue
        lines = res.pop("log_lines")
        res["prefill_batches"] = [
            {"seqs": int(m[1]), "tokens": int(m[2]), "graph": m[3] == "True"}
            for m in map(GRAPH_LABEL.search, lines)
            if m
        ]
        runs[name] = res
        print(name, json.dumps(res["prefill_batches"]), flush=True)
    ok = all("error" not in r for r in runs.values())
    same = {}
    if ok:
        for part in ("plain", "reuse", "mixed"):
            g, e = runs["graph"][part], runs["eager"][part]
            same[part] = [a == b for a, b in zip(g, e)]
    figures = {
        "model": Path(args.model).name,
        "load_format": "dummy",
        "head_map": "synthetic 1/8 global",
        "dense_layers": 8,
        "skipped": "cached",
        "plain_lengths": PLAIN,
        "segment_tokens": SEGMENT,
        "runs": runs,
        "same_tokens": same,
        "all_same": ok and all(all(v) for v in same.values()),
    }
    common.write_json(args.out, common.record(**figures))
    print(json.dumps({"same_tokens": same, "all_same": figures["all_same"]}))
    sys.exit(0 if figures["all_same"] else 1)


if __name__ == "__main__":
    main()
