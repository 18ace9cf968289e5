"""SamKV served by SGLang on the 8B shape (dummy weights): what a multi-document request holds,
how many run at once, their first token and their decode, next to flashinfer and CacheBlend.

Each variant is an ``sgl.Engine`` in a process of its own (``--child``), one after the other,
with the same ``--mem-fraction-static`` and ``--chunked-prefill-size``. The redknot variants
register ``--docs`` random documents of ``--doc-tokens`` first (their segment region is
``--segment-fraction`` of the KV budget: the documents must be stored somewhere). A request is
a head of 16 random tokens of its own (so that no two requests share a prefix in the radix
tree), every document, then a question of ``--question-tokens``; the redknot variants mark the
documents. ``--new-tokens`` each, ``ignore_eos``.

Per variant:

- ``alone``: ``--alone`` requests one after the other: ``ttft_s`` (median), ``served_tokens``
  (SamKV's reuse report: the prompt a request holds) and ``sequence_ratio``;
- ``batch``: ``--batch`` requests submitted at once: decode rates as ``lfps_serve.py`` reads them
  (``decode_tokens_per_s``, ``steady_decode_tokens_per_s`` ...);
- ``capacity``: ``--requests`` submitted at once, more than flashinfer's pool holds:
  ``peak_decoding`` (the most requests between their first and last token at once) and the
  engine log's largest decode batch (``peak_running``), with the pool's token slots.

``summary`` gives each variant's figures and their ratios to CacheBlend's and flashinfer's.

``--mode sizes``: each variant's TTFT alone (median of ``--alone``) at 8 documents of each of
``--doc-sizes`` tokens, samkv with ``--redknot-samkv-min-tokens 0`` (cut at every size), and
its speedup over flashinfer's: where the cut starts to pay.

    python3 benchmarks/gpu_run.py bench samkv_serve --variants flashinfer,cacheblend,samkv
    python3 benchmarks/gpu_run.py bench samkv_serve --mode sizes --variants flashinfer,samkv
    python benchmarks/samkv_serve.py --merge A.json,B.json --out benchmarks/results/samkv_serve.json
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
from lfps_serve import RUNNING, sessions, stream_figures, vocab_size

NAMESPACE = "samkv-bench"
VARIANTS = {
    "flashinfer": {"attention_backend": "flashinfer"},
    "cacheblend": {"attention_backend": "redknot", "redknot_policy": "cacheblend"},
    "samkv": {"attention_backend": "redknot", "redknot_policy": "samkv"},
}
LOG_GREP = ("redknot", "gen throughput")


def documents(vocab: int, count: int, tokens: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)  # the same documents for every variant
    return [[rng.randrange(100, vocab - 100) for _ in range(tokens)] for _ in range(count)]


def prompts(vocab: int, docs: list[list[int]], count: int, question: int, seed: int):
    """``count`` prompts (module docstring) and their documents' marks (the same for all)."""
    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.segcache.entry import segment_id

    rng = random.Random(seed)
    out, marks = [], []
    for i in range(count):
        head = [rng.randrange(100, vocab - 100) for _ in range(16)]
        ids, spans = common.reusing_prompt(head, docs, [], NAMESPACE)
        ids += [rng.randrange(100, vocab - 100) for _ in range(question)]
        out.append(ids)
        if i == 0:
            marks = [SegmentMark(s["start"], s["end"], NAMESPACE, segment_id(NAMESPACE, d))
                     for s, d in zip(spans, docs)]  # fmt: skip
    return out, encode_marks(marks)


def alone_ttft(engine, vocab: int, docs, args, name: str, seed: int) -> dict:
    """``--alone`` requests one after the other (after one that pays first-use costs)."""
    sampling = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
    alone, custom = prompts(vocab, docs, args.alone + 1, args.question_tokens, seed=seed)
    if name != "flashinfer":
        sampling["custom_params"] = custom
    rows = []
    for i, ids in enumerate(alone):
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=sampling)
        report = (out["meta_info"].get("redknot_reuse") or [{}])[0]
        if i:
            rows.append({"ttft_s": time.perf_counter() - t0, "reuse": report})
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "ttft_samples_s": [round(r["ttft_s"], 5) for r in rows],
        "prompt_tokens": len(alone[0]),
        "reuse_report": rows[0]["reuse"],
    }


