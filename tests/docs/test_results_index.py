"""benchmarks/results/INDEX.md lists every result file once, current ones in its first table and
archived ones (under archive/) in its second, and every current JSON says where it came from:
non-empty ``device``, ``date``, ``commit`` and ``command``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
PROVENANCE = ("device", "date", "commit", "command")


def indexed() -> dict[str, list[str]]:
    """Section title -> the files its table lists (first column), in order."""
    tables: dict[str, list[str]] = {}
    section = None
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            assert section is not None, f"a row before any section: {line}"
            tables.setdefault(section, []).append(m.group(1))
    return tables


def on_disk(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file() and p.name != "INDEX.md"}


def test_every_result_file_is_indexed_once_in_its_section():
    tables = indexed()
    assert set(tables) == {"Current", "Archive"}
    rows = tables["Current"] + tables["Archive"]
    assert len(rows) == len(set(rows)), "a file listed twice"
    assert set(tables["Current"]) == on_disk(RESULTS), "current files and the index differ"
    assert set(tables["Archive"]) == {f"archive/{n}" for n in on_disk(RESULTS / "archive")}


def test_every_row_has_all_columns_filled():
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        if re.match(r"\| `", line):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            width = 6 if not cells[0].startswith("`archive/") else 5
            assert len(cells) == width and all(cells), line


@pytest.mark.parametrize("name", sorted(n for n in on_disk(RESULTS) if n.endswith(".json")))
def test_current_json_carries_its_provenance(name):
    data = json.loads((RESULTS / name).read_text())
    for key in PROVENANCE:
        value = data.get(key)
        assert isinstance(value, str) and value.strip(), f"{name}: no {key}"
    assert re.match(r"\d{4}-\d\d-\d\d", data["date"]), f"{name}: date {data['date']!r}"


def test_index_names_the_commit_each_json_records():
    """The index's commit column starts with the commit the file records (short form)."""
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        m = re.match(r"\| `([^`/]+\.json)` \|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        recorded = json.loads((RESULTS / m.group(1)).read_text())["commit"]
        assert recorded[:7] == cells[3][:7], (m.group(1), recorded, cells[3])
