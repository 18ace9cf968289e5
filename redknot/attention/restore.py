"""Adaptive restore in the server: the reference's rule (:mod:`redknot.recovery.restore`) on
the SegPaged pool.

In the extend that completes a reusing prompt, each layer with local heads probes the newest
rows (the question, at least ``recent_n``; the same rows as the layer schedule's importance):
their attention over sink + window as the local heads compute it (after the re-alignment of
the cached K/V), and the mass of it on the oldest ``edge`` window tokens, averaged over the
probed rows and maximised over each KV head's query heads. The local heads whose mass exceeds
``restore_thresh`` are promoted for the rest of the request, at most ``R`` per layer (the
largest masses first; ``R`` = ``layout.restore``, the global store's restore columns):

| step, per layer                 | what                                                    |
| ------------------------------- | ------------------------------------------------------- |
| probe (:func:`edge_mass`)       | ``[L_l]`` edge mass from the probed queries and the keys they see (this extend's K) |
| promote (:func:`promote`)       | ``pool.promoted[req, layer]``: the heads, in order of mass, -1 after them |
| fresh K/V (:func:`keep_fresh`)  | under ``local_kv="cached"``, a promoted head's reused rows that the layer computes take back this prompt's projections (saved before the re-alignment) |
| attention                       | the kernels treat a promoted head as a global row of the request, reading its restore column |
| store                           | every row's promoted heads' K/V into the restore columns (``RedknotKVPool.write_restored``), in the prefill and every decode step |

Rows that left recovery keep the cached K/V in every head, the promoted ones included, as on the
reference path. Nothing here synchronises with the host.

Scope. A promoted head needs the K/V of every earlier position in its restore column. A local
head keeps only its ring, and the token slots of a cached prefix are shared with the other
requests that hit it (a restore column written there for one request's promoted head would be
read by another's). So a request is restored when its whole prompt is computed in the extend
that completes it: no cached prefix, and the prompt in one extend (``--chunked-prefill-size``
at least as long, or -1). Other reusing requests are served without restore, and each extend's
log line counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.attention.ffn_schedule import SparseFfn
from redknot.attention.token_policy import request_of
from redknot.kernels.extend import to_device


@dataclass(frozen=True)
class RestoreProbe:
    """One request that may promote local heads in this extend (its whole prompt): its probed
    rows (``spec``) and the ``U`` keys their local heads see."""

    spec: SparseFfn
    key_rows: torch.Tensor  # [U] int64 batch rows of the keys, by position
    visible: torch.Tensor  # [num_probe, U] bool: the key is in the probed row's sink + window
    at_edge: torch.Tensor  # [num_probe, U] float32: 1 on the oldest edge of the row's window


@dataclass(frozen=True)
class RestorePlan:
    probes: tuple[RestoreProbe, ...]
    token_req: torch.Tensor  # [N] int64 request slot of each reused token of the batch
    refused: tuple[int, ...]  # request slots served without restore (a cached prefix)


def plan_restore(reads, req_pool_indices: list[int], qo_indptr_cpu: torch.Tensor, sink: int,
                 window: int, edge: int, device) -> RestorePlan | None:  # fmt: skip
    """The probes of the requests this extend completes (``reads.sparse``) without a cached
    prefix, ``None`` when none completes. Host work only; the tables go to the device without
    a synchronisation."""
    if not reads.sparse:
        return None
    probes, refused = [], []
    for spec in reads.sparse:
        if spec.prefix > 0:  # tokens computed before: no K/V of their local heads is left
            refused.append(spec.req_pool_idx)
            continue
        probes.append(_probe(spec, sink, window, edge, device))
    request = request_of(reads.tokens_cpu, qo_indptr_cpu)
    token_req = torch.as_tensor(req_pool_indices, dtype=torch.int64)[request]
    return RestorePlan(tuple(probes), to_device(token_req, device), tuple(refused))


def _probe(spec: SparseFfn, sink: int, window: int, edge: int, device) -> RestoreProbe:
    assert spec.prefix == 0, "restore probes requests without a cached prefix"
    end, s = spec.length, spec.probe_start
    lo = max(sink, s - window + 1)
    key_pos = torch.cat([torch.arange(min(sink, end)), torch.arange(lo, end)])
    probe_pos = torch.arange(s, end)
    dist = probe_pos[:, None] - key_pos[None, :]
    seen = dist >= 0
    visible = seen & ((key_pos[None, :] < sink) | (dist < window))
    at_edge = seen & (key_pos[None, :] >= sink) & (dist >= max(window - edge, 0)) & (dist < window)
    return RestoreProbe(
        spec, to_device(spec.rows_of(key_pos), device), to_device(visible, device),
        to_device(at_edge.float(), device),
    )  # fmt: skip


def edge_mass(q_probe: torch.Tensor, keys: torch.Tensor, probe: RestoreProbe,
              scale: float) -> torch.Tensor:  # fmt: skip
    """``[L_l]`` float32 edge mass of each local KV head.

    ``q_probe``: ``[num_probe, L_l, group, D]`` the probed rows' queries of the local heads;
    ``keys``: ``[U, L_l, D]`` the keys they see (:class:`RestoreProbe`), as attended."""
    scores = torch.einsum("pgjd,ugd->pgju", q_probe.float(), keys.float()) * scale
    scores.masked_fill_(~probe.visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    mass = (probs * probe.at_edge[:, None, None, :]).sum(-1)  # [num_probe, L_l, group]
    return mass.mean(0).amax(-1)


def promote(promoted: torch.Tensor, mass: torch.Tensor, local_heads: torch.Tensor,
            thresh: float) -> None:  # fmt: skip
    """Write the request's row of one layer (``promoted``: ``[R]`` int32 view): the local
    heads (``local_heads``: ``[L_l]`` int64) whose ``mass`` exceeds ``thresh``, largest first,
    at most ``R``; -1 after them."""
    n = min(promoted.shape[0], mass.shape[0])
    values, order = mass.topk(n)
    heads = torch.where(values > thresh, local_heads[order], -1)
    promoted[:n] = heads.to(promoted.dtype)
    promoted[n:] = -1


def keep_fresh(kv: tuple[torch.Tensor, torch.Tensor], fresh: tuple[torch.Tensor, torch.Tensor],
               tokens: torch.Tensor, heads: torch.Tensor, local_column: torch.Tensor,
               computed: torch.Tensor | None) -> None:  # fmt: skip
    """Put this prompt's K and V back in ``kv`` (``[T, H, D]`` each, in place) for the promoted
    heads of the reused tokens the layer computes.

    ``fresh``: ``[N, L_l, D]`` each, the local heads' projections of the reused tokens
    ``tokens`` (``[N]``) saved before the re-alignment; ``heads``: ``[N, R]`` int32 the
    promoted heads of each token's request (-1: none, after the promoted ones);
    ``local_column``: ``[H]`` int32 a head's column among the local heads; ``computed``:
    ``[T]`` bool the rows the layer computes (None: every row). Entries without a head point at
    the request's first promoted head (or head 0) with the same value as that entry, so that no
    two writes to one place differ."""
    first = heads[:, :1].long()  # [N, 1]: -1 when the request promoted nothing
    target = torch.where(heads >= 0, heads.long(), first.clamp_min(0))  # [N, R]
    use = first >= 0
    if computed is not None:
        use = use & computed[tokens][:, None]
    cols = local_column.long()[target]  # [N, R]
    rows = tokens[:, None].expand_as(target)
    for x, saved in zip(kv, fresh):
        back = saved.gather(1, cols[:, :, None].expand(-1, -1, saved.shape[2]))  # [N, R, D]
        x[rows, target] = torch.where(use[:, :, None], back.to(x.dtype), x[rows, target])
