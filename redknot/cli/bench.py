"""``redknot bench``: run a benchmark or GPU check script of the source checkout.

    redknot bench                                  # list them, one line each
    redknot bench ttft --points 32768x8 --variants flashinfer,cacheblend --out /tmp/ttft.json
    redknot bench gpu_run check                    # every GPU check, on the GPU machine

A script is ``benchmarks/NAME.py`` or ``scripts/NAME.py`` of the checkout this package was
installed from (``pip install -e .``); it runs as ``python PATH ARGS`` in the current
directory, exactly as the commands in ``docs/results.md`` run it. A wheel install has no
checkout, so it has no scripts either.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
FOLDERS = ("benchmarks", "scripts")


def scripts(root: Path = CHECKOUT) -> dict[str, Path]:
    """Runnable scripts (those with a ``__main__`` guard) by name, benchmarks first."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            if path.stem not in found and '__name__ == "__main__"' in path.read_text():
                found[path.stem] = path
    return found


def summary(path: Path, width: int = 72) -> str:
    """The opening words of a script's docstring, at most ``width`` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    first = first.split(". ")[0].rstrip(".")
    return first if len(first) <= width else first[: width - 3].rsplit(" ", 1)[0] + " ..."


def build_parser(prog: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="examples:\n"
        f"  {prog}                      # list the scripts\n"
        f"  {prog} ttft --points 32768x8 --variants flashinfer,cacheblend --out /tmp/t.json\n"
        f"  {prog} NAME --help           # a script's own options",
    )


def main(argv: Sequence[str] | None = None, prog: str = "redknot bench") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    found = scripts()
    if not found:
        print(
            f"{prog}: no benchmarks/ or scripts/ beside this installation ({CHECKOUT}): "
            "bench runs the scripts of a source checkout (git clone, then pip install -e .)",
            file=sys.stderr,
        )
        return 2
    if not args or args[0] in ("-h", "--help"):
        build_parser(prog).print_help()
        width = max(map(len, found))
        print("\nscripts:")
        for name, path in found.items():
            print(f"  {name:<{width}}  {summary(path)}  ({path.relative_to(CHECKOUT)})")
        return 0
    name, rest = args[0], args[1:]
    if name not in found:
        print(f"{prog}: no script {name!r}; `{prog}` lists them", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(found[name]), *rest])
