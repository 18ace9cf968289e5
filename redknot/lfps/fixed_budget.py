"""Eq. 7-9 over padded tables of a batch, into a fixed-capacity candidate list (the rule the GPU
kernel ``redknot.kernels.lfps_index.lfps_candidates`` implements; PyTorch, static shapes).

The reference's candidate set (``redknot.lfps.candidates``) has a data-dependent size; a CUDA
graph needs a fixed one. Per selection head, with ``count`` candidates and capacity ``C``:

| case          | list (newest position first, ``-1`` padded)                              |
| ------------- | ------------------------------------------------------------------------ |
| count <= C    | every candidate: the reference's set exactly                             |
| count > C     | the ``C`` of highest priority; priorities are binned (below), a tie in   |
|               | the cut bin goes to the newer positions                                  |

Priority of a candidate at position ``j``: ``r = max(V[j] / mean(V), Sl[t - j] / mean(Sl))``,
its table scores relative to the tables' means over the row's non-sink keys (scale-free, like
Eq. 8); bin ``clamp(floor(log2(r) * BINS_PER_OCTAVE), 0, NUM_BINS - 1)``. Binning, not an exact
Top-C, so that the kernel needs one histogram, not a sort, and one more pass over the row only
when it overflows.
"""

from __future__ import annotations

import torch

from redknot.lfps.params import LfpsParams

NUM_BINS = 64
BINS_PER_OCTAVE = 4  # bins span r in [1, 2^16); r below 1 (expansions only) share bin 0


def tables_by_position(
    vertical: torch.Tensor, slash: torch.Tensor, scale: torch.Tensor, seq_lens: torch.Tensor,
    num_sink: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """True table values by key position and the mask of the row's non-sink keys.

    Args:
        vertical, slash: [B, Hs, N] float32 stored tables (slash by distance).
        scale: [B, Hs] float32 (true = stored * scale).
        seq_lens: [B], keys including the new token's (``t = n - 1``).
    Returns:
        ``(v, sl, valid)``: [B, Hs, N] float32 (0 off ``valid``) and [B, 1, N] bool.
    """
    B, Hs, N = vertical.shape
    j = torch.arange(N, device=vertical.device)
    n = seq_lens.view(B, 1, 1).to(j.dtype)
    valid = (j >= num_sink) & (j < n)
    dist = (n - 1 - j).clamp(0, N - 1).expand(B, Hs, N)
    v = torch.where(valid, vertical * scale[..., None], 0.0)
    sl = torch.where(valid, torch.gather(slash, 2, dist) * scale[..., None], 0.0)
    return v, sl, valid


def masked_threshold(
    x: torch.Tensor, valid: torch.Tensor, count: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Eq. 8 threshold of each row of ``x`` over ``valid`` entries (``count`` of them):
    ``redknot.lfps.candidates.kurtosis_threshold`` on the valid entries. Returns [B, Hs] x 2."""
    mean = x.sum(-1) / count
    centered = torch.where(valid, x - mean[..., None], 0.0)
    var = centered.square().sum(-1) / count
    kurt = (centered.pow(4).sum(-1) / count) / var.square().clamp_min(1e-30)
    scaled = torch.where(kurt > 0, 3.0 / kurt.clamp_min(1e-30), torch.zeros_like(kurt))
    return mean, mean + lam * var.sqrt() * scaled


def priority_bins(v, sl, mean_v, mean_s) -> torch.Tensor:
    """[B, Hs, N] int64 priority bins (module docstring) from true values and row means."""
    r_v = torch.where(mean_v > 0, v / torch.where(mean_v > 0, mean_v, 1.0), 0.0)
    r_s = torch.where(mean_s > 0, sl / torch.where(mean_s > 0, mean_s, 1.0), 0.0)
    level = torch.log2(torch.maximum(r_v, r_s).clamp_min(1e-30)) * BINS_PER_OCTAVE
    return level.clamp(0.0, NUM_BINS - 1.0).long()


def candidates_reference(
    vertical: torch.Tensor,
    slash: torch.Tensor,
    scale: torch.Tensor,
    seq_lens: torch.Tensor,
    params: LfpsParams,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 7-9 on every (request, selection head) row, then the fixed-capacity rule.

    Returns:
        candidates: [B, Hs, capacity] int32 positions, newest first, -1 padded.
        count: [B, Hs] int32, candidates before the capacity was applied.
    """
    B, Hs, N = vertical.shape
    s = params.num_sink
    v, sl, valid = tables_by_position(vertical, slash, scale, seq_lens, s)
    m = (seq_lens - s).clamp_min(1).to(torch.float32).view(B, 1)
    mean_v, theta_v = masked_threshold(v, valid, m, params.lam)
    mean_s, theta_s = masked_threshold(sl, valid, m, params.lam)
    mean_v, theta_v, mean_s, theta_s = (x[..., None] for x in (mean_v, theta_v, mean_s, theta_s))
    init = valid & ((v > theta_v) | (sl > theta_s))
    keep = valid & ((v > mean_v) | (sl > mean_s))
    shifted = torch.zeros_like(init)
    for o in params.offsets:  # init at j - o, False off the row
        if o >= 0:
            shifted[..., o:] |= init[..., : N - o]
        else:
            shifted[..., :o] |= init[..., -o:]
    cand = init | (keep & shifted)
    count = cand.sum(-1)

    level = priority_bins(v, sl, mean_v, mean_s)
    hist = torch.zeros(B, Hs, NUM_BINS, dtype=torch.int64, device=v.device)
    hist.scatter_add_(2, level, cand.long())
    bins = torch.arange(NUM_BINS, device=v.device)
    at_or_above = count[..., None] - hist.cumsum(-1) + hist
    cut = torch.where(at_or_above >= capacity, bins, 0).amax(-1, keepdim=True)
    quota = capacity - torch.where(bins > cut, hist, 0).sum(-1, keepdim=True)
    at_cut = cand & (level == cut)
    newer = at_cut.flip(-1).long().cumsum(-1).flip(-1) - at_cut.long()  # at_cut entries after j
    trimmed = cand & ((level > cut) | (at_cut & (newer < quota)))
    kept = torch.where((count > capacity)[..., None], trimmed, cand)

    j = torch.arange(N, device=v.device)
    order = torch.where(kept, j, -1).sort(-1, descending=True).values[..., :capacity]
    order = torch.nn.functional.pad(order, (0, capacity - order.shape[-1]), value=-1)
    return order.to(torch.int32), count.to(torch.int32)
