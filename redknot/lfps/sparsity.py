"""Head-sparsity estimate and the sink-plus-mean bypass (Eq. 5-6, appendix B.1).

Logit of key ``j``: ``x_j = scale * q . k_j``. Three unnormalised masses per head, in log space:

| term   | estimate                                                                       |
| ------ | ------------------------------------------------------------------------------ |
| sink   | ``log sum_{j < S} exp(x_j)`` (exact, the sinks are few)                         |
| global | ``log n + mu + sigma^2 / 2``: ``n`` non-sink logits taken as N(mu, sigma^2),    |
|        | ``mu = scale * q . k_mean``, ``sigma^2 = rho * (scale |q| |k_mean|)^2``         |
| local  | ``log sum`` over the last ``local_window`` keys (exact)                          |

Sparsity ``r = sink / (sink + max(global, local))`` (the log-normal sum of B.1 for flat heads,
the local sum for concentrated ones). ``rho`` is the stored query statistic.
"""

from __future__ import annotations

import math

import torch

from redknot.lfps.params import LfpsParams
from redknot.lfps.state import LfpsState


def head_sparsity(
    query: torch.Tensor, keys: torch.Tensor, state: LfpsState, params: LfpsParams
) -> torch.Tensor:
    """Eq. 5-6: the estimated share of attention on the sink tokens.

    Args:
        query: [H, D]; keys: [H, N, D] including the current token's key at ``N - 1``.
    Returns:
        [H] float32 in [0, 1]; zeros when ``num_sink == 0``.
    """
    h, n, _ = keys.shape
    s = params.num_sink
    if s == 0:
        return torch.zeros(h)
    q = query.float()
    scale = state.scale
    sink = torch.logsumexp(torch.einsum("hd,hnd->hn", q, keys[:, :s].float()) * scale, dim=-1)
    num_rest = n - s
    mu = (q * state.mean_key).sum(-1) * scale
    sigma2 = state.query_stat * (scale * q.norm(dim=-1) * state.mean_key.norm(dim=-1)) ** 2
    global_term = math.log(num_rest) + mu + 0.5 * sigma2
    w = min(params.local_window, num_rest)
    local_logits = torch.einsum("hd,hnd->hn", q, keys[:, n - w :].float()) * scale
    local = torch.logsumexp(local_logits, dim=-1)
    rest = torch.maximum(global_term, local)
    return torch.sigmoid(sink - rest)


def bypass_output(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, state: LfpsState, num_sink: int
) -> torch.Tensor:
    """Sink-plus-mean output: softmax over the sink keys and the mean key weighted by the count
    of non-sink keys, applied to the sink values and the mean value.

    Args:
        query: [H, D]; keys, values: [H, N, D].
    Returns:
        [H, D] float32; equals full attention when all non-sink keys and values are equal.
    """
    n = keys.shape[1]
    q = query.float()
    sink_logits = torch.einsum("hd,hnd->hn", q, keys[:, :num_sink].float()) * state.scale
    mean_logit = (q * state.mean_key).sum(-1, keepdim=True) * state.scale + math.log(n - num_sink)
    probs = torch.softmax(torch.cat([sink_logits, mean_logit], dim=-1), dim=-1)  # [H, S + 1]
    vals = torch.cat([values[:, :num_sink].float(), state.mean_value.unsqueeze(1)], dim=1)
    return torch.einsum("hs,hsd->hd", probs, vals)
