"""Adaptive restore in a served SGLang engine, on the GPU machine: its exact limit and a served
setting.

Variants (8B shape, dummy weights; the redknot ones with a synthetic 1/8 map and segments on):

| variant       | server                                                           |
| ------------- | ---------------------------------------------------------------- |
| ``dense``     | ``--attention-backend flashinfer``; the prompts without marks     |
| ``restore-all`` | restore threshold 0 and a restore column for every KV head: every local head is promoted in every layer, so a reusing prompt is computed as without reuse |
| ``reuse``     | the same reuse with restore off (local heads take the cached K/V) |
| ``restore``   | the layer schedule (dense layers 8, skipped cached) with restore at threshold 0.1, one head per layer |

Sent to each, in order: two 384-token segments registered, three prompts that reuse both (one at
a time: a token, the two documents, a 64-token question), then a batch of a reusing and a plain
prompt; 8 greedy tokens each. ``restore-all`` must give the tokens of ``dense`` (prefill and
decode of every head global) with output-token logprobs close to them; ``reuse`` shows how far
a variant that differs lies (greedy tokens of dummy weights may not tell). Writes
``benchmarks/results/restore_check.json`` (or ``--out``) with each variant's tokens, the
promotions its log reports per extend, and the agreement with ``dense``.

    python scripts/restore_check.py --out $OUT/restore_check.json
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

SEGMENT, QUESTION, NEW_TOKENS = 384, 64, 8
VARIANTS = {
    "dense": {"attention_backend": "flashinfer"},
    "restore-all": {"redknot_restore_thresh": 0.0, "redknot_restore_heads": 8},
    "reuse": {},
    "restore": {"redknot_restore_thresh": 0.1, "redknot_restore_heads": 1,
                "redknot_dense_layers": 8, "redknot_skipped": "cached"},
}  # fmt: skip
RESTORE_LOG = re.compile(r"redknot restore: (\d+) local heads promoted .*in (\d+) request")


def child(args) -> None:
    import sglang as sgl

    dense = args.child == "dense"
    extra = dict(VARIANTS[args.child], mem_fraction_static=0.8, cuda_graph_max_bs_decode=8,
                 log_level="info")  # fmt: skip
    if not dense:
        extra.update(
            attention_backend="redknot", redknot_segment_fraction=0.25,
            redknot_head_map=common.synthetic_map_file(args.model, 0.125, "/tmp"),
        )  # fmt: skip
    engine = sgl.Engine(**common.engine_kwargs(args.model, 4096, **extra))
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    docs = [rand(SEGMENT) for _ in range(2)]

    def reusing() -> tuple[list[int], dict]:
        ids, marks = common.reusing_prompt(rand(1), docs, rand(QUESTION), "check")
        return ids, greedy if dense else dict(greedy, custom_params=marks)

    def tokens(outs) -> list[list[int]]:
        outs = outs if isinstance(outs, list) else [outs]
        logprobs.extend([[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs])
        return [o["output_ids"] for o in outs]

    logprobs: list[list[float]] = []  # each generation's output-token logprobs, in order

    out: dict[str, list[list[int]]] = {"reuse": []}
    try:
        if not dense:
            common.register_segments(engine, docs, "check")
        for _ in range(3):
            ids, params = reusing()
            out["reuse"] += tokens(
                engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            )
        ids, params = reusing()
        out["mixed"] = tokens(
            engine.generate(input_ids=[ids, rand(600)], sampling_params=[params, greedy],
                            return_logprob=True)
        )  # fmt: skip
        out["logprobs"] = logprobs
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/restore_check.json"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", default=None, choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    runs = {}
    for name in args.variants.split(","):
        res = common.run_child(
            __file__, ["--child", name, "--model", args.model],
            log_grep=("redknot restore:", "startup check passed", "adaptive restore"),
        )  # fmt: skip
        if "error" not in res:
            lines = res.pop("log_lines")
            res["promoted_per_extend"] = [
                [int(m[1]), int(m[2])] for m in map(RESTORE_LOG.search, lines) if m
            ]
            res["log"] = [x[-300:] for x in lines if "redknot restore:" not in x]
        runs[name] = res
        print(name, json.dumps(res)[:1500], flush=True)
        write(args, runs)  # after every variant: a call cut short keeps what finished
    sys.exit(0 if write(args, runs) else 1)


def write(args, runs: dict) -> bool:
    """Write the results so far; True when every variant ran and the exact limit holds."""
    ok = all("error" not in r for r in runs.values())
    same = {}
    if ok and "dense" in runs:
        for name in runs:
            if name != "dense":
                same[name] = {part: [a == b for a, b in zip(runs[name][part], runs["dense"][part])]
                              for part in ("reuse", "mixed")}  # fmt: skip
    # greedy tokens on dummy weights may not tell the variants apart: the output tokens'
    # logprobs, as far from dense's as the variant is (max |difference| over every token)
    logprob_gap = {}
    if ok and "dense" in runs:
        for name in runs:
            if name != "dense":
                pairs = zip(runs[name]["logprobs"], runs["dense"]["logprobs"])
                logprob_gap[name] = max(abs(a - b) for x, y in pairs for a, b in zip(x, y))
    limit = same.get("restore-all")
    figures = {
        "model": Path(args.model).name, "load_format": "dummy",
        "head_map": "synthetic 1/8 global", "segment_tokens": SEGMENT, "question": QUESTION,
        "new_tokens": NEW_TOKENS, "variants": VARIANTS, "runs": runs, "same_as_dense": same,
        "max_logprob_gap_to_dense": logprob_gap,
        "exact_limit_holds": bool(limit) and all(all(v) for v in limit.values()),
    }  # fmt: skip
    common.write_json(args.out, common.record(**figures))
    print(json.dumps({"same_as_dense": same, "max_logprob_gap_to_dense": logprob_gap,
                      "exact_limit_holds": figures["exact_limit_holds"]}))  # fmt: skip
    return ok and figures["exact_limit_holds"]


if __name__ == "__main__":
    main()
