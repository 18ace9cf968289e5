"""Finished work of an evaluation, kept on disk so that a rerun resumes and a sweep can grow.

One directory per (backend description, case); inside, one JSON file per setting (its scored
row) and the dense reference output (``dense.pt``), which new settings are scored against::

    WORK/<case id>-<digest>/meta.json          token counts of the composed case
    WORK/<case id>-<digest>/<setting digest>.json
    WORK/<case id>-<digest>/dense.pt           PolicyOutput of the reference, as a dict
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from redknot.eval.base import PolicyOutput, PolicySetting
from redknot.eval.cases import Case


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CaseStore:
    """The stored work of one case; with ``root=None`` nothing is kept."""

    def __init__(self, root: str | Path | None, backend: dict[str, Any], case: Case) -> None:
        self.path = None
        if root is not None:
            self.path = Path(root) / f"{case.id}-{digest(backend, case.to_json())}"
            self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, setting: PolicySetting) -> Path | None:
        return None if self.path is None else self.path / f"{digest(setting.to_json())}.json"

    def row(self, setting: PolicySetting) -> dict | None:
        path = self._file(setting)
        return json.loads(path.read_text())["row"] if path and path.is_file() else None

    def put_row(self, setting: PolicySetting, row: dict) -> None:
        path = self._file(setting)
        if path is not None:
            path.write_text(json.dumps({"setting": setting.to_json(), "row": row}))

    def meta(self) -> dict | None:
        path = None if self.path is None else self.path / "meta.json"
        return json.loads(path.read_text()) if path and path.is_file() else None

    def put_meta(self, meta: dict) -> None:
        if self.path is not None:
            (self.path / "meta.json").write_text(json.dumps(meta))

    def dense(self) -> PolicyOutput | None:
        path = None if self.path is None else self.path / "dense.pt"
        if not path or not path.is_file():
            return None
        return PolicyOutput(**torch.load(path, weights_only=True))

    def put_dense(self, output: PolicyOutput) -> None:
        if self.path is not None:
            torch.save(dataclasses.asdict(output), self.path / "dense.pt")
