"""Adaptive restore: a local head that presses on the oldest edge of its window is promoted
to full attention (global) for the rest of the request.

Definition of the edge. For a probed query at position ``p`` a local head sees the sink
``[0, sink)`` and its window ``[p - window + 1, p]``. The *oldest edge* of the window is its
``edge`` oldest positions that are not sink positions::

    edge(p) = { j : sink <= j  and  window - edge <= p - j < window }

A head's *edge mass* is the attention probability its query heads put on ``edge(p)`` (as the
local head attends: softmax over sink + window), averaged over the probed queries (the newest
tokens, see :func:`redknot.recovery.importance.newest_rows`), then maximised over the query
heads of the KV head's group (a KV head serves its most demanding query head). Attention
spread evenly over sink + window puts ``edge / (sink + window)`` there; mass well above that
means the head keeps reaching for tokens just out of its sight. The statistic is the same as
:attr:`redknot.reference.AttentionProbe.edge_mass`.

A local KV head whose edge mass exceeds ``restore_thresh`` in a layer becomes global in that
layer: its KV is recomputed for every token (as a global head's) and it attends the whole
prompt, in the prefill and every decode step of the request.
"""

from __future__ import annotations

from torch import Tensor

from redknot.headmap import GLOBAL, LOCAL
from redknot.reference.stats import probe_attention


def edge_mass(
    q: Tensor,
    keys: Tensor,
    rows: Tensor,
    positions: Tensor,
    classes: str,
    *,
    window: int,
    sink: int,
    edge: int,
    scale: float,
) -> Tensor:
    """``[Hkv]`` float32 edge mass per KV head (0 for global heads, which have no window).

    ``q``: ``[Hq, P, d]`` the probed queries; ``keys``: ``[Hkv, Tk, d]`` as attended;
    ``rows`` / ``positions``: ``[P]`` int64."""
    probe = probe_attention(
        q, keys, rows, positions, classes, window=window, sink=sink, edge=edge, scale=scale
    )
    per_kv = probe.kv_head_max(probe.edge_mass, keys.shape[0])
    local = [c == LOCAL for c in classes]
    return per_kv * per_kv.new_tensor(local)


def promote(classes: str, mass: Tensor, restore_thresh: float) -> str:
    """``classes`` with every local head whose ``mass`` (``[Hkv]``) exceeds the threshold
    made global."""
    return "".join(
        GLOBAL if c == LOCAL and float(m) > restore_thresh else c
        for c, m in zip(classes, mass.tolist())
    )
