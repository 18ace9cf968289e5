"""Case files: parsing, round trip, and clear errors."""

from __future__ import annotations

import json

import pytest

from redknot.eval import Case, CaseFormatError, load_cases, write_cases


def _write(tmp_path, lines):
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = {"id": "rag-1", "segments": ["doc a", "doc b"], "question": "q?", "answers": ["x"]}


def test_round_trip_keeps_every_field(tmp_path):
    cases = [
        Case("rag-1", ("a", "b"), "q?", ("x", "y"), system="sys", between=("", "\n")),
        Case("needle-2", ("c",), "q2?", ("z",), chat=True, extra={"kind": "needle", "n": 3}),
    ]
    path = tmp_path / "c.jsonl"
    write_cases(cases, path)
    assert load_cases(path) == cases
    assert [c.kind for c in cases] == ["rag", "needle"]
    assert load_cases(path)[0].between == ("", "\n")


def test_missing_between_means_none(tmp_path):
    (case,) = load_cases(_write(tmp_path, [json.dumps(GOOD), ""]))
    assert case.between == ("", "") and case.system == "" and not case.chat


@pytest.mark.parametrize(
    "line,match",
    [
        ("{not json", r"cases.jsonl:2: not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "answers"}), "missing field.*answers"),
        (json.dumps({**GOOD, "segments": "doc"}), "segments must be a list of strings"),
        (json.dumps({**GOOD, "segments": ["a", ""]}), "empty strings"),
        (json.dumps({**GOOD, "answers": []}), "answers must not be empty"),
        (json.dumps({**GOOD, "question": ""}), "question must be a non-empty string"),
        (json.dumps({**GOOD, "between": ["x"]}), "between has 1 entries but there are 2"),
        (json.dumps({**GOOD, "chat": "yes"}), "chat must be true or false"),
        (json.dumps({**GOOD, "system": 3}), "system must be a string"),
        (json.dumps({**GOOD, "id": ""}), "id must be a non-empty string"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, line, match):
    path = _write(tmp_path, [json.dumps({**GOOD, "id": "ok"}), line])
    with pytest.raises(CaseFormatError, match=match) as err:
        load_cases(path)
    assert "cases.jsonl:2: " in str(err.value)


def test_duplicate_ids_empty_and_missing_files(tmp_path):
    with pytest.raises(CaseFormatError, match=r":2: duplicate id 'rag-1' \(first on line 1\)"):
        load_cases(_write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD)]))
    with pytest.raises(CaseFormatError, match="no cases"):
        load_cases(_write(tmp_path, ["", "  "]))
    with pytest.raises(CaseFormatError, match="no such case file"):
        load_cases(tmp_path / "absent.jsonl")
