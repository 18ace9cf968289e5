"""Plain PyTorch references of the sparse decode kernels (fp32 math, loops over requests and
selection heads, on the device of the inputs): they define what ``run_sparse_decode``,
``score_keys`` and ``exact_topk`` compute.

Common arguments: ``q`` [B, Hq, D]; ``k_buffer`` / ``v_buffer`` [slots, Hkv, D]; ``req_to_token``
[R, max_ctx] int32; ``req_pool_indices`` and ``seq_lens`` [B] (keys including the new token's).
A list of ``indices`` [B, Hs, W] serves ``rows = Hq / Hs`` query heads: query head ``h`` reads
list ``h // rows`` and KV head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import torch


def listed_positions(listed: torch.Tensor, n: int, num_sink: int) -> torch.Tensor:
    """The entries of one list a kernel attends or scores: ``num_sink <= p < n``, in order,
    duplicates kept."""
    listed = listed.long()
    return listed[(listed >= num_sink) & (listed < n)]


def sparse_decode_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    num_sink: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query head over positions ``0 .. min(num_sink, n) - 1`` and the valid
    entries of its list (a duplicate entry counts once per occurrence).

    Returns ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32 natural log, -inf: no key)``.
    """
    B, Hq, D = q.shape
    grp = Hq // k_buffer.shape[1]
    rows = Hq // indices.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), device=q.device)
    for b in range(B):
        n, row = int(seq_lens[b]), int(req_pool_indices[b])
        sinks = torch.arange(min(max(n, 0), num_sink), device=q.device)
        for h in range(Hq):
            pos = torch.cat([sinks, listed_positions(indices[b, h // rows], n, num_sink)])
            if pos.numel() == 0:
                continue
            slots = req_to_token[row, pos].long()
            k = k_buffer[slots, h // grp].float()
            v = v_buffer[slots, h // grp].float()
            s = (k @ q[b, h].float()) * sm_scale
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ v
    return out.to(q.dtype), lse


def score_keys_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor | None,
    num_sink: int,
    sm_scale: float,
    *,
    width: int | None = None,
    rows: int | None = None,
    group_max: bool = False,
) -> torch.Tensor:
    """Scaled logits ``q . k * sm_scale`` of listed keys (or of every position when ``indices``
    is None: entry ``v`` is position ``v``, ``width`` entries, ``rows`` query heads per list).

    Entries outside ``num_sink <= p < n`` score ``-inf``. Returns ``[B, Hq, W]`` float32, or
    with ``group_max`` the maximum over each list's ``rows`` query heads, ``[B, Hs, W]``.
    """
    B, Hq, _ = q.shape
    grp = Hq // k_buffer.shape[1]
    if indices is None:
        assert width is not None and rows is not None
        indices = torch.arange(width, device=q.device, dtype=torch.int32)
        indices = indices.expand(B, Hq // rows, width)
    rows = Hq // indices.shape[1]
    W = indices.shape[2]
    out = torch.full((B, Hq, W), float("-inf"), device=q.device)
    for b in range(B):
        n, row = int(seq_lens[b]), int(req_pool_indices[b])
        for h in range(Hq):
            listed = indices[b, h // rows].long()
            ok = (listed >= num_sink) & (listed < n)
            slots = req_to_token[row, listed[ok]].long()
            out[b, h, ok] = (k_buffer[slots, h // grp].float() @ q[b, h].float()) * sm_scale
    if group_max:
        return out.view(B, Hq // rows, rows, W).amax(2)
    return out


def exact_topk_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    k: int,
    num_sink: int,
    sm_scale: float,
    *,
    rows: int,
) -> torch.Tensor:
    """The ``k`` highest-scoring non-sink positions of each list (scores of a list shared by
    ``rows`` query heads: their maximum), ``[B, Hq // rows, k]`` as a set per list, -1 where a
    row has fewer than ``k`` non-sink keys; order unspecified."""
    width = int(seq_lens.max())
    scores = score_keys_reference(
        q, k_buffer, req_to_token, req_pool_indices, seq_lens, None, num_sink, sm_scale,
        width=width, rows=rows, group_max=True,
    )  # fmt: skip
    val, pos = torch.topk(scores, min(k, width), dim=-1)
    pos = torch.where(torch.isfinite(val), pos, -1).to(torch.int32)
    return torch.nn.functional.pad(pos, (0, k - pos.shape[-1]), value=-1)
