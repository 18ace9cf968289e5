"""LFPS in the server (``--redknot-lfps lfps|topk``): decode steps that attend a selected few keys.

A request whose prompt has at least ``--redknot-lfps-min-tokens`` tokens takes one of the
``--redknot-lfps-max-requests`` state slots when it is prefilled; its decode steps then attend its
sink tokens and a per-head selection of ``--redknot-lfps-budget`` of its keys:

- ``lfps``: LFPS's selection (``redknot.lfps.batched.lfps_decode_step``), from score tables built
  at the end of its prefill (Eq. 4: the attention of its last ``history_steps`` prompt tokens)
  and updated by every step (Eq. 10);
- ``topk``: the exact Top-k of every key's score at every step (the selection LFPS predicts; the
  accuracy baseline, it scores every key).

**State** (``LfpsStore``): per layer one ``LfpsBatchState`` of ``slots`` rows plus a scratch
row, tables as wide as the context, reserved from the KV budget at startup (``state_bytes``),
so admission counts it. A request keeps its row until its request slot is freed (it finished,
was aborted or retracted: the hook on ``ReqToTokenPool.free`` calls ``release``). A step reads
and updates the rows of its requests through ``LfpsBatchState.index``.

**Prefill** (``LfpsServing.after_extend``, per layer, after the K/V are written): for every
request of the extend that holds a row, the tables of Eq. 4 from the extend's last
``history_steps`` queries over every key of the request (``build_tables``), the mean key and
value and the query statistic. A chunked prompt builds at every chunk; the last one's stays.
A prompt whose last extend is shorter than ``history_steps`` (a prefix-cache hit, a short last
chunk) builds from the queries that extend has.

**Decode in CUDA graphs** (the usual case): every row of SGLang's decode graphs runs on the
step's kernels, with budgets fixed at startup (``graph_topk`` keys, ``graph_candidates``
candidates: wide enough for the context, and for listing every key of a request below
``min_tokens``). A row holder reads its row; any other request (short, or found every row
taken) lists every key it has (``dense``) on the scratch row. Before a replay, the hook on
``DecodeCudaGraphRunner.can_run_graph`` gives the backend the real batch (``graph_rows``);
``begin_graph`` copies its rows into the graphs' buffers.

**Decode, eager**: a batch no graph can serve (a request without a row longer than
``graph_topk`` keys, or a batch larger than the graphs): the row holders on the step with the
batch's own budgets (``plan_decode``, ``decode``), the others on FlashInfer.

The tables are renormalised every ``RENORMALIZE_EVERY`` steps, while planning
(``LfpsBatchState.renormalize_``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from redknot.attention.slots import request_slots
from redknot.lfps.batch_state import LfpsBatchState
from redknot.lfps.params import LfpsParams
from redknot.lfps.state import table_norm

logger = logging.getLogger(__name__)

RENORMALIZE_EVERY = 256  # decode steps between folds of the lazy decay (float32 holds ~1700)
# Over a KV store in host memory, LFPS's step gathers the rows it reads into GPU buffers first
# (redknot.kernels.host_stage) when batch x context reaches this: per layer, 8B shape, H200
# (benchmarks/results/lfps_decode_host.json), gathering took 4.88 against 5.62 ms at 128K x 8
# and 19.3 against 24.2 ms at 128K x 32, 3.94 against 4.73 ms at 32K x 32, and lost at
# 32K x 8 (0.804 against 0.794 ms), 32K x 1 and 128K x 1
STAGE_MIN_TOKENS = 1 << 20
GRAPH_STAGE_MAX_BS = 64  # decode graphs above this batch read the host store directly


@dataclass(frozen=True)
class LfpsShape:
    """What the state of one rank is sized by."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rows: int  # query heads per selection head (1: per query head; Hq / Hkv: per KV head)
    max_len: int  # table width: the context length

    @property
    def selection_heads(self) -> int:
        return self.num_q_heads // self.rows


