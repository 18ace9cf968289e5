"""Time to first token of a prompt made of cached segments: flashinfer vs redknot, one GPU.

The prompt is one unique token (so no two measured prompts share a cached prefix), ``S``
documents of ``L / S`` tokens each, and a ``--question``-token question; ``(L, S)`` runs over
``--points`` (``LxS,...``; ``--sweep`` takes the context-length sweep 8K-64K at 8 segments and
the segment-count sweep 2-32 at 32K). Variants (each an ``sgl.Engine`` on the 8B shape with
dummy weights):

- ``flashinfer``: full prefill with the flashinfer backend;
- ``flashinfer-aa``: the same in another engine, compared with the first (an A/A control: how
  far two engines doing the same work differ; list it last to see the drift of later engines);
- ``redknot-all-global``: every head global (the dense computation through redknot);
- ``redknot-g0.125``: the synthetic 1/8 map, plain prompt (head-class prefill, no reuse);
- ``redknot-g0.125-reuse``: the same map; the documents are registered first (standalone
  prefill, not timed) and the prompt marks them as segments, so local heads take the cached,
  re-aligned K/V (``redknot.segcache.reuse``);
- ``naive``, ``epic``, ``cacheblend``, ``sparsex``: the token-level policies
  (``--redknot-policy``, every head global, default knobs) on the same registered documents
  (the hybrid ``redknot+sparseq`` is no longer served, see
  ``redknot.config.REFERENCE_ONLY_POLICIES``; older results name it
  ``redknot-g0.125-reuse-sparseq``). A policy variant takes its knobs in the evaluation's label
  format, e.g. ``cacheblend[blend_ratio=0.3]`` or ``sparsex[sparseq_k=256,sparseq_block=8]``
  (a TTFT front over the knobs);
- ``samkv``: SamKV served (``--redknot-policy samkv``): a prompt whose stored documents hold at
  least ``--redknot-samkv-min-tokens`` is cut to their anchors and kept blocks before SGLang
  counts it (``docs/samkv.md``), smaller ones are computed in full; knobs as the policies',
  e.g. ``samkv[samkv_min_tokens=0]`` (cut at every size). Its ``flops`` are those of the rows
  the cut prompt computes (the first token, each document's anchors, the question: projections,
  FFN, attention over the served rows before them; the block choice's scoring is not counted),
  taken from the answer's reuse report (``samkv`` in the row).

TTFT is the wall time of ``engine.generate(max_new_tokens=1)`` for one prompt (median of
``--reps`` after one warm-up at each point; the warm-up's own TTFT is kept as ``warmup_ttft_s``:
at the first point it is the engine's first reusing prompt, and ``--compile-log`` names the
Triton kernels compiled at startup and in each warm-up, from an empty cache). Each engine first
runs the warm-up request ``launch_server`` sends once it is up (three tokens, eight new ones),
so SGLang's own first-use builds are not counted in a first prompt. ``flops`` is the analytical prefill FLOPs of the
schedule each variant runs (projections and FFN of every token, attention over the keys each
head sees); for ``redknot-g0.125-reuse-sparse-ffn`` (``--redknot-dense-layers 8``: the FFN of
deeper layers runs only on the segment tokens the question attends to most) minus the FFNs the
server reports it skipped; for every variant that leaves rows to the cache (``-cached`` and the
token-level policies) minus each left token-layer's projections, FFN and attention row. A reuse
point where any marked segment missed the store is reported with its misses
(``segment_store``) and flagged, never averaged in silently: the store is sized by
``--segment-fraction`` so that one point's documents fit. Prompts of a few thousand tokens are
host-bound, and a host's speed moves over a run (the host probe, ``redknot.costmodel.host_probe``,
went from 0.066 to 0.108 ms between the start and the end of one H200 run): ``--probe-points``
probes it in each engine's process before and after each point (``host_probe_ms``). A point
listed again is measured again later in the same engine, on new documents, as ``LxS#2``: the
same work at another time, to tell a slow point from a slow state of the engine. Every timed
prompt is sent ``--settle-ms`` (10 ms) after the engine's last answer: the scheduler works on
for a few ms after answering (an H200 at 1K tokens: ~3.5 ms), and a prompt sent at once waits
for that, so prompts that followed different work or a different client-side pause were timed
unequally (results before ``settle_ms`` was recorded sent each prompt at once);
``--back-to-back N`` measures that wait per point.

    python benchmarks/ttft.py --out benchmarks/results/ttft.json
    python benchmarks/ttft.py --sweep --variants flashinfer,redknot-g0.125-reuse \\
        --out benchmarks/results/ttft_sweep.json
    python benchmarks/ttft.py --merge A.json,B.json --out C.json  # runs split over calls
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common
from serving_common import phases_of

SINK, WINDOW = 64, 256
DENSE_LAYERS = 8  # a quarter of Llama-3.1-8B's 32 layers, the paper's proportion (20 of 80)
DECODE_GRAPH_MAX_BS = 8  # decode CUDA graphs captured at startup (the TTFT's decode step has 1)
SKIPPED = re.compile(
    r"redknot sparse FFN: (\d+) token-layer FFNs skipped"
    r"(?:.*?; (\d+) token-layers left to the cache)?"
)

RESTORE_LOG = re.compile(r"redknot restore: (\d+) local heads promoted")
POLICY_LOG = re.compile(r"redknot policy \S+: .*?; (\d+) token-layers left to the cache")
ATTENTION_LOG = re.compile(r"token-layers left to the cache; attention (.*)$")  # its kernels

VARIANTS = {  # name -> (global fraction or None for flashinfer, all-global, reuse, dense layers,
    #                   what becomes of a row that skips a deep FFN, token-level policy)
    "flashinfer": (None, False, False, None, None, None),
    "flashinfer-aa": (None, False, False, None, None, None),
    "redknot-all-global": (1.0, True, False, None, None, None),
    "redknot-g0.125": (0.125, False, False, None, None, None),
    "redknot-g0.125-reuse": (0.125, False, True, None, None, None),
    "redknot-g0.125-reuse-sparse-ffn": (0.125, False, True, DENSE_LAYERS, "residual", None),
    "redknot-g0.125-reuse-sparse-cached": (0.125, False, True, DENSE_LAYERS, "cached", None),
    # token-level policies (every head global) at their default knobs
    "naive": (1.0, True, True, None, None, "naive"),
    "epic": (1.0, True, True, None, None, "epic"),
    "cacheblend": (1.0, True, True, None, None, "cacheblend"),
    "sparsex": (1.0, True, True, None, None, "sparsex"),
    "samkv": (1.0, True, True, None, None, "samkv"),
}


GATE_KNOBS = ("reuse_gate", "cost_record")  # cost_record: a record file on the GPU machine
POLICY_KNOBS = {  # the server's knobs of each policy (--redknot-<knob>)
    "naive": GATE_KNOBS,
    "epic": ("epic_k", *GATE_KNOBS),
    "cacheblend": ("blend_check_layer", "blend_ratio", *GATE_KNOBS),
    "sparsex": ("sparseq_boundary", "sparseq_k", "sparseq_block", *GATE_KNOBS),
    # samkv: no reuse gate (its point is memory: docs/samkv.md)
    "samkv": (
        "samkv_block",
        "samkv_budget",
        "samkv_init_blocks",
        "samkv_local_blocks",
        "samkv_bias",
        "samkv_min_tokens",
    ),
}
RECOVERY_KNOBS = (  # -reuse variants
    "local_kv", "restore_thresh", "restore_edge", "restore_heads", *GATE_KNOBS,
)  # fmt: skip


def variant_knobs(base: str) -> tuple[str, ...]:
    """The knobs a variant takes in brackets: its policy's, or redknot's recovery's."""
    _, _, reuse, _, _, policy = VARIANTS[base]
    if policy is not None:
        return POLICY_KNOBS[policy]
    return RECOVERY_KNOBS if reuse else ()


