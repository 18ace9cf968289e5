"""``python -m redknot.eval``: evaluation commands.

``fidelity``: serve a case file (``shared/eval/FORMAT.md``) under ``full`` (dense prefill, the
reference) and the policies asked for (:data:`redknot.recovery.POLICIES`: ``naive``,
``redknot``, ``cacheblend``, ``epic``, ``sparsex``, ``redknot+sparseq``) and write every
metric per setting::

    python -m redknot.eval fidelity --cases benchmarks/cases/rag_v1.jsonl --model smollm2 \\
        --head-map configs/heads/smollm2-135m-instruct.json --policies full,naive,redknot \\
        --dense-layers 4,8 --mass-thresh 0.3,0.6 --out benchmarks/results/fidelity.json

Every recovery knob (:class:`redknot.recovery.RecoveryOptions`) is a flag taking one value or
a comma list; each policy runs once per combination (the cartesian product) of the knobs it
reads (``ReusePolicy.knobs``), labelled by those given on the command line. ``--redknot-settings "dense_layers=8,mass_thresh=0.5;
dense_layers=30,mass_thresh=1"`` lists settings explicitly instead (knob flags, single-valued,
then apply to each).

``--backend server`` scores a running redknot server against a dense server of the same model
(:mod:`redknot.eval.server_backend`), with TTFT; the recovery knobs are the server's options::

    python -m redknot.eval fidelity --cases benchmarks/cases/rag_v1.jsonl --backend server \\
        --server http://localhost:30000 --reference-server http://localhost:30001 \\
        --out benchmarks/results/fidelity_server.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from redknot.eval.base import REFERENCE_LABEL, FidelityBackend, PolicySetting
from redknot.eval.cases import Case, CaseFormatError, load_cases
from redknot.recovery import KNOBS, POLICIES, RecoveryOptions, RecoveryOptionsError

BACKENDS = ("reference", "server")
DEFAULT_POLICIES = ("full", "naive", "redknot")


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text.lower() in ("none", "off", "map") else kind(text)


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "on", "off"):
        raise ValueError(f"{text!r} is not a boolean (true/false, on/off, 1/0)")
    return value in ("true", "1", "on")


KNOB_TYPES: dict[str, Callable[[str], Any]] = {
    "global_fraction": _optional(float),
    "window": _optional(int),
    "sink": _optional(int),
    "dense_layers": int,
    "mass_thresh": float,
    "recent_n": int,
    "restore_thresh": _optional(float),
    "restore_edge": int,
    "local_kv": str,
    "skipped": str,
    "repair_k": int,
    "blend_check_layer": int,
    "blend_ratio": float,
    "epic_k": int,
    "sparseq_boundary": int,
    "sparseq_k": int,
    "sparseq_block": int,
    "samkv_block": int,
    "samkv_init_blocks": int,
    "samkv_local_blocks": int,
    "samkv_stable_layers": int,
    "samkv_stable_from": _optional(int),
    "samkv_bias": _flag,
    "samkv_budget": _optional(float),
    "samkv_recompute": str,
    "samkv_update": str,
    "samkv_spread": str,
    "samkv_block_score": str,
    "samkv_outlier_sigma": float,
}
assert set(KNOB_TYPES) == set(KNOBS), "every recovery knob needs a CLI type"


def _list(kind: Callable[[str], Any], name: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}: {e}") from None

    return parse


def build_parser(prog: str = "python -m redknot.eval") -> argparse.ArgumentParser:
    doc = __doc__.replace("python -m redknot.eval", prog).replace("``", "").replace("::", ":")
    example = (
        f"example (CPU, SmolLM2, 4 cases):\n  {prog} fidelity --cases benchmarks/cases/rag_v1.jsonl "
        "--policies full,cacheblend --limit 4 --out /tmp/fidelity.json"
    )
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc,
        epilog=example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "fidelity",
        help="first-token and answer fidelity of reuse policies",
        description=doc.split("\n\n", 1)[1],
        epilog=example,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", required=True, help="case file (JSON Lines, FORMAT.md)")
    p.add_argument("--model", default="smollm2", help="model spec (reference backend)")
    p.add_argument(
        "--head-map", default=None, help="head-class map JSON of the model (reference backend)"
    )
    p.add_argument(
        "--policies",
        default=None,
        type=_list(str, "policies"),
        help=f"comma list of {', '.join(POLICIES)} (full is always run: it is the reference; "
        "default full,naive,redknot, with --backend server full,redknot)",
    )
    p.add_argument(
        "--backend",
        default="reference",
        choices=BACKENDS,
        help="reference: PyTorch reference path; server: a redknot server against a dense "
        "reference server over HTTP (full and the policy the server serves, TTFT measured)",
    )
    p.add_argument("--server", default=None, help="server backend: redknot server URL")
    p.add_argument(
        "--reference-server",
        default=None,
        help="server backend: URL of a dense server of the same model (flashinfer, or redknot "
        "with --redknot-all-global)",
    )
    p.add_argument(
        "--tokenizer", default=None, help="server backend: tokenizer path (default: the server's)"
    )
    p.add_argument("--namespace", default="default", help="server backend: segment namespace")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="reference backend: the model's dtype (bfloat16: a server's numerics, to tell "
        "them apart from a difference of algorithm)",
    )
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument(
        "--auto-chunks",
        type=int,
        default=None,
        metavar="N",
        help="reference backend: reuse what --redknot-auto-segments cdc would (its chunks of "
        "about N tokens that lie inside a case segment) instead of the case's segments",
    )
    p.add_argument(
        "--auto-mode",
        choices=("cdc", "cdc-edges", "cdc-docs"),
        default="cdc",
        help="reference backend, with --auto-chunks: cdc reuses the chunks inside a case "
        "segment; cdc-edges and cdc-docs what their store holds after serving 16 prompts of "
        "the case's documents and two of another case in random orders",
    )
    p.add_argument(
        "--capture-context",
        type=int,
        default=0,
        metavar="K",
        help="reference backend, with --auto-mode cdc-edges / cdc-docs: a segment is captured "
        "after the K tokens that preceded it in the prompt that stored it (0: alone, from "
        "position 0)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N cases only")
    p.add_argument("--work-dir", default=None, help="keep finished cases here; a rerun resumes")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument(
        "--redknot-settings",
        default=None,
        help='explicit redknot settings, "knob=value,...;knob=value,..." (instead of a product)',
    )
    defaults = RecoveryOptions()
    for name in KNOBS:
        readers = ", ".join(p for p, cls in POLICIES.items() if name in cls.knobs)
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=_list(KNOB_TYPES[name], name),
            default=None,
            help=f"knob of {readers} (default {getattr(defaults, name)!r}); comma list to sweep",
        )
    return parser


def parse_settings(text: str) -> list[dict[str, Any]]:
    """``"a=1,b=2;a=3"`` -> ``[{"a": 1, "b": 2}, {"a": 3}]`` with the knobs' types."""
    out = []
    for group in text.split(";"):
        changes: dict[str, Any] = {}
        for item in group.split(","):
            if not item.strip():
                continue
            name, _, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in KNOB_TYPES or not value:
                raise SystemExit(
                    f"error: --redknot-settings: {item.strip()!r} is not knob=value with a "
                    f"knob among {', '.join(KNOBS)}"
                )
            try:
                changes[name] = KNOB_TYPES[name](value.strip())
            except ValueError as e:
                raise SystemExit(f"error: --redknot-settings: {name}: {e}") from None
        if changes:
            out.append(changes)
    return out


