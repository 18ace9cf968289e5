"""``benchmarks/selection_numerics.py``: the selection each token policy made is recorded from
the reference path, compared between two runs, and servers' generations are matched to them."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.selection_numerics import (
    BF16_RESOLUTION,
    HeadInCall,
    jaccard,
    near_cut,
    run,
    served_agreement,
    summarise,
)
from redknot.eval.cases import Case

from .conftest import CharTokenizer

CASE = Case("c", ("the cat sat on the mat. " * 6, "a dog ran in the park. " * 6), " who? ",
            ("cat",), system="be brief.")  # fmt: skip
LABELS = ["epic[epic_k=16]", "sparsex[sparseq_boundary=1]"]


def test_overlap_and_rows_near_the_cut():
    assert jaccard([1, 2, 3], [2, 3, 4]) == pytest.approx(0.5) and jaccard([], []) == 1.0
    scores = torch.tensor([10.0, 5.0, 5.0 * (1 + BF16_RESOLUTION / 2), 1.0, 0.0])
    # the 2nd largest is 5.0 * (1 + r/2): 5.0 lies within the resolution of it, 10 does not
    assert near_cut(scores, torch.arange(5), 2) == 2
    assert near_cut(scores, torch.arange(5), 5) == 0  # nothing is cut


def test_selections_are_recorded_per_policy_and_the_runs_compared(backend):
    a = run(backend, CASE, LABELS)
    b = run(backend, CASE, LABELS)  # the same backend again: identical
    epic, sparsex = a[LABELS[0]], a[LABELS[1]]
    assert epic["selected"] and sparsex["selected"] and "near_cut" in sparsex
    composed = backend.composed(CASE)
    firsts = [s for s, e in composed.segments]
    # EPIC keeps each segment's first 16 tokens, as prompt positions
    want = sorted(p for s, e in composed.segments for p in range(s, min(s + 16, e)))
    assert epic["selected"] == want and min(firsts) in epic["selected"]
    per_case = [{"id": "c", "one": a, "two": b}]
    summary = summarise(per_case, LABELS, ("one", "two"))
    assert summary["full"]["identical_generations"] == 1
    assert summary[LABELS[1]]["identical_selections"] == 1
    assert summary[LABELS[1]]["mean_jaccard"] == 1.0


def test_a_head_computed_in_the_call_keeps_positions_comparable(backend):
    inside = HeadInCall(backend.runner.model.hf_model, CharTokenizer(), backend.head_map,
                        model_name="tiny", max_new_tokens=4)  # fmt: skip
    cached, computed = run(backend, CASE, LABELS[:1]), run(inside, CASE, LABELS[:1])
    assert backend.composed(CASE).prefix_len > 0  # the case has a head to move
    assert cached[LABELS[0]]["selected"] == computed[LABELS[0]]["selected"]


def test_served_generations_are_matched_to_each_run(tmp_path):
    per_case = [
        {"id": "a", "x": {"full": {"output": "Paris"}, "epic[epic_k=16]": {"output": "Rome"}},
         "y": {"full": {"output": "Paris"}, "epic[epic_k=16]": {"output": "Paris"}}},
        {"id": "b", "x": {"full": {"output": "1"}, "epic[epic_k=16]": {"output": "2"}},
         "y": {"full": {"output": "1"}, "epic[epic_k=16]": {"output": "2"}}},
    ]  # fmt: skip
    server = {"commit": "abc", "per_case": [
        {"id": "a", "settings": {"full": {"output": " Paris"}, "epic": {"output": "Rome "}}},
        {"id": "b", "settings": {"full": {"output": "1"}, "epic": {"output": "3"}}},
        {"id": "z", "settings": {"full": {"output": "?"}, "epic": {"output": "?"}}},
    ]}  # fmt: skip
    path = tmp_path / "s.json"
    path.write_text(json.dumps(server))
    got = served_agreement(per_case, [f"{path}=epic[epic_k=16]"], ("x", "y"))
    item = got[f"{path}=epic[epic_k=16]"]
    assert item["cases"] == 2 and item["commit"] == "abc"
    assert item["x"] == {"epic": 1, "full": 2} and item["y"] == {"epic": 0, "full": 2}
