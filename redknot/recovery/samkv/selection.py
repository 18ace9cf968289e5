"""SamKV's choice of KV blocks (§3.2, Eq. 2-3, A.2): which middle blocks of which documents
every layer keeps.

Per document ``i`` and layer ``n``, with ``Q^`` its personalized query (position-free):

| step        | what                                                                   |
| ----------- | ---------------------------------------------------------------------- |
| block keys  | each middle block is the mean of its tokens' keys; the anchor key is the mean of the initial and local tokens' keys |
| scores      | ``s = sum_h <Q^_h, K_{h // g}>`` over query heads ``h`` (``g`` queries per KV head); with ``samkv_block_score="token-max"`` (not the paper) a block's best token's ``s`` instead |
| Eq. 2       | ``P^(n) = (s_max - s_anc) / (s_max - s_min)`` if ``s_min < s_anc <= s_max``, else 0 (max / min over the middle blocks) |
| Eq. 3       | ``P = mean of P^(n)`` over the stable layers ``N*``; document ``i`` retrieves its top ``ceil(P * M_i)`` blocks in every layer |
| retention   | scores normalised per (document, layer) to ``(s - s_min) / (s_max - s_min)``; every layer keeps the best ``ceil(R / D)`` retrieved blocks across documents (``R`` retrieved in all, ``D`` documents with middle blocks) |

With ``budget`` set, every middle block is a candidate and each layer keeps the best
``ceil(budget * sum M_i)`` by normalised score (1: every block); with ``per_document`` (the
server's rule) each document keeps its own best ``ceil(budget * M_i)`` instead. Ties go to the larger raw
score, then to the earlier block. The paper takes ``s_max`` / ``s_min`` from the blocks of
highest and lowest static importance (A.1, power-law fits of attention columns); here they are
the highest and lowest scores under ``Q^`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from redknot.recovery.samkv.layout import DocumentBlocks


def block_keys(keys: Tensor, doc: DocumentBlocks) -> tuple[Tensor, Tensor]:
    """Position-free keys of one document in one layer, ``[Hkv, n, d]`` -> (middle block means
    ``[Hkv, M, d]``, anchor mean ``[Hkv, d]``), float32."""
    keys = keys.to(torch.float32)
    middle = keys[:, doc.init : doc.middle_end]
    blocks = middle.reshape(keys.shape[0], doc.num_blocks, doc.block, keys.shape[2]).mean(dim=2)
    anchor = keys[:, doc.anchor_mask()].mean(dim=1)
    return blocks, anchor


def scores(query: Tensor, keys: Tensor) -> Tensor:
    """``query`` ``[Hq, d]`` against ``keys`` ``[Hkv, R, d]``: ``[R]`` float32 inner products
    summed over query heads (query head ``h`` reads KV head ``h // (Hq / Hkv)``)."""
    group = query.shape[0] // keys.shape[0]
    per_kv = query.to(torch.float32).view(keys.shape[0], group, -1).sum(dim=1)  # [Hkv, d]
    return torch.einsum("hd,hrd->r", per_kv, keys.to(torch.float32))


def token_max_scores(query: Tensor, keys: Tensor, doc: DocumentBlocks) -> tuple[Tensor, float]:
    """``samkv_block_score="token-max"`` (not the paper, which scores a block by its mean key
    so that no lone token such as a punctuation mark decides it): each middle block scored by
    its best token, ``max_t sum_h <Q^_h, k_t>``, and the anchors by theirs; ``keys``
    ``[Hkv, n, d]`` position-free -> (``[M]`` float32, anchor score)."""
    per_token = scores(query, keys)  # [n]
    middle = per_token[doc.init : doc.middle_end].view(doc.num_blocks, doc.block)
    return middle.amax(dim=1), float(per_token[doc.anchor_mask()].max())


def top_p_ratio(block_scores: Tensor, anchor_score: float) -> float:
    """Eq. 2: the share of the middle blocks above the anchor, from ``block_scores`` ``[M]``."""
    if block_scores.numel() == 0:
        return 0.0
    s_max, s_min = float(block_scores.max()), float(block_scores.min())
    if not s_min < anchor_score <= s_max:
        return 0.0
    return (s_max - anchor_score) / (s_max - s_min)


@dataclass(frozen=True)
class BlockSelection:
    """The blocks every layer keeps.

    | field           | shape / type          | meaning                                      |
    | --------------- | --------------------- | -------------------------------------------- |
    | ``layer_ratios``| [N, D] float64        | ``P^(n)`` of Eq. 2 per layer and document    |
    | ``ratios``      | [D] float64           | ``P`` of Eq. 3 (``nan`` with a fixed budget) |
    | ``retrieved``   | list of D int         | blocks each document offers per layer        |
    | ``per_layer``   | int                   | blocks every layer keeps, all documents together |
    | ``kept``        | D x [N, M_i] bool     | the kept blocks                              |
    """

    layer_ratios: Tensor
    ratios: Tensor
    retrieved: list[int]
    per_layer: int
    kept: list[Tensor]


def normalised(block_scores: Tensor) -> Tensor:
    """``[N, M]`` -> ``(s - min) / (max - min)`` per layer (1 where all scores are equal)."""
    lo = block_scores.amin(dim=1, keepdim=True)
    hi = block_scores.amax(dim=1, keepdim=True)
    span = hi - lo
    out = (block_scores - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return torch.where(span > 0, out, torch.ones_like(out))


def select_blocks(
    block_scores: Sequence[Tensor],
    anchor_scores: Tensor,
    *,
    stable_layers: Sequence[int],
    budget: float | None = None,
    per_document: bool = False,
) -> BlockSelection:
    """``block_scores``: per document ``[N, M_i]`` (``M_i`` may be 0); ``anchor_scores``:
    ``[N, D]``; ``stable_layers``: the layers ``N*`` of Eq. 3. ``per_document`` (with a
    ``budget``; the server's rule, not the paper): each document keeps its best
    ``ceil(budget * M_i)`` blocks in every layer by its own scores."""
    num_docs = len(block_scores)
    num_layers = anchor_scores.shape[0]
    layer_ratios = torch.zeros(num_layers, num_docs, dtype=torch.float64)
    for i, s in enumerate(block_scores):
        for n in range(num_layers):
            layer_ratios[n, i] = top_p_ratio(s[n], float(anchor_scores[n, i]))
    sizes = [int(s.shape[1]) for s in block_scores]
    if budget is None:
        ratios = layer_ratios[list(stable_layers)].mean(dim=0)
        retrieved = [min(m, math.ceil(float(p) * m - 1e-9)) for p, m in zip(ratios, sizes)]
        offering = sum(1 for m in sizes if m > 0)
        per_layer = math.ceil(sum(retrieved) / offering) if offering else 0
    else:
        ratios = torch.full((num_docs,), float("nan"), dtype=torch.float64)
        retrieved = list(sizes)
        per_layer = math.ceil(budget * sum(sizes) - 1e-9)
    kept = [torch.zeros(num_layers, m, dtype=torch.bool) for m in sizes]
    if per_document:
        assert budget is not None, "a per-document share needs a budget"
        for i, s in enumerate(block_scores):
            count = min(sizes[i], math.ceil(budget * sizes[i] - 1e-9))
            for n in range(num_layers):
                order = torch.sort(s[n].to(torch.float64), descending=True, stable=True).indices
                kept[i][n, order[:count]] = True
        per_layer = sum(min(m, math.ceil(budget * m - 1e-9)) for m in sizes)
        return BlockSelection(layer_ratios, ratios, retrieved, per_layer, kept)
    for n in range(num_layers):
        candidates = []  # (normalised, raw, -doc, -block)
        for i, s in enumerate(block_scores):
            if retrieved[i] == 0:
                continue
            order = torch.sort(s[n].to(torch.float64), descending=True, stable=True).indices
            top = order[: retrieved[i]]
            norm = normalised(s[n : n + 1].to(torch.float64))[0]
            candidates += [(float(norm[b]), float(s[n, b]), -i, -int(b)) for b in top]
        candidates.sort(reverse=True)
        for _, _, i, b in candidates[:per_layer]:
            kept[-i][n, -b] = True
    return BlockSelection(layer_ratios, ratios, retrieved, per_layer, kept)
