"""Token-level recovery policies in the server (``--redknot-policy naive|epic|cacheblend|
sparsex``): the reference path's rules (``redknot.recovery.baselines``, ``epic``,
``cacheblend``, ``sparsex``) on the server's segment cache, RoPE alignment and kernels.

One choice per reused segment token for every head at once, taken once per extend. The chosen
("kept") tokens and every row that is not a reused segment token (the new text, and each
request's last row, whose logits are read) are computed in every layer; from ``sparse_from`` on
the others leave recovery exactly as the rows that skip a deep FFN under ``--redknot-skipped
cached`` do (``redknot.attention.ffn_schedule``): every head reads their cached, re-aligned K/V,
and nothing of them is computed.

| policy       | chooses                   | leave from layer          | kept segment tokens       |
| ------------ | ------------------------- | ------------------------- | ------------------------- |
| ``naive``    | when the batch is planned | 0                         | none                      |
| ``epic``     | when the batch is planned | 0                         | the first ``epic_k`` of every reused segment |
| ``cacheblend`` | in ``blend_check_layer`` | ``blend_check_layer + 1`` | per request, the ``round(blend_ratio * S)`` of its ``S`` reused tokens whose fresh K/V deviates most from the cached, aligned K/V (``redknot.recovery.cacheblend.kv_deviation``; ties: the lower row) |
| ``sparsex``  | in ``sparseq_boundary - 1`` | ``sparseq_boundary``    | per request, SparseX's sparse-Q set from that layer's queries and keys (``redknot.recovery.sparseq.select_tokens``: top ``sparseq_k`` by the non-reused rows' attention, ``sparseq_block`` rows of overflow, the tail fallback) |
| ``samkv``    | when the batch is planned; each layer fills the middle slots | 0 | every document's anchors; its middle slots take the blocks each layer chooses (``redknot.recovery.samkv.served``: the request holds only those rows) |

Token-level policies treat every head alike, so they are served with every head global. The
reference path's hybrid ``redknot+sparseq`` is not served
(``redknot.config.REFERENCE_ONLY_POLICIES`` says why). Under chunked prefill each chunk chooses
among its own reused tokens (the reference path prefills in one call); with one chunk per
prompt the two are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.config import TOKEN_POLICIES, RedknotConfig
from redknot.kernels.extend import to_device
from redknot.recovery.cacheblend import blend_count
from redknot.recovery.samkv.served import SamkvKnobs


@dataclass(frozen=True)
class TokenPolicy:
    """The served token-level policy and its knobs."""

    name: str
    epic_k: int
    blend_check_layer: int
    blend_ratio: float
    sparseq_boundary: int
    sparseq_k: int
    sparseq_block: int
    samkv: SamkvKnobs | None = None

    def __post_init__(self) -> None:
        assert self.name in TOKEN_POLICIES, self.name

    @classmethod
    def of(cls, config: RedknotConfig) -> TokenPolicy | None:
        """The configured token-level policy (None: redknot's recovery)."""
        if config.policy not in TOKEN_POLICIES:
            return None
        return cls(
            config.policy, config.epic_k, config.blend_check_layer, config.blend_ratio,
            config.sparseq_boundary, config.sparseq_k, config.sparseq_block,
            SamkvKnobs.of(config),
        )  # fmt: skip

    def describe(self) -> str:
        return {
            "naive": "no reused token recomputed",
            "epic": f"the first {self.epic_k} tokens of every reused segment recomputed",
            "cacheblend": f"every token recomputed up to layer {self.blend_check_layer}, then "
            f"the {self.blend_ratio:g} of each request's reused tokens of largest KV deviation",
            "sparsex": f"every token recomputed below layer {self.sparseq_boundary}, then the "
            f"sparse-Q set (top {self.sparseq_k}, overflow {self.sparseq_block})",
            "samkv": self._describe_samkv(),
        }[self.name]

    def _describe_samkv(self) -> str:
        k = self.samkv
        if k is None:
            return "SamKV"
        return (
            f"each document's anchors ({k.init_blocks} + {k.local_blocks} blocks of {k.block}) "
            f"recomputed, {k.budget:g} of its middle blocks held, chosen per layer; requests "
            f"whose stored documents hold fewer than {k.min_tokens} tokens computed in full "
            "(--redknot-samkv-min-tokens: the cut was measured faster than recomputing from 4K "
            "document tokens, docs/samkv.md)"
        )

    @property
    def chooses_at_plan(self) -> bool:
        """True: the choice needs no layer's K/V (made when the batch is planned)."""
        return self.name in ("naive", "epic", "samkv")

    @property
    def select_layer(self) -> int:
        """The layer whose fresh K/V the choice reads (-1: none)."""
        if self.name == "sparsex":
            return self.sparseq_boundary - 1
        return self.blend_check_layer if self.name == "cacheblend" else -1

    def planned_kept(
        self, pos_off: torch.Tensor, middle: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[R]`` bool over the reads (``pos_off``: each read token's position in its
        segment; ``middle``: SamKV's middle slots): the tokens ``naive``, ``epic`` and
        ``samkv`` keep (SamKV: every read but the middle slots, i.e. the anchors)."""
        if self.name == "epic":
            return pos_off < self.epic_k
        if self.name == "samkv":
            return torch.ones_like(pos_off, dtype=torch.bool) if middle is None else ~middle
        return torch.zeros_like(pos_off, dtype=torch.bool)

    def blend_kept(
        self,
        deviation: torch.Tensor,
        tokens: torch.Tensor,
        tokens_cpu: torch.Tensor,
        qo_indptr: torch.Tensor,
    ) -> torch.Tensor:
        """``[R]`` bool over the reads, on ``deviation``'s device: per request, the
        ``blend_count`` of its reused tokens of largest ``deviation`` (``[R]`` float64; ties:
        the lower row). ``tokens``: their batch rows on that device, ``tokens_cpu`` the same on
        the host, ``qo_indptr``: the requests' first rows (host). Chosen on the device
        (:func:`top_per_request`), without a host synchronisation: the caller's copy of the
        result is the choice's only one, and the host has nothing to sort after it."""
        B = qo_indptr.shape[0] - 1
        reads = torch.bincount(request_of(tokens_cpu, qo_indptr), minlength=B).tolist()
        counts = [blend_count(self.blend_ratio, n) for n in reads]
        host = torch.tensor(counts + qo_indptr.tolist(), dtype=torch.int64)
        on_device = to_device(host, deviation.device)
        counts_dev, qo_dev = on_device[:B], on_device[B:]
        return top_per_request(deviation, tokens, request_of(tokens, qo_dev), counts_dev)


def top_per_request(
    scores: torch.Tensor, rows: torch.Tensor, request: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``[R]`` bool: for each request ``b``, the ``counts[b]`` entries of ``request == b`` of
    largest ``scores``, ties to the lower ``rows`` (distinct): sorted by row, then stably by
    score and by request, and ranked within each request; on the tensors' device (every
    argument there; ``counts`` int64 ``[B]``)."""
    order = torch.argsort(rows)
    order = order[torch.argsort(scores[order], descending=True, stable=True)]
    order = order[torch.argsort(request[order], stable=True)]
    grouped = request[order].contiguous()
    rank = torch.arange(grouped.numel(), device=grouped.device) - torch.searchsorted(
        grouped, grouped
    )
    kept = torch.empty(rows.shape, dtype=torch.bool, device=rows.device)
    kept[order] = rank < counts[grouped]
    return kept


def request_of(tokens: torch.Tensor, qo_indptr: torch.Tensor) -> torch.Tensor:
    """The request of each batch row ``tokens`` (int64; ``qo_indptr``: the requests' first
    rows, on the same device)."""
    return torch.searchsorted(qo_indptr.to(torch.int64), tokens, right=True) - 1


def per_request(tokens: torch.Tensor, qo_indptr: torch.Tensor):
    """``(request, indices)`` of the reads (``tokens``: batch rows, host) of each request."""
    request = request_of(tokens, qo_indptr)
    for b in request.unique().tolist():
        yield b, (request == b).nonzero().squeeze(1)


def segment_spans(rows: torch.Tensor, pos_off: torch.Tensor) -> list[tuple[int, int]]:
    """The reused segments of one request as ``(start, end)`` rows, from its reads (``rows``
    ascending, ``pos_off``: each one's position in its segment): a span breaks where either
    stops counting up by one."""
    if rows.numel() == 0:
        return []
    breaks = ((rows[1:] != rows[:-1] + 1) | (pos_off[1:] != pos_off[:-1] + 1)).nonzero()
    starts = [0] + (breaks.squeeze(1) + 1).tolist()
    ends = starts[1:] + [rows.numel()]
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, ends)]


def kept_rows(
    num_rows: int, tokens: torch.Tensor, kept: torch.Tensor, qo_indptr: torch.Tensor
) -> torch.Tensor:
    """``[T]`` bool over the batch rows (host): every row but the reused tokens not ``kept``;
    each request's last row always."""
    keep = torch.ones(num_rows, dtype=torch.bool)
    keep[tokens[~kept]] = False
    ends = qo_indptr[1:].to(torch.int64)
    last = ends[ends > qo_indptr[:-1].to(torch.int64)] - 1
    keep[last] = True
    return keep
