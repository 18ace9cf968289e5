"""Important-token selection against brute force, and the FFN rows of the elastic schedule."""

from __future__ import annotations

import itertools

import pytest
import torch

from redknot.headmap import synthetic_map
from redknot.recovery import RecoveryOptions, create_policy, newest_rows, select_important, serve

from .conftest import compose


def _brute_force(mass, candidates, thresh):
    """Smallest subsets reaching the threshold; among them, those of the largest mass."""
    values = {int(c): float(mass[c]) for c in candidates}
    total = sum(values.values())
    for size in range(len(values) + 1):
        sets = [
            s
            for s in itertools.combinations(values, size)
            if sum(values[c] for c in s) >= thresh * total - 1e-12
        ]
        if sets:
            best = max(sum(values[c] for c in s) for s in sets)
            return size, best
    raise AssertionError


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thresh", [0.1, 0.3, 0.5, 0.77, 0.95])
def test_selection_is_the_smallest_set_of_largest_mass(seed, thresh):
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(14, generator=gen) ** 3
    candidates = torch.sort(torch.randperm(14, generator=gen)[:9]).values
    got = select_important(mass, candidates, thresh)
    size, best = _brute_force(mass, candidates, thresh)
    assert got.numel() == size
    assert abs(float(mass[got].sum()) - best) < 1e-6
    assert bool((got[1:] > got[:-1]).all()) and set(got.tolist()) <= set(candidates.tolist())


def test_selection_limits_and_ties():
    mass = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    rows = torch.arange(5)
    assert select_important(mass, rows, 0.0).numel() == 0
    assert select_important(mass, rows, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert select_important(mass, rows, 0.5).tolist() == [1, 2]  # ties: lower rows first
    assert select_important(torch.zeros(5), rows, 0.5).numel() == 0
    assert select_important(mass, rows[:0], 0.5).numel() == 0


def test_newest_rows_cover_the_question_and_recent_n():
    assert newest_rows(100, 90, 4).tolist() == list(range(90, 100))
    assert newest_rows(100, 98, 4).tolist() == [96, 97, 98, 99]
    assert newest_rows(10, 5, 64).tolist() == list(range(10))


def test_elastic_ffn_rows_follow_the_schedule(runner, pieces):
    """Shallow layers: every row; deep layers: new rows, the last recent_n and the chosen
    segment rows, chosen from the newest rows' attention mass as a brute force recomputes it."""
    hm = synthetic_map(runner.shape, 0.5, window=16, sink=2, seed=0)
    prompt = compose(runner, pieces, hm)
    opts = RecoveryOptions(
        dense_layers=1, mass_thresh=0.6, recent_n=8, restore_thresh=None, skipped="residual"
    )
    policy = create_policy("redknot", prompt, shape=runner.shape, head_map=hm, options=opts)
    seen = []
    original = policy.choose_ffn_rows

    def spy(ctx, probe):
        rows = original(ctx, probe)
        seen.append((ctx.layer, probe, rows))
        return rows

    policy.choose_ffn_rows = spy
    serve(runner, policy, max_new_tokens=1)
    segment = prompt.is_segment_row()
    new = set(torch.nonzero(~segment).flatten().tolist()) | set(range(110, 118))
    for layer, probe, rows in seen:
        if layer < 1:
            assert rows is None and probe is None
            continue
        assert probe.rows.tolist() == list(range(106, 118))  # question (12) > recent_n (8)
        mass = probe.key_mass.sum(0)
        candidates = [r for r in range(118) if r not in new]
        ranked = sorted(candidates, key=lambda r: (-float(mass[r]), r))
        total, covered, chosen = sum(float(mass[r]) for r in candidates), 0.0, []
        for r in ranked:
            if covered >= 0.6 * total:
                break
            chosen.append(r)
            covered += float(mass[r])
        assert rows.tolist() == sorted(new | set(chosen))
    ffn = policy.record.fractions()["ffn"]
    assert 0.0 < ffn < 1.0
    assert policy.record.fractions()["kv_heads"] == pytest.approx(0.5)
    assert policy.record.fractions()["attention"] == 1.0
