"""Segments stored on the GPU hold the K/V dense prefill computes: checked through answers.

A redknot server under ``--redknot-policy naive`` reads a reused segment's stored K/V and
recomputes nothing of it. A segment stored after the tokens that precede it in the prompt that
reuses it gives that prompt (nearly) the K/V a dense prefill computes, and its answer must be
(nearly) the flashinfer backend's. The storing prompt and the reusing one differ in their first
token only: the same prefix would be served by SGLang's radix cache instead of the store (and
the redknot cache, which holds the store, is SGLang's radix cache: it cannot be turned off
here). Each way of storing is
checked so, on SmolLM2-135M-Instruct with its real weights (``--model /tmp/smol-hf``,
docs/benchmarks.md "Real weights"; dummy weights give every token the same logit, which would
make any two answers equal), with every store made in a batch that reads no segment (FlashInfer runs it and writes the segment after each layer,
``SegPagedRunner.plan_dense``):

| case | stored by | then |
| --- | --- | --- |
| ``capture_after_context`` | a capture registration: context, then the document, marked | the prompt context + document + question, the document marked |
| ``in_place`` | the first prompt that misses it, its mark listed in ``redknot_seg_store`` | another question after the same context and document |
| ``control_standalone`` | a registration of the document alone (positions from 0) | the same prompt: the stored K/V lacks the context, so the answer should differ more (shows what the check can tell) |

Per case: whether the greedy tokens equal flashinfer's, the first token's log-probability on
both, and the reuse report (``reused_tokens``, ``stored``: the read did happen). Writes ``$OUT/stored_kv_check.json`` (or ``--out``).

    python scripts/stored_kv_check.py --model /tmp/smol-hf --out $OUT/stored_kv_check.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def prompts(vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    ctx, doc, doc2, doc3 = (_ids(rng, n, vocab) for n in (300, 700, 600, 650))
    qs = [_ids(rng, 40, vocab) for _ in range(4)]
    heads = rng.sample(range(100, vocab - 100), 2)  # the storing and the reusing prompt's first
    return {"ctx": ctx, "doc": doc, "doc2": doc2, "doc3": doc3, "qs": qs, "heads": heads}


def _answer(out: dict) -> dict:
    meta = out["meta_info"]
    first = meta.get("output_token_logprobs") or [[None]]
    return {
        "tokens": out["output_ids"],
        "first_logprob": first[0][0],
        "reuse": (meta.get("redknot_reuse") or [None])[0],
        "meta_keys": sorted(meta),
        "cached_tokens": meta.get("cached_tokens", 0),
    }


def load_format(model: str) -> str:
    """Dummy weights for the bundle's configs (``.device/models``), else the checkpoint's."""
    return "dummy" if "/.device/models/" in str(Path(model).resolve()) + "/" else "auto"


def run_child(args: argparse.Namespace) -> None:
    import sglang as sgl

    from redknot.api.marks import SegmentMark, encode_marks, segment_id

    p = json.loads(Path(args.prompts_file).read_text())
    qs = p["qs"]
    stores, reuses = ([h, *p["ctx"]] for h in p["heads"])  # contexts differing in token 0
    redknot = args.child == "redknot"
    spec = (
        {"attention_backend": "redknot", "redknot_policy": "naive",
         "redknot_segment_fraction": 0.2, "redknot_reuse_gate": "always"}
        if redknot else {"attention_backend": "flashinfer"}
    )  # fmt: skip
    engine = sgl.Engine(
        model_path=args.model, load_format=load_format(args.model), skip_tokenizer_init=True,
        grammar_backend="none", sampling_backend="pytorch", context_length=4096,
        mem_fraction_static=0.8, random_seed=0, log_level="warning",
        disable_prefill_cuda_graph=True, **spec,
    )  # fmt: skip
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    def ask(ids: list[int], custom: dict | None = None) -> dict:
        params = dict(sampling, custom_params=custom) if custom else sampling
        out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        return _answer(out)

    def mark(doc: list[int], start: int) -> SegmentMark:
        return SegmentMark(start, start + len(doc), "check", segment_id("check", doc))

    def register(ids: list[int], marks: list[SegmentMark], capture: bool) -> None:
        custom = encode_marks(marks, register=True, capture=capture)
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0,
                                                        "custom_params": custom})  # fmt: skip

    result: dict = {"variant": args.child}
    try:
        cases = {
            "capture_after_context": (p["doc"], qs[0]),
            "in_place": (p["doc2"], qs[2]),
            "control_standalone": (p["doc3"], qs[3]),
        }
        n = len(stores)
        for name, (doc, q) in cases.items():
            if not redknot:
                result[name] = ask(reuses + doc + q)
                if name == "in_place":
                    result["in_place_first"] = ask(stores + doc + qs[1])
                continue
            if name == "capture_after_context":
                register(stores + doc, [mark(doc, n)], capture=True)
            elif name == "control_standalone":
                register(doc, [mark(doc, 0)], capture=False)
            else:  # the first prompt misses it and stores it itself
                custom = encode_marks([mark(doc, n)], store=[0])
                result["in_place_first"] = ask(stores + doc + qs[1], custom)
            result[name] = ask(reuses + doc + q, encode_marks([mark(doc, n)]))
    finally:
        engine.shutdown()
    Path(args.child_out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="/tmp/smol-hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/stored_kv_check.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_file = out_dir / "stored_kv_prompts.tmp.json"
    prompts_file.write_text(json.dumps(prompts(vocab, args.seed)))
    results = {}
    for name in ("flashinfer", "redknot"):
        child_out = out_dir / f"stored_kv_{name}.tmp.json"
        cmd = [sys.executable, __file__, "--child", name, "--child-out", str(child_out),
               "--prompts-file", str(prompts_file), "--model", args.model]  # fmt: skip
        proc = subprocess.run(cmd, check=False, env=os.environ.copy())
        if proc.returncode != 0 or not child_out.exists():
            results[name] = {"error": f"variant exited with {proc.returncode}"}
            continue
        results[name] = json.loads(child_out.read_text())
        child_out.unlink()
    prompts_file.unlink()
    ref, got = results.get("flashinfer", {}), results.get("redknot", {})
    cases = {}
    for name in ("capture_after_context", "in_place_first", "in_place", "control_standalone"):
        if name not in ref or name not in got:
            continue
        a, b = ref[name], got[name]
        reuse = b["reuse"] or {}
        cases[name] = {
            "identical_greedy": a["tokens"] == b["tokens"],
            "first_divergence": next(
                (j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None
            ),
            "first_logprob": [a["first_logprob"], b["first_logprob"]],
            "first_logprob_diff": (
                None
                if None in (a["first_logprob"], b["first_logprob"])
                else abs(a["first_logprob"] - b["first_logprob"])
            ),
            "reused_tokens": reuse.get("reused_tokens"),
            "segments_hit": reuse.get("segments_hit"),
            "stored": reuse.get("stored"),
            "meta_keys": b.get("meta_keys"),
        }
    import torch

    record = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": os.environ.get("REDKNOT_COMMIT", "unknown"),
        "command": " ".join(sys.argv),
        "model": args.model,
        "load_format": load_format(args.model),
        "new_tokens": NEW_TOKENS,
        "cases": cases,
        "errors": {k: v["error"] for k, v in results.items() if "error" in v},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