def policy_settings(
    args: argparse.Namespace, policy: str, defaults: RecoveryOptions | None = None
) -> list[PolicySetting]:
    """Settings of a tunable ``policy``: one per combination of the values given for the knobs
    it reads (``POLICIES[policy].knobs``), or for ``redknot`` one per explicit setting of
    ``--redknot-settings``; labelled by the knobs that were given."""
    knobs = POLICIES[policy].knobs
    given = {k: getattr(args, k) for k in knobs if getattr(args, k) is not None}
    if policy == "redknot" and args.redknot_settings:
        many = [k for k, v in given.items() if len(v) > 1]
        if many:
            raise SystemExit(
                f"error: --{many[0].replace('_', '-')} lists several values; with "
                "--redknot-settings knob flags take one value (applied to every setting)"
            )
        base = {k: v[0] for k, v in given.items()}
        combos = [{**base, **c} for c in parse_settings(args.redknot_settings)]
    else:
        combos = [dict(zip(given, values)) for values in itertools.product(*given.values())]
    out = []
    defaults = default_options(args) if defaults is None else defaults  # the knobs not given
    for changes in combos:
        options = defaults.replace(**changes)
        label = policy
        if changes:
            label += "[" + ",".join(f"{k}={v}" for k, v in changes.items()) + "]"
        out.append(PolicySetting(policy, options, label))
    return out


def default_options(args: argparse.Namespace) -> RecoveryOptions:
    """The knobs not given on the command line: those the head map records for its model
    (``HeadMap.recorded_recovery``; the server takes the same), else ``RecoveryOptions``'s (also
    when the map cannot be read: loading the backend reports that)."""
    if not getattr(args, "head_map", None) or args.backend != "reference":
        return RecoveryOptions()
    from redknot.headmap import HeadMap, HeadMapError

    try:
        recorded = HeadMap.load(args.head_map).recorded_recovery()
    except HeadMapError:
        return RecoveryOptions()
    return RecoveryOptions().replace(**{k: v for k, v in recorded.items() if k in KNOBS})


def policies_of(args: argparse.Namespace) -> list[str]:
    """The policies asked for, or the backend's default list."""
    if args.policies is not None:
        return args.policies
    return ["full", "redknot"] if args.backend == "server" else list(DEFAULT_POLICIES)


def settings_of(args: argparse.Namespace) -> list[PolicySetting]:
    policies = policies_of(args)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"error: unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    settings = [PolicySetting(REFERENCE_LABEL)]
    defaults = default_options(args)  # the head map is read once
    for policy in dict.fromkeys(policies):  # in the order given, once each
        if policy == REFERENCE_LABEL:
            continue
        if POLICIES[policy].knobs:
            settings += policy_settings(args, policy, defaults)
        else:
            settings.append(PolicySetting(policy))
    return settings


