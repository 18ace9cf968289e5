"""The README is a user's guide that stays true: at most 300 lines, an options table with a row
for every ``RedknotConfig`` field (and no row for an option that does not exist), the blocks CI
runs, links that resolve, and result figures drawn from current result files."""

from __future__ import annotations

import re
from pathlib import Path

from redknot.config import RedknotConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# docs written on other branches (reuse without markup, calibration, performance), linked ahead
ELSEWHERE = {"docs/reuse.md", "docs/calibration.md", "docs/performance.md"}


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.MULTILINE | re.DOTALL)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def option_rows() -> list[str]:
    """The flag of every row of the options table (without ``--redknot-``)."""
    rows = re.findall(
        r"^\| `--redknot-([a-z-]+)[^|]*\| ([^|]+) \|$", section("Options"), re.MULTILINE
    )
    assert all(meaning.strip() for _, meaning in rows)
    return [flag for flag, _ in rows]


def test_readme_is_short():
    assert len(README.splitlines()) <= 300


def test_options_table_has_one_row_per_config_field():
    rows = option_rows()
    assert len(rows) == len(set(rows)), "an option listed twice"
    fields = {name.replace("_", "-") for name in RedknotConfig.field_names()}
    assert fields - set(rows) == set(), "options without a row in the README"
    assert set(rows) - fields == {"config"}, "rows for options that do not exist"


def test_ci_blocks_are_there():
    for name in ("install", "test"):
        assert re.search(rf"<!-- ci:{name} -->\n```bash\n.+\n```", README), name


def test_relative_links_resolve():
    links = set(re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README))
    assert links, "no links found"
    missing = {link for link in links if not (ROOT / link).exists()} - ELSEWHERE
    assert missing == set()


def test_figures_name_current_result_files():
    """Every result file the README cites exists among the current results."""
    cited = set(re.findall(r"`([a-z0-9_.]+\.json)`", README))
    assert cited, "the README cites no result file"
    current = {p.name for p in (ROOT / "benchmarks/results").glob("*.json")}
    assert cited <= current, cited - current


def test_docs_links_resolve():
    for doc in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            target = (doc.parent / link).resolve()
            if not target.exists():
                assert str(target.relative_to(ROOT)) in ELSEWHERE, f"{doc.name}: {link}"


def test_docs_cite_result_files_that_exist():
    """docs/results.md cites current results only; docs/history.md current or archived ones."""
    results = ROOT / "benchmarks/results"
    current = {p.name for p in results.glob("*.json")}
    archived = {p.name for p in (results / "archive").glob("*.json")}
    for name, allowed in (("results.md", current), ("history.md", current | archived)):
        cited = set(re.findall(r"`([a-z0-9_.]+\.json)`", (ROOT / "docs" / name).read_text()))
        assert cited and cited <= allowed, (name, cited - allowed)
