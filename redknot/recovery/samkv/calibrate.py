"""SamKV's stable layers ``N*`` per model (appendix A.2): the layers that agree on which block
matters most.

For each document of each calibration request (``SamkvReport.block_scores``, a layer's scores
of the middle blocks under the document's query, ``[N, M]``): the block ``beta`` with the best
rank averaged over every layer; a layer votes when ``beta``'s score there is an outlier by the
PauTa criterion (above the layer's mean by ``sigma`` standard deviations). ``N*`` is the
window of ``samkv_stable_layers`` consecutive layers with the most votes (the paper keeps
consecutive last layers: 32-36 of Qwen2.5-3B, 28-32 of Mistral-7B); it is served as
``samkv_stable_from``.

>>> votes = sum(layer_votes(report.block_scores) for report in reports)
>>> start = stable_window(votes, width=4)          # RecoveryOptions(samkv_stable_from=start)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def layer_votes(block_scores: Sequence[Tensor], sigma: float = 3.0) -> Tensor:
    """[N] int64 votes of one request: per document with two or more middle blocks, the layers
    where its best block on average is a PauTa outlier."""
    votes = None
    for s in block_scores:
        s = s.to(torch.float64)
        if votes is None:
            votes = torch.zeros(s.shape[0], dtype=torch.int64)
        if s.shape[1] < 2:
            continue
        ranks = torch.argsort(torch.argsort(-s, dim=1, stable=True), dim=1).to(torch.float64)
        beta = int(ranks.mean(dim=0).argmin())  # 0 is the best rank; ties: the first block
        mean, std = s.mean(dim=1), s.std(dim=1, unbiased=False)
        votes += (s[:, beta] > mean + sigma * std).to(torch.int64)
    return votes if votes is not None else torch.zeros(0, dtype=torch.int64)


def stable_window(votes: Tensor, width: int) -> int:
    """The first layer of the ``width`` consecutive layers with the most votes (the later
    window on a tie: the paper finds stability in the last layers)."""
    n = votes.shape[0]
    if not 1 <= width <= n:
        raise ValueError(f"a window of {width} layers does not fit {n} layers")
    sums = [int(votes[i : i + width].sum()) for i in range(n - width + 1)]
    best = max(sums)
    return max(i for i, total in enumerate(sums) if total == best)
