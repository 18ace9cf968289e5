"""Answer and first-token metrics."""

from __future__ import annotations

import pytest
import torch

from redknot.eval import answer_scores, first_token_scores, normalize, token_f1
from redknot.eval.fidelity import pareto


def test_normalisation_and_f1():
    assert normalize("The  Red, Compass!") == "red compass"
    assert token_f1("red compass.", "a red compass") == 1.0
    assert token_f1("blue compass", "red compass") == pytest.approx(0.5)
    assert token_f1("", "x") == 0.0


def test_answer_scores_use_first_line_for_em_and_f1():
    got = answer_scores(" Anton Quinlan.\n\nQuestion: who", ["anton quinlan", "Bruno"])
    assert got == {"contains": 1.0, "exact_match": 1.0, "f1": 1.0}
    got = answer_scores("He is Anton Quinlan", ["Anton Quinlan"])
    assert got["contains"] == 1.0 and got["exact_match"] == 0.0
    assert got["f1"] == pytest.approx(2 * (2 / 4) * 1 / (2 / 4 + 1))
    assert answer_scores("12345", ["54321"]) == {"contains": 0.0, "exact_match": 0.0, "f1": 0.0}


def test_first_token_scores():
    dense = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0, 2.0, 0.5, 0.1, 0.2, 0.3, 0.4, -1.0])
    same = first_token_scores(
        dense, dense.topk(10).indices.tolist(), dense, dense.topk(10).indices.tolist()
    )
    assert same == {"top1": 1.0, "top10": 1.0, "cosine": pytest.approx(1.0), "kl": 0.0}
    other = dense.clone()
    other[3], other[11] = 9.0, 0.45
    got = first_token_scores(
        other, other.topk(10).indices.tolist(), dense, dense.topk(10).indices.tolist()
    )
    assert got["top1"] == 0.0 and got["top10"] == 0.9
    assert got["cosine"] == pytest.approx(float(torch.cosine_similarity(other, dense, dim=0)))
    p, q = torch.softmax(dense.double(), 0), torch.softmax(other.double(), 0)
    assert got["kl"] == pytest.approx(float((p * (p / q).log()).sum()))
    assert got["kl"] > 0.0
    assert first_token_scores(None, [1], None, [1])["cosine"] is None
    assert first_token_scores(None, [1], None, [1])["kl"] is None


def test_pareto_front():
    summary = {
        "full": {"flops_fraction": 1.0, "top1": 1.0},
        "a": {"flops_fraction": 0.5, "top1": 0.9},
        "b": {"flops_fraction": 0.6, "top1": 0.8},  # dominated by a
        "c": {"flops_fraction": 0.1, "top1": 0.5},
    }
    assert pareto(summary) == ["c", "a", "full"]
