"""Sparse-Q token selection (SparseX §3.2-3.3, Algorithm 1 steps 11-17): which reused tokens a
request recomputes, estimated from the queries it computes anyway. Shared by ``sparsex`` and
``redknot+sparseq``.

Rows are the rows of the prefill call (an exact-prefix hit is not part of it). With
``I_nr`` the non-reused rows and ``K`` every key the call attends (prefix hit included):

| set        | definition                                                              |
| ---------- | ----------------------------------------------------------------------- |
| scores     | ``s_j = sum_i sum_heads softmax(q_i K^T / sqrt(d) + causal)[j]`` over the probed rows ``i`` (Eq. 1-2); one global score over heads |
| ``key``    | ``TopK(s, k)`` over the reused rows of the call (Eq. 3 ranks every token; see below) |
| ``overflow`` | for each maximal run of non-reused rows, the last ``block`` rows of the segment just before it and the first ``block`` rows of the segment just after it (§3.3); the rows of an exact-prefix hit count as non-reused |
| ``tail``   | when the prompt ends inside a segment (no non-reused row at its tail), the last ``64`` rows of that final segment (§3.2, fallback) |
| recompute  | ``I_nr | key | overflow | tail`` (step 17)                              |

Where the paper is silent, this module chooses:

* the probed rows are ``I_nr``, plus the ``tail`` rows when the fallback applies (the paper
  calls the fallback "close to last-Q probing", so those rows also probe);
* the top-k ranks the reused rows of the call only. Eq. 3 ranks every token of the prompt, so
  non-reused tokens, recomputed anyway, take part of the budget; which of them are in the call
  depends on what a server's radix cache holds of the prompt's head (the template and system
  rows before the first segment), so ranking them made the recomputed set, and the answer,
  depend on the cache's state (measured: ``benchmarks/selection_numerics.py --compare
  prefix``). Exact-prefix rows are never recomputed, though their keys take part in the
  softmax; their queries are not probed (they only attend rows before the segments, so no
  reused row's score depends on them);
* the rows of an exact-prefix hit are non-reused text before the call: a span that starts the
  call after such a hit overflows at its start, as it would with those rows in the call (a hit
  that ends inside a segment also does: ``block`` rows recomputed that need not be). A span
  that starts the prompt or ends the call has no neighbour on that side; a segment shorter
  than ``block`` overflows over all of it, never further;
* ties in the top-k go to the lower row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from redknot.recovery.importance import top_rows
from redknot.recovery.prompt import reused_mask
from redknot.reference.attention import attention_probs

TAIL_FALLBACK = 64  # rows of the final segment recomputed when the prompt ends inside it
SCORE_BLOCK = 128  # probed rows per block of explicit probabilities (bounds memory)


@dataclass(frozen=True)
class SparseQSelection:
    """One request's selection; every mask is ``[T]`` bool over the rows of the call.

    | field       | shape       | meaning                                            |
    | ----------- | ----------- | -------------------------------------------------- |
    | ``scores``  | [T] float64 | ``s_j`` of every row                               |
    | ``probed``  | [P] int64   | the query rows the scores came from (ascending)    |
    | ``key``     | [K] int64   | the top-k rows (ascending)                         |
    | ``overflow``| [T] bool    | overflow rows                                      |
    | ``tail``    | [T] bool    | tail-fallback rows                                 |
    | ``recompute`` | [T] bool  | ``non-reused | key | overflow | tail``             |
    """

    scores: Tensor
    probed: Tensor
    key: Tensor
    overflow: Tensor
    tail: Tensor
    recompute: Tensor


def overflow_rows(
    spans: Sequence[tuple[int, int]],
    num_rows: int,
    block: int,
    device=None,
    *,
    after_prefix: bool = False,
) -> Tensor:
    """``[T]`` bool: the overflow of every run of non-reused rows (see the module table);
    ``after_prefix``: rows of an exact-prefix hit precede the call (non-reused text)."""
    reused = reused_mask(spans, num_rows, device)
    out = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if block <= 0:
        return out
    for start, end in spans:
        before = not bool(reused[start - 1]) if start > 0 else after_prefix
        if before:  # a non-reused run ends at `start`
            out[start : min(start + block, end)] = True
        if end < num_rows and not bool(reused[end]):  # a non-reused run starts at `end`
            out[max(end - block, start) : end] = True
    return out


def tail_rows(spans: Sequence[tuple[int, int]], num_rows: int, device=None) -> Tensor:
    """``[T]`` bool: the last :data:`TAIL_FALLBACK` rows of the final segment when the prompt
    ends inside it, else none."""
    out = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if spans and spans[-1][1] == num_rows:
        start, end = spans[-1]
        out[max(end - TAIL_FALLBACK, start) : end] = True
    return out


def sparseq_scores(
    q: Tensor,
    keys: Tensor,
    positions: Tensor,
    classes: str,
    *,
    window: int,
    sink: int,
    scale: float | None = None,
) -> Tensor:
    """``[Tk]`` float64: attention probability each key receives, summed over the query rows
    and the query heads (Eq. 2 with one score over heads), each head attending as its class
    allows.

    ``q``: ``[Hq, P, d]`` the probed queries (RoPE applied); ``keys``: ``[Hkv, Tk, d]``, key row
    ``j`` at position ``j``; ``positions``: ``[P]`` int64 ascending; ``classes``: one ``G``/``L``
    per KV head."""
    scores = torch.zeros(keys.shape[1], dtype=torch.float64, device=keys.device)
    for start in range(0, q.shape[1], SCORE_BLOCK):
        end = min(q.shape[1], start + SCORE_BLOCK)
        probs = attention_probs(
            q[:, start:end],
            keys,
            positions[start:end],
            classes,
            window=window,
            sink=sink,
            scale=scale,
        )  # [Hq, P_block, Tk]
        scores += probs.sum(dim=(0, 1)).to(torch.float64)
    return scores


def select_tokens(
    q: Tensor,
    keys: Tensor,
    spans: Sequence[tuple[int, int]],
    *,
    past_len: int,
    classes: str,
    window: int,
    sink: int,
    scale: float | None,
    k: int,
    block: int,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> SparseQSelection:
    """The selection of one request (Algorithm 1 steps 11-17).

    ``q``: ``[Hq, T, d]`` this layer's queries of every row of the call; ``keys``:
    ``[Hkv, past_len + T, d]`` as attended; ``spans``: the segments, ``(start, end)`` rows of the
    call, ascending and disjoint; ``classes``: the KV heads' classes (a subset of heads may be
    passed with the matching slices of ``q`` and ``keys``); ``reduce``: applied to the scores
    before the top-k (the server sums them over tensor-parallel ranks, each holding some
    heads)."""
    num_rows, device = q.shape[1], q.device
    reused = reused_mask(spans, num_rows, device)
    tail = tail_rows(spans, num_rows, device)
    probed = torch.nonzero(~reused | tail).flatten()
    scores = torch.zeros(num_rows, dtype=torch.float64, device=device)
    if probed.numel():
        scores = sparseq_scores(
            q[:, probed],
            keys,
            probed + past_len,
            classes,
            window=window,
            sink=sink,
            scale=scale,
        )[past_len:]
    if reduce is not None:
        scores = reduce(scores)
    key = top_rows(scores, torch.nonzero(reused).flatten(), k)
    overflow = overflow_rows(spans, num_rows, block, device, after_prefix=past_len > 0)
    recompute = ~reused | overflow | tail
    recompute[key] = True
    return SparseQSelection(scores, probed, key, overflow, tail, recompute)
