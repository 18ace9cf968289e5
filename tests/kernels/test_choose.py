"""The sparse FFN's fused choice (``redknot.kernels.choose``) against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from redknot.kernels.choose import choose_rows
from redknot.kernels.reference import choose_rows_reference


def _case(seed: int, num_keys: int, num_cand: int, inactive: float, ties: bool, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(num_keys, generator=g)
    if ties:  # few distinct values: the order among equals decides
        mass = (mass * 4).floor() / 4
    mass[torch.rand(num_keys, generator=g) < 0.1] = 0.0
    candidates = torch.sort(torch.randperm(num_keys, generator=g)[:num_cand]).values
    num_rows = num_keys + 7
    rows = candidates + 3  # the batch rows of the request start at row 3
    keep = torch.rand(num_rows, generator=g) >= inactive
    return (x.to(device) for x in (mass.float(), candidates, rows, keep))


def _check(mass, candidates, rows, keep, thresh, check_votes=False):
    want_keep, want_count = choose_rows_reference(mass, candidates, rows, thresh, keep, check_votes)
    got_keep = keep.clone()
    skipped = torch.zeros(3, dtype=torch.int32, device=keep.device)
    choose_rows(mass, candidates, rows, thresh, got_keep, skipped, 1, check_votes=check_votes)
    assert torch.equal(got_keep.cpu(), want_keep.cpu())
    assert skipped.tolist() == [0, want_count, 0]
    return want_count


@pytest.mark.parametrize("thresh", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize(
    "num_keys, num_cand, inactive, ties",
    [(50, 0, 0.0, False), (50, 1, 0.0, False), (300, 200, 0.0, False), (3000, 2500, 0.3, False),
     (3000, 2500, 0.0, True), (2100, 2049, 0.5, True)],
)  # fmt: skip
def test_choice_matches_the_reference(num_keys, num_cand, inactive, ties, thresh):
    args = _case(7 + num_cand, num_keys, num_cand, inactive, ties)
    count = _check(*args, thresh)
    if 0 < thresh < 1 and num_cand > 100:
        assert count > 0, "the case needs rows that skip"


def test_no_vote_skips_nobody_when_asked_and_everyone_otherwise():
    mass, candidates, rows, keep = _case(3, 400, 300, 0.2, False)
    mass.zero_()  # no global head voted
    assert _check(mass, candidates, rows, keep, 0.5, check_votes=True) == 0
    # without the vote check every active candidate skips (no mass: none is important)
    assert _check(mass, candidates, rows, keep, 0.5) == int(keep[rows].sum())
    other = min(set(range(mass.numel())) - set(candidates.tolist()))
    mass[other] = 1.0  # a vote on a key that is not a candidate: candidates hold no mass
    assert _check(mass, candidates, rows, keep, 0.5, check_votes=True) == int(keep[rows].sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("thresh", [0.3, 0.5])
def test_choice_at_a_32k_prompt_on_the_gpu(thresh):
    args = _case(11, 32768, 30000, 0.4, False, device="cuda")
    assert _check(*args, thresh) > 0


def test_startup_check_of_the_choice_passes_and_catches_a_wrong_choice(monkeypatch):
    from redknot.attention import startup_check
    from redknot.kernels import choose

    startup_check.check_choice(torch.device("cpu"))
    startup_check.check_choice(torch.device("cpu"), check_votes=True)
    real = choose.choose_rows

    def off_by_one(mass, candidates, rows, thresh, keep, skipped, index, check_votes=False):
        real(mass, candidates, rows, min(thresh + 0.05, 1.0), keep, skipped, index, check_votes)

    monkeypatch.setattr(choose, "choose_rows", off_by_one)
    with pytest.raises(startup_check.StartupCheckError, match="choice of rows .* differs"):
        startup_check.check_choice(torch.device("cpu"))
