"""Segment reuse's sparse FFN: key mass and row choice against brute force, the MLP hook, and
the runner deciding each deep layer's rows (limits: mass_thresh 1 and dense_layers = layers
skip nothing)."""

from __future__ import annotations

import math

import pytest
import torch

from redknot.attention.ffn_schedule import SCHEDULE, SparseFfn, around_mlp
from redknot.kernels.choose import choose_rows
from redknot.kernels.reference import key_mass_reference


def brute_mass(q, keys, q_pos, scale):
    """q: [P, G, grp, D]; keys: [L, G, D]."""
    mass = [0.0] * keys.shape[0]
    for i, pos in enumerate(q_pos.tolist()):
        for g in range(q.shape[1]):
            for j in range(q.shape[2]):
                s = [float(q[i, g, j] @ keys[t, g]) * scale for t in range(pos + 1)]
                m = max(s)
                z = sum(math.exp(x - m) for x in s)
                for t in range(pos + 1):
                    mass[t] += math.exp(s[t] - m) / z
    return torch.tensor(mass)


def brute_skip(mass, candidates, thresh):
    """Candidates outside the fewest highest-mass ones covering ``thresh`` of their mass."""
    order = sorted(candidates, key=lambda c: (-float(mass[c]), c))
    total = sum(float(mass[c]) for c in candidates)
    taken, acc = [], 0.0
    for c in order:
        if acc >= thresh * total:
            break
        taken.append(c)
        acc += float(mass[c])
    return sorted(set(candidates) - set(taken))


def test_key_mass_reference_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 2, 8, generator=g)
    keys = torch.randn(12, 2, 8, generator=g)
    pos = torch.tensor([9, 10, 11])
    got = key_mass_reference(q, keys, pos, 0.35)
    torch.testing.assert_close(got, brute_mass(q, keys, pos, 0.35), atol=1e-5, rtol=1e-5)
    assert abs(float(got.sum()) - 3 * 2 * 2) < 1e-4  # one unit per probed query head


@pytest.mark.parametrize("thresh", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("held", [False, True])
def test_rows_that_skip_the_ffn_match_brute_force(thresh, held):
    mass = torch.rand(40, generator=torch.Generator().manual_seed(1))
    cand = torch.arange(10, 30)
    spec = SparseFfn(req_pool_idx=1, batch_offset=7, prefix=5, length=35, probe_start=30,
                     candidates=cand)  # fmt: skip
    keep = torch.ones(42, dtype=torch.bool)  # rows in recovery
    active = cand.tolist()
    if held:  # rows that left earlier are no candidates: the choice is among the others
        keep[[c - 5 + 7 for c in (11, 12, 20, 29)]] = False
        active = [c for c in active if c not in (11, 12, 20, 29)]
    keep[1] = False  # another request's row that left: stays out
    before = keep.clone()
    skipped = torch.zeros(2, dtype=torch.int32)
    choose_rows(mass, spec.candidates, spec.candidate_rows, thresh, keep, skipped, 1)
    want = [c - 5 + 7 for c in brute_skip(mass, active, thresh)]
    assert (before & ~keep).nonzero().squeeze(1).tolist() == want
    assert not (keep & ~before).any() and skipped.tolist() == [0, len(want)]


def test_no_row_skips_when_no_global_head_voted():
    spec = SparseFfn(1, 0, 0, 20, 15, torch.arange(2, 12))
    keep = torch.ones(20, dtype=torch.bool)
    skipped = torch.zeros(1, dtype=torch.int32)
    choose_rows(torch.zeros(20), spec.candidates, spec.candidate_rows, 0.5, keep, skipped, 0,
                check_votes=True)  # fmt: skip
    assert keep.all() and skipped.tolist() == [0]


def test_mlp_hook_runs_only_the_scheduled_rows():
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.SiLU())
    x = torch.randn(5, 6)

    def original(module, h):
        return module(h)

    SCHEDULE.reset()
    torch.testing.assert_close(around_mlp(original, mlp, x), mlp(x))
    SCHEDULE.layer, SCHEDULE.rows[3] = 3, torch.tensor([0, 2])
    out = around_mlp(original, mlp, x)
    torch.testing.assert_close(out[[0, 2]], mlp(x[[0, 2]]))
    assert torch.equal(out[[1, 3, 4]], torch.zeros(3, 6))
    SCHEDULE.layer = 4  # another layer: no schedule
    torch.testing.assert_close(around_mlp(original, mlp, x), mlp(x))
    SCHEDULE.reset()
