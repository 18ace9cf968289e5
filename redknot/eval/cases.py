"""Evaluation cases in the project's JSON Lines format (``shared/eval/FORMAT.md``).

One JSON object per line::

    {"id": "rag-0003", "system": "...", "segments": ["doc 1", "doc 2"],
     "between": ["", "\\n\\n"], "question": "...", "answers": ["Oakhaven"], "chat": false}

``system``, ``between`` and ``chat`` are optional; any other key (``kind``, ``meta``...) is kept
in :attr:`Case.extra` and ignored by the evaluation. Texts are joined as given: a case puts
its own separators into ``between`` and ``question``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUIRED = ("id", "segments", "question", "answers")
OPTIONAL = ("system", "between", "chat")


class CaseFormatError(ValueError):
    """A case file that does not follow the format; the message names file, line and field."""


@dataclass(frozen=True)
class Case:
    """One evaluation case (see the module docstring for the fields)."""

    id: str
    segments: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    system: str = ""
    between: tuple[str, ...] = ()
    chat: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.between:
            object.__setattr__(self, "between", ("",) * len(self.segments))

    @property
    def kind(self) -> str:
        """``extra["kind"]`` when given, else the id up to its first ``-``."""
        return str(self.extra.get("kind", self.id.split("-")[0]))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.system:
            out["system"] = self.system
        out["segments"] = list(self.segments)
        if any(self.between):
            out["between"] = list(self.between)
        out["question"] = self.question
        out["answers"] = list(self.answers)
        if self.chat:
            out["chat"] = True
        return {**out, **self.extra}


def _strings(value: Any, what: str, *, allow_empty_list: bool) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CaseFormatError(f"{what} must be a list of strings, got {type(value).__name__}")
    if not value and not allow_empty_list:
        raise CaseFormatError(f"{what} must not be empty")
    return tuple(value)


def parse_case(data: Any) -> Case:
    """One decoded JSON object -> :class:`Case`; :class:`CaseFormatError` says which field is wrong."""
    if not isinstance(data, dict):
        raise CaseFormatError(f"a case must be a JSON object, got {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise CaseFormatError(f"missing field(s) {', '.join(missing)}")
    if not isinstance(data["id"], str) or not data["id"]:
        raise CaseFormatError("id must be a non-empty string")
    segments = _strings(data["segments"], "segments", allow_empty_list=True)
    if any(not s for s in segments):
        raise CaseFormatError("segments must not contain empty strings")
    answers = _strings(data["answers"], "answers", allow_empty_list=False)
    if not isinstance(data["question"], str) or not data["question"]:
        raise CaseFormatError("question must be a non-empty string")
    system = data.get("system", "")
    if not isinstance(system, str):
        raise CaseFormatError("system must be a string")
    between = _strings(data.get("between", []), "between", allow_empty_list=True)
    if between and len(between) != len(segments):
        raise CaseFormatError(
            f"between has {len(between)} entries but there are {len(segments)} segments "
            "(one text before each segment, or leave it out)"
        )
    chat = data.get("chat", False)
    if not isinstance(chat, bool):
        raise CaseFormatError("chat must be true or false")
    extra = {k: v for k, v in data.items() if k not in REQUIRED + OPTIONAL}
    return Case(data["id"], segments, data["question"], answers, system, between, chat, extra)


def load_cases(path: str | Path) -> list[Case]:
    """Read a case file; blank lines are skipped. Raises :class:`CaseFormatError` naming the
    file and line of the first problem (bad JSON, a wrong field, a duplicate id)."""
    path = Path(path)
    if not path.is_file():
        raise CaseFormatError(f"{path}: no such case file")
    cases: list[Case] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            case = parse_case(json.loads(line))
        except json.JSONDecodeError as e:
            raise CaseFormatError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        except CaseFormatError as e:
            raise CaseFormatError(f"{path}:{number}: {e}") from None
        if case.id in seen:
            raise CaseFormatError(
                f"{path}:{number}: duplicate id {case.id!r} (first on line {seen[case.id]})"
            )
        seen[case.id] = number
        cases.append(case)
    if not cases:
        raise CaseFormatError(f"{path}: no cases")
    return cases


def write_cases(cases: list[Case], path: str | Path) -> None:
    """Write ``cases`` one JSON object per line (compact, UTF-8)."""
    lines = [json.dumps(c.to_json(), ensure_ascii=False, separators=(",", ":")) for c in cases]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
