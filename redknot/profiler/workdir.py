"""The profiler's work directory: per-prompt scores on disk, so that a rerun skips them.

Layout: ``<root>/<key>/fingerprint.json`` and one ``<prompt>.pt`` per finished prompt, where
``<key>`` hashes everything that changes per-prompt scores (model, calibration settings,
calibration version). Runs with other settings never read each other's files; runs that
differ only in the ranking (global fraction, weights) reuse all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor


class ScoreCache:
    def __init__(self, root: str | Path, fingerprint: dict) -> None:
        text = json.dumps(fingerprint, sort_keys=True, default=str)
        key = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "fingerprint.json").write_text(
            json.dumps(fingerprint, sort_keys=True, indent=1, default=str) + "\n"
        )

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.pt"

    def get(self, name: str) -> dict[str, Tensor] | None:
        """The stored scores of prompt ``name``, or ``None`` if not finished (or unreadable)."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError):
            return None

    def put(self, name: str, scores: dict[str, Tensor]) -> None:
        """Store atomically: a killed run never leaves a half-written file behind."""
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        torch.save({k: v.detach().cpu() for k, v in scores.items()}, tmp)
        os.replace(tmp, self._path(name))
