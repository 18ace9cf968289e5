"""Random requests in SGLang's paged KV layout for the sparse decode tests: every request's keys
and values written to randomly permuted slots of ``k_buffer`` / ``v_buffer`` [slots, Hkv, D]
through a randomly chosen row of ``req_to_token``. Slots nobody wrote hold NaN, so a kernel that
reads a key it should not see produces NaN instead of a plausible number. Also a random LFPS
batch state for the kernels of its step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.lfps.batch_state import LfpsBatchState


@dataclass
class PagedBatch:
    k_buffer: torch.Tensor  # [slots, Hkv, D]
    v_buffer: torch.Tensor  # [slots, Hkv, D]
    req_to_token: torch.Tensor  # [R, max_ctx] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, keys of each request
    keys: list[torch.Tensor]  # per request [n, Hkv, D], as written
    values: list[torch.Tensor]

    def stores(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_buffer, self.v_buffer, self.req_to_token, self.req_pool_indices


def make_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    keys: list[torch.Tensor] | None = None,
    values: list[torch.Tensor] | None = None,
) -> PagedBatch:
    """A batch holding ``seq_lens[b]`` keys per request (random, or ``keys[b]`` / ``values[b]``
    of shape [n, Hkv, D] when given)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    R = B + 2
    max_ctx = max(seq_lens + [1]) + 5
    slots = R * max_ctx + 7
    perm = torch.randperm(slots, generator=g)[: R * max_ctx].view(R, max_ctx)
    req_to_token = perm.to(torch.int32)
    rows = torch.randperm(R, generator=g)[:B]
    kb = torch.full((slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    vb = kb.clone()
    ks, vs = [], []
    for b, n in enumerate(seq_lens):
        k = keys[b] if keys is not None else torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = values[b] if values is not None else torch.randn(n, num_kv_heads, head_dim, generator=g)
        k, v = k.to(dtype), v.to(dtype)
        where = req_to_token[int(rows[b]), :n].long()
        kb[where], vb[where] = k, v
        ks.append(k.to(device))
        vs.append(v.to(device))
    return PagedBatch(
        kb.to(device), vb.to(device), req_to_token.to(device), rows.to(device),
        torch.tensor(seq_lens, dtype=torch.int64, device=device), ks, vs,
    )  # fmt: skip


def random_lfps_state(B, Hq, Hkv, D, rows, n_max, seed) -> LfpsBatchState:
    """An LFPS batch state with random sparse tables (``rows`` query heads per selection head),
    random scales and priors."""
    g = torch.Generator().manual_seed(seed)
    Hs = Hq // rows
    return LfpsBatchState(
        vertical=torch.rand(B, Hs, n_max, generator=g) ** 4,
        slash=torch.rand(B, Hs, n_max, generator=g) ** 4,
        scale=torch.rand(B, Hs, generator=g) + 0.5,
        mean_key=torch.randn(B, Hkv, D, generator=g) * 0.3,
        mean_value=torch.randn(B, Hkv, D, generator=g),
        query_stat=torch.rand(B, Hq, generator=g) * 0.1,
        rows=rows,
    )
