"""Fidelity metrics: the first token against dense, and the greedy answer against the answers.

| metric            | definition                                                           |
| ----------------- | -------------------------------------------------------------------- |
| ``top1``          | 1 when the first token's argmax equals dense's                       |
| ``top10``         | ``|top-10 ∩ dense top-10| / 10``                                    |
| ``cosine``        | cosine similarity of the first token's logits with dense's           |
| ``kl``            | ``KL(dense || policy)`` of the first token's softmax, in nats         |
| ``contains``      | 1 when an answer appears in the output (case-insensitive)            |
| ``exact_match``   | 1 when the output's first line equals an answer after normalisation  |
| ``f1``            | best token F1 of the output's first line against an answer           |

Normalisation (SQuAD style): lower case, punctuation and the articles a/an/the removed,
whitespace collapsed.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def token_f1(prediction: str, answer: str) -> float:
    pred, gold = normalize(prediction).split(), normalize(answer).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or common == 0:
        return float(pred == gold)
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def answer_scores(output: str, answers: Sequence[str]) -> dict[str, float]:
    """``contains``, ``exact_match`` and ``f1`` of a greedy ``output``."""
    line = first_line(output)
    return {
        "contains": float(any(a.lower() in output.lower() for a in answers)),
        "exact_match": float(any(normalize(line) == normalize(a) for a in answers)),
        "f1": max(token_f1(line, a) for a in answers),
    }


def first_token_scores(
    logits: Tensor | None, top: Sequence[int], dense_logits: Tensor | None, dense_top: Sequence[int]
) -> dict[str, float | None]:
    """``top1``, ``top10`` from the top-10 ids (``[10]``, best first); ``cosine`` and ``kl``
    from the full ``[vocab]`` logits when both sides have them (else ``None``)."""
    cosine = kl = None
    if logits is not None and dense_logits is not None:
        cosine = float(
            torch.nn.functional.cosine_similarity(logits.double(), dense_logits.double(), dim=0)
        )
        kl = kl_to_dense(logits, dense_logits)
    return {
        "top1": float(top[0] == dense_top[0]),
        "top10": len(set(top[:10]) & set(dense_top[:10])) / 10,
        "cosine": cosine,
        "kl": kl,
    }


def kl_to_dense(logits: Tensor, dense_logits: Tensor) -> float:
    """``KL(p_dense || p)`` in nats of the softmax of two ``[vocab]`` logit vectors (float64):
    how much probability the policy moves away from what dense predicts (0 when equal)."""
    log_p = torch.log_softmax(logits.double(), dim=0)
    log_dense = torch.log_softmax(dense_logits.double(), dim=0)
    return float(torch.sum(log_dense.exp() * (log_dense - log_p)).clamp(min=0.0))