def make_backend(args: argparse.Namespace, cases: Sequence[Case] = ()) -> FidelityBackend:
    """The backend ``args`` ask for; ``cases``: the whole cases file (whose documents neighbour
    a case's under ``--auto-mode cdc-edges`` / ``cdc-docs``)."""
    if args.backend == "server":
        return server_backend(args)
    if not args.head_map:
        raise SystemExit("error: --head-map is required with --backend reference")
    from redknot.api.options import MIN_AUTO_CHUNK_TOKENS

    if args.auto_mode != "cdc" and args.auto_chunks is None:
        raise SystemExit(f"error: --auto-mode {args.auto_mode} needs --auto-chunks N")
    if args.auto_chunks is not None and args.auto_chunks < MIN_AUTO_CHUNK_TOKENS:
        raise SystemExit(
            f"error: --auto-chunks must be at least {MIN_AUTO_CHUNK_TOKENS} (the server's "
            f"--redknot-auto-chunk-tokens minimum), got {args.auto_chunks}"
        )
    import torch

    from redknot.eval.reference_backend import ReferenceBackend

    return ReferenceBackend.load(
        args.model,
        args.head_map,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        max_new_tokens=args.max_new_tokens,
        auto_chunk_tokens=args.auto_chunks,
        auto_mode=args.auto_mode,
        capture_context=args.capture_context,
        auto_pool=(
            tuple(doc for case in cases for doc in case.segments) if args.auto_mode != "cdc" else ()
        ),
    )


def server_backend(args: argparse.Namespace) -> FidelityBackend:
    """The server backend; its recovery knobs are the redknot server's own options."""
    from redknot.eval.server_backend import SERVER_POLICIES, ServerBackend, ServerEvalError

    if not args.server or not args.reference_server:
        raise SystemExit("error: --backend server needs --server URL and --reference-server URL")
    if args.auto_chunks is not None:
        raise SystemExit(
            "error: --auto-chunks is for --backend reference; a server chunks unmarked prompts "
            "itself under --redknot-auto-segments cdc"
        )
    other = [p for p in policies_of(args) if p not in SERVER_POLICIES]
    knobs = [k for k in KNOBS if getattr(args, k) is not None] + (
        ["redknot_settings"] if args.redknot_settings else []
    )
    if other or knobs:
        what = f"policy {other[0]!r}" if other else f"--{knobs[0].replace('_', '-')}"
        raise SystemExit(
            f"error: {what} cannot be used with --backend server: it serves "
            f"{', '.join(SERVER_POLICIES)} with the redknot server's own options (start the "
            "server with --redknot-policy, --redknot-dense-layers etc.)"
        )
    try:
        return ServerBackend(
            args.server,
            args.reference_server,
            tokenizer_path=args.tokenizer,
            namespace=args.namespace,
            max_new_tokens=args.max_new_tokens,
        )
    except ServerEvalError as e:
        raise SystemExit(f"error: {e}") from None


def fidelity(args: argparse.Namespace) -> int:
    from redknot.eval.fidelity import evaluate
    from redknot.headmap.provenance import git_commit

    try:
        settings = settings_of(args)
        every = load_cases(args.cases)
    except (CaseFormatError, RecoveryOptionsError) as e:
        raise SystemExit(f"error: {e}") from None
    cases = every[: args.limit] if args.limit else every
    commit, dirty = git_commit()
    if args.backend == "server":  # the server's own options apply, recorded under "servers"
        settings = [dataclasses.replace(s, options=None) for s in settings]
    backend = make_backend(args, every)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    result = evaluate(backend, cases, settings, work_dir=args.work_dir, log=log)
    info = backend.describe()
    out = {
        "benchmark": "fidelity",
        "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
        "device": info.pop("device"),
        "device_detail": info.pop("device_detail"),
        "commit": commit,
        "git_commit": commit,
        "git_dirty": dirty,
        "command": "python -m redknot.eval " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "cases_file": args.cases,
        **info,
        **(
            {"default_options": dataclasses.asdict(default_options(args))}
            if args.backend == "reference"
            else {}
        ),
        **result,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for label, s in result["summary"].items():
        print(
            f"{label:60s} top1 {fmt(s['top1'])} top10 {fmt(s['top10'])} "
            f"KL {fmt(s['kl'])} EM {fmt(s['exact_match'])} contains {fmt(s['contains'])} "
            f"F1 {fmt(s['f1'])} kept {fmt(s['kept'])} FLOPs {fmt(s['flops_fraction'])} "
            f"TTFT {fmt(s['ttft_s'])}"
        )
    print(f"{result['cases']['count']} cases, {result['seconds']} s; wrote {args.out}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m redknot.eval") -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser(prog).parse_args(argv)
    if args.command == "fidelity":
        return fidelity(args)
    raise SystemExit(f"error: unknown command {args.command!r}")
