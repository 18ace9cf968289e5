"""What every map-writing tool records about itself: version, commit, date."""

from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path

import redknot
from redknot import envs


def git_commit(path: str | Path | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout holding ``path`` (default: this package);
    ``(REDKNOT_COMMIT, None)`` when that is set (a run that names its commit, such as a GPU
    machine's source copy, whose own git metadata may be stale) or outside a checkout (an
    installed wheel); ``(None, None)`` when neither gives one."""
    if envs.REDKNOT_COMMIT.get():
        return envs.REDKNOT_COMMIT.get(), None
    where = Path(path) if path else Path(redknot.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return envs.REDKNOT_COMMIT.get(), None
    return commit or None, bool(status.strip())


def tool_provenance(tool: str) -> dict:
    """``tool``, ``version``, ``commit``, ``dirty`` and a UTC ``date``."""
    commit, dirty = git_commit()
    return {
        "tool": tool,
        "version": redknot.__version__,
        "commit": commit,
        "dirty": dirty,
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
    }
