"""``python -m redknot.headmap``: make, inspect, check and re-threshold head maps.

    python -m redknot.headmap synth --model-config ../shared/models/llama-3.1-8b \\
        --global-fraction 0.125 --out configs/heads/synthetic/llama-3.1-8b-g0.125.json
    python -m redknot.headmap show configs/heads/smollm2-135m-instruct.json
    python -m redknot.headmap validate MAP --model-config DIR_OR_JSON [--tp 2]
    python -m redknot.headmap threshold MAP --global-fraction 0.25 --out MAP25

``synth`` maps are labelled ``"synthetic": true``: their global heads are placed at random,
for memory and speed measurements on dummy weights only. ``threshold`` re-classifies a
profiled map at another global fraction from the scores it stores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from redknot.headmap.map import HeadMap, HeadMapError, ModelShape
from redknot.headmap.provenance import tool_provenance
from redknot.headmap.ranking import reclassify
from redknot.headmap.synthetic import synthetic_map


def read_model_config(path: str | Path) -> tuple[ModelShape, str]:
    """``(shape, name)`` from a Hugging Face ``config.json`` or the directory holding one; the
    name is the directory's."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise HeadMapError(
            f"model config {str(path)!r}: no such file (give config.json or its directory)"
        )
    try:
        data = json.loads(file.read_text())
        return ModelShape.from_hf_config(data), file.resolve().parent.name
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise HeadMapError(f"model config {str(file)!r} is not a usable config.json: {e}") from e


def summary(hm: HeadMap) -> str:
    """A few human-readable lines about a map."""
    m = hm.model
    kind = "SYNTHETIC (placement not measured)" if hm.is_synthetic else "profiled"
    lines = [
        (
            f"{hm.model_name or '(unnamed model)'} [{m.architecture}]: {m.num_layers} layers x "
            f"{m.num_kv_heads} KV heads ({m.num_attention_heads} query heads, "
            f"head_dim {m.head_dim})"
        ),
        (
            f"{kind}; {hm.num_global} global heads ({hm.global_fraction:.1%}); "
            f"window {hm.window}, sink {hm.sink}, dense_layers {hm.dense_layers}"
        ),
    ]
    prov = hm.provenance
    lines.append(
        "made by "
        + ", ".join(
            f"{k} {prov[k]}"
            for k in ("tool", "version", "commit", "date")
            if prov.get(k) is not None
        )
    )
    if hm.scores:
        lines.append(f"scores: {', '.join(sorted(hm.scores))}")
    for layer, row in enumerate(hm.classes):
        lines.append(f"  layer {layer:3d}  {row}  ({row.count('G')} global)")
    return "\n".join(lines)


def _cmd_synth(args: argparse.Namespace) -> None:
    shape, name = read_model_config(args.model_config)
    hm = synthetic_map(
        shape,
        args.global_fraction,
        window=args.window,
        sink=args.sink,
        dense_layers=args.dense_layers,
        seed=args.seed,
        model_name=args.name or name,
    )
    prov = {**tool_provenance("redknot.headmap synth"), **hm.provenance}
    prov["model_config"] = str(args.model_config)
    hm = dataclasses.replace(hm, provenance=prov)
    hm.save(args.out)
    print(
        f"wrote {args.out}: SYNTHETIC map, {hm.num_global} global heads ({hm.global_fraction:.1%})"
    )


def _cmd_show(args: argparse.Namespace) -> None:
    print(summary(HeadMap.load(args.map)))


def _cmd_validate(args: argparse.Namespace) -> None:
    hm = HeadMap.load(args.map)
    shape, _ = read_model_config(args.model_config)
    hm.validate_against(shape, tp_size=args.tp, source=f"head map {args.map!r}")
    print(f"{args.map}: fits {args.model_config} at --tp {args.tp}")


def _cmd_threshold(args: argparse.Namespace) -> None:
    hm = reclassify(HeadMap.load(args.map), args.global_fraction)
    hm.save(args.out)
    print(f"wrote {args.out}: {hm.num_global} global heads ({hm.global_fraction:.1%})")


def build_parser(prog: str = "python -m redknot.headmap") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="examples:\n"
        + __doc__.split("\n\n", 2)[1].replace("python -m redknot.headmap", prog)
        + "\n\n"
        + __doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser(
        "synth", help="a SYNTHETIC map of a given global fraction for a model config"
    )
    synth.add_argument("--model-config", required=True, help="config.json or its directory")
    synth.add_argument("--global-fraction", type=float, required=True)
    synth.add_argument("--out", required=True)
    synth.add_argument("--window", type=int, default=256)
    synth.add_argument("--sink", type=int, default=64)
    synth.add_argument("--dense-layers", type=int, default=None, help="default: every layer")
    synth.add_argument("--seed", type=int, default=0, help="which heads of a layer are global")
    synth.add_argument("--name", default=None, help="model name (default: the config's directory)")
    synth.set_defaults(run=_cmd_synth)

    show = sub.add_parser("show", help="print a map's summary and classes")
    show.add_argument("map")
    show.set_defaults(run=_cmd_show)

    validate = sub.add_parser("validate", help="check that a map fits a model config and TP size")
    validate.add_argument("map")
    validate.add_argument("--model-config", required=True)
    validate.add_argument("--tp", type=int, default=1)
    validate.set_defaults(run=_cmd_validate)

    threshold = sub.add_parser("threshold", help="re-classify a profiled map at another fraction")
    threshold.add_argument("map")
    threshold.add_argument("--global-fraction", type=float, required=True)
    threshold.add_argument("--out", required=True)
    threshold.set_defaults(run=_cmd_threshold)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m redknot.headmap") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        args.run(args)
    except (HeadMapError, ValueError) as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0
