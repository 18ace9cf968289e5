"""An older commit's package as ``git archive`` would give it, rebuilt from this tree and a
reverse patch: for ``gpu_run.py ab`` when the older commit's archive would push the carried
files over the device machine's 64 MiB.

Here (with git): ``git diff HEAD OLD -- redknot > .old.patch``. There (no git)::

    python3 benchmarks/patched_archive.py --patch .old.patch --commit OLD_SHA40 \\
        --out .devsrc_old.tar
    python3 benchmarks/gpu_run.py ab --old .devsrc_old.tar bench ttft ...

The archive holds the package's files (``PACKAGE``) with the patch applied, and records
``--commit`` in its global pax header as ``git archive`` does, so the older run's JSON names it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ("README.md", "pyproject.toml", "setup.py", "redknot", "configs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--patch", required=True, help="git diff HEAD OLD -- redknot")
    ap.add_argument("--commit", required=True, help="OLD's full 40-digit commit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        raise SystemExit(f"--commit must be a full 40-digit commit, got {args.commit!r}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for name in PACKAGE:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(
                    src, tree / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
                )
            elif src.is_file():
                shutil.copy2(src, tree / name)
        patch = Path(args.patch).resolve()
        subprocess.run(["patch", "-p1", "-s", "-i", str(patch)], cwd=tree, check=True)
        with tarfile.open(args.out, "w:gz", format=tarfile.PAX_FORMAT,
                          pax_headers={"comment": args.commit}) as t:  # fmt: skip
            for path in sorted(tree.rglob("*")):
                t.add(path, arcname=str(path.relative_to(tree)), recursive=False)
    print(f"{args.out}: {args.commit[:7]} rebuilt from {ROOT} and {patch.name}")


if __name__ == "__main__":
    main()
