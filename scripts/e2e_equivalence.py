"""Greedy outputs of the redknot backend against the flashinfer backend, served by SGLang.

Runs each server variant in its own process (an ``sgl.Engine``), sends the same prompts
(random token ids, 1K-16K tokens, all submitted at once so they batch), then a second round
whose prompts extend prefixes of the first (prefix-cache hits), and compares greedy tokens with
the flashinfer variant. Writes ``benchmarks/results/e2e_equivalence.json`` (or ``--out``).

    python scripts/e2e_equivalence.py --model .device/models/llama-3.1-8b \
        --variants flashinfer,redknot,redknot-triton,cacheblend --out $OUT/e2e_equivalence.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> extra Engine keywords
VARIANTS = {
    "flashinfer": {"attention_backend": "flashinfer"},
    "redknot": {"attention_backend": "redknot", "redknot_all_global": True},
    "redknot-triton": {
        "attention_backend": "redknot",
        "redknot_all_global": True,
        "redknot_kernel": "triton",
    },
    # a token-level policy with a segment cache: prompts that reuse nothing and every decode
    # step run on FlashInfer (the per-batch dispatch of redknot/attention/backend.py)
    "cacheblend": {"attention_backend": "redknot", "redknot_policy": "cacheblend"},
}


def git_commit() -> str:
    """The checkout's commit; the GPU machine's copy has no .git, so scripts pass REDKNOT_COMMIT."""
    proc = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [round(min_len * (max_len / min_len) ** (i / max(1, n - 1))) for i in range(n)]
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for length in lengths]


def second_round(first: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts sharing the first half of a first-round prompt, then new tokens."""
    rng = random.Random(seed + 1)
    return [p[: len(p) // 2] + [rng.randrange(100, vocab - 100) for _ in range(64)] for p in first]


def run_variant(args: argparse.Namespace) -> None:
    """Child process: serve one variant, write its outputs as JSON to args.child_out."""
    import sglang as sgl

    if args.child == "map":
        spec = {"attention_backend": "redknot", "redknot_head_map": args.head_map}
    else:
        spec = dict(VARIANTS[args.child])
    engine = sgl.Engine(
        model_path=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        grammar_backend="none",
        sampling_backend="pytorch",
        context_length=args.context_length,
        cuda_graph_max_bs_decode=16,
        disable_prefill_cuda_graph=args.disable_prefill_cuda_graph,
        mem_fraction_static=0.8,
        random_seed=0,
        log_level="warning",
        **spec,
    )
    sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    result = {"variant": args.child, "spec": {k: str(v) for k, v in spec.items()}}
    try:
        for name, prompts in (("round1", args.prompts), ("round2", args.prompts2)):
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sampling)
            result[name] = [o["output_ids"] for o in outs]
            result[name + "_cached_tokens"] = [o["meta_info"].get("cached_tokens", 0) for o in outs]
            result[name + "_seconds"] = time.perf_counter() - t0
    finally:
        engine.shutdown()
    Path(args.child_out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".device/models/llama-3.1-8b"))
    ap.add_argument("--variants", default="flashinfer,redknot,redknot-triton")
    ap.add_argument(
        "--head-map",
        default=None,
        help="also serve this map (variant 'map'); 'synthetic:F' makes one with a "
        "global fraction F",
    )
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--context-length", type=int, default=20480)
    ap.add_argument("--disable-prefill-cuda-graph", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/e2e_equivalence.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    if args.child:
        data = json.loads(Path(args.prompts_file).read_text())
        args.prompts, args.prompts2 = data["round1"], data["round2"]
        run_variant(args)
        return

    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_file = out_dir / "e2e_prompts.tmp.json"
    prompts_file.write_text(
        json.dumps({"round1": prompts, "round2": second_round(prompts, vocab, args.seed)})
    )
    if args.head_map and args.head_map.startswith("synthetic:"):
        from redknot.headmap import ModelShape, synthetic_map

        fraction = float(args.head_map.split(":", 1)[1])
        shape = ModelShape.from_hf_config(json.loads(Path(args.model, "config.json").read_text()))
        args.head_map = str(out_dir / f"e2e_map_g{fraction}.tmp.json")
        synthetic_map(shape, fraction).save(args.head_map)
    variants = args.variants.split(",") + (["map"] if args.head_map else [])
    results = {}
    for name in variants:
        child_out = out_dir / f"e2e_{name}.tmp.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "map" if name == "map" else name,
            "--child-out",
            str(child_out),
            "--prompts-file",
            str(prompts_file),
            "--model",
            args.model,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--context-length",
            str(args.context_length),
        ]
        if name == "map":
            cmd += ["--head-map", args.head_map]
        if args.disable_prefill_cuda_graph:
            cmd.append("--disable-prefill-cuda-graph")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, env=os.environ.copy())
        if proc.returncode != 0 or not child_out.exists():
            results[name] = {"error": f"variant exited with {proc.returncode}"}
            continue
        results[name] = json.loads(child_out.read_text())
        results[name]["wall_seconds"] = time.perf_counter() - t0
        child_out.unlink()
    prompts_file.unlink()

    ref = results.get("flashinfer", {})
    summary = {}
    for name, res in results.items():
        if name == "flashinfer" or "error" in res or "round1" not in ref:
            continue
        same1 = [a == b for a, b in zip(res["round1"], ref["round1"])]
        same2 = [a == b for a, b in zip(res["round2"], ref["round2"])]
        summary[name] = {
            "identical_greedy": sum(same1),
            "identical_greedy_prefix_hit_round": sum(same2),
            "mismatching_prompts": [i for i, s in enumerate(same1) if not s],
            "first_divergence": [
                next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(res["round1"], ref["round1"])
            ],
            "round2_cached_tokens": res.get("round2_cached_tokens"),
        }
    import torch

    record = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("REDKNOT_COMMIT") or git_commit(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "load_format": "dummy",
        "prompts": len(prompts),
        "prompt_lengths": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "batch": "all prompts submitted at once (continuous batching)",
        "reference": "flashinfer",
        "variants": summary,
        "errors": {k: v["error"] for k, v in results.items() if "error" in v},
        "identical_greedy": summary.get("redknot", {}).get("identical_greedy"),
        "timings_seconds": {k: v.get("wall_seconds") for k, v in results.items()},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "prompt_lengths"}, indent=1))


if __name__ == "__main__":
    main()
