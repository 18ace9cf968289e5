"""The ``redknot`` command: a dispatcher to each tool's ``main(argv)``, every subcommand with a
``--help`` that says what it does and gives an example; the ``python -m`` entry points stay."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from redknot import cli
from redknot.cli import bench

ROOT = Path(__file__).resolve().parents[2]


def test_usage_lists_every_command(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name, (_, summary) in cli.COMMANDS.items():
        assert f"  {name}" in out and summary in out
    assert "example" in out


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_help_says_what_it_does_with_an_example(name, capsys):
    try:
        status = cli.main([name, "--help"])
    except SystemExit as e:  # argparse's --help
        status = e.code
    assert status == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: redknot {name}")
    assert "example" in out.lower()
    assert re.search(rf"^\s+redknot {name} \S", out, re.MULTILINE), "the example runs this command"


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_a_command_runs_its_tool(tmp_path, capsys):
    assert (
        cli.main(["headmap", "show", str(ROOT / "configs/heads/smollm2-135m-instruct.json")]) == 0
    )
    assert "global" in capsys.readouterr().out
    assert cli.main(["headmap", "show", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("redknot headmap show: error:")


@pytest.mark.parametrize(
    "module, prog",
    [
        ("redknot", "redknot"),
        ("redknot.eval", "python -m redknot.eval"),
        ("redknot.headmap", "python -m redknot.headmap"),
        ("redknot.profiler", "redknot-profile"),
    ],
)
def test_python_m_entry_points_still_work(module, prog):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert prog in proc.stdout


def test_setup_declares_the_console_scripts():
    text = (ROOT / "setup.py").read_text()
    assert '"redknot = redknot.cli:main"' in text
    assert '"redknot-profile = redknot.profiler.cli:main"' in text


def test_bench_finds_the_checkout_scripts():
    found = bench.scripts()
    assert found["ttft"] == ROOT / "benchmarks/ttft.py"
    assert found["gpu_run"] == ROOT / "benchmarks/gpu_run.py"
    assert found["e2e_equivalence"] == ROOT / "scripts/e2e_equivalence.py"
    assert "serving_common" not in found  # imported by scripts, not run itself
    assert all(bench.summary(p) and len(bench.summary(p)) <= 72 for p in found.values())


def test_bench_runs_a_script_and_refuses_unknown_names(capsys):
    assert cli.main(["bench", "ab_join", "--help"]) == 0
    assert cli.main(["bench", "no_such_script"]) == 2
    assert "no script 'no_such_script'" in capsys.readouterr().err