def child_sizes(args, name: str) -> dict:
    """``--mode sizes``: TTFT alone at each ``--doc-sizes`` (8 documents of that many tokens)."""
    import sglang as sgl

    sizes = [int(x) for x in args.doc_sizes.split(",")]
    options = {**VARIANTS[name], "mem_fraction_static": args.mem_fraction_static,
               "chunked_prefill_size": args.chunk, "disable_prefill_cuda_graph": True,
               "cuda_graph_max_bs_decode": 4, "log_level": "info"}  # fmt: skip
    if name != "flashinfer":
        options["redknot_segment_fraction"] = args.segment_fraction
        options["redknot_samkv_min_tokens"] = 0  # measured at every size
    context = args.docs * max(sizes) + 16 + args.question_tokens + 64
    engine = sgl.Engine(**common.engine_kwargs(args.model, context, **options))
    vocab = vocab_size(args.model)
    result: dict = {"variant": name, "sizes": {}}
    try:
        common.launch_server_warmup(engine)
        for i, size in enumerate(sizes):
            docs = documents(vocab, args.docs, size, seed=100 + i)
            if name != "flashinfer":
                common.register_segments(engine, docs, NAMESPACE)
            result["sizes"][str(size * args.docs)] = alone_ttft(engine, vocab, docs, args, name, i)
            print(name, size, result["sizes"][str(size * args.docs)]["ttft_s"], flush=True)
    finally:
        engine.shutdown()
    return result


def child(args, name: str) -> dict:
    import sglang as sgl

    options = {
        **VARIANTS[name],
        "mem_fraction_static": args.mem_fraction_static,
        "chunked_prefill_size": args.chunk,
        "disable_prefill_cuda_graph": True,
        "cuda_graph_max_bs_decode": min(args.requests, 32),  # larger batches run eagerly
        "log_level": "info",
        "decode_log_interval": 1,
    }
    if name != "flashinfer":
        options["redknot_segment_fraction"] = args.segment_fraction
    context = args.docs * args.doc_tokens + 16 + args.question_tokens + args.new_tokens + 64
    engine = sgl.Engine(**common.engine_kwargs(args.model, context, **options))
    vocab = vocab_size(args.model)
    docs = documents(vocab, args.docs, args.doc_tokens)
    result: dict = {"variant": name}
    try:
        result["kv_pool_tokens"] = int(engine.get_server_info()["max_total_num_tokens"])
        common.launch_server_warmup(engine)
        if name != "flashinfer":
            common.register_segments(engine, docs, NAMESPACE)
        result["alone"] = alone_ttft(engine, vocab, docs, args, name, seed=1)
        sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        if name != "flashinfer":
            sampling["custom_params"] = prompts(vocab, docs, 1, args.question_tokens, seed=1)[1]
        engine.flush_cache()
        if name != "flashinfer":
            common.register_segments(engine, docs, NAMESPACE)  # the flush dropped them
        batch, _ = prompts(vocab, docs, args.batch, args.question_tokens, seed=2)
        result["batch"] = {
            "batch": args.batch,
            **stream_figures(*sessions(engine, batch, sampling)),
        }
        burst, _ = prompts(vocab, docs, args.requests, args.question_tokens, seed=3)
        submitted, streams = sessions(engine, burst, sampling, deadline_s=args.deadline)
        begun = [s for s in streams if any(k >= 1 for _, k in s)]
        figures = stream_figures(submitted, begun) if begun else {}
        finished = sum(1 for s in streams if s and s[-1][1] >= args.new_tokens)
        result["capacity"] = {"requests": args.requests, "sessions_started": len(begun),
                              "sessions_finished": finished, **figures}  # fmt: skip
    finally:
        engine.shutdown()
    return result


def summarize_sizes(runs: dict[str, dict]) -> dict:
    """``--mode sizes``: per variant and prompt's document tokens, TTFT and its speedup over
    flashinfer's."""
    base = runs.get("flashinfer", {}).get("sizes", {})
    out = {}
    for name, run in runs.items():
        if "error" in run:
            out[name] = {"error": run["error"]}
            continue
        out[name] = {}
        for size, row in run["sizes"].items():
            fig = {"ttft_s": row["ttft_s"], "prompt_tokens": row["prompt_tokens"],
                   "served_tokens": (row["reuse_report"].get("samkv") or {}).get(
                       "served_tokens", row["prompt_tokens"])}  # fmt: skip
            if size in base:
                fig["speedup_vs_flashinfer"] = round(base[size]["ttft_s"] / row["ttft_s"], 3)
            out[name][size] = fig
    return out