def split_variants(text: str) -> list[str]:
    """``"flashinfer,sparsex[sparseq_k=256,sparseq_block=8]"`` -> the two names (commas inside
    brackets belong to the knobs)."""
    return [m.strip() for m in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if m.strip()]


def parse_variant(name: str) -> tuple[str, dict]:
    """``"cacheblend[blend_ratio=0.3]"`` -> ``("cacheblend", {"blend_ratio": 0.3})``: a variant
    of :data:`VARIANTS`, with knobs of its policy in the evaluation's label format."""
    base, _, rest = name.partition("[")
    if base not in VARIANTS:
        raise SystemExit(f"--variants: {base!r} is not one of {', '.join(VARIANTS)}")
    if not rest:
        return base, {}
    allowed = variant_knobs(base)
    knobs = {}
    for item in rest.rstrip("]").split(","):
        key, _, value = item.partition("=")
        if key not in allowed or not value:
            raise SystemExit(
                f"--variants: {name!r}: knobs of {base} are {', '.join(allowed) or 'none'}"
            )
        try:
            knobs[key] = float(value) if "." in value else int(value)
        except ValueError:
            knobs[key] = value  # a word (local_kv=fresh)
    return base, knobs


def token_layer_flops(cfg: dict) -> tuple[int, int]:
    """FLOPs of one token in one layer: (q, k, v, o projections; FFN)."""
    h, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    return 2 * h * d * (2 * hq + 2 * hkv), 2 * 3 * h * cfg["intermediate_size"]


