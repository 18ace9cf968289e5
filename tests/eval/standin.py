"""What the CPU tests of a benchmark's engine process share: a model folder holding only its
``config.json``, SGLang's engine stood in for, and the one ``RESULT`` line the process prints
(``serving_common.run_child`` reads that line on a GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import serving_common as common


def model_dir(tmp_path: Path, config: dict) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def stand_in_engine(monkeypatch, tmp_path: Path, engine: type) -> None:
    """``sglang.Engine`` is ``engine``; a head map asked of ``serving_common`` is a path only."""
    import sglang

    monkeypatch.setattr(sglang, "Engine", engine, raising=False)
    monkeypatch.setattr(common, "synthetic_map_file", lambda *a: str(tmp_path / "map.json"))


def child_result(capsys) -> dict:
    """The last ``RESULT`` line the engine process printed, as JSON."""
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :])
