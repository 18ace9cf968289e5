"""Every Triton kernel, launched as the CPU tests launch it, also compiles for a GPU.

The CPU tests run the kernels under the Triton interpreter, which executes them as Python and
accepts programs Triton's compiler refuses. This test runs a set of them in a subprocess that
records each launch's argument types (``launch_specs.install``), then lowers every recorded
launch to Triton IR for an sm_90 target in a second process without the interpreter
(``launch_specs.lower``); no GPU is needed for that step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RECORDED = [  # tests whose launches cover every kernel and its constexpr variants
    "tests/kernels/test_decode.py::test_decode_matches_reference",
    "tests/kernels/test_decode.py::test_decode_local_rows_split_and_merge",
    "tests/kernels/test_extend.py::test_extend_matches_reference",
    "tests/kernels/test_extend.py::test_extend_split_keys_without_lse_and_window_blocks",
    "tests/kernels/test_rope_align.py::test_align_matches_reference_and_sglang",
    "tests/kernels/test_rope_align.py::test_one_launch_over_layers_equals_a_launch_per_layer",
    "tests/kernels/test_extend.py::test_extend_promoted_heads_match_reference",
    "tests/kernels/test_decode.py::test_decode_promoted_heads_match_reference",
    "tests/kernels/test_sparse_decode.py::test_sparse_decode_matches_reference",
    "tests/kernels/test_lfps_index.py::test_score_listed_keys",
    "tests/kernels/test_lfps_index.py::test_exact_topk_matches_reference",
    "tests/kernels/test_lfps_index.py::test_candidates_kernel_matches_rule",
    "tests/kernels/test_lfps_step.py",
    "tests/kernels/test_lfps_select.py::test_topk_matches_reference",
    "tests/kernels/test_lfps_select.py::test_union_lists_every_marked_entry_in_list_order",
    "tests/kernels/test_lfps_build.py::test_the_kernels_build_the_tables_of_the_pytorch_build",
]
KERNELS = {
    "segpaged_decode_kernel", "segpaged_decode_merge_kernel", "segpaged_extend_kernel",
    "rope_align_kernel", "sparse_decode_kernel", "sparse_decode_merge_kernel",
    "lfps_score_kernel", "lfps_moments_kernel", "lfps_mark_kernel", "lfps_hist_kernel",
    "lfps_write_kernel",
    "lfps_sparsity_kernel", "lfps_update_stats_kernel", "lfps_update_add_kernel",
    "lfps_attend_merge_kernel",
    "lfps_topk_kernel", "lfps_union_kernel",
    "lfps_build_lse_kernel", "lfps_build_tables_kernel",
}  # fmt: skip


def test_recorded_launches_lower_to_triton_ir(tmp_path):
    specs = tmp_path / "launches.json"
    root = TESTS.parent
    env = dict(os.environ, TRITON_INTERPRET="1", REDKNOT_RECORD_LAUNCHES=str(specs))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RECORDED],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recorded = json.loads(specs.read_text())
    assert {s["kernel"] for s in recorded} >= KERNELS, sorted({s["kernel"] for s in recorded})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(root), env.get("PYTHONPATH", "")])
    low = subprocess.run(
        [sys.executable, "-m", "kernels.launch_specs", str(specs)],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert low.returncode == 0, low.stdout[-2000:] + low.stderr[-4000:]
    lowered = [line for line in low.stdout.splitlines() if line.startswith("lowered ")]
    assert len(lowered) == len(recorded)
