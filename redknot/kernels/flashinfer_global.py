"""Extend attention of the global KV heads through FlashInfer, next to the Triton kernel for the
local heads: the explicit alternative to running every row in ``segpaged_extend_kernel``.

Per layer: FlashInfer ragged causal attention of the global heads over the new tokens, plus (when
some request has a cached prefix) FlashInfer paged attention over the prefix in the global store
(page size 1, pages = ``req_to_token`` slots), merged by log-sum-exp; then
``run_extend(..., skip_global=True)`` for the local heads. GPU only.

>>> fi = FlashInferGlobalRows(geo, device="cuda")
>>> fi.plan(plan, req_to_token, global_counts={1}, dtype=torch.bfloat16, sm_scale=scale)
>>> for layer in range(num_layers):
...     run_extend_flashinfer_global(fi, plan, q, k_new, v_new, kg[layer], vg[layer],
...                                  kl[layer], vl[layer], req_to_token, heads[layer], scale, out)

The global store of a layer must have exactly its ``num_global`` columns, in the order of
``heads.global_heads`` (the order ``HeadLayout`` assigns).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from redknot.kernels.extend import ExtendPlan, run_extend
from redknot.kernels.geometry import LayerHeads, SegGeometry


class FlashInferGlobalRows:
    """FlashInfer wrappers for the global heads, one pair per global-head count of a layer."""

    def __init__(
        self, geo: SegGeometry, device: torch.device | str, workspace_bytes: int = 256 << 20
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.geo = geo
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._ragged: dict[int, object] = {}
        self._paged: dict[int, object] = {}
        self._has_prefix = False
        self._prefix_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        self._head_index: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(
        self,
        plan: ExtendPlan,
        req_to_token: torch.Tensor,
        global_counts: Iterable[int],
        dtype: torch.dtype,
        sm_scale: float,
    ) -> None:
        """Plan FlashInfer for the batch of ``plan`` and every count of global heads a layer
        has (``{layout.num_global(l) for l in layers}``). Every row: FlashInfer's ragged
        attention has no plan over listed rows (:func:`redknot.kernels.extend.gather_tiles`)."""
        if plan.gathered:
            raise ValueError("FlashInferGlobalRows plans every row of a batch, not a gathered plan")
        grp, D = self.geo.group_size, self.geo.head_dim
        indptr = plan.qo_indptr_cpu  # FlashInfer plans on the host
        prefix = plan.prefix_lens_cpu.to(torch.int64)
        lens = (indptr[1:] - indptr[:-1]).to(torch.int64)
        # The paged call covers only requests with a prefix and new tokens (FlashInfer's output
        # for an empty KV range must not be merged); its tokens are gathered by index.
        with_prefix = [b for b in range(len(lens)) if prefix[b] > 0 and lens[b] > 0]
        self._has_prefix = bool(with_prefix)
        if self._has_prefix:
            rows = plan.req_pool_indices_gpu.tolist()
            sub_lens = lens[with_prefix]
            sub_prefix = prefix[with_prefix]
            qo_sub = torch.zeros(len(with_prefix) + 1, dtype=torch.int32)
            torch.cumsum(sub_lens, 0, out=qo_sub[1:])
            kv_indptr = torch.zeros(len(with_prefix) + 1, dtype=torch.int32)
            torch.cumsum(sub_prefix, 0, out=kv_indptr[1:])
            kv_indices = torch.cat(
                [req_to_token[rows[b], : int(prefix[b])] for b in with_prefix]
            ).to(torch.int32)
            last_page = torch.ones(len(with_prefix), dtype=torch.int32, device=self.device)
            self._prefix_tokens = torch.cat(
                [torch.arange(int(indptr[b]), int(indptr[b + 1])) for b in with_prefix]
            ).to(self.device)
        for G in sorted(set(global_counts) - {0}):
            ragged = self._ragged.setdefault(
                G, self._fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
            )
            ragged.plan(
                indptr, indptr, G * grp, G, D, causal=True, sm_scale=sm_scale,
                q_data_type=dtype, kv_data_type=dtype,
            )  # fmt: skip
            if self._has_prefix:
                paged = self._paged.setdefault(
                    G, self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                )
                paged.plan(
                    qo_sub, kv_indptr, kv_indices, last_page, G * grp, G, D, 1,
                    causal=False, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype,
                )  # fmt: skip

    def _indices(self, global_heads: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device indices of the global KV heads and of their query heads (cached per layer
        pattern; allocated once)."""
        if global_heads not in self._head_index:
            grp = self.geo.group_size
            q_heads = [h * grp + i for h in global_heads for i in range(grp)]
            as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)
            self._head_index[global_heads] = (as_t(list(global_heads)), as_t(q_heads))
        return self._head_index[global_heads]

    def run(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_new: torch.Tensor,  # [T, H_kv, D]
        v_new: torch.Tensor,
        k_global: torch.Tensor,  # [S_g, G_l, D]
        v_global: torch.Tensor,
        heads: LayerHeads,
        out: torch.Tensor,  # [T, Hq, D], its global query heads are written
        lse: torch.Tensor | None = None,  # [T, Hq] float32, natural log
    ) -> None:
        G = heads.num_global
        if G == 0 or q.shape[0] == 0:
            return
        kv_idx, q_idx = self._indices(heads.global_heads)
        q_g = q.index_select(1, q_idx)
        o, lse2 = self._ragged[G].run(
            q_g, k_new.index_select(1, kv_idx), v_new.index_select(1, kv_idx), return_lse=True
        )
        if self._has_prefix:
            assert k_global.shape[1] == G and v_global.shape[1] == G, k_global.shape
            tok = self._prefix_tokens
            paged = (k_global.unsqueeze(1), v_global.unsqueeze(1))  # page size 1
            o_p, lse2_p = self._paged[G].run(q_g.index_select(0, tok), paged, return_lse=True)
            o_sub, lse2_sub = o.index_select(0, tok), lse2.index_select(0, tok)
            self._fi.merge_state_in_place(o_sub, lse2_sub, o_p, lse2_p)
            o.index_copy_(0, tok, o_sub)
            lse2.index_copy_(0, tok, lse2_sub)
        out.index_copy_(1, q_idx, o)
        if lse is not None:
            lse.index_copy_(1, q_idx, lse2 * math.log(2.0))  # FlashInfer's lse is base 2


def run_extend_flashinfer_global(
    fi: FlashInferGlobalRows,
    plan: ExtendPlan,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    req_to_token: torch.Tensor,
    heads: LayerHeads,
    sm_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """``run_extend`` semantics, with the global heads computed by FlashInfer (two or three
    launches and a few small copies instead of one launch)."""
    if out is None:
        out = torch.empty_like(q)
    fi.run(q, k_new, v_new, k_global, v_global, heads, out, lse)
    return run_extend(
        plan, q, k_new, v_new, k_global, v_global, k_local, v_local, req_to_token, heads,
        sm_scale, out=out, lse=lse, skip_global=True,
    )  # fmt: skip
