from __future__ import annotations

import pytest
import torch

from redknot.reference import attention as A
from redknot.reference.attention import attention_probs, head_class_attention


def brute_force(q, k, v, q_pos, classes, window, sink):
    """Per query head, per query: softmax over the keys its class lets it see, in float64."""
    group = q.shape[0] // k.shape[0]
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float64)
    for h in range(q.shape[0]):
        kv = h // group
        for r, p in enumerate(q_pos.tolist()):
            keys = [j for j in range(p + 1) if classes[kv] == "G" or j < sink or p - j < window]
            s = (k[kv, keys].double() @ q[h, r].double()) * q.shape[-1] ** -0.5
            out[h, r] = torch.softmax(s, 0) @ v[kv, keys].double()
    return out


CASES = [
    # (classes, Tk, rows, window, sink)
    ("GL", 70, "tail", 8, 4),
    ("LG", 70, "all", 16, 0),
    ("LL", 90, "sparse", 5, 3),
    ("GG", 33, "tail", 4, 2),
    ("GLL", 120, "tail", 200, 8),  # window beyond the sequence
    ("LGL", 50, "sparse", 1, 1),  # window 1: the query's own key plus the sink
]


@pytest.mark.parametrize("classes,tk,rows,window,sink", CASES)
def test_matches_brute_force(monkeypatch, classes, tk, rows, window, sink):
    # small blocks, so that several blocks and the band gather are exercised
    monkeypatch.setattr(A, "GLOBAL_BLOCK", 16)
    monkeypatch.setattr(A, "LOCAL_BLOCK", 8)
    torch.manual_seed(len(classes) * tk + window)
    num_kv, group, d = len(classes), 2, 8
    k, v = torch.randn(2, num_kv, tk, d).unbind(0)
    if rows == "all":
        q_pos = torch.arange(tk)
    elif rows == "tail":
        q_pos = torch.arange(tk - 20, tk)
    else:
        q_pos = torch.sort(torch.randperm(tk)[:25]).values
    q = torch.randn(num_kv * group, q_pos.numel(), d)
    got = head_class_attention(q, k, v, q_pos, classes, window=window, sink=sink)
    want = brute_force(q, k, v, q_pos, classes, window, sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_probs_match_brute_force():
    torch.manual_seed(0)
    k = torch.randn(2, 40, 8)
    q_pos = torch.tensor([30, 35, 39])
    q = torch.randn(4, 3, 8)
    probs = attention_probs(q, k, q_pos, "GL", window=6, sink=2)
    assert probs.shape == (4, 3, 40)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3))
    v = torch.eye(40).expand(2, 40, 40)  # value j = one-hot j: the output is the probability row
    want = brute_force(q, k, v, q_pos, "GL", 6, 2)
    torch.testing.assert_close(probs.double(), want, atol=1e-6, rtol=1e-5)
    local = probs[2:]  # query heads of KV head 1 (local)
    for r, p in enumerate(q_pos.tolist()):
        hidden = [j for j in range(40) if not (j <= p and (j < 2 or p - j < 6))]
        assert float(local[:, r, hidden].abs().max()) == 0.0
