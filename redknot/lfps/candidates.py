"""Candidate keys from the score tables: kurtosis-scaled thresholds (Eq. 7-8) and the positional
expansion (Eq. 9). All masks are [H, N] bool over key positions of the query at ``t = N - 1``;
sink positions are never candidates (they are always attended).

Threshold of a table ``x`` (its non-sink entries): ``theta = mean + lam * std * 3 / kurt`` with
``kurt = E[(x - mean)^4] / std^4``; a Gaussian table (kurt = 3) gets ``mean + lam * std``, a
sharper (more kurtic) one a lower threshold, hence a larger candidate budget.
"""

from __future__ import annotations

import torch

from redknot.lfps.params import LfpsParams


def slash_by_position(slash: torch.Tensor) -> torch.Tensor:
    """Slash table read per key position: ``out[:, j] = slash[:, t - j]``, ``t = N - 1``.

    Args:
        slash: [H, N] float32 indexed by distance.
    Returns:
        [H, N] float32 indexed by position.
    """
    return slash.flip(-1)


def kurtosis_threshold(table: torch.Tensor, lam: float) -> torch.Tensor:
    """Eq. 8 for each row of ``table`` ([H, M] float32); returns [H] float32."""
    mean = table.mean(-1, keepdim=True)
    centered = table - mean
    var = centered.square().mean(-1)
    kurt = centered.pow(4).mean(-1) / var.square().clamp_min(1e-30)
    std = var.sqrt()
    scaled = torch.where(kurt > 0, 3.0 / kurt.clamp_min(1e-30), torch.zeros_like(kurt))
    return mean.squeeze(-1) + lam * std * scaled


def initial_candidates(
    vertical: torch.Tensor, slash: torch.Tensor, params: LfpsParams
) -> torch.Tensor:
    """Eq. 7: positions whose vertical score or whose distance's slash score passes Eq. 8.

    Args:
        vertical, slash: [H, N] float32 (slash by distance).
    Returns:
        [H, N] bool.
    """
    s = params.num_sink
    v_pos = vertical[:, s:]
    s_pos = slash_by_position(slash)[:, s:]
    theta_v = kurtosis_threshold(v_pos, params.lam).unsqueeze(-1)
    theta_s = kurtosis_threshold(s_pos, params.lam).unsqueeze(-1)
    mask = torch.zeros_like(vertical, dtype=torch.bool)
    mask[:, s:] = (v_pos > theta_v) | (s_pos > theta_s)
    return mask


def expand_candidates(
    initial: torch.Tensor, vertical: torch.Tensor, slash: torch.Tensor, params: LfpsParams
) -> torch.Tensor:
    """Eq. 9: ``{i + o : i in initial, o in offsets}`` kept where the vertical or the slash score
    of ``i + o`` exceeds that table's mean (over non-sink entries); ``initial`` is always kept.

    Args:
        initial: [H, N] bool; vertical, slash: [H, N] float32 (slash by distance).
    Returns:
        [H, N] bool.
    """
    s = params.num_sink
    n = initial.shape[1]
    shifted = torch.zeros_like(initial)
    for o in params.offsets:  # a handful of shifts, each one batched over heads
        if o >= 0:
            shifted[:, o:] |= initial[:, : n - o]
        else:
            shifted[:, :o] |= initial[:, -o:]
    v_pos = vertical
    s_pos = slash_by_position(slash)
    v_mean = v_pos[:, s:].mean(-1, keepdim=True)
    s_mean = s_pos[:, s:].mean(-1, keepdim=True)
    keep = (v_pos > v_mean) | (s_pos > s_mean)
    out = (shifted & keep) | initial
    out[:, :s] = False
    return out
