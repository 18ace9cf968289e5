"""``benchmarks/patched_archive.py``: the older package rebuilt from this tree and a reverse
patch, with the older commit in the archive's header as ``git archive`` writes it."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "patched_archive.py"


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch program")
def test_archive_holds_the_patched_package_and_names_the_commit(tmp_path):
    name = "redknot/__init__.py"
    now = (ROOT / name).read_text().splitlines(keepends=True)
    old = [*now, "OLDER = True\n"]
    patch = tmp_path / "old.patch"
    patch.write_text("".join(difflib.unified_diff(now, old, f"a/{name}", f"b/{name}")))
    out, commit = tmp_path / "old.tar", "0123456789abcdef0123456789abcdef01234567"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--patch", str(patch), "--commit", commit, "--out", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    with tarfile.open(out) as t:
        assert t.pax_headers["comment"] == commit
        names = set(t.getnames())
        assert {"pyproject.toml", name, "redknot/kernels/extend.py"} <= names
        assert not any("__pycache__" in n for n in names)
        assert t.extractfile(name).read().decode() == "".join(old)
    assert (ROOT / name).read_text() == "".join(now)  # this tree is left as it was


def test_a_short_commit_is_refused(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--patch", "x", "--commit", "abc1234", "--out", "y"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode != 0 and "40-digit" in run.stderr
