"""LFPS in the server (``--redknot-lfps lfps|topk``): decode steps that attend a selected few keys.

A request whose prompt has at least ``--redknot-lfps-min-tokens`` tokens takes one of the
``--redknot-lfps-max-requests`` state slots when it is prefilled; its decode steps then attend its
sink tokens and a per-head selection of ``--redknot-lfps-budget`` of its keys:

- ``lfps``: LFPS's selection (``redknot.lfps.batched.lfps_decode_step``), from score tables built
  at the end of its prefill (Eq. 4: the attention of its last ``history_steps`` prompt tokens)
  and updated by every step (Eq. 10);
- ``topk``: the exact Top-k of every key's score at every step (the selection LFPS predicts; the
  accuracy baseline, it scores every key).

Requests without a slot (shorter prompts, or every slot taken) decode densely, on FlashInfer, in
the same batch.

**State** (``LfpsStore``): per layer one ``LfpsBatchState`` of ``slots`` rows, tables as wide as
the context, reserved from the KV budget at startup (``state_bytes``), so admission counts it.
The rows in use are always ``0 .. count - 1`` (a freed row is refilled by moving the last one
into it), and every owner of a row is in every decode batch (a request absent from one has
finished, been aborted or retracted: its row is freed then), so a decode step passes the rows as
one contiguous slice to the batched step, whose kernels index the state by batch row.

**Prefill** (``LfpsServing.after_extend``, per layer, after the K/V are written): for every
request of the extend that holds a slot, the tables of Eq. 4 from the extend's last
``history_steps`` queries over every key of the request (``build_tables``), the mean key and
value and the query statistic. A chunked prompt builds at every chunk; the last one's stays.
A prompt whose last extend is shorter than ``history_steps`` (a prefix-cache hit, a short last
chunk) builds from the queries that extend has.

**Decode** (``LfpsServing.plan_decode`` once per batch on the host, ``decode`` per layer): the
batch's slot holders, in slot order, as a sub-batch; the budgets ``K`` (the widest row's Top-k)
and ``C`` (``candidate_factor * K``) from the host's sequence lengths. Such a batch runs eagerly
(its budgets change with the lengths; ``needs_eager``); the tables are renormalised every
``RENORMALIZE_EVERY`` steps (``LfpsBatchState.renormalize_``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from redknot.lfps.batch_state import LfpsBatchState
from redknot.lfps.params import LfpsParams
from redknot.lfps.state import table_norm

logger = logging.getLogger(__name__)

MODES = ("off", "lfps", "topk")
SELECTIONS = ("query-head", "kv-head")
RENORMALIZE_EVERY = 256  # decode steps between folds of the lazy decay (float32 holds ~1700)


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
    """Query heads per selection head for ``--redknot-lfps-selection``."""
    return 1 if selection == "query-head" else num_q_heads // num_kv_heads


def state_bytes(shape: LfpsShape, slots: int) -> int:
    """Bytes of ``slots`` rows of state over every layer (float32 tables, scale and priors)."""
    hs = shape.selection_heads
    per_row = (
        2 * hs * shape.max_len + hs + 2 * shape.num_kv_heads * shape.head_dim + shape.num_q_heads
    )
    return 4 * per_row * slots * shape.num_layers


class LfpsStore:
    """``slots`` rows of LFPS state for every layer (see the module docstring)."""

    def __init__(self, shape: LfpsShape, slots: int, device: torch.device | str):
        self.shape, self.slots = shape, slots
        hs, hkv, hq, d, n = (shape.selection_heads, shape.num_kv_heads, shape.num_q_heads,
                             shape.head_dim, shape.max_len)  # fmt: skip

        def zeros(*size):
            return torch.zeros(*size, dtype=torch.float32, device=device)

        self.layers = [
            LfpsBatchState(
                vertical=zeros(slots, hs, n),
                slash=zeros(slots, hs, n),
                scale=torch.ones(slots, hs, device=device),
                mean_key=zeros(slots, hkv, d),
                mean_value=zeros(slots, hkv, d),
                query_stat=zeros(slots, hq),
                rows=shape.rows,
            )
            for _ in range(shape.num_layers)
        ]

    def view(self, layer: int, count: int) -> LfpsBatchState:
        """Rows ``0 .. count - 1`` of ``layer`` (views: the step updates the store in place)."""
        state = self.layers[layer]
        return dataclasses.replace(
            state,
            **{
                f.name: getattr(state, f.name)[:count]
                for f in dataclasses.fields(state)
                if f.name != "rows"
            },
        )

    def move(self, dst: int, src: int) -> None:
        """Row ``src`` of every layer into row ``dst``."""
        for state in self.layers:
            for f in dataclasses.fields(state):
                if f.name != "rows":
                    t = getattr(state, f.name)
                    t[dst].copy_(t[src])

    def renormalize_(self, count: int) -> None:
        for layer in range(len(self.layers)):
            self.view(layer, count).renormalize_()


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
    """One decode batch's LFPS part (host decisions, device indices)."""

    lfps_rows: torch.Tensor  # [Bl] long: batch rows that decode with LFPS, in slot order
    dense_rows: torch.Tensor  # [Bd] long: the others
    dense_rows_list: list[int]
    req_pool_indices: torch.Tensor  # [Bl]
    seq_lens: torch.Tensor  # [Bl]
    topk: int  # K
    candidates: int  # C
    width: int  # the longest row's keys (exact Top-k scores every position below it)
    sparse: object  # SparseDecodePlan of width K (None off CUDA: the references need none)


