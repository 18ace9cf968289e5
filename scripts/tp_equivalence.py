"""Greedy tokens with ``--tp 2`` against ``--tp 1`` for the redknot backend (GPU machine, 2 GPUs).

Dummy weights differ between TP sizes (each rank draws its own shard), so this builds a small
Llama-architecture checkpoint with fixed random weights (seeded, bf16) and serves the same
checkpoint at TP 1 and TP 2: flashinfer (the control: how much TP alone moves greedy tokens),
redknot with every head global, and redknot with a 1/4-global map (each rank holds its KV heads
and its slice of the map). Writes ``benchmarks/results/tp_equivalence.json``.

Random weights leave greedy tokens fragile: TP alone (split matmuls, all-reduce order) flips
them for the control too. The sharper comparison is the first output token, whose context is
the same on both sides: the top-10 logprobs of TP 1 and TP 2 must differ by no more for redknot
than for the flashinfer control, and far less than redknot's 1/4 map differs from dense
attention (what a wrong slice of the map at TP 2 would look like).

    python scripts/tp_equivalence.py --out benchmarks/results/tp_equivalence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serving_common as common

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_hidden_layers": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 16384,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LM_HEAD_SCALE = 40.0
TOP_LOGPROBS = 10
VARIANTS = {
    "flashinfer": {"attention_backend": "flashinfer"},
    "redknot-all-global": {"attention_backend": "redknot", "redknot_all_global": True},
    "redknot-g0.25": {"attention_backend": "redknot"},  # map path added at run time
}


def build_checkpoint(path: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    # Random weights give nearly flat next-token logits, whose greedy choice then flips with
    # any change of summation order (TP splits the matmuls and all-reduces). A sharper output
    # layer makes the greedy token a property of the model, not of rounding.
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(path)


def agreement(a: list, b: list) -> int:
    return sum(x == y for x, y in zip(a, b))


def first_token_logprob_gap(a: list, b: list) -> dict:
    """First output token (same context on both sides): how far two runs' top logprobs differ.

    Per prompt, the largest |logprob difference| over the token ids both runs rank in their
    top ``TOP_LOGPROBS``; reported as the maximum and mean over prompts, with the number of
    prompts whose top-1 token is the same.
    """
    gaps, same_top1 = [], 0
    for x, y in zip(a, b):
        dx, dy = {t: lp for lp, t in x}, {t: lp for lp, t in y}
        shared = dx.keys() & dy.keys()
        gaps.append(max(abs(dx[t] - dy[t]) for t in shared) if shared else float("inf"))
        same_top1 += x[0][1] == y[0][1]
    return {
        "max_abs_logprob_diff": round(max(gaps), 5),
        "mean_abs_logprob_diff": round(sum(gaps) / len(gaps), 5),
        "same_first_token": same_top1,
    }


def common_prefix_fraction(a: list, b: list) -> float:
    """Mean over prompts of the share of output tokens before the first difference."""
    shares = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        shares.append(n / max(len(x), 1))
    return round(sum(shares) / max(len(shares), 1), 4)


def child(args) -> None:
    import sglang as sgl

    spec = dict(VARIANTS[args.child])
    if args.child == "redknot-g0.25":
        spec["redknot_head_map"] = common.synthetic_map_file(args.model, 0.25, "/tmp")
    engine = sgl.Engine(
        model_path=args.model, skip_tokenizer_init=True, grammar_backend="none",
        sampling_backend="pytorch", context_length=8192, tp_size=args.tp, random_seed=0,
        disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=8, mem_fraction_static=0.6,
        log_level="warning", **spec,
    )  # fmt: skip
    prompts = json.loads(Path(args.prompts).read_text())
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={
                "temperature": 0.0,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True,
            },
            return_logprob=True,
            top_logprobs_num=TOP_LOGPROBS,
        )
    finally:
        engine.shutdown()
    first = [o["meta_info"]["output_top_logprobs"][0] for o in outs]
    print(
        "RESULT "
        + json.dumps(
            {
                "outputs": [o["output_ids"] for o in outs],
                "first_top_logprobs": [[[lp, tok] for lp, tok, *_ in f] for f in first],
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/redknot-tp")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/tp_equivalence.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import random

    work = Path(args.workdir)
    model = work / "model"
    if not (model / "config.json").exists():
        build_checkpoint(model, seed=0)
    rng = random.Random(0)
    lengths = [1024 + 384 * i for i in range(args.num_prompts)]
    prompts = [[rng.randrange(3, CONFIG["vocab_size"]) for _ in range(n)] for n in lengths]
    (work / "prompts.json").write_text(json.dumps(prompts))
    results, timings = {}, {}
    for name in VARIANTS:
        for tp in (1, 2):
            t0 = time.perf_counter()
            res = common.run_child(
                __file__,
                [
                    "--child",
                    name,
                    "--tp",
                    str(tp),
                    "--model",
                    str(model),
                    "--prompts",
                    str(work / "prompts.json"),
                    "--max-new-tokens",
                    str(args.max_new_tokens),
                ],
            )
            results[f"{name}@tp{tp}"] = res
            timings[f"{name}@tp{tp}"] = time.perf_counter() - t0
            print(name, tp, "error" in res and res["error"], flush=True)
    summary = {}
    for name in VARIANTS:
        a, b = results[f"{name}@tp1"], results[f"{name}@tp2"]
        if "outputs" in a and "outputs" in b:
            summary[name] = {
                "identical_greedy_tp1_vs_tp2": agreement(a["outputs"], b["outputs"]),
                "common_prefix_tp1_vs_tp2": common_prefix_fraction(a["outputs"], b["outputs"]),
                "first_token_tp1_vs_tp2": first_token_logprob_gap(
                    a["first_top_logprobs"], b["first_top_logprobs"]
                ),
                "prompts": len(a["outputs"]),
            }
            for tp, mine in ((1, a), (2, b)):
                ref = results.get(f"flashinfer@tp{tp}", {})
                if name == "flashinfer" or "outputs" not in ref:
                    continue
                summary[name][f"vs_flashinfer_at_tp{tp}"] = {
                    "identical_greedy": agreement(mine["outputs"], ref["outputs"]),
                    "common_prefix": common_prefix_fraction(mine["outputs"], ref["outputs"]),
                    "first_token": first_token_logprob_gap(
                        mine["first_top_logprobs"], ref["first_top_logprobs"]
                    ),
                }
        else:
            summary[name] = {
                "error": a.get("error") or b.get("error"),
                "log_tail": (a.get("log_tail") or b.get("log_tail", ""))[-1500:],
            }
    common.write_json(args.out, common.record(
        model="random Llama-architecture checkpoint (seed 0, bf16)", model_config=CONFIG,
        lm_head_scale=LM_HEAD_SCALE, prompt_lengths=lengths, max_new_tokens=args.max_new_tokens,
        summary=summary, timings_seconds=timings,
        outputs={k: v.get("outputs") for k, v in results.items()},
    ))  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
