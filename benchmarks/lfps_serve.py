"""LFPS sparse decode served by SGLang: answers on real weights, decode throughput on the 8B shape.

Each variant is an ``sgl.Engine`` in a process of its own (``--child``), one after the other.

``--mode accuracy``: SmolLM2-135M-Instruct with real weights serves the long cases
(``long_v1``, 4-8K tokens) one request at a time, greedy, ``--max-new-tokens`` tokens. Prompts
are composed once here (``redknot.eval.compose``) and sent as ``input_ids``, so every variant
gets the same tokens. Scored with ``redknot.eval.metrics.answer_scores``; per variant other
than ``dense``: ``kept_of_dense_correct`` (of the cases dense answers right by ``contains``,
those this variant also answers right) and ``identical_generations`` (output ids equal to
dense's).

``--mode throughput``: the 8B shape with dummy weights; per length x batch, ``batch`` random
prompts submitted at once, each generating ``--new-tokens`` tokens (``ignore_eos``). Every
session streams; the times are when this process receives each chunk
(``time.perf_counter``) with ``meta_info["completion_tokens"]``, the session's token count:

- ``decode_tokens_per_s``: tokens received after the last session's first token, over the time
  from that token to the last token of all. Prefill stalls decode in SGLang, so this window
  is decode alone with every session in the batch (at batch 1: first token to last);
- ``steady_decode_tokens_per_s``: ``batch`` over the median time a token inside that window
  (``decode_step_ms_median``), which a one-off stall such as a first-use kernel compile at a
  new length does not move (``decode_step_ms_max`` shows it);
- ``end_to_end_tokens_per_s``: every generated token over the time from submission to the last;
- ``peak_decoding``: the most sessions between their first and last token at once (the
  engine's ``peak_running`` from its log, over all its points, is under ``engines``).

A point whose KV (``batch * (length + new_tokens)``) exceeds the engine's pool is skipped.
Decode batches holding an LFPS request run eagerly; dense ones replay CUDA graphs.

``--mode capacity``: the 8B shape with dummy weights; ``--capacity-requests`` random prompts of
``--capacity-length`` tokens submitted at once, ``--capacity-new-tokens`` each, more than the
pool may hold: SGLang admits what fits and queues the rest. Per variant: the pool's token slots
(``kv_pool_tokens``, and the requests of that size they hold, ``fit_by_pool``), the most
sessions between their first and last token at once (``peak_decoding``: the concurrent requests
served) and the engine log's largest decode batch (``peak_running``), with the rates above. The
variant ``lfps-offload`` keeps the KV in pinned host memory (``--redknot-lfps-offload-gb``, 64 GiB
unless the spec sets ``redknot_lfps_offload_gb``); LFPS variants get
``redknot_lfps_max_requests=--capacity-requests``; ``--mem-fraction-static 0`` leaves SGLang's
default for the GPU.

Variants (``--variants``, comma-separated): the names of ``VARIANTS``, or ``NAME=k1=v1,k2=v2``,
engine keywords over the built-in variant that ``NAME`` starts with (``NAME`` is ``BASE`` or
``BASE-...``), e.g. ``dense,lfps,lfps-b0.05=redknot_lfps_budget=0.05,redknot_lfps_max_requests=4``.
LFPS variants get ``redknot_lfps_min_tokens=--lfps-min-tokens`` unless they set it.

    python3 benchmarks/gpu_run.py bench lfps_serve --mode accuracy          # needs /tmp/smol-hf
    python3 benchmarks/gpu_run.py bench lfps_serve --mode throughput --variants dense,lfps-kv-head
    python3 benchmarks/gpu_run.py bench lfps_serve --mode throughput \\
        --variants lfps-query-head,topk-kv-head
    python3 benchmarks/gpu_run.py bench lfps_serve --mode capacity --capacity-requests 14 \\
        --variants "lfps-offload=redknot_lfps_offload_gb=200,chunked_prefill_size=131072"
    python benchmarks/lfps_serve.py --merge A.json,B.json --out benchmarks/results/lfps_serve.json

``/tmp/smol-hf`` is the bf16 checkpoint of docs/benchmarks.md ("Real weights"). A device call
lasts 600 s: split variants over calls and join the JSONs with ``--merge`` (same commit and
device).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

REDKNOT = {
    "attention_backend": "redknot",
    "redknot_all_global": True,
    "redknot_segment_fraction": 0,  # every head global, no reuse: the dense path with LFPS
}
VARIANTS = {
    "dense": {"attention_backend": "flashinfer"},
    "redknot-dense": {**REDKNOT, "redknot_lfps": "off"},
    "lfps": {**REDKNOT, "redknot_lfps": "lfps"},
    "topk": {**REDKNOT, "redknot_lfps": "topk"},
    "lfps-kv-head": {**REDKNOT, "redknot_lfps": "lfps", "redknot_lfps_selection": "kv-head"},
    "lfps-query-head": {**REDKNOT, "redknot_lfps": "lfps", "redknot_lfps_selection": "query-head"},
    "topk-kv-head": {**REDKNOT, "redknot_lfps": "topk", "redknot_lfps_selection": "kv-head"},
    "lfps-kv-head-union": {
        **REDKNOT,
        "redknot_lfps": "lfps",
        "redknot_lfps_selection": "kv-head-union",
        "redknot_lfps_candidate_factor": 8,
    },
    "lfps-offload": {**REDKNOT, "redknot_lfps": "lfps", "redknot_lfps_offload_gb": 64},
}
DEFAULT_VARIANTS = {
    "accuracy": "dense,lfps,topk",
    "throughput": "dense,lfps-kv-head,lfps-query-head,topk-kv-head",
    "capacity": "dense,lfps-offload",
}
BASELINE = "dense"
SMOL_MODEL = "/tmp/smol-hf"
RUNNING = re.compile(r"#running-req:\s*(\d+)")
LOG_GREP = ("lfps", "LFPS", "gen throughput")
RATES = ("decode_tokens_per_s", "steady_decode_tokens_per_s", "end_to_end_tokens_per_s")


# ---- variants and engine options ----------------------------------------------------------


def _value(text: str):
    """``"0.05"`` -> 0.05, ``"8"`` -> 8, ``"true"`` -> True, anything else stays a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def split_variants(text: str) -> list[str]:
    """``--variants`` -> each variant's own spec; a piece with one ``=`` (``key=value``)
    belongs to the variant before it."""
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if piece.count("=") == 1:
            if not specs:
                raise SystemExit(f"--variants: {piece!r} comes before any variant")
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse_variant(spec: str) -> tuple[str, dict]:
    """``"lfps-b=redknot_lfps_budget=0.05,redknot_lfps_selection=kv-head"`` -> its name and
    engine keywords: those of the longest built-in name it starts with, then its own."""
    name, _, own = spec.partition("=")
    bases = [b for b in VARIANTS if name == b or name.startswith(b + "-")]
    if not bases or (name not in VARIANTS and not own):
        raise SystemExit(
            f"--variants: {name!r} is none of {', '.join(VARIANTS)}; a variant of your own is "
            "BASE-SUFFIX=key=value,... over one of them"
        )
    kwargs = dict(VARIANTS[max(bases, key=len)])
    for item in filter(None, own.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = _value(value)
    return name, kwargs


def parse_variants(text: str) -> dict[str, dict]:
    """``--variants`` -> name -> engine keywords (a name given twice is refused)."""
    out: dict[str, dict] = {}
    for spec in split_variants(text):
        name, kwargs = parse_variant(spec)
        if name in out:
            raise SystemExit(f"--variants: {name!r} is given twice")
        out[name] = kwargs
    return out


def engine_options(variant: dict, base: dict, lfps: dict) -> dict:
    """``base``, then ``lfps`` where the variant decodes sparsely, then the variant's own keys."""
    sparse = variant.get("redknot_lfps", "off") != "off"
    return {**base, **(lfps if sparse else {}), **variant}


# ---- figures ------------------------------------------------------------------------------


def variant_rows(variant: str, cases, prompts: dict, outputs: dict, decode) -> list[dict]:
    """Per case one row: the variant's output ids and text and their answer scores."""
    from redknot.eval.metrics import answer_scores

    rows = []
    for case in cases:
        if case.id in outputs:
            text = decode(outputs[case.id])
            rows.append({"variant": variant, "case": case.id, "kind": case.kind,
                         "prompt_tokens": len(prompts[case.id]), "output_ids": outputs[case.id],
                         "output": text.strip(), **answer_scores(text, case.answers)})  # fmt: skip
    return rows


def accuracy_summary(rows: list[dict]) -> dict[str, dict]:
    """Per variant: mean scores; the others also against ``dense`` on the cases both served."""
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        by[row["variant"]][row["case"]] = row
    dense = by.get(BASELINE, {})
    out = {}
    for variant, cases in by.items():
        summary: dict = {"cases": len(cases)}
        for key in ("contains", "exact_match", "f1"):
            summary[key] = sum(r[key] for r in cases.values()) / len(cases)
        summary["mean_prompt_tokens"] = sum(r["prompt_tokens"] for r in cases.values()) / len(cases)
        if variant != BASELINE and dense:
            shared = [c for c in cases if c in dense]
            correct = [c for c in shared if dense[c]["contains"]]
            lost = [c for c in correct if not cases[c]["contains"]]
            same = sum(cases[c]["output_ids"] == dense[c]["output_ids"] for c in shared)
            summary["kept_of_dense_correct"] = f"{len(correct) - len(lost)}/{len(correct)}"
            summary["kept_of_dense_correct_fraction"] = (
                (len(correct) - len(lost)) / len(correct) if correct else None
            )
            summary["identical_generations"] = f"{same}/{len(shared)}"
            summary["identical_generations_fraction"] = same / len(shared) if shared else None
            summary["lost_cases"] = lost
        out[variant] = summary
    return out


def stream_figures(submitted: float, streams: list[list[tuple[float, int]]]) -> dict:
    """Decode and end-to-end rates of sessions submitted at ``submitted``; ``streams``: per
    session, ``(receipt time, tokens so far)`` of each chunk (module docstring)."""
    firsts = [next(t for t, n in s if n >= 1) for s in streams]
    lasts = [s[-1][0] for s in streams]
    totals = [s[-1][1] for s in streams]
    start, end = max(firsts), max(lasts)
    before = [max((n for t, n in s if t <= start), default=0) for s in streams]
    steps = max(n - b for n, b in zip(totals, before))  # decode steps in the window
    decoded, window = sum(totals) - sum(before), end - start
    gaps = sorted(  # seconds a token from chunk to chunk, inside the window
        (t1 - t0) / (n1 - n0)
        for s in streams
        for (t0, n0), (t1, n1) in pairwise(s)
        if t0 >= start and n1 > n0
    )
    median = gaps[len(gaps) // 2] if gaps else None
    running = peak = 0  # at a tie a session's first token counts before another's last
    for _, _, change in sorted([(t, 0, 1) for t in firsts] + [(t, 1, -1) for t in lasts]):
        running += change
        peak = max(peak, running)
    return {
        "generated_tokens": sum(totals),
        "ttft_last_session_s": start - submitted,
        "decode_window_s": window,
        "decode_tokens": decoded,
        "decode_tokens_per_s": decoded / window if window > 0 else None,
        "decode_step_ms": 1e3 * window / steps if steps else None,
        "decode_step_ms_median": 1e3 * median if median else None,
        "decode_step_ms_max": 1e3 * gaps[-1] if gaps else None,
        "steady_decode_tokens_per_s": len(streams) / median if median else None,
        "end_to_end_tokens_per_s": sum(totals) / (end - submitted),
        "wall_s": end - submitted,
        "peak_decoding": peak,
    }


def point_key(point: dict) -> str:
    return f"{point['length']}x{point['batch']}"


def throughput_summary(points: list[dict]) -> dict[str, dict]:
    """Per variant and ``LENGTHxBATCH``: the rates, and their ratio to ``dense``'s."""
    dense = {point_key(p): p for p in points if p["variant"] == BASELINE and "skipped" not in p}
    out: dict[str, dict] = defaultdict(dict)
    for p in points:
        if "skipped" in p:
            out[p["variant"]][point_key(p)] = {"skipped": p["skipped"]}
            continue
        row = {k: p.get(k) for k in (*RATES, "peak_decoding")}
        ref = dense.get(point_key(p), {})
        for rate in RATES:
            if p.get(rate) and ref.get(rate):
                row[rate.replace("tokens_per_s", "speedup_vs_dense")] = p[rate] / ref[rate]
        out[p["variant"]][point_key(p)] = row
    return dict(out)


CAPACITY_KEYS = ("requests", "length", "kv_pool_tokens", "fit_by_pool", "peak_decoding",
                 "sessions_started", "sessions_finished",
                 "ttft_last_session_s", "decode_tokens_per_s", "end_to_end_tokens_per_s",
                 "wall_s")  # fmt: skip


def dense_concurrency(dense: dict) -> tuple[int | None, str]:
    """What ``dense`` serves at once and where the figure comes from: its ``peak_decoding``
    when requests queued (fewer decoded at once than were sent), else the requests its pool
    holds (``fit_by_pool``): a run sent no more than fit measured only what it was sent."""
    peak, fit = dense.get("peak_decoding"), dense.get("fit_by_pool")
    if peak and fit and peak >= dense.get("requests", 0) and fit > peak:
        return fit, "fit_by_pool"
    return peak, "peak_decoding"


def capacity_summary(runs: list[dict]) -> dict[str, dict]:
    """Per variant: the concurrent requests served (``peak_decoding``) and its ratio to
    ``dense``'s (:func:`dense_concurrency`), next to what the pool holds by its size."""
    dense = next((r for r in runs if r["variant"] == BASELINE and "error" not in r), None)
    base, base_from = dense_concurrency(dense) if dense else (None, "")
    out = {}
    for r in runs:
        row = {k: r.get(k) for k in CAPACITY_KEYS}
        if "error" in r:
            row["error"] = r["error"]
        elif base and r.get("peak_decoding") is not None:
            row["concurrent_vs_dense"] = 1.0 if r is dense else r["peak_decoding"] / base
            row["dense_concurrent"], row["dense_concurrent_from"] = base, base_from
        if r.get("output_ids"):  # the same prompts: which other variants generated the same
            row["same_outputs_as"] = [o["variant"] for o in runs if o is not r
                                      and o.get("output_ids") == r["output_ids"]]  # fmt: skip
        out[r["variant"]] = row
    return out


def assemble(
    settings: dict, variants: dict, per_case: list, per_point: list, engines: dict,
    per_capacity: list | None = None,
):  # fmt: skip
    """The result's figures (``common.record`` adds device, date, commit and command)."""
    figures = {
        "settings": settings,
        "variants": variants,
        "engines": engines,
        "per_case": per_case,
        "per_point": per_point,
        "summary": {
            "accuracy": accuracy_summary(per_case),
            "throughput": throughput_summary(per_point),
        },
    }
    if per_capacity:
        figures["per_capacity"] = per_capacity
        figures["summary"]["capacity"] = capacity_summary(per_capacity)
    return figures


def merge(runs: dict[str, dict]) -> dict:
    """One result of several runs (``path -> result``) of one commit and device: their rows
    together (a variant's case or point measured twice is refused), summaries recomputed."""
    first = next(iter(runs.values()))
    per_case, per_point, per_capacity, variants = [], [], [], {}
    engines = defaultdict(dict)
    for path, run in runs.items():
        for k in ("commit", "device"):
            if run[k] != first[k]:
                raise SystemExit(f"--merge: {path} differs in {k}: not comparable")
        per_case += run["per_case"]
        per_point += run["per_point"]
        per_capacity += run.get("per_capacity", [])
        variants.update(run["variants"])
        for mode, by_variant in run["engines"].items():
            engines[mode].update(by_variant)
    seen = [(r["variant"], r["case"]) for r in per_case]
    seen += [(p["variant"], p["length"], p["batch"]) for p in per_point]
    seen += [(r["variant"], "capacity") for r in per_capacity]
    twice = sorted({str(x) for x in seen if seen.count(x) > 1})
    if twice:
        raise SystemExit(f"--merge: measured twice: {', '.join(twice)}")
    merged = {k: first[k] for k in ("device", "commit")}
    merged["date"] = max(run["date"] for run in runs.values())
    merged["merged_from"] = [{"path": p, "date": r["date"], "command": r["command"],
                              "settings": r["settings"]} for p, r in runs.items()]  # fmt: skip
    notes = sorted({r["commit_note"] for r in runs.values() if r.get("commit_note")})
    if notes:  # how a run's commit was recorded, where it says
        merged["commit_note"] = " / ".join(notes)
    figures = assemble(first["settings"], variants, per_case, per_point, dict(engines),
                       per_capacity)  # fmt: skip
    return {**merged, **figures}


# ---- the engines (GPU) --------------------------------------------------------------------


def child_accuracy(args, variant: dict) -> dict:
    import sglang as sgl

    job = json.loads(Path(args.prompts).read_text())
    base = {"load_format": "auto", "mem_fraction_static": args.accuracy_mem_fraction,
            "disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": 4,
            "log_level": "info"}  # fmt: skip
    lfps = {"redknot_lfps_min_tokens": args.lfps_min_tokens}
    options = engine_options(variant, base, lfps)
    engine = sgl.Engine(**common.engine_kwargs(args.accuracy_model, args.context_length, **options))
    sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens,
                "stop_token_ids": job["stop_token_ids"]}  # fmt: skip
    try:
        outputs = {}
        for case_id, ids in job["prompts"].items():  # one at a time: no batch effects
            out = engine.generate(input_ids=ids, sampling_params=sampling)
            outputs[case_id] = out["output_ids"]
    finally:
        engine.shutdown()
    return {"outputs": outputs}


def sessions(
    engine,
    prompts: list[list[int]],
    sampling: dict,
    outputs: list | None = None,
    deadline_s: float | None = None,
) -> tuple[float, list]:
    """Submit ``prompts`` at once, streaming; (submission time, per session its chunks'
    ``(receipt time, tokens so far)``). ``outputs``, if given, gets each session's output ids
    (the last chunk's, which SGLang streams whole). After ``deadline_s`` the sessions still
    running are abandoned and their chunks so far returned."""
    marks: list[list] = [[] for _ in prompts]

    async def one(i, ids):
        last = None
        stream = await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True)
        async for chunk in stream:
            marks[i].append((time.perf_counter(), chunk["meta_info"]["completion_tokens"]))
            last = chunk
        if outputs is not None:
            outputs[i] = last.get("output_ids") if last else None

    async def every():
        work = asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(work, deadline_s)

    submitted = time.perf_counter()
    engine.loop.run_until_complete(every())
    return submitted, marks