def left_row_flops(cfg: dict, length: int, global_fraction: float) -> float:
    """FLOPs one segment token left to the cache saves in one layer: its projections, its FFN
    and its attention query row (keys estimated at the mean position ``length / 2`` for global
    heads, sink + window for local ones)."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // hq
    proj, ffn = token_layer_flops(cfg)
    keys = global_fraction * length / 2 + (1 - global_fraction) * min(SINK + WINDOW, length)
    return proj + ffn + 4 * d * hq * keys


def prefill_flops(cfg: dict, length: int, global_fraction: float | None) -> float:
    """Analytical prefill FLOPs of one ``length``-token prompt (multiply-add = 2 FLOPs)."""
    full_keys = length * (length + 1) / 2  # causal (query, key) pairs of one head
    ring = SINK + WINDOW
    local_keys = (
        sum(min(j + 1, ring) for j in range(min(length, ring))) + max(length - ring, 0) * ring
    )
    g = 1.0 if global_fraction is None else global_fraction
    return rows_prefill_flops(cfg, length, g * full_keys + (1 - g) * local_keys)


def samkv_work(
    head: int, doc_tokens: list[int], question: int, report: dict, block: int, init_blocks: int
) -> tuple[int, float]:
    """What one layer of a SamKV-cut prompt computes (``redknot.recovery.samkv.served``): the
    rows it runs (the ``head`` tokens, each document's anchors, the ``question``; its middle
    slots take cached K/V) and the causal (query, key) pairs of those rows over the served
    prompt. ``report``: the answer's ``samkv`` reuse report (``kept_blocks`` and ``blocks``
    per document, in prompt order)."""
    rows, pairs, pos = 0, 0.0, 0

    def run(n: int) -> None:  # n computed rows at served positions pos .. pos + n - 1
        nonlocal rows, pairs, pos
        rows += n
        pairs += n * pos + n * (n + 1) / 2
        pos += n

    run(head)
    for n, kept, middle in zip(doc_tokens, report["kept_blocks"], report["blocks"], strict=True):
        init = min(init_blocks * block, n)
        run(init)
        pos += kept * block  # middle slots: no row computed
        run(n - init - middle * block)  # local anchors (the remainder with them)
    run(question)
    if pos != report["served_tokens"]:
        raise ValueError(f"samkv report of {report['served_tokens']} served tokens does not "
                         f"match the layout ({pos})")  # fmt: skip
    return rows, pairs


def rows_prefill_flops(cfg: dict, rows: int, pairs: float) -> float:
    """Prefill FLOPs when every layer computes ``rows`` rows and each query head attends
    ``pairs`` (query, key) pairs: a prompt's (:func:`prefill_flops`), a cut one's
    (:func:`samkv_work`)."""
    h, hq = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // hq
    proj, ffn = token_layer_flops(cfg)
    return cfg["num_hidden_layers"] * (rows * (proj + ffn) + 4 * d * hq * pairs)


SWEEP = "8192x8,16384x8,32768x8,65536x8,32768x2,32768x4,32768x16,32768x32"
STORE_COUNTERS = ("hits", "misses", "hit_tokens")
GATE_COUNTERS = ("served_with_reuse", "served_without_reuse")  # redknot.costmodel.gate


def parse_points(text: str, flag: str = "--points") -> list[tuple[int, int]]:
    """``"32768x8,8192x2"`` -> ``[(32768, 8), (8192, 2)]`` (context length x segment count);
    ``flag`` names the option in the error."""
    points = []
    for item in text.split(","):
        length, _, segments = item.strip().partition("x")
        if not (length.isdigit() and segments.isdigit() and int(segments) > 0):
            raise SystemExit(f"{flag}: {item!r} is not LENGTHxSEGMENTS (e.g. 32768x8)")
        points.append((int(length), int(segments)))
    return points


NEUTRAL_PARAMS = {"probe": 0}  # a key nothing reads (as ttft_side_by_side.py)


def median_ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 3)


def queue_phases(answer: dict, sent: float, took: float) -> dict[str, float] | None:
    """A prompt's phases (``serving_common.PHASES`` from SGLang's timestamps; ``http_in`` is
    the engine's own entry here), with ``to_forward`` split at the waiting queue where SGLang
    reports the queue time (``to_queue``: IPC and the request's handling; ``queue``); None
    without the timestamps."""
    meta = answer.get("meta_info") or {}
    phases = phases_of(meta, sent, took)
    queue = meta.get("queue_time")  # forward entry - entry into the waiting queue
    if phases is not None and isinstance(queue, (int, float)):
        phases["to_queue"] = phases["to_forward"] - queue
        phases["queue"] = queue
    return phases


def phases_summary(row_phases: dict[str, list[dict]]) -> dict:
    """``phases_ms``: per kind of prompt, the median of each phase (ms) (``to_queue`` and
    ``queue`` split ``to_forward`` where SGLang reports the queue time); ``phase_samples_ms``:
    every prompt's, in order; ``phases_paired_ms`` (marked and recompute prompts timed rep by
    rep): the median over reps of the marked prompt's phase minus its recompute's;
    ``phases_paired_params_ms`` (``--params-too``): the same against the neutral-params
    prompt."""
    names = list(next(iter(row_phases.values()))[0])  # serving_common.PHASES, the queue's
    out = {
        "phases_ms": {
            kind: {name: median_ms([p[name] for p in seen]) for name in names}
            for kind, seen in row_phases.items()
        },
        "phase_samples_ms": {
            kind: [{name: round(1e3 * p[name], 3) for name in names} for p in seen]
            for kind, seen in row_phases.items()
        },
    }
    marked = row_phases.get("marked")
    for kind, key in (("recompute", "phases_paired_ms"), ("params", "phases_paired_params_ms")):
        other = row_phases.get(kind)
        if marked and other and len(marked) == len(other):
            out[key] = {
                name: median_ms([m[name] - r[name] for m, r in zip(marked, other)])
                for name in names
            }
    return out


def point_key(length: int, segments: int) -> str:
    return f"{length}x{segments}"


def point_keys(points: list[tuple[int, int]]) -> list[str]:
    """The result key of each point: ``LxS``, and ``LxS#n`` for its ``n``-th repeat (a point
    listed again is measured again, on new documents, later in the same engine)."""
    seen: Counter = Counter()
    keys = []
    for point in points:
        seen[point] += 1
        keys.append(point_key(*point) + (f"#{seen[point]}" if seen[point] > 1 else ""))
    return keys


def child(args) -> None:
    import sglang as sgl

    from redknot.api.marks import SegmentMark, encode_marks
    from redknot.segcache.entry import segment_id

    base, knobs = parse_variant(args.child)
    fraction, all_global, reuse, dense_layers, skipped, policy = VARIANTS[base]
    points = parse_points(args.points)
    extra = {
        "mem_fraction_static": args.mem_fraction_static,
        "disable_prefill_cuda_graph": not args.prefill_graph_tokens,
        # Decode graphs for small batches only (quicker startup). Not none: SGLang's overlap
        # scheduler launches the next (decode) step of a one-token prompt before it returns
        # the prompt's token, so an eager decode step would count in the TTFT.
        "cuda_graph_max_bs_decode": DECODE_GRAPH_MAX_BS,
        "chunked_prefill_size": args.chunked_prefill_size,
    }
    if args.prefill_graph_tokens:  # SGLang's default prefill graph, captured up to this size
        extra["cuda_graph_max_bs_prefill"] = args.prefill_graph_tokens
    if fraction is None:
        extra["attention_backend"] = "flashinfer"
    else:
        extra["attention_backend"] = "redknot"
        extra["redknot_segment_fraction"] = args.segment_fraction
        if dense_layers is not None:
            extra["redknot_dense_layers"] = dense_layers
            extra["redknot_skipped"] = skipped
            extra["log_level"] = "info"  # the sparse-FFN log lines count what was skipped
        extra.update({f"redknot_{k}": v for k, v in knobs.items()})
        if policy is not None:
            extra["redknot_policy"] = policy
            extra["log_level"] = "info"  # the policy's log lines count the rows that left
        elif all_global:  # (token-level policies serve every head global by themselves)
            extra["redknot_all_global"] = True
        if not all_global:
            extra["redknot_head_map"] = common.synthetic_map_file(args.model, fraction, "/tmp")
    context = max(length for length, _ in points) + args.question + 64
    if args.compile_log:  # a cache of its own: every Triton kernel this engine uses compiles
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="redknot-triton-")
    if args.phases:  # SGLang's per-request timestamps in each answer's meta_info
        extra["enable_metrics"] = True
    engine = sgl.Engine(**common.engine_kwargs(args.model, context, **extra))
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def store_counters() -> dict:
        state = engine.get_server_info()["internal_states"][0]
        info, gate = state.get("redknot_segments", {}), state.get("redknot_reuse_gate", {})
        counts = {k: info.get(k, 0) for k in STORE_COUNTERS}
        counts.update({k: gate.get(k, 0) for k in GATE_COUNTERS})
        counts["host_scale"] = gate.get("host_scale")
        counts["measured"] = gate.get("measured")  # the gate's measured correction
        return counts

    def gc_total() -> float | None:
        """The scheduler's garbage-collection pauses so far (ms, every generation); None where
        the server does not count them (not a redknot scheduler)."""
        state = engine.get_server_info()["internal_states"][0].get("redknot_process")
        if state is None:
            return None
        return sum(gen["pause_ms"] for gen in state["gc"].values())

    gc_seen = [gc_total() if args.gc_prompts else None]  # the last reading

    def gc_after(kind: str, rep: int, row_gc: dict) -> None:
        """With ``--gc-prompts``: the collector's pauses since the last reading, which ended the
        prompt before, into ``row_gc[kind]`` (rep 0, the warm-up, is read and not kept). A
        collection the reading itself sets off counts toward the next prompt, of either kind."""
        if gc_seen[0] is None:
            return
        now = gc_total()
        answered[0] = time.perf_counter()  # the reading is an answer of the engine's too
        if rep:
            row_gc.setdefault(kind, []).append(round(now - gc_seen[0], 4))
        gc_seen[0] = now

    answered = [time.perf_counter()]  # when the engine last answered

    def timed(ids: list[int], sampling: dict, settle: bool = True) -> tuple[dict, float, float]:
        """``engine.generate`` of one prompt, sent ``--settle-ms`` after the engine's last
        answer (``settle``; else at once): (answer, wall-clock send time, seconds to answer).
        The scheduler works on for a few ms after an answer, and a prompt that arrives then
        waits for it: a fixed gap gives every kind of prompt the same wait."""
        if settle:
            common.settle(answered[0], args.settle_ms)
        sent, t0 = time.time(), time.perf_counter()
        answer = engine.generate(input_ids=ids, sampling_params=sampling)
        answered[0] = time.perf_counter()
        return answer, sent, answered[0] - t0

    server_warmup_s = common.launch_server_warmup(engine)
    if args.freeze_gc:  # SGLang's own advice against long collections, after its warm-up
        engine.freeze_gc()
    compiled_at_startup = compiled = triton_kernels() if args.compile_log else {}
    one = {"temperature": 0.0, "max_new_tokens": 1}
    profile_points = None  # with --profile-points, the points profiled
    if args.profile_points:
        profile_points = {
            point_key(*p) for p in parse_points(args.profile_points, "--profile-points")
        }

    def phases_after(kind: str, answer: dict, sent: float, took: float, row_phases: dict):
        """With ``--phases``: the timed prompt's phases (:func:`queue_phases`) into
        ``row_phases[kind]``."""
        if args.phases:
            phases = queue_phases(answer, sent, took)
            if phases is not None:
                row_phases.setdefault(kind, []).append(phases)

    def recompute(
        fresh: list[int], rep: int, samples: list[float], row_gc: dict, row_phases: dict,
        kind: str = "recompute",
    ) -> None:  # fmt: skip
        """The prompt ``fresh`` (fresh tokens, no marks), timed into ``samples`` (rep 0: the
        warm-up, not timed); ``kind`` "params": with a neutral ``custom_params``."""
        sampling = dict(one)
        if kind == "params":
            sampling["custom_params"] = dict(NEUTRAL_PARAMS)
        answer, sent, took = timed(fresh, sampling)
        gc_after(kind, rep, row_gc)
        if rep:
            samples.append(took)
            phases_after(kind, answer, sent, took, row_phases)

    def back_to_back(prompt_tokens: int) -> dict:
        """``--back-to-back N``: N pairs of prompts of fresh tokens (no marks), the first sent
        ``--settle-ms`` after the engine's last answer, the second at once after the first's:
        what a prompt that arrives while the scheduler still works on the answer before it
        waits (``extra_ms``: the median over pairs of the second's TTFT minus the first's;
        with ``--phases`` each one's ``to_queue``, the wait before the scheduler's queue)."""
        settled, at_once, queues = [], [], {"settled": [], "back_to_back": []}
        for _ in range(args.back_to_back):
            first, second = rand(prompt_tokens), rand(prompt_tokens)  # both built before
            for ids, settle, times, kind in (
                (first, True, settled, "settled"), (second, False, at_once, "back_to_back")
            ):  # fmt: skip
                answer, sent, took = timed(ids, one, settle)
                times.append(took)
                phases = queue_phases(answer, sent, took) if args.phases else None
                if phases is not None and "to_queue" in phases:
                    queues[kind].append(phases["to_queue"])
        out = {
            "pairs": args.back_to_back,
            "settled_ttft_s": statistics.median(settled),
            "back_to_back_ttft_s": statistics.median(at_once),
            "extra_ms": median_ms([b - a for a, b in zip(settled, at_once)]),
        }
        if queues["settled"] and queues["back_to_back"]:
            out["to_queue_ms"] = {kind: median_ms(xs) for kind, xs in queues.items()}
        return out

    profiler_warm: list[bool] = []  # the throwaway first profile has run

    def under_profiler(ids: list[int], sampling: dict, where: Path) -> None:
        """The prompt ``ids`` with a first token no earlier prompt had, traced into ``where``."""
        ids[0] = rand(1)[0]
        start_profile(engine, where)
        engine.generate(input_ids=ids, sampling_params=sampling)
        engine.stop_profile()

    out = {}
    try:
        for key, (length, segments) in zip(point_keys(points), points):
            docs = [rand(length // segments) for _ in range(segments)]
            prompt_tokens = 1 + sum(map(len, docs)) + args.question  # as the marked prompts
            if reuse:
                for doc in docs:
                    mark = SegmentMark(0, len(doc), "bench", segment_id("bench", doc))
                    params = encode_marks([mark], register=True, pin=False)
                    engine.generate(
                        input_ids=doc,
                        sampling_params={"max_new_tokens": 0, "custom_params": params},
                    )
                answered[0] = time.perf_counter()
                before = store_counters()
            probed = [point_probe()] if args.probe_points else []  # the host's speed now
            times, reports, plain, params = [], [], [], []
            row_gc: dict[str, list[float]] = {}  # --gc-prompts: the collector's ms per prompt
            row_phases: dict[str, list[dict]] = {}  # --phases: each timed prompt's phases
            gc_after("before", 0, row_gc)  # registrations and probes are not a prompt's
            # the same prompt shape, nothing stored: how this engine computes a prompt without
            # reuse (what its gate compares reuse with), interleaved with the marked prompts so
            # that a host whose speed drifts during the point moves both alike
            own = args.own_recompute and reuse
            for rep in range(args.reps + 1):
                # every prompt of a rep is built before any is sent, so that each leaves right
                # after the answer before it, whatever its kind (drawing 1,089 fresh tokens
                # takes ~0.5 ms; the scheduler still works for a few ms after an answer)
                fresh = rand(prompt_tokens) if own else None
                neutral = rand(prompt_tokens) if own and args.params_too else None
                ids, marks = [rand(1)[0]], []
                for doc in docs:
                    marks.append(SegmentMark(len(ids), len(ids) + len(doc), "bench",
                                             segment_id("bench", doc)))  # fmt: skip
                    ids += doc
                ids += rand(args.question)
                sampling = dict(one)
                if reuse:
                    sampling["custom_params"] = encode_marks(marks)
                if own and rep % 2:  # every other rep times its recompute first
                    recompute(fresh, rep, plain, row_gc, row_phases)
                if neutral is not None:  # right before the marked prompt
                    recompute(neutral, rep, params, row_gc, row_phases, "params")
                profiled = args.profile_warmup and not rep and not out
                if profiled:  # the engine's first prompt of this kind, under the profiler
                    start_profile(engine, Path(args.profile_dir, f"{args.child}-warmup"))
                answer, sent, took = timed(ids, sampling)
                gc_after("marked" if reuse else "prompt", rep, row_gc)
                if rep:  # the first is a warm-up
                    times.append(took)
                    phases_after("marked" if reuse else "prompt", answer, sent, took, row_phases)
                    if policy == "samkv":  # how the prompt was served (its reuse report)
                        reports.append(
                            (answer["meta_info"].get("redknot_reuse") or [{}])[0].get("samkv")
                        )
                else:
                    warmup_s = took
                    warmup_at = time.time() - warmup_s  # wall clock, to match compile logs
                    if profiled:
                        engine.stop_profile()
                    if args.compile_log:  # what compiled in the point's first prompt
                        now = triton_kernels()
                        first_compiles = {
                            k: n - compiled.get(k, 0) for k, n in now.items()
                            if n > compiled.get(k, 0)
                        }  # fmt: skip
                        compiled = now
                if own and not rep % 2:
                    recompute(fresh, rep, plain, row_gc, row_phases)
            back = back_to_back(prompt_tokens) if args.back_to_back else None
            profile_point = profile_points is None or point_key(length, segments) in profile_points
            if args.profile_dir and not args.profile_warmup and profile_point:  # one more,
                # under the profiler
                if not profiler_warm:  # the process's first profile is slower throughout: a
                    # throwaway one first, kept apart (not summarised)
                    profiler_warm.append(True)
                    under_profiler(ids, sampling, Path(f"{args.profile_dir}-warmup", args.child))
                under_profiler(ids, sampling, Path(args.profile_dir, f"{args.child}-{key}"))
            row = {
                "length": length,
                "segments": segments,
                "prompt_tokens": len(ids),
                "ttft_s": statistics.median(times),
                "ttft_samples_s": times,
                "warmup_ttft_s": warmup_s,  # the point's first prompt (the engine's first too)
            }
            if reports:
                row.update(samkv_row(reports, [len(d) for d in docs], args.question, knobs))
            if probed:  # and after the point's prompts (its own recompute's included)
                row["host_probe_ms"] = probed + [point_probe()]
            if row_gc:  # per timed prompt, in order
                row["gc_pause_ms"] = row_gc
            if back is not None:
                row["back_to_back"] = back
            if row_phases:  # per kind, each phase's median (ms)
                row.update(phases_summary(row_phases))
            if params:  # --params-too: fresh tokens with a neutral custom_params
                row["params_ttft_s"] = statistics.median(params)
                row["params_samples_s"] = params
                row["params_paired"] = [a / b for a, b in zip(params, times)]
            if plain:
                row["own_recompute_ttft_s"] = statistics.median(plain)
                row["own_recompute_samples_s"] = plain
                # rep by rep (each pair timed back to back): recompute / reuse
                row["own_recompute_paired"] = [a / b for a, b in zip(plain, times)]
            if args.compile_log:
                row["triton_compiled_in_warmup"] = first_compiles
                row["warmup_started_at"] = warmup_at
            if reuse:  # this point's lookups only (warm-up included)
                after = store_counters()
                row["segment_store"] = {k: after[k] - before[k] for k in STORE_COUNTERS}
                row["every_segment_hit"] = row["segment_store"]["misses"] == 0
                # how the reuse gate served this point's prompts (warm-up included)
                gate = {k: after[k] - before[k] for k in GATE_COUNTERS}
                if any(gate.values()):  # none: no gate decided (reuse_gate=always)
                    row["served"] = ["reuse"] * gate["served_with_reuse"] + ["recomputed"] * gate[
                        "served_without_reuse"
                    ]
                if after.get("host_scale") is not None:  # the gate's factor on the record's host
                    row["gate_host_scale"] = after["host_scale"]  # constants (its own probe)
                if after.get("measured") is not None:  # what its measured correction holds
                    row["gate_measured"] = after["measured"]
            out[key] = row
            print(args.child, length, segments, row["ttft_s"], flush=True)
    finally:
        engine.shutdown()
    result = {"points": out, "server_warmup_s": server_warmup_s}
    if args.compile_log:
        result["triton_compiled_at_startup"] = compiled_at_startup
    print("RESULT " + json.dumps(result))


def samkv_row(reports: list, doc_tokens: list[int], question: int, knobs: dict) -> dict:
    """A samkv point's figures: the last measured prompt's reuse report, and the rows its layers
    computed (``samkv_rows``, ``samkv_pairs``: :func:`samkv_work`) when it was cut (the same
    layout at every rep). ``samkv_cut``: how many of the measured prompts were cut."""
    from redknot.config import RedknotConfig
    from redknot.recovery.samkv.served import SamkvKnobs

    served = SamkvKnobs.of(RedknotConfig(policy="samkv", **knobs))  # as the server reads them
    cut = [r for r in reports if r and r.get("served_tokens") is not None]
    row = {"samkv": reports[-1], "samkv_cut": len(cut)}
    if cut:
        rows, pairs = samkv_work(1, doc_tokens, question, cut[-1], served.block,
                                 served.init_blocks)  # fmt: skip
        row.update(samkv_rows=rows, samkv_pairs=pairs)
    return row


def start_profile(engine, where: Path) -> None:
    """The torch profiler (host and GPU, no stacks or shapes) on the engine, traces to ``where``."""
    engine.start_profile(
        output_dir=str(where), activities=["CPU", "GPU"], with_stack=False, record_shapes=False
    )


def triton_kernels() -> dict[str, int]:
    """Kernel name -> compiled variants in this process's Triton cache directory."""
    names = [p.stem for p in Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.json")]
    return dict(Counter(n for n in names if not n.startswith("__grp__")))


def point_probe() -> float:
    """``redknot.costmodel.host_probe.probe_ms`` in this (engine's) process, on its GPU (the
    CPU without one), between a point's prompts: how fast the host issues work at that time.
    A prompt of a few thousand tokens is host-bound, so its time moves with this."""
    import torch

    from redknot.costmodel.host_probe import probe_ms

    return round(probe_ms("cuda" if torch.cuda.is_available() else "cpu"), 5)


def host_probe() -> float | None:
    """``redknot.costmodel.host_probe.probe_ms`` on the GPU in a process of its own (this
    process holds no CUDA context while the engines run); None without a GPU."""
    code = (
        "import torch\nfrom redknot.costmodel.host_probe import probe_ms\n"
        "print(probe_ms('cuda') if torch.cuda.is_available() else '')"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    text = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
    return float(text[0]) if text and text[0] else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument(
        "--points",
        default="8192x8,16384x8,32768x8",
        help="context length x segment count, comma-separated",
    )
    ap.add_argument("--sweep", action="store_true", help=f"--points {SWEEP}")
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument(
        "--segment-fraction",
        type=float,
        default=0.25,
        help="redknot's --redknot-segment-fraction: the segment store must hold one point's "
        "documents (the 8B shape keeps about 114 KB per segment token with the 1/8 map)",
    )
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=-1,
        help="SGLang's prefill chunk (-1: one chunk per prompt; the sparse FFN acts on the chunk "
        "that ends the prompt, so chunking limits it to that chunk)",
    )
    ap.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="serve with SGLang's prefill CUDA graph (its default backend, on by default in a "
        "server) captured for prompts of up to this many tokens; 0: prefill graphs off, every "
        "extend eager",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--profile-dir",
        default="",
        help="after the timed prompts of each point, run one more under the torch profiler and "
        "write its trace under DIR/VARIANT-POINT (summarise with benchmarks/profile_summary.py)",
    )
    ap.add_argument(
        "--profile-warmup",
        action="store_true",
        help="with --profile-dir: profile the first point's warm-up prompt (the engine's first "
        "prompt of its kind: compiles and first-use costs show) instead of one more prompt",
    )
    ap.add_argument(
        "--profile-variants",
        default="",
        help="with --profile-dir: profile only these variants (comma-separated; default all)",
    )
    ap.add_argument(
        "--profile-points",
        default="",
        help="with --profile-dir: profile only these points (as --points; default all)",
    )
    ap.add_argument(
        "--compile-log",
        action="store_true",
        help="give each engine an empty Triton cache and record the kernels compiled at "
        "startup and in each point's first (warm-up) prompt (name -> new variants)",
    )
    ap.add_argument(
        "--own-recompute",
        action="store_true",
        help="also time, in each reusing engine, prompts of each point's shape with nothing "
        "stored (fresh tokens, no marks): that engine's own recompute, what its reuse gate "
        "weighs reuse against, free of the engine-to-engine spread of small prompts; one per "
        "marked prompt, timed back to back with it (every other pair recompute first)",
    )
    ap.add_argument(
        "--probe-points",
        action="store_true",
        help="also probe the host's speed (redknot.costmodel.host_probe) in each engine's "
        "process before and after each point's prompts: host_probe_ms per point, to tell a "
        "slow host from a slow path",
    )
    ap.add_argument(
        "--gc-prompts",
        action="store_true",
        help="read the scheduler's garbage-collection pauses (redknot_process in server_info) "
        "after every prompt: gc_pause_ms per point, per kind (marked, recompute, prompt), what "
        "the collector took from each timed prompt",
    )
    ap.add_argument(
        "--params-too",
        action="store_true",
        help="with --own-recompute: each rep also times a prompt of fresh tokens carrying a "
        "neutral custom_params (what carrying custom_params alone costs, the channel the marks "
        "travel in), right before the marked prompt: params_ttft_s, "
        "speedup_vs_params_paired, and with --phases phases_paired_params_ms",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="start each engine with SGLang's metrics and split every timed prompt into the "
        "phases of its timestamps (serving_common.PHASES: http_in is the engine's entry, "
        "to_forward the scheduler's queue, prefill its forward and sample, out the answer's way "
        "back): phases_ms per kind, and with --own-recompute phases_paired_ms, the median over "
        "pairs of the marked prompt's phase minus its recompute's",
    )
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=10.0,
        help="send every timed prompt this long after the engine's last answer (the scheduler "
        "works on for a few ms after an answer; a prompt sent at once waits for that, so "
        "prompts sent at once after different work would be timed unequally); 0: at once",
    )
    ap.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="N",
        help="after each point's reps, N pairs of fresh-token prompts, one sent --settle-ms "
        "after the answer before it, one at once: back_to_back per point, what the scheduler's "
        "work after an answer adds to a prompt that arrives during it",
    )
    ap.add_argument(
        "--freeze-gc",
        action="store_true",
        help="after each engine's warm-up prompt, freeze its processes' garbage collectors "
        "(SGLang's Engine.freeze_gc: every object alive then is never scanned again), to "
        "compare with a run without it: the share of the collector in small prompts' TTFT",
    )
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/ttft.json"))
    ap.add_argument(
        "--merge",
        default=None,
        help="comma-separated results of this script (same commit, device and settings) to "
        "write as one to --out, nothing run",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.params_too and not args.own_recompute:
        ap.error("--params-too times a third prompt next to each pair: give --own-recompute")
    if args.sweep:
        args.points = SWEEP
    parse_points(args.points)  # refuse a malformed list before any engine starts
    if args.profile_points:
        parse_points(args.profile_points, "--profile-points")
    for name in split_variants(args.variants):
        parse_variant(name)
    if args.child:
        child(args)
        return
    cfg = model_config(args.model)
    if args.merge:
        runs = {p: json.loads(Path(p).read_text()) for p in args.merge.split(",")}
        merged = merge(cfg, runs)
        merged["command"] = " ".join([Path(sys.executable).name] + sys.argv)
        common.write_json(args.out, merged)
        print(json.dumps(merged["summary"], indent=1))
        return
    base = common.forward_args(
        args,
        "model",
        "points",
        "question",
        "reps",
        "mem_fraction_static",
        "segment_fraction",
        "chunked_prefill_size",
        "prefill_graph_tokens",
        "profile_dir",
        "profile_points",
        "settle_ms",
        "back_to_back",
    ) + [
        f"--{flag}"
        for flag in (
            "compile-log",
            "profile-warmup",
            "own-recompute",
            "probe-points",
            "gc-prompts",
            "params-too",
            "phases",
            "freeze-gc",
        )
        if getattr(args, flag.replace("-", "_"))
    ]
    profiled = set(split_variants(args.profile_variants or args.variants))
    probes = [host_probe()]  # this machine's host speed, before and after the engines
    results = {}
    names = split_variants(args.variants)
    for name in names:
        child_args = base + ["--child", name]
        if name not in profiled:
            child_args[child_args.index("--profile-dir") + 1] = ""
        results[name] = common.run_child(
            __file__, child_args, log_grep=("token-layers left to the cache", "redknot restore:")
        )
        lines = results[name].pop("log_lines", [])
        # per measured prompt (warm-up included), in order: token-layer FFNs skipped, and
        # token-layers left to the cache (nothing computed but their attention query rows)
        found = [m for m in map(SKIPPED.search, lines) if m]
        results[name]["ffn_skipped_per_prompt"] = [int(m.group(1)) for m in found]
        results[name]["left_per_prompt"] = [int(m.group(2) or 0) for m in found]
        restored = [int(m.group(1)) for m in map(RESTORE_LOG.search, lines) if m]
        if restored:  # adaptive restore: (layer, head) pairs promoted, per prompt
            results[name]["restored_heads_per_prompt"] = restored
        policy = VARIANTS[parse_variant(name)[0]][5]
        if policy is not None:  # a policy skips no FFN itself
            found = [m for m in map(POLICY_LOG.search, lines) if m]
            results[name]["left_per_prompt"] = [int(m.group(1)) for m in found]
            # which kernels attended each prompt (redknot.attention.segpaged_runner)
            paths = [m.group(1) for m in map(ATTENTION_LOG.search, lines) if m]
            results[name]["attention_per_prompt"] = paths
        if policy == "samkv":  # its FLOPs are the cut prompt's rows (samkv_work), not these
            results[name]["left_per_prompt"] = []
        print(name, json.dumps(results[name])[:400], flush=True)
        summary = summarize(cfg, results, args.reps)  # written after every variant
        if name == names[-1]:
            probes.append(host_probe())
        common.write_json(args.out, common.record(
            host_probe_ms=statistics.median(probes) if None not in probes else None,
            host_probe_samples_ms=probes,
            model=args.model, load_format="dummy", points=args.points, question=args.question,
            reps=args.reps, settle_ms=args.settle_ms,
            chunked_prefill_size=args.chunked_prefill_size,
            prefill_graph_tokens=args.prefill_graph_tokens,
            decode_cuda_graph_max_bs=DECODE_GRAPH_MAX_BS, sink=SINK, window=WINDOW,
            mem_fraction_static=args.mem_fraction_static,
            segment_fraction=args.segment_fraction, dense_layers_of_sparse_variant=DENSE_LAYERS,
            note="reuse: cached, re-aligned local-head K/V for segment tokens, every FFN run; "
            "reuse-sparse-ffn: also FFN only on important segment tokens above the dense "
            "layers, the others go on along the residual path (skipped=residual); "
            "reuse-sparse-cached: the others leave recovery, from the next layer on no "
            "projection, attention row or FFN of theirs is computed and every head takes their "
            "cached K/V (skipped=cached; the attention kernel runs the rows in recovery, packed "
            "into tiles). Dummy weights give nearly uniform attention, so importance "
            "selects about mass_thresh of the remaining candidates in every deep layer. flops "
            "subtract the FFNs skipped and, per token-layer left to the cache, its projections, "
            "FFN and attention row (keys at the mean position L/2: left_row_flops)",
            variants=results, summary=summary,
        ))  # fmt: skip
    print(json.dumps(summary, indent=1))


# What must be equal for runs to be compared as one (the device and commit above all).
MERGE_KEYS = ("device", "commit", "model", "load_format", "question", "reps", "settle_ms",
              "chunked_prefill_size", "prefill_graph_tokens", "decode_cuda_graph_max_bs",
              "sink", "window", "mem_fraction_static", "segment_fraction",
              "dense_layers_of_sparse_variant")  # fmt: skip


def model_config(model: str) -> dict:
    """The model's ``config.json``; for ``--merge`` here also a name the reference path loads
    (``smollm2``: the shape a GPU run read from its converted checkpoint)."""
    path = Path(model, "config.json")
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoConfig

    from redknot.reference.loading import resolve_source

    source = resolve_source(model)
    return AutoConfig.from_pretrained(source.directory, **source.kwargs()).to_dict()


def merge(cfg: dict, runs: dict[str, dict]) -> dict:
    """One result of several runs (``path -> result``) of the same commit on the same device
    and settings, e.g. the variants of one comparison split over device calls of 10 minutes:
    their variants together (a variant in two runs is refused, but for ``flashinfer``) and the
    summary recomputed, so that every variant is compared with the ``flashinfer`` of the run
    that measured it, or of the first run where its own run has none (a later run's
    ``flashinfer`` is kept as ``flashinfer@N``, N its place in ``--merge``; ``baselines`` says
    which each variant is compared with). Each run keeps its date, command and host probe in
    ``merged_from``."""
    first = next(iter(runs.values()))
    for path, run in runs.items():
        differ = [k for k in MERGE_KEYS if run.get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"--merge: {path} differs in {', '.join(differ)}: not comparable")
    variants: dict = {}
    baselines: dict[str, str] = {}
    for i, (path, run) in enumerate(runs.items(), start=1):
        mine = dict(run["variants"])
        base = "flashinfer"
        if "flashinfer" in mine and "flashinfer" in variants:
            base = f"flashinfer@{i}"
            mine[base] = mine.pop("flashinfer")
        twice = sorted(set(variants) & set(mine))
        if twice:
            raise SystemExit(f"--merge: {path} measures {', '.join(twice)} again")
        variants.update(mine)
        baselines.update({name: base for name in mine})
    merged = {k: first[k] for k in first if k not in ("variants", "summary", "date", "command")}
    merged["points"] = ",".join(
        dict.fromkeys(",".join(r["points"] for r in runs.values()).split(","))
    )
    merged["date"] = max(run["date"] for run in runs.values())  # of the last measurement
    merged["merged_from"] = [  # each run's own host probe too (the top level keeps the first's)
        {"path": path, "date": run["date"], "command": run["command"],
         "host_probe_ms": run.get("host_probe_ms")}
        for path, run in runs.items()
    ]  # fmt: skip
    merged["variants"] = variants
    merged["baselines"] = baselines
    merged["summary"] = summarize(cfg, variants, first["reps"], baselines)
    return merged


def summarize(cfg: dict, results: dict, reps: int, baselines: dict | None = None) -> dict:
    """Per variant and point: TTFT, analytical FLOPs, and the ratios to flashinfer (to the
    variant ``baselines`` names, where given: ``flashinfer@N`` of a merged run)."""
    summary = {}
    _, ffn = token_layer_flops(cfg)
    for name, res in results.items():
        base = (baselines or {}).get(name, "flashinfer")
        ref = results.get(base, results.get("flashinfer", {})).get("points", {})
        fraction = VARIANTS[parse_variant(name.split("@")[0])[0]][0]
        skipped = res.get("ffn_skipped_per_prompt", [])
        left_all = res.get("left_per_prompt", [])
        at = 0  # the server logs these per prompt served with reuse only
        for key, row in res.get("points", {}).items():
            n = row["prompt_tokens"]
            flops = prefill_flops(cfg, n, fraction)
            if row.get("samkv_cut"):  # a SamKV-cut prompt: the rows it ran
                flops = rows_prefill_flops(cfg, row["samkv_rows"], row["samkv_pairs"])
            # no decision counted (no gate: --redknot-reuse-gate always): every prompt reused
            logged = row["served"].count("reuse") if row.get("served") else reps + 1
            # the measured prompts' entries: after the warm-up's when every prompt reused
            measured = slice(at + max(logged - reps, 0), at + logged)
            at += logged
            mine, left = skipped[measured], left_all[measured]
            if mine:
                flops -= statistics.median(mine) * ffn
            if left:
                flops -= statistics.median(left) * left_row_flops(cfg, n, fraction)
            entry = summary.setdefault(name, {})[key] = {
                "length": row["length"],
                "segments": row["segments"],
                "ttft_s": row["ttft_s"],
                "flops": flops,
            }
            if "warmup_ttft_s" in row:
                entry["warmup_ttft_s"] = row["warmup_ttft_s"]
            if "samkv" in row:  # how many measured prompts were cut, and the last one's report
                entry["samkv_cut"] = row["samkv_cut"]
                if (row["samkv"] or {}).get("served_tokens") is not None:
                    entry["served_tokens"] = row["samkv"]["served_tokens"]
                    entry["sequence_ratio"] = row["samkv"]["sequence_ratio"]
                else:
                    entry["samkv_note"] = (row["samkv"] or {}).get("note")
            if "every_segment_hit" in row:
                entry["every_segment_hit"] = row["every_segment_hit"]
            if "served" in row:  # the reuse gate's decisions (redknot.costmodel.gate)
                entry["served_with_reuse"] = row["served"].count("reuse")
                entry["served_recomputed"] = row["served"].count("recomputed")
            if "host_probe_ms" in row:  # the host's speed before and after the point
                entry["host_probe_ms"] = row["host_probe_ms"]
            if "gc_pause_ms" in row:  # the scheduler's collector, per timed prompt of each kind
                entry["gc_pause_ms_mean"] = {
                    kind: statistics.mean(ms) for kind, ms in row["gc_pause_ms"].items()
                }
            for k in ("phases_ms", "phases_paired_ms", "phases_paired_params_ms", "back_to_back"):
                if k in row:
                    entry[k] = row[k]
            if "gate_host_scale" in row:
                entry["gate_host_scale"] = row["gate_host_scale"]
            if row.get("params_paired"):  # the same engine, fresh tokens with custom_params
                entry["params_ttft_s"] = row["params_ttft_s"]
                entry["speedup_vs_params_paired"] = statistics.median(row["params_paired"])
            if "own_recompute_ttft_s" in row:  # the same engine without reuse
                entry["own_recompute_ttft_s"] = row["own_recompute_ttft_s"]
                entry["speedup_vs_own_recompute"] = row["own_recompute_ttft_s"] / row["ttft_s"]
            if row.get("own_recompute_paired"):  # rep by rep, each pair back to back
                paired = row["own_recompute_paired"]
                entry["speedup_vs_own_recompute_paired"] = statistics.median(paired)
                entry["pairs_slower_than_own_recompute"] = sum(r < 1 for r in paired)
                entry["pairs"] = len(paired)
            if mine:
                entry["ffn_token_layers_skipped"] = statistics.median(mine)
                token_layers = n * cfg["num_hidden_layers"]
                ran = (
                    token_layers
                    - statistics.median(mine)
                    - (statistics.median(left) if left else 0)
                )
                entry["ffn_fraction_run"] = ran / token_layers
            if left:
                entry["token_layers_left_to_cache"] = statistics.median(left)
            if key in ref:
                entry["speedup_vs_flashinfer"] = ref[key]["ttft_s"] / row["ttft_s"]
                entry["flop_ratio_vs_flashinfer"] = prefill_flops(cfg, n, None) / flops
                entry["fraction_of_flop_ratio"] = (
                    entry["speedup_vs_flashinfer"] / entry["flop_ratio_vs_flashinfer"]
                )
    return summary


if __name__ == "__main__":
    main()
