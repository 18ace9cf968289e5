"""Attention restricted per head class, in plain PyTorch (SDPA over query blocks).

Keys are addressed by row: key row ``j`` sits at position ``j`` (the runner keeps the KV of a
sequence in position order, re-aligning any key it takes from a cache). A query at position
``p`` sees key ``j`` when

| head class | visible keys                                  |
| ---------- | --------------------------------------------- |
| global G   | ``j <= p``                                    |
| local  L   | ``j <= p`` and (``j < sink`` or ``p - j < window``) |

Query heads are grouped as in Hugging Face's ``repeat_kv``: query head ``i`` reads KV head
``i // group``. KV is never copied per query head (SDPA's ``enable_gqa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from redknot.headmap import GLOBAL, LOCAL

GLOBAL_BLOCK = 512  # query rows per SDPA call for global heads
LOCAL_BLOCK = 256  # query rows per SDPA call for local heads


def visible(q_pos: Tensor, k_pos: Tensor, *, local: bool, window: int, sink: int) -> Tensor:
    """Boolean ``[len(q_pos), len(k_pos)]``: which keys each query may attend."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    mask = kp <= qp
    if local:
        mask &= (kp < sink) | (qp - kp < window)
    return mask


def _check(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, classes: str) -> int:
    num_q, num_kv = q.shape[0], k.shape[0]
    assert q.dim() == k.dim() == v.dim() == 3, (q.shape, k.shape, v.shape)
    assert k.shape == v.shape and q.shape[2] == k.shape[2], (q.shape, k.shape, v.shape)
    assert num_q % num_kv == 0 and len(classes) == num_kv, (num_q, num_kv, classes)
    assert q_pos.shape == (q.shape[1],) and q_pos.dtype == torch.int64, q_pos
    if q_pos.numel():
        assert int(q_pos[-1]) < k.shape[1], "a query's own key must be present"
        assert bool((q_pos[1:] >= q_pos[:-1]).all()), "query positions must be ascending"
    return num_q // num_kv


def head_class_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    classes: str,
    *,
    window: int,
    sink: int,
    scale: float | None = None,
) -> Tensor:
    """Causal attention with every KV head restricted by its class.

    Parameters
    ----------
    q : ``[num_q_heads, Tq, head_dim]`` queries (RoPE applied), any float dtype.
    k, v : ``[num_kv_heads, Tk, head_dim]``; key row ``j`` is position ``j``.
    q_pos : ``[Tq]`` int64, ascending positions of the queries, each ``< Tk``.
    classes : one ``"G"``/``"L"`` per KV head.
    window, sink : the local heads' visible set (see module docstring).
    scale : softmax scale, default ``head_dim ** -0.5``.

    Returns
    -------
    ``[num_q_heads, Tq, head_dim]`` in the dtype of ``q``.
    """
    group = _check(q, k, v, q_pos, classes)
    out = torch.empty_like(q)
    for cls, block in ((GLOBAL, GLOBAL_BLOCK), (LOCAL, LOCAL_BLOCK)):
        heads = [h for h, c in enumerate(classes) if c == cls]
        if not heads:
            continue
        if len(heads) == len(classes):
            q_rows = torch.arange(q.shape[0], device=q.device)
            kh, vh = k, v
        else:
            kv_index = torch.tensor(heads, device=q.device)
            q_rows = (kv_index[:, None] * group + torch.arange(group, device=q.device)).flatten()
            kh, vh = k.index_select(0, kv_index), v.index_select(0, kv_index)
        qh = q.index_select(0, q_rows)
        oh = _blocked(
            qh,
            kh,
            vh,
            q_pos,
            local=cls == LOCAL,
            window=window,
            sink=sink,
            scale=scale,
            block=block,
        )
        out.index_copy_(0, q_rows, oh)
    return out


def _blocked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    *,
    local: bool,
    window: int,
    sink: int,
    scale: float | None,
    block: int,
) -> Tensor:
    """One head class: SDPA per block of query rows over the keys the block can see."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[1], block):
        end = min(q.shape[1], start + block)
        pos = q_pos[start:end]
        p_min, p_max = int(pos[0]), int(pos[-1])
        if local and p_min - window + 1 > sink:
            # keys: the sink, then the band from the oldest window start to the newest query.
            lo = p_min - window + 1
            k_pos = torch.cat(
                (torch.arange(sink, device=q.device), torch.arange(lo, p_max + 1, device=q.device))
            )
            kb = torch.cat((k[:, :sink], k[:, lo : p_max + 1]), dim=1)
            vb = torch.cat((v[:, :sink], v[:, lo : p_max + 1]), dim=1)
        else:
            k_pos = torch.arange(p_max + 1, device=q.device)
            kb, vb = k[:, : p_max + 1], v[:, : p_max + 1]
        mask = visible(pos, k_pos, local=local, window=window, sink=sink)
        attn_mask = None if bool(mask.all()) else mask
        out[:, start:end] = F.scaled_dot_product_attention(
            q[None, :, start:end],
            kb[None],
            vb[None],
            attn_mask=attn_mask,
            scale=scale,
            enable_gqa=True,
        )[0]
    return out


def attention_probs(
    q: Tensor,
    k: Tensor,
    q_pos: Tensor,
    classes: str,
    *,
    window: int,
    sink: int,
    scale: float | None = None,
) -> Tensor:
    """Explicit attention probabilities of a few query rows, for statistics.

    ``q``: ``[num_q_heads, P, head_dim]``, ``k``: ``[num_kv_heads, Tk, head_dim]``, ``q_pos``:
    ``[P]``. Returns float32 ``[num_q_heads, P, Tk]``; invisible keys have probability 0.
    Memory is ``num_q_heads * P * Tk`` floats: keep ``P`` small (the last queries).
    """
    group = q.shape[0] // k.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_pos = torch.arange(k.shape[1], device=q.device)
    masks = torch.stack(
        [visible(q_pos, k_pos, local=c == LOCAL, window=window, sink=sink) for c in classes]
    )  # [num_kv_heads, P, Tk]
    kr = k.to(torch.float32).repeat_interleave(group, dim=0)
    scores = torch.matmul(q.to(torch.float32), kr.transpose(1, 2)) * scale
    scores = scores.masked_fill(~masks.repeat_interleave(group, dim=0), float("-inf"))
    return torch.softmax(scores, dim=-1)
