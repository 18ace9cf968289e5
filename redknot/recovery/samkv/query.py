"""SamKV's query vectors (§3.1): the generic query of the question and the personalized
query of every document (Eq. 1).

Query and key vectors are compared *position-free*: each is rotated back from its position to
position 0 (``R(-p) q``) before pooling or scoring. A mean of rotated vectors taken at
different positions mixes phases, and the documents' keys sit at positions that change with
the composition of the prompt; without rotation a score is the same wherever the document
lands.

| quantity                       | shape           | source                                  |
| ------------------------------ | --------------- | --------------------------------------- |
| generic query ``Q_que``        | [N, Hq, d]      | mean over the question's rows of its queries, prefilled over the anchors of every document |
| local query ``Q_doc-j_loc``    | [N, Hq, d]      | mean over document ``j``'s local rows of their queries in its own prefill |
| personalized ``Q^_doc-i``      | [N, Hq, d]      | Eq. 1                                   |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from redknot.reference.rope import Rope


def position_free(rope: Rope, x: Tensor, positions: Tensor) -> Tensor:
    """``x`` (``[..., T, d]``, rotated to ``positions`` ``[T]``) rotated back to position 0,
    in float32."""
    return rope.realign(x.to(torch.float32), positions, torch.zeros_like(positions))


def pooled(rope: Rope, q: Tensor, positions: Tensor) -> Tensor:
    """Mean over rows of position-free queries: ``q`` ``[Hq, R, d]`` -> ``[Hq, d]`` float32."""
    return position_free(rope, q, positions).mean(dim=1)


def personalized_queries(generic: Tensor, local: Tensor) -> Tensor:
    """Eq. 1 for every document ``i``:
    ``Q^_i = Q_que + 1/(D-1) sum_{j != i} |cos(Q_que, Q_loc_j)| Q_loc_j``, per layer and query
    head (the cosine over the head dimension).

    ``generic``: ``[N, Hq, d]``; ``local``: ``[D, N, Hq, d]``. Returns ``[D, N, Hq, d]`` float32;
    a single document gets ``Q_que`` itself (no other document to take consensus from)."""
    generic = generic.to(torch.float32)
    local = local.to(torch.float32)
    num_docs = local.shape[0]
    if num_docs <= 1:
        return generic.expand(max(num_docs, 1), *generic.shape).clone()
    weight = F.cosine_similarity(generic[None], local, dim=-1).abs()  # [D, N, Hq]
    weighted = weight[..., None] * local
    others = weighted.sum(dim=0, keepdim=True) - weighted  # sum over j != i
    return generic[None] + others / (num_docs - 1)