def child_throughput(args, variant: dict) -> dict:
    import sglang as sgl

    lengths, batches = _ints(args.lengths), _ints(args.batches)
    base = {"mem_fraction_static": args.mem_fraction_static, "disable_prefill_cuda_graph": True,
            "cuda_graph_max_bs_decode": max(batches), "log_level": "info",
            "decode_log_interval": 10}  # fmt: skip
    lfps = {"redknot_lfps_min_tokens": args.lfps_min_tokens,
            "redknot_lfps_max_requests": max(batches)}  # fmt: skip
    context = max(lengths) + args.new_tokens + 64
    options = engine_options(variant, base, lfps)
    engine = sgl.Engine(**common.engine_kwargs(args.throughput_model, context, **options))
    vocab = vocab_size(args.throughput_model)
    sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    points = []
    try:
        capacity = int(engine.get_server_info()["max_total_num_tokens"])
        common.launch_server_warmup(engine)
        rng = random.Random(1)  # first-use compiles of every batch size, over the LFPS floor
        for batch in batches:
            warm = random_prompts(rng, vocab, args.lfps_min_tokens + 256, batch)
            sessions(engine, warm, {**sampling, "max_new_tokens": 8})
        for length in lengths:
            for batch in batches:
                point = {"length": length, "batch": batch}
                need = batch * (length + args.new_tokens)
                if need > capacity:
                    points.append({**point, "skipped": f"needs {need} KV tokens, pool {capacity}"})
                    continue
                engine.flush_cache()
                rng = random.Random(length * 1000 + batch)  # the same prompts for every variant
                prompts = random_prompts(rng, vocab, length, batch)
                figures = stream_figures(*sessions(engine, prompts, sampling))
                points.append({**point, **figures})
                print(point, figures, flush=True)
    finally:
        engine.shutdown()
    return {"kv_pool_tokens": capacity, "points": points}