def summarize(runs: dict[str, dict]) -> dict:
    """Per variant the figures, and ratios to CacheBlend's and flashinfer's."""
    if any("sizes" in run for run in runs.values()):
        return summarize_sizes(runs)
    out = {}
    for name, run in runs.items():
        if "error" in run:
            out[name] = {"error": run["error"]}
            continue
        report = run["alone"]["reuse_report"].get("samkv") or {}
        row = {
            "ttft_s": run["alone"]["ttft_s"],
            "prompt_tokens": run["alone"]["prompt_tokens"],
            "served_tokens": report.get("served_tokens", run["alone"]["prompt_tokens"]),
            "sequence_ratio": report.get("sequence_ratio"),
            "kv_pool_tokens": run["kv_pool_tokens"],
            "decode_tokens_per_s": run["batch"].get("decode_tokens_per_s"),
            "steady_decode_tokens_per_s": run["batch"].get("steady_decode_tokens_per_s"),
            "batch": run["batch"]["batch"],
            "concurrent_requests": run["capacity"].get("peak_decoding"),
            "peak_running": run.get("peak_running"),
        }
        out[name] = row
    for base in ("cacheblend", "flashinfer"):
        ref = out.get(base)
        if not ref or "error" in ref:
            continue
        for row in out.values():
            if "error" in row:
                continue
            for key in ("concurrent_requests", "decode_tokens_per_s", "steady_decode_tokens_per_s"):
                if row.get(key) and ref.get(key):
                    row[f"{key}_vs_{base}"] = round(row[key] / ref[key], 3)
            if row.get("ttft_s") and ref.get("ttft_s"):
                row[f"speedup_vs_{base}"] = round(ref["ttft_s"] / row["ttft_s"], 3)
    return out


def merge(parts: list[dict]) -> dict:
    """Runs of one commit and device split over calls, joined (each run's command kept)."""
    for key in ("device", "commit"):
        values = {p[key] for p in parts}
        if len(values) != 1:
            raise SystemExit(f"--merge: the runs differ in {key}: {sorted(values)}")
    runs = {}
    for part in parts:
        for name, run in part["runs"].items():
            runs[name] = {**run, "command": part["command"], "date": part["date"]}
    return {"device": parts[0]["device"], "date": max(p["date"] for p in parts),
            "commit": parts[0]["commit"], "runs": runs, "summary": summarize(runs)}  # fmt: skip


def peak_running(lines: list[str]) -> int | None:
    found = [int(m.group(1)) for line in lines for m in [RUNNING.search(line)] if m]
    return max(found) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=("serve", "sizes"), default="serve")
    ap.add_argument("--doc-sizes", default="256,512,1024,2048", help="sizes mode: tokens a doc")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model", default=common.DEFAULT_MODEL, help="dummy weights")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alone", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds for the burst")
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--segment-fraction", type=float, default=0.1)
    ap.add_argument("--chunk", type=int, default=16384, help="--chunked-prefill-size")
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/samkv_serve.json"))
    ap.add_argument("--merge", default=None, help="comma-separated results to join into --out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run = child_sizes if args.mode == "sizes" else child
        print("RESULT " + json.dumps(run(args, args.child)), flush=True)
        return
    if args.merge:
        data = merge([json.loads(Path(p).read_text()) for p in args.merge.split(",")])
        data["command"] = " ".join([Path(sys.executable).name] + sys.argv)
        common.write_json(args.out, data)
        print(json.dumps(data["summary"], indent=1))
        return
    forward = common.forward_args(
        args, "model", "docs", "doc_tokens", "question_tokens", "new_tokens", "alone", "batch",
        "requests", "deadline", "mem_fraction_static", "segment_fraction", "chunk", "mode",
        "doc_sizes",
    )  # fmt: skip
    runs: dict = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    for name in args.variants.split(","):
        res = common.run_child(__file__, forward + ["--child", name], log_grep=LOG_GREP)
        res["peak_running"] = peak_running(res.get("log_lines", []))
        res["log_lines"] = [x for x in res.get("log_lines", []) if "redknot" in x][-40:]
        runs[name] = res
        print(name, json.dumps(res)[:600], flush=True)
        common.write_json(args.out, common.record(runs=runs, summary=summarize(runs)))
    print(json.dumps(summarize(runs), indent=1))


if __name__ == "__main__":
    main()