class LfpsServing:
    """The LFPS decode of one rank: slots, the prefill build and the decode step."""

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
        kernels: bool = True,
    ):
        assert mode in ("lfps", "topk"), mode
        self.mode, self.params, self.shape, self.store = mode, params, shape, store
        self.req_to_token = req_to_token
        self.min_tokens, self.candidate_factor, self.kernels = min_tokens, candidate_factor, kernels
        self.owner: list[str] = []  # rid of each row in use (row i: owner[i])
        self.row_of: dict[str, int] = {}
        self.steps = 0  # decode steps since the last renormalisation
        self.extend_rows: list[tuple[int, int, int, int, int]] = []  # per extend, see plan_extend
        self.served = 0  # requests that took a slot
        self.refused = 0  # long-enough requests that found every slot taken

    # ---- slots ---------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return len(self.owner)

    def acquire(self, rid: str) -> int | None:
        """The row of ``rid`` (a new one if it has none), or None when every row is taken."""
        row = self.row_of.get(rid)
        if row is not None:
            return row
        if self.count >= self.store.slots:
            self.refused += 1
            return None
        row = self.count
        self.owner.append(rid)
        self.row_of[rid] = row
        self.served += 1
        return row

    def release_absent(self, present: set[str]) -> None:
        """Free the rows of requests not in ``present`` (a decode batch holds every running
        request), keeping the rows in use contiguous."""
        for rid in [r for r in self.owner if r not in present]:
            row = self.row_of.pop(rid)
            last = self.count - 1
            moved = self.owner.pop()
            if row != last:
                self.store.move(row, last)
                self.owner[row] = moved
                self.row_of[moved] = row

    # ---- prefill -------------------------------------------------------------------------

    def plan_extend(self, forward_batch) -> None:
        """Take a row for every request of this extend whose prompt so far is long enough:
        ``(row, req_pool_index, seq_len, last query row + 1, extend length)`` each."""
        self.extend_rows = []
        rids = getattr(forward_batch, "rids", None)
        lens = forward_batch.extend_seq_lens_cpu
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
                pool_rows = forward_batch.req_pool_indices.tolist()
            self.extend_rows.append((row, int(pool_rows[i]), n, end, int(lens[i])))

    def wants_extend(self, forward_batch) -> bool:
        """Whether an extend batch has a prompt long enough for LFPS (it then runs eagerly)."""
        seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
        return seq_lens is not None and bool((seq_lens >= self.min_tokens).any())

    def after_extend(self, layer_id: int, q: torch.Tensor, k_buffer, v_buffer, sm_scale: float):
        """Build the state of this layer for the extend's slot holders (K/V already written).

        ``q``: [T, Hq * D] the extend's post-RoPE queries."""
        if not self.extend_rows:
            return
        shape = self.shape
        q = q.view(-1, shape.num_q_heads, shape.head_dim)
        state = self.store.layers[layer_id]
        for row, pool_row, n, end, length in self.extend_rows:
            m = min(length, self.params.history_steps)
            slots = self.req_to_token[pool_row, :n].long()
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

    # ---- decode --------------------------------------------------------------------------

    def has_rows(self, forward_batch) -> bool:
        """Whether a decode batch has a request that holds a row (such a batch runs eagerly)."""
        rids = getattr(forward_batch, "rids", None)
        return bool(rids) and any(rid in self.row_of for rid in rids)

    def plan_decode(self, forward_batch) -> DecodePlan | None:
        """Free the rows of requests that left; the plan of this batch's slot holders, or None
        when it has none."""
        rids = getattr(forward_batch, "rids", None)
        if rids is None:  # a synthetic batch (CUDA-graph capture, warm-up): no request
            return None
        self.release_absent(set(rids))
        if self.count == 0:
            return None
        index_of = {rid: i for i, rid in enumerate(rids)}
        lfps = [index_of[rid] for rid in self.owner]
        taken = set(lfps)
        dense = [i for i in range(len(rids)) if i not in taken]
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        longest = max(int(seq_lens[i]) for i in lfps)
        p = self.params
        topk = p.budget_for(longest - p.num_sink)
        candidates = min(max(topk, self.candidate_factor * topk), max(topk, longest - p.num_sink))
        dev = forward_batch.seq_lens.device
        lfps_rows = torch.tensor(lfps, dtype=torch.long, device=dev)
        sparse = None
        if self.kernels:
            from redknot.kernels.sparse_decode import plan_sparse_decode

            sparse = plan_sparse_decode(
                batch_size=len(lfps), num_q_heads=self.shape.num_q_heads,
                head_dim=self.shape.head_dim, rows=self.shape.rows, width=topk,
                num_sink=p.num_sink, device=dev,
            )  # fmt: skip
        self.steps += 1
        if self.mode == "lfps" and self.steps >= RENORMALIZE_EVERY:
            self.store.renormalize_(self.count)
            self.steps = 0
        return DecodePlan(
            lfps_rows=lfps_rows,
            dense_rows=torch.tensor(dense, dtype=torch.long, device=dev),
            dense_rows_list=dense,
            req_pool_indices=forward_batch.req_pool_indices[lfps_rows],
            seq_lens=forward_batch.seq_lens[lfps_rows],
            topk=topk,
            candidates=candidates,
            width=longest,
            sparse=sparse,
        )

    def decode(
        self, layer_id: int, q: torch.Tensor, k_buffer, v_buffer, plan: DecodePlan, sm_scale
    ) -> torch.Tensor:
        """Attention of the plan's rows in this layer: ``q`` [Bl, Hq, D] -> [Bl, Hq, D]."""
        paged = (self.req_to_token, plan.req_pool_indices, plan.seq_lens)
        p = self.params
        if self.mode == "lfps":
            from redknot.lfps.batched import LfpsBudgets, lfps_decode_step

            state = self.store.view(layer_id, self.count)
            res = lfps_decode_step(
                q, k_buffer, v_buffer, *paged, state, p,
                LfpsBudgets(candidates=plan.candidates, topk=plan.topk), sm_scale=sm_scale,
                kernels=self.kernels, plan=plan.sparse,
            )  # fmt: skip
            return res.output
        from redknot.lfps.batched import row_budgets

        if self.kernels:
            from redknot.kernels.lfps_index import exact_topk
            from redknot.kernels.sparse_decode import run_sparse_decode

            picked = exact_topk(
                q, k_buffer, *paged, k=plan.topk, num_sink=p.num_sink, sm_scale=sm_scale,
                width=plan.width, rows=self.shape.rows,
            )  # fmt: skip
        else:
            from redknot.kernels.sparse_reference import exact_topk_reference

            picked = exact_topk_reference(
                q, k_buffer, *paged, plan.topk, p.num_sink, sm_scale, rows=self.shape.rows
            )
        # exact_topk orders each list by descending score: each row keeps its own budget
        keep = torch.arange(plan.topk, device=q.device) < row_budgets(plan.seq_lens, p)[:, None]
        picked = torch.where(keep[:, None, :], picked, -1).contiguous()
        if self.kernels:
            return run_sparse_decode(plan.sparse, q, k_buffer, v_buffer, *paged, picked, sm_scale)
        from redknot.kernels.sparse_reference import sparse_decode_reference

        out, _ = sparse_decode_reference(
            q, k_buffer, v_buffer, *paged, picked, p.num_sink, sm_scale
        )
        return out