def random_prompts(rng: random.Random, vocab: int, length: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (clear of the vocabulary's ends)."""
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def vocab_size(model: str) -> int:
    return json.loads(Path(model, "config.json").read_text())["vocab_size"]


def child_capacity(args, variant: dict) -> dict:
    """More requests than the pool may hold, submitted at once (module docstring)."""
    import sglang as sgl

    n, length = args.capacity_requests, args.capacity_length
    base = {"disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": n,
            "log_level": "info", "decode_log_interval": 1}  # fmt: skip
    if args.mem_fraction_static > 0:  # else SGLang's default for the GPU
        base["mem_fraction_static"] = args.mem_fraction_static
    lfps = {"redknot_lfps_min_tokens": args.lfps_min_tokens, "redknot_lfps_max_requests": n}
    context = length + args.capacity_new_tokens + 64
    options = engine_options(variant, base, lfps)
    started = time.perf_counter()
    engine = sgl.Engine(**common.engine_kwargs(args.throughput_model, context, **options))
    startup_s = time.perf_counter() - started
    vocab = vocab_size(args.throughput_model)
    sampling = {"temperature": 0.0, "max_new_tokens": args.capacity_new_tokens, "ignore_eos": True}
    try:
        pool = int(engine.get_server_info()["max_total_num_tokens"])
        common.launch_server_warmup(engine)
        rng = random.Random(length)  # the same prompts for every variant
        prompts = random_prompts(rng, vocab, length, n)
        outputs: list = [None] * n
        submitted, streams = sessions(engine, prompts, sampling, outputs, args.capacity_deadline)
        finished = sum(1 for s in streams if s and s[-1][1] >= args.capacity_new_tokens)
        begun = [s for s in streams if any(k >= 1 for _, k in s)]  # a first token came back
        figures = stream_figures(submitted, begun) if begun else {}
        figures.update(sessions_started=len(begun), sessions_finished=finished)
    finally:
        engine.shutdown()
    fit = pool // (length + args.capacity_new_tokens)
    run = {"requests": n, "length": length, "new_tokens": args.capacity_new_tokens,
           "kv_pool_tokens": pool, "fit_by_pool": fit, "startup_s": startup_s,
           **figures}  # fmt: skip
    print(run, flush=True)
    return {"capacity": {**run, "output_ids": outputs}}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- the runner ---------------------------------------------------------------------------


def prompt_job(tokenizer, cases) -> dict:
    """What every accuracy child serves: each case composed as the evaluation composes it
    (``case id -> ids``) and the stop tokens of ``redknot.eval``'s server backend."""
    from redknot.eval.compose import compose

    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return {"stop_token_ids": sorted(t for t in stops if isinstance(t, int) and t >= 0),
            "prompts": {c.id: list(compose(tokenizer, c).ids) for c in cases}}  # fmt: skip


def prepare_accuracy(args, workdir: str) -> tuple[list, dict, object, str]:
    """The cases, their prompts (``case id -> ids``), the tokenizer, the children's job file."""
    from transformers import AutoTokenizer

    from redknot.eval.cases import load_cases
    from redknot.reference.loading import resolve_source

    source = resolve_source(args.tokenizer or args.accuracy_model)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
    cases = load_cases(args.cases)[: args.limit]
    job = prompt_job(tokenizer, cases)
    prompts = job["prompts"]
    lengths = [len(p) for p in prompts.values()]
    print(f"prompt tokens {min(lengths)}-{max(lengths)} over {len(cases)} cases", flush=True)
    if max(lengths) + args.max_new_tokens > args.context_length:
        raise SystemExit(f"a prompt of {max(lengths)} tokens exceeds --context-length")
    if min(lengths) < args.lfps_min_tokens:
        print(f"warning: prompts under {args.lfps_min_tokens} tokens decode densely", flush=True)
    path = Path(workdir, "prompts.json")
    path.write_text(json.dumps(job))
    return cases, prompts, tokenizer, str(path)


def settings_of(args, modes: list[str], prompts: dict) -> dict:
    out: dict = {"modes": modes, "lfps_min_tokens": args.lfps_min_tokens}
    if "accuracy" in modes:
        lengths = [len(p) for p in prompts.values()]
        out["accuracy"] = {"model": args.accuracy_model, "cases": args.cases,
                           "case_count": len(prompts), "context_length": args.context_length,
                           "max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                           "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
                           "mem_fraction_static": args.accuracy_mem_fraction}  # fmt: skip
    if "capacity" in modes:
        out["capacity"] = {"model": args.throughput_model, "load_format": "dummy",
                           "requests": args.capacity_requests, "length": args.capacity_length,
                           "new_tokens": args.capacity_new_tokens,
                           "mem_fraction_static": args.mem_fraction_static}  # fmt: skip
    if "throughput" in modes:
        out["throughput"] = {"model": args.throughput_model, "load_format": "dummy",
                             "lengths": _ints(args.lengths), "batches": _ints(args.batches),
                             "new_tokens": args.new_tokens,
                             "mem_fraction_static": args.mem_fraction_static,
                             "timing": "chunks streamed to the engine's process, "
                             "time.perf_counter at receipt, meta_info completion_tokens"}  # fmt: skip
    return out


def engine_info(result: dict) -> dict:
    """What a child's log and exit say of its engine: the most requests one decode batch ran,
    the server's first LFPS lines (not its options' dump), and its error if it failed."""
    lines = result.pop("log_lines", [])
    running = [int(m.group(1)) for m in map(RUNNING.search, lines) if m]
    lfps = [x[:300] for x in lines if "lfps" in x.lower() and "ServerArgs" not in x]
    info = {"peak_running": max(running, default=None), "lfps_log_lines": lfps[:10]}
    if "error" in result:
        info.update(error=result["error"], error_lines=result.get("error_lines", []),
                    log_tail=result["log_tail"])  # fmt: skip
    return info


def run(args, modes: list[str], workdir: str) -> dict:
    """Every variant of every mode in a child of its own; the JSON rewritten after each."""
    plans = {m: split_variants(args.variants or DEFAULT_VARIANTS[m]) for m in modes}
    variants = dict(parse_variant(spec) for specs in plans.values() for spec in specs)
    prompts: dict = {}
    if "accuracy" in modes:
        cases, prompts, tokenizer, job = prepare_accuracy(args, workdir)
        decode = partial(tokenizer.decode, skip_special_tokens=True)
    settings = settings_of(args, modes, prompts)
    per_case, per_point, per_capacity, engines = [], [], [], defaultdict(dict)
    for mode in modes:
        forward = common.forward_args(
            args, "lfps_min_tokens", "accuracy_model", "context_length", "max_new_tokens",
            "accuracy_mem_fraction", "throughput_model", "lengths", "batches", "new_tokens",
            "mem_fraction_static", "capacity_requests", "capacity_length", "capacity_new_tokens",
        ) + ["--mode", mode]  # fmt: skip
        if args.capacity_deadline:
            forward += ["--capacity-deadline", str(args.capacity_deadline)]
        if mode == "accuracy":
            forward += ["--prompts", job]
        for spec in plans[mode]:
            name = spec.split("=")[0]
            res = common.run_child(__file__, forward + ["--child", spec], log_grep=LOG_GREP)
            engines[mode][name] = engine_info(res)
            if "outputs" in res:
                per_case += variant_rows(name, cases, prompts, res["outputs"], decode)
            per_point += [{"variant": name, **point} for point in res.get("points", [])]
            if mode == "capacity":
                row = {"variant": name, **res.get("capacity", {}),
                       "peak_running": engines[mode][name]["peak_running"]}  # fmt: skip
                if "error" in res:
                    row["error"] = res["error"]
                per_capacity.append(row)
            print(mode, name, json.dumps(engines[mode][name])[:400], flush=True)
            figures = assemble(settings, variants, per_case, per_point, dict(engines),
                               per_capacity)  # fmt: skip
            common.write_json(args.out, common.record(**figures))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=("accuracy", "throughput", "capacity", "both"),
                    default="both", help="both: accuracy and throughput")  # fmt: skip
    ap.add_argument("--variants", default=None, help="default: per mode, DEFAULT_VARIANTS")
    ap.add_argument("--lfps-min-tokens", type=int, default=1024)
    ap.add_argument("--accuracy-model", default=SMOL_MODEL, help="real weights")
    ap.add_argument("--tokenizer", default=None, help="default: the accuracy model's")
    ap.add_argument("--cases", default=str(common.ROOT / "benchmarks/cases/long_v1.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="the first N cases")
    ap.add_argument("--context-length", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--accuracy-mem-fraction", type=float, default=0.3)
    ap.add_argument("--throughput-model", default=common.DEFAULT_MODEL, help="dummy weights")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8,
                    help="capacity mode: 0 for SGLang's default")  # fmt: skip
    ap.add_argument("--capacity-requests", type=int, default=6)
    ap.add_argument("--capacity-length", type=int, default=130000, help="prompt tokens")
    ap.add_argument("--capacity-new-tokens", type=int, default=16)
    ap.add_argument(
        "--capacity-deadline",
        type=float,
        default=None,
        help="seconds after submission to stop waiting (the figures of what ran)",
    )
    ap.add_argument("--commit", default=None, help="record this commit instead of git's")
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/lfps_serve.json"))
    ap.add_argument("--merge", default=None, help="comma-separated results to join into --out")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _, variant = parse_variant(args.child)
        child = {"accuracy": child_accuracy, "capacity": child_capacity}.get(
            args.mode, child_throughput
        )
        print("RESULT " + json.dumps(child(args, variant)), flush=True)
        return
    if args.merge:
        merged = merge({p: json.loads(Path(p).read_text()) for p in args.merge.split(",")})
        command = " ".join([Path(sys.executable).name] + sys.argv)
        common.write_json(args.out, {**merged, "command": command})
        print(json.dumps(merged["summary"], indent=1))
        return
    if args.commit:
        os.environ["REDKNOT_COMMIT"] = args.commit  # what common.git_commit records
    modes = ["accuracy", "throughput"] if args.mode == "both" else [args.mode]
    for mode in modes:  # a malformed variant is refused before any engine starts
        parse_variants(args.variants or DEFAULT_VARIANTS[mode])
    with tempfile.TemporaryDirectory() as workdir:
        figures = run(args, modes, workdir)
    print(json.dumps(figures["summary"], indent=1))


if __name__ == "__main__":
    main()
