"""Plain PyTorch reference of SegPagedAttention (decode and extend), fp32 math, one request and
one KV head at a time, on the device of the inputs. It defines the semantics the Triton kernels
must match; see ``redknot.kernels.geometry`` for visibility and local-store addressing.

A request may promote local heads to global (adaptive restore, ``promoted``): see
``redknot.kernels.extend.run_extend``.

Both functions return ``(out, lse)``: ``out`` in the dtype of ``q``, ``lse`` float32 natural-log
log-sum-exp of the scaled scores per (token, query head), ``-inf`` where no key is visible (the
output there is 0).
"""

from __future__ import annotations

import torch

from redknot.kernels.geometry import LayerHeads, SegGeometry

_QUERY_CHUNK = 1024  # queries per score matrix in extend_reference (bounds its memory)


def visibility(i: torch.Tensor, j: torch.Tensor, is_local: bool, geo: SegGeometry) -> torch.Tensor:
    """Boolean [len(i), len(j)]: may a query at position ``i`` attend the key at ``j``."""
    i, j = i[:, None], j[None, :]
    vis = j <= i
    if is_local:
        vis &= (j < geo.sink) | (i - j < geo.window)
    return vis


def store_slots(
    positions: torch.Tensor,
    req_row: int,
    req_to_token: torch.Tensor,
    is_local: bool,
    geo: SegGeometry,
) -> torch.Tensor:
    """Slots (int64) of ``positions`` of the request in row ``req_row`` of ``req_to_token``."""
    if is_local and geo.ring:
        span = geo.ring_len - geo.sink
        ring = torch.where(
            positions < geo.sink, positions, geo.sink + (positions - geo.sink) % span
        )
        return req_row * geo.ring_len + ring
    return req_to_token[req_row, positions].long()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor, scale: float):
    """q [M, G, D], k/v [N, D], vis [M, N] (fp32) -> out [M, G, D], lse [M, G]."""
    s = torch.einsum("mgd,nd->mgn", q, k) * scale
    s = s.masked_fill(~vis[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("mgn,nd->mgd", p, v), lse


def _head(heads: LayerHeads, h: int, stores: tuple[torch.Tensor, ...], promoted_row=None):
    """``(is_local, column, K store, V store)`` of KV head ``h``; a local head in the request's
    row of ``promoted`` is global, in restore column ``num_global + r`` of the global store."""
    is_local = bool(heads.is_local_gpu[h].item())
    col = int(heads.column_gpu[h].item())
    if is_local and promoted_row is not None and h in promoted_row.tolist():
        is_local, col = False, heads.num_global + promoted_row.tolist().index(h)
    k_store, v_store = (stores[2], stores[3]) if is_local else (stores[0], stores[1])
    return is_local, col, k_store, v_store


def _promoted_row(promoted: torch.Tensor | None, row: int):
    return None if promoted is None else promoted[row]


def decode_reference(
    q: torch.Tensor,  # [B, Hq, D]
    k_global: torch.Tensor,  # [S_g, G_l, D]
    v_global: torch.Tensor,
    k_local: torch.Tensor,  # [S_l, L_l, D]
    v_local: torch.Tensor,
    req_to_token: torch.Tensor,  # [R, max_ctx] int32
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B], keys including the new token
    heads: LayerHeads,
    geo: SegGeometry,
    sm_scale: float,
    promoted: torch.Tensor | None = None,  # [R rows, restore columns] int32, -1: none
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: the query of request ``b`` sits at position ``seq_lens[b] - 1``."""
    B, Hq, D = q.shape
    grp, dev = geo.group_size, q.device
    stores = (k_global, v_global, k_local, v_local)
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=dev)
    lse = torch.full((B, Hq), float("-inf"), device=dev)
    for b in range(B):
        n, row = int(seq_lens[b]), int(req_pool_indices[b])
        if n <= 0:
            continue
        pos = torch.arange(n, device=dev)
        for h in range(geo.num_kv_heads):
            is_local, col, ks, vs = _head(heads, h, stores, _promoted_row(promoted, row))
            vis = visibility(pos[-1:], pos, is_local, geo)
            keep = pos[vis[0]]
            slots = store_slots(keep, row, req_to_token, is_local, geo)
            k, v = ks[slots, col].float(), vs[slots, col].float()
            qs = slice(h * grp, (h + 1) * grp)
            o, s = _attend(q[b : b + 1, qs].float(), k, v, vis[:, vis[0]], sm_scale)
            out[b, qs], lse[b, qs] = o[0], s[0]
    return out.to(q.dtype), lse


def extend_reference(
    q: torch.Tensor,  # [T, Hq, D], ragged by qo_indptr
    k_new: torch.Tensor,  # [T, H_kv, D]
    v_new: torch.Tensor,
    k_global: torch.Tensor,  # [S_g, G_l, D]
    v_global: torch.Tensor,
    k_local: torch.Tensor,  # [S_l, L_l, D]
    v_local: torch.Tensor,
    req_to_token: torch.Tensor,  # [R, max_ctx] int32
    req_pool_indices: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B], cached keys before the new tokens
    qo_indptr: torch.Tensor,  # [B + 1]
    heads: LayerHeads,
    geo: SegGeometry,
    sm_scale: float,
    promoted: torch.Tensor | None = None,  # [R rows, restore columns] int32, -1: none
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal extend: new token ``t`` of request ``b`` sits at position ``prefix_lens[b] + t``;
    keys below ``prefix_lens[b]`` come from the stores, the others from ``k_new``/``v_new``."""
    T, Hq, D = q.shape
    grp, dev = geo.group_size, q.device
    stores = (k_global, v_global, k_local, v_local)
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=dev)
    lse = torch.full((T, Hq), float("-inf"), device=dev)
    indptr = [int(x) for x in qo_indptr]
    for b in range(len(indptr) - 1):
        start, E, P = indptr[b], indptr[b + 1] - indptr[b], int(prefix_lens[b])
        if E == 0:
            continue
        row = int(req_pool_indices[b])
        pos = torch.arange(P + E, device=dev)
        for h in range(geo.num_kv_heads):
            is_local, col, ks, vs = _head(heads, h, stores, _promoted_row(promoted, row))
            # Prefix keys a local head never sees may be absent from a ring: read only the seen.
            seen = visibility(pos[P:], pos, is_local, geo).any(dim=0)
            old = pos[:P][seen[:P]]
            slots = store_slots(old, row, req_to_token, is_local, geo)
            k = torch.cat([ks[slots, col], k_new[start : start + E, h]]).float()
            v = torch.cat([vs[slots, col], v_new[start : start + E, h]]).float()
            key_pos = torch.cat([old, pos[P:]])
            qs = slice(h * grp, (h + 1) * grp)
            for c in range(0, E, _QUERY_CHUNK):
                rows = slice(start + c, start + min(c + _QUERY_CHUNK, E))
                vis = visibility(pos[P + c : P + min(c + _QUERY_CHUNK, E)], key_pos, is_local, geo)
                out[rows, qs], lse[rows, qs] = _attend(q[rows, qs].float(), k, v, vis, sm_scale)
    return out.to(q.dtype), lse


def _probe_scores(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """[P, G, grp, L] float32 scaled scores of the probed queries, -inf after each position."""
    scores = torch.einsum("pgjd,lgd->pgjl", q.float(), keys.float()) * scale
    future = torch.arange(keys.shape[0], device=keys.device)[None, :] > q_pos[:, None]
    return scores.masked_fill_(future[:, None, None, :], float("-inf"))


def probe_lse(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """[P, G, grp] float32: the log-sum-exp the layer's attention writes for each probed query
    (over every key at or before its position); arguments as :func:`key_mass_reference`."""
    return torch.logsumexp(_probe_scores(q, keys, q_pos, scale), dim=-1)


def key_mass_reference(
    q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention mass each key receives from the probed queries, summed over queries and heads
    (what :func:`redknot.kernels.key_mass.key_mass` computes from the attention's LSE).

    Parameters
    ----------
    q : [P, G, grp, D] probed queries of the global heads (``grp`` query heads per KV head).
    keys : [L, G, D] every key of the request (position = row).
    q_pos : [P] int64 positions of the probed queries (causal: a query sees keys ``<= pos``).
    scale : softmax scale.

    Returns
    -------
    [L] float32 mass per key.
    """
    return torch.softmax(_probe_scores(q, keys, q_pos, scale), dim=-1).sum(dim=(0, 1, 2))


def choose_rows_reference(
    mass: torch.Tensor,
    candidates: torch.Tensor,
    rows: torch.Tensor,
    mass_thresh: float,
    keep: torch.Tensor,
    check_votes: bool = False,
) -> tuple[torch.Tensor, int]:
    """What :func:`redknot.kernels.choose.choose_rows` computes: ``(keep without the skipped
    rows, how many skipped)``, from :func:`redknot.recovery.importance.important_mask`."""
    from redknot.recovery.importance import important_mask

    active = keep[rows]
    skip = active & ~important_mask(mass, candidates, mass_thresh, active)
    if check_votes and not bool(mass.sum() > 0):
        skip[:] = False
    out = keep.clone()
    out[rows[skip]] = False
    return out, int(skip.sum())
