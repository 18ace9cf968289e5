"""Per-layer attention statistics of probed query rows (typically the last queries of a prompt).

They feed the head profiler (long-range need of every head) and, later, recovery policies
(token importance for the sparse FFN, window-edge mass for adaptive restore).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from redknot.reference.attention import attention_probs


@dataclass
class AttentionProbe:
    """Attention of ``P`` probed query rows in one layer, as actually computed (local heads
    restricted to sink + window).

    | field          | shape             | meaning                                                |
    | -------------- | ----------------- | ------------------------------------------------------ |
    | ``rows``       | [P] int64         | probed rows of the forward (indices into its tokens)   |
    | ``positions``  | [P] int64         | their positions                                        |
    | ``key_mass``   | [Hq, Tk] float32  | attention each key receives, summed over probed rows   |
    | ``outside_mass`` | [Hq] float32    | mean mass on keys outside sink + window (0 on local heads) |
    | ``edge_mass``  | [Hq] float32      | mean mass on the ``edge`` oldest non-sink keys of the window |
    | ``probs``      | [Hq, P, Tk] or None | the probabilities themselves, when asked for          |

    A probed row at position ``p`` has, for a key ``j <= p``: *outside* when ``j >= sink`` and
    ``p - j >= window``; *edge* when ``j >= sink`` and ``window - edge <= p - j < window``.
    """

    rows: Tensor
    positions: Tensor
    key_mass: Tensor
    outside_mass: Tensor
    edge_mass: Tensor
    probs: Tensor | None = None

    def kv_head_max(self, values: Tensor, num_kv_heads: int) -> Tensor:
        """Reduce a per-query-head ``[Hq]`` statistic to ``[num_kv_heads]`` by the max over
        each KV head's group (a KV head must serve its most demanding query head)."""
        return values.view(num_kv_heads, -1).amax(dim=1)


def probe_attention(
    q: Tensor,
    k: Tensor,
    rows: Tensor,
    positions: Tensor,
    classes: str,
    *,
    window: int,
    sink: int,
    edge: int = 16,
    scale: float | None = None,
    keep_probs: bool = False,
) -> AttentionProbe:
    """Probe ``q`` (``[Hq, P, head_dim]``, the probed rows only) against all keys ``k``
    (``[Hkv, Tk, head_dim]``). ``rows`` and ``positions`` are ``[P]`` int64."""
    probs = attention_probs(q, k, positions, classes, window=window, sink=sink, scale=scale)
    k_pos = torch.arange(k.shape[1], device=q.device)
    qp, kp = positions[:, None], k_pos[None, :]
    distance = qp - kp  # [P, Tk]
    beyond_sink = kp >= sink
    outside = beyond_sink & (distance >= window)
    at_edge = beyond_sink & (distance >= max(window - edge, 0)) & (distance < window)
    num_rows = max(int(rows.numel()), 1)
    return AttentionProbe(
        rows=rows,
        positions=positions,
        key_mass=probs.sum(dim=1),
        outside_mass=(probs * outside).sum(dim=(1, 2)) / num_rows,
        edge_mass=(probs * at_edge).sum(dim=(1, 2)) / num_rows,
        probs=probs if keep_probs else None,
    )