def rows_of(selection: str, num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per selection head (tables and list) for ``--redknot-lfps-selection``."""
    return 1 if selection == "query-head" else num_q_heads // num_kv_heads


def union_of(selection: str, num_q_heads: int, num_kv_heads: int) -> int:
    """``LfpsBudgets.union`` for ``--redknot-lfps-selection``: the query heads whose own Top-k
    a list unites (``kv-head-union``), else 1."""
    return num_q_heads // num_kv_heads if selection == "kv-head-union" else 1


def state_bytes(shape: LfpsShape, slots: int) -> int:
    """Bytes of ``slots`` rows of state (and the scratch row) over every layer (float32
    tables, scale and priors)."""
    hs = shape.selection_heads
    per_row = (
        2 * hs * shape.max_len + hs + 2 * shape.num_kv_heads * shape.head_dim + shape.num_q_heads
    )
    return 4 * per_row * (slots + 1) * shape.num_layers


class LfpsStore:
    """``slots`` rows of LFPS state for every layer, and one scratch row (``scratch``) that the
    requests of a CUDA-graph batch without a row of their own update (its contents never
    matter)."""

    def __init__(self, shape: LfpsShape, slots: int, device: torch.device | str):
        self.shape, self.slots, self.scratch = shape, slots, slots
        hs, hkv, hq, d, n = (shape.selection_heads, shape.num_kv_heads, shape.num_q_heads,
                             shape.head_dim, shape.max_len)  # fmt: skip
        rows = slots + 1

        def zeros(*size):
            return torch.zeros(*size, dtype=torch.float32, device=device)

        self.layers = [
            LfpsBatchState(
                vertical=zeros(rows, hs, n),
                slash=zeros(rows, hs, n),
                scale=torch.ones(rows, hs, device=device),
                mean_key=zeros(rows, hkv, d),
                mean_value=zeros(rows, hkv, d),
                query_stat=zeros(rows, hq),
                rows=shape.rows,
            )
            for _ in range(shape.num_layers)
        ]

    def state(self, layer: int, index: torch.Tensor) -> LfpsBatchState:
        """The state of ``layer`` for a step whose request ``i`` uses row ``index[i]``."""
        return dataclasses.replace(self.layers[layer], index=index)

    def renormalize_(self) -> None:
        for state in self.layers:
            state.renormalize_()


def build_tables(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    params: LfpsParams,
    rows: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4 and the priors of one request, one KV head's group at a time (bounded memory).

    ``redknot.lfps.state.build_state`` on K/V expanded to the query heads, then
    ``pack_states``'s mean over each selection head's ``rows`` query heads.

    Args:
        queries: [m, Hq, D], the last ``m`` prompt positions' post-RoPE queries (the last
            ``params.history_steps`` of them are used).
        keys, values: [n, Hkv, D], every prompt key (post-RoPE) and value, ``n > num_sink``.
    Returns:
        vertical, slash [Hs, n], mean_key, mean_value [Hkv, D], query_stat [Hq], float32.
    """
    queries = queries[-params.history_steps :]
    m, hq, _ = queries.shape
    n, hkv, _ = keys.shape
    grp = hq // hkv
    s = params.num_sink
    dev = keys.device
    qpos = torch.arange(n - m, n, device=dev)
    kpos = torch.arange(n, device=dev)
    allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= s)  # [m, n]
    weight = params.decay ** torch.arange(m - 1, -1, -1, dtype=torch.float32, device=dev)
    weight = weight * table_norm(params, m)
    src = qpos[:, None] - kpos[None, :]  # slash: distance d of row i reads key t_i - d
    by_distance = src.clamp_min(0).expand(grp, m, n)
    vertical = torch.empty(hq // rows, n, device=dev)
    slash = torch.empty(hq // rows, n, device=dev)
    for h in range(hkv):
        q = queries[:, h * grp : (h + 1) * grp].float()
        logits = torch.einsum("mgd,nd->gmn", q, keys[:, h].float()) * sm_scale
        attn = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        vert = torch.einsum("gmn,m->gn", attn, weight)
        dist = torch.gather(attn, -1, by_distance) * (src >= 0)
        sl = torch.einsum("gmn,m->gn", dist, weight)
        at = slice(h * grp // rows, (h + 1) * grp // rows)
        vertical[at] = vert.view(grp // rows, rows, n).mean(1)
        slash[at] = sl.view(grp // rows, rows, n).mean(1)
    q_last = queries[-1].float()
    query_stat = q_last.var(dim=-1, unbiased=False) / q_last.square().sum(-1).clamp_min(1e-30)
    mean_key = keys[s:].float().mean(0)
    mean_value = values[s:].float().mean(0)
    return vertical, slash, mean_key, mean_value, query_stat


@dataclass
class DecodePlan:
    """One eager decode batch's LFPS part (host decisions, device indices)."""

    lfps_rows: torch.Tensor  # [Bl] long: batch rows that decode with LFPS
    index: torch.Tensor  # [Bl] int32: their state rows
    dense_rows: torch.Tensor  # [Bd] long: the others
    dense_rows_list: list[int]
    req_pool_indices: torch.Tensor  # [Bl]
    seq_lens: torch.Tensor  # [Bl]
    topk: int  # K
    candidates: int  # C
    width: int  # the longest row's keys (exact Top-k scores every position below it)
    sparse: object  # SparseDecodePlan of LfpsBudgets.width (None: off CUDA, or mode lfps)


class LfpsServing:
    """The LFPS decode of one rank: state rows, the prefill build and the decode step, eager
    (``plan_decode``, ``decode``) or in SGLang's decode CUDA graphs (``graph_rows``,
    ``begin_graph``, ``decode_graph``)."""

    def __init__(
        self,
        mode: str,
        params: LfpsParams,
        shape: LfpsShape,
        store: LfpsStore,
        req_to_token: torch.Tensor,
        *,
        min_tokens: int,
        candidate_factor: int = 4,
        union: int = 1,
        kernels: bool = True,
        host_kv_dtype: torch.dtype | None = None,
    ):
        assert mode in ("lfps", "topk"), mode
        assert union in (1, shape.rows) and (union == 1 or mode == "lfps"), (union, shape.rows)
        self.mode, self.params, self.shape, self.store = mode, params, shape, store
        self.req_to_token = req_to_token
        self.min_tokens, self.candidate_factor, self.kernels = min_tokens, candidate_factor, kernels
        self.union = union  # LfpsBudgets.union
        self.row_of: dict[str, int] = {}  # rid -> its state row
        self.free = list(range(store.slots - 1, -1, -1))  # rows not in use (popped from the end)
        self.steps = 0  # decode steps since the last renormalisation
        self.extend_rows: list[tuple[int, int, int, int, int]] = []  # per extend, see plan_extend
        self.refused = 0  # long-enough requests that found every row taken
        keys = shape.max_len - params.num_sink
        # CUDA graphs: fixed budgets wide enough for the longest request, and for listing every
        # key of a request without a row that started below min_tokens
        self.graph_topk = max(
            1, min(keys, max(params.budget_for(keys), min_tokens - params.num_sink))
        )
        self.graph_candidates = self._candidates(self.graph_topk, keys)
        self.graph_index: torch.Tensor | None = None  # [max_bs] int32 state row of each row
        self.graph_dense: torch.Tensor | None = None  # [max_bs] bool rows listing every key
        self.graph_plans: dict[int, object] = {}  # batch size -> SparseDecodePlan
        # a KV store in host memory (--redknot-lfps-offload-gb; its dtype, else None): LFPS's
        # step gathers the rows it reads into GPU buffers first (redknot.kernels.host_stage)
        # where that was measured faster, lists per KV head only
        self.host_kv_dtype = host_kv_dtype
        per_kv_head = shape.selection_heads == shape.num_kv_heads
        self.stages = host_kv_dtype is not None and kernels and mode == "lfps" and per_kv_head
        self.graph_stage = None  # staging buffers of the decode graphs (their largest batch)
        # the tables built in Triton, reading the store through the slots: 3.1-3.2x the PyTorch
        # build with the store in GPU memory, 0.39-0.41x with it in host memory, where it
        # crosses PCIe for every key twice and the PyTorch build gathers them once
        # (lfps_build.json, H100)
        self.triton_build = kernels and host_kv_dtype is None
        self.eager_stage: tuple[tuple[int, int], object] | None = None  # (budgets), buffers

    # ---- rows ----------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return len(self.row_of)

    def stats(self) -> dict:
        """What ``GET /redknot/stats`` reports under ``"lfps"``: the mode, the state rows, those
        in use, and the requests long enough for LFPS that found every row taken (they decode
        on FlashInfer: raise ``--redknot-lfps-max-requests`` when this grows)."""
        return {
            "mode": self.mode, "rows": self.store.slots, "in_use": self.count,
            "refused": self.refused, "min_tokens": self.min_tokens,
        }  # fmt: skip

    def acquire(self, rid: str) -> int | None:
        """The row of ``rid`` (a new one if it has none), or None when every row is taken."""
        row = self.row_of.get(rid)
        if row is not None:
            return row
        if not self.free:
            self.refused += 1
            return None
        row = self.free.pop()
        self.row_of[rid] = row
        return row

    def release(self, rid: str) -> None:
        """Free the row of ``rid`` (its request slot was freed: it finished, was aborted or
        retracted; called by redknot's hook on ``ReqToTokenPool.free``)."""
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.free.append(row)

    def release_all(self) -> None:
        """Free every row (``ReqToTokenPool.clear``: the server flushed its caches)."""
        for rid in list(self.row_of):
            self.release(rid)

    # ---- prefill -------------------------------------------------------------------------

    def plan_extend(self, forward_batch) -> None:
        """Take a row for every request of this extend whose prompt so far is long enough:
        ``(row, req_pool_index, seq_len, last query row + 1, extend length)`` each."""
        self.extend_rows = []
        rids = getattr(forward_batch, "rids", None)
        lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if not rids or lens is None:
            return
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        pool_rows = None
        end = 0
        for i, rid in enumerate(rids):
            end += int(lens[i])
            n = int(seq_lens[i])
            if n < self.min_tokens or n <= self.params.num_sink or lens[i] == 0:
                continue
            row = self.acquire(rid)
            if row is None:
                continue
            if pool_rows is None:
                pool_rows = request_slots(forward_batch)
            self.extend_rows.append((row, int(pool_rows[i]), n, end, int(lens[i])))

    def wants_extend(self, forward_batch) -> bool:
        """Whether an extend batch has a prompt long enough for LFPS (it then runs eagerly)."""
        seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
        return seq_lens is not None and bool((seq_lens >= self.min_tokens).any())

    def after_extend(self, layer_id: int, q: torch.Tensor, k_buffer, v_buffer, sm_scale: float):
        """Build the state of this layer for the extend's row holders (K/V already written).

        ``q``: [T, Hq * D] the extend's post-RoPE queries."""
        if not self.extend_rows:
            return
        shape = self.shape
        q = q.view(-1, shape.num_q_heads, shape.head_dim)
        state = self.store.layers[layer_id]
        if self.triton_build:
            from redknot.kernels.lfps_build import build_tables_kernels
        for row, pool_row, n, end, length in self.extend_rows:
            m = min(length, self.params.history_steps)
            slots = self.req_to_token[pool_row, :n].long()
            if self.triton_build:
                vert, sl, mk, mv, qs = build_tables_kernels(
                    q[end - m : end], k_buffer, v_buffer, slots, self.params, shape.rows, sm_scale
                )
            else:
                vert, sl, mk, mv, qs = build_tables(
                    q[end - m : end], k_buffer[slots], v_buffer[slots], self.params, shape.rows,
                    sm_scale,
                )  # fmt: skip
            state.vertical[row, :, :n] = vert
            state.vertical[row, :, n:] = 0.0
            state.slash[row, :, :n] = sl
            state.slash[row, :, n:] = 0.0
            state.scale[row] = 1.0
            state.mean_key[row] = mk
            state.mean_value[row] = mv
            state.query_stat[row] = qs

    # ---- decode, eager -------------------------------------------------------------------

    def _step(self) -> None:
        """Count a decode step; fold the lazy decay in every ``RENORMALIZE_EVERY`` (outside
        any graph: called while planning)."""
        self.steps += 1
        if self.mode == "lfps" and self.steps >= RENORMALIZE_EVERY:
            self.store.renormalize_()
            self.steps = 0

    def plan_decode(self, forward_batch) -> DecodePlan | None:
        """The plan of this batch's row holders, or None when it has none."""
        rids = getattr(forward_batch, "rids", None)
        if rids is None:  # a synthetic batch (CUDA-graph capture, warm-up): no request
            return None
        lfps = [i for i, rid in enumerate(rids) if rid in self.row_of]
        if not lfps:
            return None
        taken = set(lfps)
        dense = [i for i in range(len(rids)) if i not in taken]
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        longest = max(int(seq_lens[i]) for i in lfps)
        p = self.params
        topk = p.budget_for(longest - p.num_sink)
        candidates = self._candidates(topk, longest - p.num_sink)
        dev = forward_batch.seq_lens.device
        lfps_rows = torch.tensor(lfps, dtype=torch.long, device=dev)
        index = [self.row_of[rids[i]] for i in lfps]
        self._step()
        # the LFPS step attends an eager batch's selections from its own logits (no row here
        # lists every key): only exact Top-k runs the sparse attention
        width = self._budgets(candidates, topk).width
        sparse = self._sparse_plan(len(lfps), width, dev) if self.mode == "topk" else None
        return DecodePlan(
            lfps_rows=lfps_rows,
            index=torch.tensor(index, dtype=torch.int32, device=dev),
            dense_rows=torch.tensor(dense, dtype=torch.long, device=dev),
            dense_rows_list=dense,
            req_pool_indices=forward_batch.req_pool_indices[lfps_rows],
            seq_lens=forward_batch.seq_lens[lfps_rows],
            topk=topk,
            candidates=candidates,
            width=longest,
            sparse=sparse,
        )

    def _budgets(self, candidates: int, topk: int):
        from redknot.lfps.batched import LfpsBudgets

        return LfpsBudgets(candidates=candidates, topk=topk, union=self.union)

    def _candidates(self, topk: int, keys: int) -> int:
        """C for a Top-``topk``: ``candidate_factor`` times it, at most every key (never below
        ``topk``)."""
        return max(topk, min(self.candidate_factor * topk, keys))

    def _sparse_plan(self, batch: int, width: int, device):
        if not self.kernels:
            return None
        from redknot.kernels.sparse_decode import plan_sparse_decode

        return plan_sparse_decode(
            batch_size=batch, num_q_heads=self.shape.num_q_heads, head_dim=self.shape.head_dim,
            rows=self.shape.rows, width=width, num_sink=self.params.num_sink, device=device,
        )  # fmt: skip

    def decode(
        self, layer_id: int, q: torch.Tensor, k_buffer, v_buffer, plan: DecodePlan, sm_scale
    ) -> torch.Tensor:
        """Attention of the plan's rows in this layer: ``q`` [Bl, Hq, D] -> [Bl, Hq, D]."""
        stage = self._eager_stage(q.shape[0], plan.candidates, plan.topk, plan.width, q.device)
        return self._attend(
            layer_id, q, k_buffer, v_buffer, plan.req_pool_indices, plan.seq_lens, plan.index,
            None, plan.topk, plan.candidates, plan.width, plan.sparse, sm_scale, stage,
        )  # fmt: skip

    # ---- staging rows of a store in host memory --------------------------------------------

    def stage_pays(self, batch: int, context: int) -> bool:
        """Whether a step of ``batch`` requests of up to ``context`` tokens over a host store
        gathers its rows first (``STAGE_MIN_TOKENS``)."""
        return self.stages and batch * context >= STAGE_MIN_TOKENS

    def _host_stages(self, batch: int, candidates: int, topk: int, device):
        from redknot.lfps.batched import host_stages

        shape = self.shape
        return host_stages(batch, shape.num_kv_heads, shape.head_dim, self.params,
                           self._budgets(candidates, topk), self.host_kv_dtype, device)  # fmt: skip

    def _eager_stage(self, batch: int, candidates: int, topk: int, context: int, device):
        """An eager step's staging buffers (kept for the next step of the same budgets and no
        larger batch), or None where staging does not pay."""
        if not self.stage_pays(batch, context):
            return None
        key = (candidates, topk)
        held = self.eager_stage
        if held is None or held[0] != key or held[1][0].req_pool_indices.shape[0] < batch:
            held = self.eager_stage = (key, self._host_stages(batch, candidates, topk, device))
        return _first_rows(held[1], batch)

    # ---- decode in CUDA graphs ------------------------------------------------------------

    def init_graph_state(self, max_bs: int, device) -> None:
        """Static buffers of the decode graphs; the constants the step reads made now (a copy
        from the host cannot be captured)."""
        from redknot.kernels.lfps_index import offsets_tensor
        from redknot.kernels.lfps_step import row_budget_args

        self.graph_index = torch.full((max_bs,), self.store.scratch, dtype=torch.int32,
                                      device=device)  # fmt: skip
        self.graph_dense = torch.ones(max_bs, dtype=torch.bool, device=device)
        if self.stages:  # the graphs' batch sizes the buffers serve: up to GRAPH_STAGE_MAX_BS
            bs = min(max_bs, GRAPH_STAGE_MAX_BS)
            self.graph_stage = self._host_stages(bs, self.graph_candidates, self.graph_topk,
                                                 device)  # fmt: skip
        offsets_tensor(self.params.offsets, torch.device(device))
        row_budget_args(self.params, torch.device(device))

    def fits_graph(self, forward_batch) -> bool:
        """Whether a decode graph can serve this batch: every request holds a row or is short
        enough to have every key listed (``graph_topk``)."""
        rids = getattr(forward_batch, "rids", None)
        seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
        if rids is None or seq_lens is None:
            return True
        limit = self.graph_topk + self.params.num_sink
        return all(rid in self.row_of or int(n) <= limit for rid, n in zip(rids, seq_lens))

    def graph_rows(self, forward_batch) -> tuple[list[int], list[bool]]:
        """Per request of a (real) decode batch: its state row (the scratch row without one)
        and whether it lists every key."""
        rids = forward_batch.rids
        index = [self.row_of.get(rid, self.store.scratch) for rid in rids]
        return index, [rid not in self.row_of for rid in rids]

    def begin_graph(self, bs: int, rows: tuple[list[int], list[bool]] | None) -> None:
        """Before capturing (``rows`` None: every row dense, on the scratch row) or replaying a
        graph of batch size ``bs``: the static buffers; padded rows are dense on the scratch."""
        index, dense = rows if rows is not None else ([], [])
        pad = bs - len(index)
        index = index + [self.store.scratch] * pad
        dense = dense + [True] * pad
        self.graph_index[:bs].copy_(torch.tensor(index, dtype=torch.int32), non_blocking=True)
        self.graph_dense[:bs].copy_(torch.tensor(dense, dtype=torch.bool), non_blocking=True)
        if bs not in self.graph_plans:
            width = self._budgets(self.graph_candidates, self.graph_topk).width
            self.graph_plans[bs] = self._sparse_plan(bs, width, self.graph_index.device)
        if rows is not None:
            self._step()

    def decode_graph(
        self, layer_id: int, q: torch.Tensor, k_buffer, v_buffer, req_pool_indices, seq_lens,
        sm_scale,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of every row of a graph batch (``q`` [bs, Hq, D]), fixed budgets."""
        bs = q.shape[0]
        stage = None
        held = self.graph_stage  # the graphs know no lengths: the context is the longest
        fits = held is not None and bs <= held[0].req_pool_indices.shape[0]
        if fits and self.stage_pays(bs, self.shape.max_len):
            stage = _first_rows(held, bs)
        return self._attend(
            layer_id, q, k_buffer, v_buffer, req_pool_indices, seq_lens, self.graph_index[:bs],
            self.graph_dense[:bs], self.graph_topk, self.graph_candidates, self.shape.max_len,
            self.graph_plans[bs], sm_scale, stage,
        )  # fmt: skip

    # ---- the step ------------------------------------------------------------------------

    def _attend(self, layer_id, q, k_buffer, v_buffer, req_pool_indices, seq_lens, index, dense,
                topk, candidates, width, sparse, sm_scale, stage=None):  # fmt: skip
        paged = (self.req_to_token, req_pool_indices, seq_lens)
        p = self.params
        if self.mode == "lfps":
            from redknot.lfps.batched import lfps_decode_step

            res = lfps_decode_step(
                q, k_buffer, v_buffer, *paged, self.store.state(layer_id, index), p,
                self._budgets(candidates, topk), sm_scale=sm_scale,
                kernels=self.kernels, plan=sparse, dense=dense, stage=stage,
            )  # fmt: skip
            return res.output
        from redknot.lfps.batched import every_key, row_budgets

        if self.kernels:
            from redknot.kernels.lfps_index import exact_topk
            from redknot.kernels.sparse_decode import run_sparse_decode

            picked = exact_topk(
                q, k_buffer, *paged, k=topk, num_sink=p.num_sink, sm_scale=sm_scale,
                width=width, rows=self.shape.rows,
            )  # fmt: skip
        else:
            from redknot.kernels.sparse_reference import exact_topk_reference

            picked = exact_topk_reference(
                q, k_buffer, *paged, topk, p.num_sink, sm_scale, rows=self.shape.rows
            )
        # exact_topk orders each list by descending score: each row keeps its own budget
        keep = torch.arange(topk, device=q.device) < row_budgets(seq_lens, p)[:, None]
        picked = torch.where(keep[:, None, :], picked, -1).contiguous()
        if dense is not None:
            picked = every_key(picked, dense, seq_lens, p.num_sink)
        if self.kernels:
            return run_sparse_decode(sparse, q, k_buffer, v_buffer, *paged, picked, sm_scale)
        from redknot.kernels.sparse_reference import sparse_decode_reference

        out, _ = sparse_decode_reference(
            q, k_buffer, v_buffer, *paged, picked, p.num_sink, sm_scale
        )
        return out


def _first_rows(stages: tuple, batch: int) -> tuple:
    """The first ``batch`` rows of each of a step's staging buffers."""
    from redknot.kernels.host_stage import first_rows

    return tuple(first_rows(st, batch) for st in stages)
