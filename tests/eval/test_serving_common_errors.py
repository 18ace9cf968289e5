"""``serving_common.run_child`` on a child that fails: the lines that name the error, from both
ends of its output, and the grepped server lines, beside the tail."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serving_common as common

CHILD = """
print("[redknot] LFPS store: tiered, 4,096 GPU slots")
print("nvcc fatal   : Memory allocation failure")
print("ninja: build stopped: subcommand failed.")
for i in range(400):
    print(f"loading shard {i} " + "x" * 40)
raise RuntimeError("CUDA out of memory. Tried to allocate 3.47 GiB")
"""


def test_a_failed_child_keeps_its_first_error_lines_and_its_grepped_lines(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = common.run_child(str(script), [], log_grep="LFPS")
    assert out["error"] == "exit 1"
    assert "build stopped" not in out["log_tail"]  # far above the tail
    joined = "\n".join(out["error_lines"])
    assert "nvcc fatal" in joined and "ninja: build stopped" in joined
    assert "RuntimeError: CUDA out of memory" in joined
    assert not any("loading shard 5 " in x for x in out["error_lines"])
    assert out["log_lines"] == ["[redknot] LFPS store: tiered, 4,096 GPU slots"]


def test_error_lines_keep_both_ends_of_many():
    text = "\n".join(f"line {i}" + (" Error" if i % 2 else "") for i in range(200))
    got = common.error_lines(text, each_end=3)
    assert got[:2] == ["line 0", "line 1 Error"]
    assert got[-1] == "line 199 Error" and "line 101 Error" not in got
    assert len(got) == 12
