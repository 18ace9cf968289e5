"""The SegPaged path of the redknot backend: plans a batch once, runs each layer.

Per batch (``plan``): run the queued ring/snapshot copies, plan the kernels, and compute where
the new tokens' local-head K/V go in the rings. Per layer (``extend``/``decode``): store the new
tokens' global-head K/V in their token slots, run one SegPagedAttention launch over every request
and KV head, and store the local-head K/V of the positions the rings keep.

Order inside a layer matters for extend: the kernel reads the prefix's local K/V from the ring,
so the new tokens enter the ring after the attention (a chunk longer than the window would
otherwise overwrite positions its own first tokens still need). Decode writes first: the new
token overwrites exactly the position that just left the window.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING

import torch

from redknot.attention import restore
from redknot.attention.extend_state import (
    AlignedHeads,
    ExtendState,
    HeldRows,
    LayerConsts,
    rows_per_request,
)
from redknot.attention.ffn_schedule import SCHEDULE
from redknot.attention.slots import request_slots
from redknot.attention.token_policy import TokenPolicy, kept_rows, per_request, segment_spans
from redknot.attention.trace import phase
from redknot.kernels.choose import choose_rows
from redknot.kernels.decode import DecodeWorkspace, choose_num_splits, plan_decode, run_decode
from redknot.kernels.extend import gather_tiles, plan_extend, run_extend, to_device
from redknot.kernels.geometry import LayerHeads, SegGeometry, num_sms
from redknot.kernels.key_mass import key_mass, query_heads
from redknot.kernels.rope_align import (
    AlignableRope,
    LayerStack,
    alignable_rope,
    rope_align,
    rope_align_layers,
)
from redknot.pool.kv_pool import RedknotKVPool, capture_rows
from redknot.pool.layout import HeadLayout
from redknot.recovery.cacheblend import kv_deviation
from redknot.recovery.samkv.served import ChoiceReplay, layer_choice, plan_batch
from redknot.recovery.sparseq import select_tokens
from redknot.segcache import registration, reuse
from redknot.segcache.registration import SegmentWrites
from redknot.segcache.reuse import SegmentReads

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

MAX_SPLITS = 128  # long rows of small batches split this far (measured up to 128 useful)


def model_rope(model: torch.nn.Module) -> AlignableRope:
    """The RoPE of a loaded SGLang model (its first rotary embedding), checked for alignment.

    Raises ``NotImplementedError`` naming the variant when cached segment keys cannot be
    re-rotated (then serve with ``--redknot-segment-fraction 0``)."""
    for module in model.modules():
        if type(module).__module__.startswith("sglang.srt.layers.rotary_embedding"):
            try:
                return alignable_rope(module)
            except NotImplementedError as e:
                raise NotImplementedError(
                    f"{e}; cached segments cannot be reused at new positions with this model: "
                    "start the server with --redknot-segment-fraction 0"
                ) from e
    raise NotImplementedError(
        "found no SGLang rotary embedding in the model, so cached segments cannot be re-rotated: "
        "start the server with --redknot-segment-fraction 0"
    )


class SegPagedRunner:
    def __init__(
        self,
        layout: HeadLayout,
        pool: RedknotKVPool,
        req_to_token: torch.Tensor,
        max_batch_size: int,
        max_context_len: int,
        device: torch.device,
    ):
        if not isinstance(pool, RedknotKVPool):
            raise TypeError(
                f"the redknot backend needs its own KV pool, found {type(pool).__name__}: the "
                "pool hook did not run (see the redknot plugin's startup errors)"
            )
        self.layout = layout
        self.pool = pool
        self.req_to_token = req_to_token
        self.max_context_len = max_context_len
        self.device = device
        ring = pool.ring_len > 0
        self.geo = SegGeometry.from_layout(
            layout, local_mode="ring" if ring else "token_table", ring_len=pool.ring_len
        )
        self.heads = LayerHeads.all_layers(layout, device)
        self.heavy_heads = max(layout.num_global(i) for i in range(layout.num_layers)) or 1
        self.num_sms = num_sms(device)
        self.workspace = DecodeWorkspace.sized_for(
            self.geo, max_batch_size, self.num_sms, device, max_splits=MAX_SPLITS
        )
        self._dummy = torch.zeros((1, 1, layout.head_dim), dtype=pool.dtype, device=device)
        # RoPE of the model, for re-rotating reused segment keys (set when segments are on)
        self.rope: AlignableRope | None = None
        self.consts = (
            [LayerConsts.of(layout, pool.segments.heads[i], i, device)
             for i in range(layout.num_layers)]
            if pool.segments is not None else []
        )  # fmt: skip
        # Segment reuse's layer schedule (redknot.attention.ffn_schedule); off by default
        self.dense_layers = layout.num_layers
        self.mass_thresh = 1.0
        self.recent_n = 128
        self.skipped = "cached"  # what becomes of a row that skipped a deep FFN (ffn_schedule)
        self.local_kv = "cached"  # local heads of the reused rows a layer computes: cache or fresh
        # Adaptive restore (redknot.attention.restore): on with a threshold and restore columns
        self.restore_thresh: float | None = None
        self.restore_edge = 32
        self._local_queries = [
            query_heads(layout.local_heads(i), layout.group_size, device).long()
            for i in range(layout.num_layers)
        ] if layout.restore else []  # fmt: skip
        self.policy: TokenPolicy | None = None  # a token-level policy (token_policy); None: redknot
        self.tp_size = 1
        self.samkv_graphs = True  # SamKV's choice replayed as a CUDA graph (ChoiceReplay)
        # Token policies' reusing extends on FlashInfer (use_flashinfer): SGLang's FlashInfer
        # backend, and the held rows' attention (redknot.kernels.held_rows.HeldRowsAttention)
        self.flashinfer = None
        self.held_attention = None
        self._arange = torch.arange(max_context_len, device=device)
        self.decode_plan = None
        self.decode_rows: torch.Tensor | None = None  # [B] int64 ring rows of the new tokens
        self.graph_plans: dict[int, object] = {}
        self.graph_rows: torch.Tensor | None = None
        self.extend_state: ExtendState | None = None
        self.dense_writes: SegmentWrites | None = None  # a FlashInfer batch's (plan_dense)
        # Segment writes at their stored positions: rope_align with equal positions copies rows
        # bit for bit and never uses its table's values, so one row of zeros serves any model
        self._copy_table = torch.zeros((1, layout.head_dim), dtype=torch.float32, device=device)
        self._zeros = torch.zeros(4096, dtype=torch.int64, device=device)

    @classmethod
    def from_model_runner(cls, model_runner, layout: HeadLayout) -> SegPagedRunner:
        req_pool = model_runner.req_to_token_pool
        runner = cls(
            layout,
            model_runner.token_to_kv_pool,
            req_pool.req_to_token,
            max_batch_size=req_pool.size + 1,
            max_context_len=model_runner.model_config.context_len,
            device=torch.device(model_runner.device),
        )
        if runner.pool.segments is not None:
            cls.check_segment_dtype(runner.pool.dtype, model_runner.dtype)
            runner.rope = model_rope(model_runner.model)
        return runner

    @staticmethod
    def check_segment_dtype(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
        """Reused segment K/V is re-rotated straight into the layer's K/V: the cache must keep
        the model's dtype."""
        if kv_dtype != model_dtype:
            raise ValueError(
                f"segment reuse needs the KV cache in the model's dtype ({model_dtype}), got "
                f"{kv_dtype}: start the server with --kv-cache-dtype auto, or with "
                "--redknot-segment-fraction 0 to serve without cached segments"
            )

    def use_flashinfer(self, dense, held_attention) -> None:
        """Run the attention of a token policy's reusing extends on FlashInfer (every head
        global; ``dense``: SGLang's FlashInfer backend over the same pool; ``held_attention``:
        a :class:`redknot.kernels.held_rows.HeldRowsAttention`). A layer that computes every
        row runs SGLang's FlashInfer extend on the layer's K/V; a layer that computes only the
        held rows writes their K/V into the pool, where the left rows' cached, re-aligned K/V
        already is (:meth:`_align_left_layers`), then attends the held rows as runs
        (:meth:`_extend_on_flashinfer`). Batches that
        register or capture segments keep the Triton kernel (:meth:`_serves_on_flashinfer`), and
        held rows that runs do not suit (``redknot.kernels.held_rows.runs_pay``) too."""
        self.flashinfer, self.held_attention = dense, held_attention

    # ---- planning ----------------------------------------------------------------------------

    @property
    def restores(self) -> bool:
        """Whether this server promotes local heads (adaptive restore)."""
        return bool(self.layout.restore) and self.restore_thresh is not None

    def begin_forward(self) -> None:
        """What every forward starts with, whichever kernels run it: the queued ring/snapshot
        copies, no promoted head, an empty layer schedule."""
        self.pool.pending.run(self.pool)
        self.pool.reset_promoted()
        SCHEDULE.reset()
        SCHEDULE.last_layer = self.layout.num_layers - 1
        self.dense_writes = None

    def needs_kernels(self, fb: ForwardBatch) -> bool:
        """Whether a request of this batch reads cached segments or captures a ring snapshot:
        only such an extend needs these kernels when every head is global. The others are
        dense attention, those that fill segments (registrations, captures) included: they run
        on FlashInfer and write their segments after each layer (:meth:`plan_dense`). No device
        sync while no request of the server has such work."""
        pool = self.pool
        work = (pool.segment_reads, pool.capture_jobs)
        if not any(work):
            return False
        return any(rpi in w for rpi in request_slots(fb) for w in work)

    def plan_dense(self, fb: ForwardBatch) -> None:
        """A batch that FlashInfer runs: the forward's start, and the segment writes of the
        registrations it computes (``dense_writes``; :meth:`write_segments` after each layer)."""
        self.begin_forward()
        mode = fb.forward_mode
        if not self.pool.segment_jobs or mode not in (mode.EXTEND, mode.MIXED):
            return
        rpis = request_slots(fb)
        if any(rpi in self.pool.segment_jobs for rpi in rpis):
            self.dense_writes = registration.plan_writes(
                self.pool, rpis, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, self.device
            )

    def write_segments(self, layer: RadixAttention, k, v) -> None:
        """A FlashInfer batch's segment writes of one layer (``k``, ``v``: the layer's new K/V)."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        self._write_segments(layer.layer_id, k.view(-1, H, D), v.view(-1, H, D), self.dense_writes)

    def plan(self, fb: ForwardBatch, for_graph: bool = False, in_capture: bool = False) -> None:
        self.begin_forward()
        mode = fb.forward_mode
        if mode.is_idle():
            return
        if mode.is_decode():
            if for_graph:
                self._plan_graph_decode(fb, in_capture)
            else:
                self._plan_decode(fb)
        elif mode in (mode.EXTEND, mode.MIXED):
            self._plan_extend(fb)
        else:
            raise NotImplementedError(f"redknot does not serve forward mode {mode.name}")

    def rows_vary(self, fb: ForwardBatch) -> bool:
        """Whether the rows some layer of this extend computes depend on its requests: a request
        of the batch reuses cached segments and the layer schedule or a token policy is on."""
        if not self.pool.segment_reads or (
            self.policy is None and self.dense_layers >= self.layout.num_layers
        ):
            return False
        reads = self.pool.segment_reads
        return any(rpi in reads for rpi in request_slots(fb))

    def _plan_decode(self, fb: ForwardBatch) -> None:
        self.decode_plan = plan_decode(
            self.geo,
            self.workspace,
            fb.seq_lens,
            fb.req_pool_indices,
            seq_lens_cpu=fb.seq_lens_cpu,
            heavy_heads=self.heavy_heads,
            num_sms=self.num_sms,
        )
        self.decode_rows = self._ring_rows(fb.req_pool_indices, fb.seq_lens - 1)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_rows = torch.zeros(max_bs, dtype=torch.int64, device=self.device)

    def _plan_graph_decode(self, fb: ForwardBatch, in_capture: bool) -> None:
        bs = fb.batch_size
        if in_capture or bs not in self.graph_plans:
            # The plan keeps the graph's static seq_lens / req_pool_indices by reference; the
            # split count is fixed per captured batch size (each program sizes its own chunk).
            splits = choose_num_splits(
                bs, self.max_context_len, self.heavy_heads,
                num_sms=self.num_sms, max_splits=MAX_SPLITS,
            )  # fmt: skip
            self.graph_plans[bs] = plan_decode(
                self.geo, self.workspace, fb.seq_lens[:bs], fb.req_pool_indices[:bs],
                num_splits=splits,
            )  # fmt: skip
        self.decode_plan = self.graph_plans[bs]
        self.decode_rows = self.graph_rows[:bs]

    def plan_in_graph(self, fb: ForwardBatch) -> None:
        """Recorded into the decode graph: the new tokens' ring rows from the static buffers."""
        if fb.forward_mode.is_decode() and self.pool.ring_len:
            bs = fb.batch_size
            self.graph_rows[:bs].copy_(
                self._ring_rows(fb.req_pool_indices[:bs], fb.seq_lens[:bs] - 1)
            )

    def _plan_extend(self, fb: ForwardBatch) -> None:
        prefix_cpu = fb.extend_prefix_lens_cpu
        lens_cpu = fb.extend_seq_lens_cpu
        plan = plan_extend(self.geo, fb.req_pool_indices, prefix_cpu, lens_cpu)
        keep_tokens = keep_rows = None
        if self.pool.ring_len:
            keep_tokens, positions, reqs = self._ring_keep(prefix_cpu, lens_cpu)
            keep_tokens = keep_tokens.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True)
            reqs = reqs.to(self.device, non_blocking=True)
            keep_rows = self._ring_rows(fb.req_pool_indices[reqs], positions)
        capture = self._plan_captures(fb, prefix_cpu, lens_cpu) if self.pool.capture_jobs else None
        writes = reads = rpis = None
        if self.pool.segment_jobs or self.pool.segment_reads:
            rpis = request_slots(fb)
        if self.pool.segment_jobs:
            writes = registration.plan_writes(self.pool, rpis, prefix_cpu, lens_cpu, self.device)
        if self.pool.segment_reads:
            reads = reuse.plan_reads(
                self.pool, rpis, prefix_cpu, lens_cpu, self.device, self.recent_n
            )
        self.extend_state = ExtendState(
            plan, keep_tokens, keep_rows, capture, writes, reads, req_pool_indices=rpis
        )
        if self.layout.restore:  # every row's request, for its restore columns
            per_row = torch.repeat_interleave(
                torch.arange(len(lens_cpu)), torch.as_tensor(lens_cpu)
            )
            self.extend_state.row_req = fb.req_pool_indices[to_device(per_row, self.device)]
        if reads is not None and self.restores:
            self.extend_state.restore = restore.plan_restore(
                reads, rpis, plan.qo_indptr_cpu, self.layout.sink, self.layout.window,
                self.restore_edge, self.device,
            )  # fmt: skip
        state = self.extend_state
        if self._serves_on_flashinfer(fb, state):
            state.on_flashinfer, state.out_cache_loc = True, fb.out_cache_loc
        if reads is not None and self.policy is not None and self.policy.chooses_at_plan:
            self._keep(self.policy.planned_kept(reads.pos_off_cpu, reads.middle_cpu), 0)
            if self.policy.name == "samkv" and reads.middle_cpu is not None:
                self._plan_samkv(rpis, prefix_cpu, lens_cpu)
        if state.on_flashinfer and (state.held is None or not self.policy.chooses_at_plan):
            self.flashinfer.init_forward_metadata(fb)  # some layer computes every row

    def _serves_on_flashinfer(self, fb: ForwardBatch, state: ExtendState) -> bool:
        """Whether this extend's attention runs on FlashInfer (:meth:`use_flashinfer`): a
        token policy's reuse (not SamKV's, whose rows change per layer) in a plain extend
        batch that neither writes segments, captures a snapshot, keeps ring rows nor restores."""
        return (
            self.held_attention is not None
            and state.segment_reads is not None
            and self.policy is not None
            and self.policy.name != "samkv"
            and self.dense_layers >= self.layout.num_layers
            and fb.forward_mode == fb.forward_mode.EXTEND
            and state.capture is None
            and state.segment_writes is None
            and state.keep_tokens_gpu is None
            and state.restore is None
        )

    def _plan_held(self, keep_cpu: torch.Tensor) -> None:
        """Rows leave recovery in a batch on FlashInfer: plan the held rows' attention as runs
        (``state.held_plan``); where runs do not pay, the held layers keep the Triton kernel."""
        state, plan = self.extend_state, self.extend_state.plan
        try:
            state.held_plan = self.held_attention.plan(
                keep_cpu, plan.qo_indptr_cpu, plan.prefix_lens_cpu, plan.req_pool_indices_gpu,
                self.req_to_token, plan.config.block_q(self.layout.group_size),
            )  # fmt: skip
        except RuntimeError as e:  # served on the Triton kernel from here on, said once
            self.held_attention = None
            logger.warning("redknot: planning the rows in recovery on FlashInfer failed (%s); "
                           "they attend on redknot's Triton kernel from now on", e)  # fmt: skip

    def _plan_samkv(self, rpis: list[int], prefix_cpu, lens_cpu) -> None:
        """SamKV's inputs of every layer's choice (``redknot.recovery.samkv.served``), after
        the anchors were kept (:meth:`_keep`: the middle slots left recovery before layer 0)."""
        state = self.extend_state
        reads, keep = state.segment_reads, state.keep_cpu
        if keep is None:  # nothing left: every middle slot is some request's last row
            return
        uses = [self.pool.segment_reads.get(rpi, ()) for rpi in rpis]
        leaving = ~keep[reads.tokens_cpu]
        state.samkv, skipped = plan_batch(
            uses, [int(x) for x in prefix_cpu], [int(x) for x in lens_cpu], keep,
            reads.tokens_cpu, leaving, self.policy.samkv.bias, self.rope.cos_sin_cache,
            self.rope.is_neox, self.device,
        )  # fmt: skip
        if skipped:
            logger.info(
                "redknot samkv: %d request(s) of this extend keep the blocks their prompt was cut "
                "with (the extend does not hold their documents and question together)",
                len(skipped),
            )

    def _plan_captures(self, fb: ForwardBatch, prefix_cpu, lens_cpu):
        """Rows of the snapshot captures whose branch point this extend computes."""
        rows: tuple[list[int], ...] = ([], [], [], [])
        offset = 0
        for rpi, p, e in zip(request_slots(fb), list(prefix_cpu), list(lens_cpu)):
            job = self.pool.capture_jobs.get(rpi)
            if job is not None and int(p) < job.position <= int(p) + int(e):
                for acc, part in zip(rows, capture_rows(self.pool, job, rpi, int(p), offset)):
                    acc.extend(part)
                cache = getattr(self.pool, "cache", None)
                if cache is not None:
                    cache.capture_issued(rpi)
                else:
                    self.pool.capture_jobs.pop(rpi)
            offset += int(e)
        if not rows[0] and not rows[2]:
            return None
        return tuple(torch.tensor(r, dtype=torch.int64).to(self.device) for r in rows)

    def _ring_keep(self, prefix_cpu, lens_cpu):
        """New tokens a ring keeps after the extend: the sink and the last ``window``."""
        sink, window = self.layout.sink, self.layout.window
        tokens, positions, reqs = [], [], []
        start = 0
        for b, (p, e) in enumerate(zip(list(prefix_cpu), list(lens_cpu))):
            p, e = int(p), int(e)
            end = p + e
            keep = list(range(p, min(sink, end))) + list(range(max(p, sink, end - window), end))
            tokens += [start + pos - p for pos in keep]
            positions += keep
            reqs += [b] * len(keep)
            start += e
        as_t = lambda x: torch.tensor(x, dtype=torch.int64)
        return as_t(tokens), as_t(positions), as_t(reqs)

    def _ring_rows(self, req_pool_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.pool.local_rows(req_pool_indices.to(torch.int64), positions.to(torch.int64))

    # ---- running -----------------------------------------------------------------------------

    def stores(self, layer_id: int):
        """The layer's four stores as the kernels take them (global K, V, local K, V; a small
        stand-in where the layer has no head of a class)."""
        g = self.layout.global_columns(layer_id)
        loc = self.layout.num_local(layer_id)
        kg = self.pool.k_global[layer_id] if g else self._dummy
        vg = self.pool.v_global[layer_id] if g else self._dummy
        kl = self.pool.k_local[layer_id] if loc else self._dummy
        vl = self.pool.v_local[layer_id] if loc else self._dummy
        return kg, vg, kl, vl

    @staticmethod
    def _check_layer(layer: RadixAttention) -> None:
        if layer.logit_cap or layer.is_cross_attention or layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError(
                "redknot serves causal self-attention without logit capping and with equal "
                "K/V head dims"
            )

    def _views(self, q, k, v, layer: RadixAttention):
        """[T, Hq, D] queries and [T, H_kv, D] keys/values of one layer call."""
        self._check_layer(layer)
        H, Hq, D = self.layout.num_kv_heads, self.layout.num_q_heads, self.layout.head_dim
        return q.reshape(-1, Hq, D), k.view(-1, H, D), v.view(-1, H, D)

    def extend(self, q, k, v, layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool):
        lid = layer.layer_id
        q, k, v = self._views(q, k, v, layer)
        state = self.extend_state
        SCHEDULE.layer = lid
        with phase("redknot.held_rows"):
            held = self._held_rows(state)  # None: every row
        on_flashinfer = state.on_flashinfer and (held is None or state.held_plan is not None)
        if on_flashinfer and save_kv_cache and not layer.logit_cap:
            out = self._extend_on_flashinfer(q, k, v, layer, fb, held)
            self._after_attention(lid, q, k, v, layer, held, save_kv_cache)
            return out
        if held is not None:  # q stays as it is: the gathered plan reads and writes held rows
            with phase("redknot.spread"):
                k, v = self._spread(k, held), self._spread(v, held)
        probing = state.restore is not None and self.layout.num_local(lid) > 0
        fresh = None
        if probing and self.local_kv == "cached" and state.restore.probes:
            with phase("redknot.restore_save"):  # the projections the re-alignment replaces
                tok, li = state.segment_reads.tokens_gpu[:, None], self.pool.local_index[lid]
                fresh = (k[tok, li], v[tok, li])  # [N, L_l, D] each, one gather
        if state.segment_reads is not None:
            left = None
            if state.samkv is not None and held is not None:
                with phase("redknot.samkv_choice"):
                    left = self._samkv_choice(lid, q, held.left)
            with phase("redknot.reuse_kv"):
                self._reuse_kv(lid, k, v, state.segment_reads, held, left)
        if probing:
            with phase("redknot.restore"):
                self._restore(lid, q, k, v, fresh, held, layer.scaling)
        out = q.new_empty(q.shape)
        plan = state.plan if held is None else held.plan  # only the rows in recovery
        reads = state.segment_reads
        schedules = (
            reads is not None and bool(reads.sparse) and lid >= self.dense_layers and save_kv_cache
        )
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if schedules else None
        # the kernel reads this extend's keys from k / v, the stores only below the prefix:
        # launched before the stores are written, so that the GPU starts early
        with phase("redknot.extend_kernel"):
            run_extend(
                plan, q, k.to(q.dtype), v.to(q.dtype), *self.stores(lid), self.req_to_token,
                self.heads[lid], layer.scaling, out=out, lse=lse,
                promoted=self.pool.promoted_of(lid),
            )  # fmt: skip
        if save_kv_cache:
            with phase("redknot.write_global"):
                self.pool.write_global(lid, fb.out_cache_loc, k, v)
                if self.layout.restore:
                    self.pool.write_restored(lid, fb.out_cache_loc, state.row_req, k, v)
        with phase("redknot.local_writes"):
            self._write_local(lid, k, v, state, save_kv_cache)
        if schedules:
            with phase("redknot.schedule_ffn"):
                self._schedule_ffn(lid, q, lse, layer.scaling, reads)
        if state.restore is not None and lid == self.layout.num_layers - 1:
            self._log_restore(state.restore)
        self._after_attention(lid, q, k, v, layer, held, save_kv_cache)
        return out.flatten(1)

    def _after_attention(self, lid: int, q, k, v, layer, held, save_kv_cache: bool) -> None:
        """A token policy's choice in its choice layer, and its log line after the last."""
        reads = self.extend_state.segment_reads
        if reads is None or self.policy is None:
            return
        if lid == self.policy.select_layer and save_kv_cache:
            assert held is None, "a policy chooses before any row leaves"
            with phase("redknot.policy_choice"):
                if self.policy.name == "cacheblend":
                    self._blend(lid, k, v, reads)
                else:
                    self._sparsex(lid, q, layer.scaling, reads)
        if lid == self.layout.num_layers - 1:
            self._log_policy(reads)

    def _extend_on_flashinfer(self, q, k, v, layer: RadixAttention, fb, held) -> torch.Tensor:
        """A layer of a reusing extend on FlashInfer (:meth:`use_flashinfer`); returns
        ``[rows, Hq * D]``. Every row computed (``held`` None): SGLang's FlashInfer extend,
        which also stores the K/V. Held rows only: their K/V goes into the pool first, and the
        left rows' cached K/V (re-rotated to their positions, every head) unless it is there
        already (:meth:`_align_left_layers`), then the runs attend it."""
        lid = layer.layer_id
        if held is None:
            with phase("redknot.flashinfer_extend"):
                return self.flashinfer.forward_extend(q, k, v, layer, fb, save_kv_cache=True)
        state, pool = self.extend_state, self.pool
        with phase("redknot.write_global"):
            pool.write_global(lid, state.held_loc, k, v)
        left, heads = held.left, self.left_heads(lid)
        aligned = state.left_from is not None and lid >= state.left_from
        if left.tokens_gpu.numel() and len(heads) and not aligned:
            with phase("redknot.reuse_kv"):
                self._align(lid, pool.k_global[lid], pool.v_global[lid], heads, left,
                            dst_rows=state.left_loc)  # fmt: skip
        with phase("redknot.extend_kernel"):
            out = self.held_attention.run(q, pool.k_global[lid], pool.v_global[lid], layer.scaling)
        return out.flatten(1)

    def _restore(self, lid: int, q, k, v, fresh, held: HeldRows | None, scale: float) -> None:
        """Adaptive restore in layer ``lid`` (:mod:`redknot.attention.restore`): probe each
        completing request's newest rows, promote its local heads over the threshold and,
        under ``local_kv="cached"``, put this prompt's projections (``fresh``: K, V of the
        reused tokens' local heads) back for the promoted heads. ``q``: the rows this layer
        computes; ``k``/``v``: every row."""
        state = self.extend_state
        lay = self.layout
        li = self.pool.local_index[lid]
        column = self.heads[lid].column_gpu
        shape = (lay.num_local(lid), lay.group_size, lay.head_dim)
        for probe in state.restore.probes:
            spec = probe.spec
            row0 = (spec.rows_of(spec.probe_start) if held is None
                    else held.first_row(spec.index, spec.num_probe))  # fmt: skip
            q_probe = q[row0 : row0 + spec.num_probe][:, self._local_queries[lid]]
            keys = k[probe.key_rows[:, None], li]  # [U, L_l, D]
            mass = restore.edge_mass(q_probe.view(-1, *shape), keys, probe, scale)
            restore.promote(self.pool.promoted[spec.req_pool_idx, lid], mass, li,
                            self.restore_thresh)  # fmt: skip
        if fresh is not None:
            reads = state.segment_reads
            heads = self.pool.promoted[state.restore.token_req, lid]
            computed = None if held is None else held.mask
            restore.keep_fresh((k, v), fresh, reads.tokens_gpu, heads, column, computed)

    def _log_restore(self, plan: restore.RestorePlan) -> None:
        """The extend's promotions (one host synchronisation, after the last layer)."""
        slots = [p.spec.req_pool_idx for p in plan.probes]
        promoted = int((self.pool.promoted[slots] >= 0).sum()) if slots else 0
        logger.info(
            "redknot restore: %d local heads promoted (layer, head pairs) in %d request(s); "
            "%d reusing request(s) served without restore (a cached prefix, or a prompt split "
            "by chunked prefill: --chunked-prefill-size -1 keeps prompts whole)",
            promoted, len(slots), len(plan.refused),
        )  # fmt: skip

    def _write_local(self, lid: int, k, v, state: ExtendState, save_kv_cache: bool) -> None:
        """After the attention: snapshot captures, the ring's new positions, registered
        segments' K/V."""
        if not save_kv_cache:
            return
        if state.capture is not None:
            dst_ring, src_ring, dst_new, src_tok = state.capture
            self.pool.copy_local_rows(lid, dst_ring, src_ring)
            self.pool.write_local(lid, dst_new, k[src_tok], v[src_tok])
        if state.keep_rows_gpu is not None:
            idx = state.keep_tokens_gpu
            self.pool.write_local(lid, state.keep_rows_gpu, k[idx], v[idx])
        if state.segment_writes is not None:
            self._write_segments(lid, k, v, state.segment_writes)

    def _write_segments(self, lid: int, k, v, writes: SegmentWrites) -> None:
        """Registered segments' K/V of one layer into the region (``k``, ``v``: [T, H_kv, D]):
        one launch gathers the batch rows, rotates the keys of a capture after its context back
        to positions from 0 (others are copied bit for bit) and writes keys and values of the
        region's heads."""
        region = self.pool.segments
        if not region.heads[lid]:
            return
        n = writes.tokens_gpu.numel()
        if writes.pos_gpu is None:  # stored positions: equal positions copy bit for bit
            pos_off = pos_on = self._zero_positions(n)
            table, is_neox = self._copy_table, True
        else:
            pos_off, pos_on = writes.pos_gpu[0], writes.pos_gpu[1]
            table, is_neox = self.rope.cos_sin_cache, self.rope.is_neox
        heads = self.consts[lid].stored if len(region.heads[lid]) != k.shape[1] else None
        rope_align(
            k, writes.tokens_gpu, region.k[lid], writes.rows_gpu, pos_off, pos_on, table,
            is_neox=is_neox, v_src=v, v_dst=region.v[lid],
            src_heads=None if heads is None else heads.heads,
            dst_heads=None if heads is None else heads.cols,
        )  # fmt: skip

    def _zero_positions(self, n: int) -> torch.Tensor:
        """``n`` zero positions (int64, on the device), from a buffer grown as needed."""
        if self._zeros.numel() < n:
            self._zeros = self._zeros.new_zeros(1 << (n - 1).bit_length())
        return self._zeros[:n]

    @staticmethod
    def _held_rows(state: ExtendState) -> HeldRows | None:
        """The rows the current layer computes (``SCHEDULE.held``; None: every row)."""
        if SCHEDULE.held is None:
            return None
        assert state.held is not None and state.held.rows is SCHEDULE.held
        return state.held

    @staticmethod
    def _spread(x: torch.Tensor, held: HeldRows) -> torch.Tensor:
        """``x`` of the held rows placed at their batch rows of a zero ``[T, ...]``."""
        full = x.new_zeros((held.mask.shape[0], *x.shape[1:]))
        full[held.rows] = x
        return full

    def _probe_mass(self, lid: int, q, lse, scale: float, spec, held) -> torch.Tensor:
        """Attention mass of the probed queries on every key of ``spec``'s request, summed over
        the layer's global heads (zero when the rank holds none), from the layer's queries
        ``q`` and their LSE ``lse`` (the rows this layer computes: ``held``'s, or every row)."""
        num_probe = spec.num_probe
        if held is None:
            row0 = spec.rows_of(spec.probe_start)
        else:  # the probed rows are the request's last rows, always held
            row0 = held.first_row(spec.index, num_probe)
        g = self.layout.num_global(lid)  # not the restore columns: the map's global heads vote
        store = self.pool.k_global[lid][:, :g] if g else self._dummy[:, :0]
        return key_mass(
            q, lse, store, self.req_to_token, spec.req_pool_idx, row0, spec.probe_start,
            num_probe, spec.prefix + spec.length, self.consts[lid].global_queries, scale,
        )  # fmt: skip

    def _schedule_ffn(self, lid: int, q, lse, scale: float, reads: SegmentReads) -> None:
        """Decide which rows of this layer run the FFN (after the layer's global K/V is stored),
        and under ``skipped="cached"`` which rows leave recovery from the next layer on.

        ``q``, ``lse``: this layer's queries and their attention LSE, of the rows it computes.
        Each reusing request's choice clears its skipping rows in the layer's keep mask and
        counts them on the device (:func:`redknot.kernels.choose.choose_rows`); the one host
        synchronisation reads those counts."""
        state = self.extend_state
        num_rows = state.plan.num_tokens
        held = self._held_rows(state)
        # without tensor parallelism the rank's global heads vote (each probe spreads a mass of
        # one over the keys), or nobody does; summed over ranks, it may be nobody
        voting = self.layout.num_global(lid) > 0
        sparse = reads.sparse if voting or self.tp_size > 1 else ()
        if held is None:  # every row in recovery, none left yet
            indptr, left_before = state.plan.qo_indptr_cpu.tolist(), 0
        else:
            indptr, left_before = held.plan.rows_indptr_cpu.tolist(), held.left.tokens_gpu.numel()
        counts_cpu = [b - a for a, b in itertools.pairwise(indptr)]  # rows of each request
        if sparse:
            if held is None:
                keep = torch.ones(num_rows, dtype=torch.bool, device=q.device)
            else:
                keep = held.mask.clone()
            skipped = torch.zeros(len(sparse), dtype=torch.int32, device=q.device)
            for i, spec in enumerate(sparse):
                with phase("redknot.importance_mass"):
                    mass = self._probe_mass(lid, q, lse, scale, spec, held)
                    if self.tp_size > 1:  # every rank must skip the same rows (MLP all-reduce)
                        mass = self._sum_over_ranks()(mass)
                with phase("redknot.importance_select"):
                    choose_rows(mass, spec.candidates, spec.candidate_rows, self.mass_thresh,
                                keep, skipped, i, check_votes=self.tp_size > 1)  # fmt: skip
            with phase("redknot.sync"):
                gone = skipped.tolist()
            for spec, n in zip(sparse, gone):
                counts_cpu[spec.index] -= n
        kept = sum(counts_cpu)
        computed = num_rows if held is None else held.rows.numel()
        SCHEDULE.skipped += computed - kept
        if kept < computed:
            if self.skipped == "cached":  # the segment tokens outside the kept rows leave
                leaving = ~keep[reads.tokens_gpu]
                rows = self._hold(keep, counts_cpu, leaving, left_before + computed - kept)
            else:
                rows = torch.nonzero_static(keep, size=kept)[:, 0]
            # the MLP sees the rows this layer computes: index into them
            SCHEDULE.rows[lid] = (
                rows if held is None else torch.nonzero_static(keep[held.rows], size=kept)[:, 0]
            )
        if lid == self.layout.num_layers - 1:
            logger.info(
                "redknot sparse FFN: %d token-layer FFNs skipped in layers %d-%d of this "
                "extend (%d tokens); %d token-layers left to the cache (skipped=%s)",
                SCHEDULE.skipped,
                self.dense_layers,
                lid,
                num_rows,
                SCHEDULE.left,
                self.skipped,
            )

    def _hold(self, keep, counts_cpu: list[int], leaving, num_left: int) -> torch.Tensor:
        """From the next layer on only ``keep`` (``[T]`` bool on the device; ``counts_cpu[b]``
        rows of request ``b``) stays in recovery: the decoder-layer hook compacts to those rows,
        and every head of the reused tokens ``leaving`` (``[R]`` bool, ``num_left`` of them)
        takes the cached K/V. The Triton kernel's tiles are planned over the rows unless they
        attend on FlashInfer (``state.held_plan``). Returns the rows on the device; no host
        synchronisation."""
        state = self.extend_state
        reads = state.segment_reads
        rows = torch.nonzero_static(keep, size=sum(counts_cpu))[:, 0]
        left = torch.nonzero_static(leaving, size=num_left)[:, 0]
        tiles = gather_tiles(state.plan, rows, counts_cpu) if state.held_plan is None else None
        state.held = HeldRows(rows, keep, tiles, reads.select(left))
        SCHEDULE.target = rows
        return rows

    def _keep(self, kept, first_layer: int) -> None:
        """A token policy's choice (``kept``: ``[R]`` bool over the reads, on the host): the
        rows outside it leave recovery from layer ``first_layer`` on (the next layer; 0 when
        planning)."""
        state = self.extend_state
        reads, plan = state.segment_reads, state.plan
        keep_cpu = kept_rows(plan.num_tokens, reads.tokens_cpu, kept, plan.qo_indptr_cpu)
        state.kept_tokens = int(kept.sum())
        counts = rows_per_request(keep_cpu, plan.qo_indptr_cpu).tolist()
        if sum(counts) < plan.num_tokens:
            state.keep_cpu = keep_cpu
            device = reads.tokens_gpu.device
            leaving = ~keep_cpu[reads.tokens_cpu]  # not ~kept: each request's last row stays
            if state.on_flashinfer:  # before the rows are held: runs need no tiles
                self._plan_held(keep_cpu)
            self._hold(to_device(keep_cpu, device), counts, to_device(leaving, device),
                       int(leaving.sum()))  # fmt: skip
            if state.held_plan is not None:
                state.held_loc = state.out_cache_loc[state.held.rows]
                state.left_loc = state.out_cache_loc[state.held.left.tokens_gpu]
                self._align_left_layers(first_layer)

    def _align_left_layers(self, first: int) -> None:
        """On FlashInfer, the rows that left take their cached K/V, re-rotated, in the pool of
        every layer from ``first`` on, in one launch (``rope_align_layers``): the held layers
        then only store their own rows. What those rows take is the cache's K/V, not anything
        a layer computes, so it can be written before the layers run. Skipped (a launch per
        layer instead) where the layers' buffers or head maps differ."""
        state, stacks = self.extend_state, self._left_stacks
        left = state.held.left
        if stacks is None or first >= self.layout.num_layers or not left.tokens_gpu.numel():
            return
        k_src, k_dst, v_src, v_dst, heads = stacks
        rope_align_layers(
            k_src.select(first), left.rows_gpu, k_dst.select(first), state.left_loc,
            left.pos_off_gpu, left.pos_on_gpu, self.rope.cos_sin_cache, is_neox=self.rope.is_neox,
            rotary_dim=self.rope.rotary_dim, v_src=v_src.select(first), v_dst=v_dst.select(first),
            src_heads=heads.cols, dst_heads=heads.heads,
        )  # fmt: skip
        state.left_from = first

    @functools.cached_property
    def _left_stacks(self):
        """The region's and the pool's per-layer K/V as layer stacks on one device, with the
        heads that leave (the same in every layer); None where layers differ. Built once."""
        heads = [self.left_heads(i) for i in range(self.layout.num_layers)]
        if not len(heads[0]) or not all(
            torch.equal(h.cols, heads[0].cols) and torch.equal(h.heads, heads[0].heads)
            for h in heads
        ):
            return None
        pool, region = self.pool, self.pool.segments
        try:
            stacks = [LayerStack.of(t) for t in (region.k, pool.k_global, region.v,
                                                 pool.v_global)]  # fmt: skip
        except ValueError:
            return None
        return (*stacks, heads[0]) if len({x.first.device for x in stacks}) == 1 else None

    def _blend(self, lid: int, k, v, reads: SegmentReads) -> None:
        """CacheBlend's choice in its check layer: the KV deviation of every reused token's
        fresh K/V (``k``, ``v``: [T, H_kv, D]) from its cached, re-aligned K/V, every head."""
        region = self.pool.segments
        n = reads.rows_gpu.numel()
        cached_k = region.k[lid].new_empty((n, *region.k[lid].shape[1:]))
        cached_v = region.v[lid].new_empty((n, *region.v[lid].shape[1:]))
        rope_align(
            region.k[lid], reads.rows_gpu, cached_k, self._arange[:n], reads.pos_off_gpu,
            reads.pos_on_gpu, self.rope.cos_sin_cache, is_neox=self.rope.is_neox,
            rotary_dim=self.rope.rotary_dim, v_src=region.v[lid], v_dst=cached_v,
        )  # fmt: skip
        heads = region.head_index[lid]  # every head (startup requires segment heads 'all')
        tok = reads.tokens_gpu
        fresh_k, fresh_v = k[tok][:, heads], v[tok][:, heads]
        deviation = kv_deviation(
            *(x.transpose(0, 1) for x in (fresh_k, fresh_v, cached_k, cached_v))
        )
        if self.tp_size > 1:  # every rank must keep the same rows: sum over every rank's heads
            deviation = self._sum_over_ranks()(deviation)
        plan = self.extend_state.plan
        kept = self.policy.blend_kept(deviation, tok, reads.tokens_cpu, plan.qo_indptr_cpu)
        self._keep(kept.cpu(), lid + 1)  # the choice's one host synchronisation

    def _sparsex(self, lid: int, q, scale: float, reads: SegmentReads) -> None:
        """SparseX's choice in the last full layer, per request: its sparse-Q set from this
        layer's queries (``q``: [T, Hq, D]; a token-level policy serves every head global, so
        every query head scores) and every key they attend (the global store)."""
        state, policy = self.extend_state, self.policy
        plan = state.plan
        qo, prefix = plan.qo_indptr_cpu.tolist(), plan.prefix_lens_cpu.tolist()
        # every rank must keep the same rows: scores summed over every rank's heads
        reduce = self._sum_over_ranks() if self.tp_size > 1 else None
        kept = torch.zeros(reads.tokens_cpu.shape[0], dtype=torch.bool)
        for b, mine in per_request(reads.tokens_cpu, plan.qo_indptr_cpu):
            start, end, past = qo[b], qo[b + 1], prefix[b]
            order = mine[reads.tokens_cpu[mine].argsort()]
            rows = reads.tokens_cpu[order] - start
            spans = segment_spans(rows, reads.pos_off_cpu[order])
            slots = self.req_to_token[state.req_pool_indices[b], : past + end - start].long()
            selection = select_tokens(
                q[start:end].transpose(0, 1), self.pool.k_global[lid][slots].transpose(0, 1),
                spans, past_len=past, classes="G" * self.layout.num_global(lid),
                window=self.layout.window, sink=self.layout.sink, scale=scale,
                k=policy.sparseq_k, block=policy.sparseq_block, reduce=reduce,
            )  # fmt: skip
            kept[order] = selection.recompute.cpu()[rows]
        self._keep(kept, lid + 1)

    @staticmethod
    def _sum_over_ranks():
        """The all-reduce (sum) over the tensor-parallel ranks, for choices every rank must
        make alike from scores of its own heads."""
        from sglang.srt.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce

    def _log_policy(self, reads: SegmentReads) -> None:
        state = self.extend_state
        kept = state.kept_tokens
        logger.info(
            "redknot policy %s: %d of %d reused segment tokens recomputed; %d "
            "token-layers left to the cache; attention %s",
            self.policy.name,
            max(kept, 0),
            reads.tokens_gpu.numel(),
            SCHEDULE.left,
            self._attention_path(state),
        )

    def _attention_path(self, state: ExtendState) -> str:
        """Which kernels attended this extend (its policy's log line)."""
        if not state.on_flashinfer:
            return "on redknot's Triton kernel"
        if state.held is None:
            return "on FlashInfer"
        if state.held_plan is None:
            why = (
                "its plan on FlashInfer failed"
                if self.held_attention is None
                else "as runs they would read over twice its tiles' keys"
            )
            return (
                "on FlashInfer where every row is computed, on redknot's Triton kernel for the "
                f"rows in recovery ({why})"
            )
        return f"on FlashInfer ({state.held_plan.describe()})"

    def _samkv_choice(self, lid: int, q, left: SegmentReads) -> SegmentReads:
        """The reads that left recovery with SamKV's middle slots pointing at this layer's
        chosen blocks (``q``: the layer's queries of the rows it computes)."""
        choice = self.extend_state.samkv
        region_k = self.pool.segments.k[lid]
        chosen = None
        graphs = self.samkv_graphs and q.is_cuda and not torch.cuda.is_current_stream_capturing()
        if graphs and self.tp_size == 1:  # (TP: the scores take an all-reduce)
            if choice.replay is None:
                choice.replay = ChoiceReplay(choice)
            try:
                chosen = choice.replay(q, region_k)
            except RuntimeError as e:  # served eagerly from here on, said once
                self.samkv_graphs = False
                logger.warning("redknot samkv: the choice's CUDA graph failed (%s); the "
                               "choice runs eagerly from now on", e)  # fmt: skip
        if chosen is None:
            reduce = self._sum_over_ranks() if self.tp_size > 1 else None
            idx = layer_choice(q, region_k, choice.inputs, reduce)
            chosen = choice.flat_rows[idx], choice.flat_pos[idx]
        rows, pos_off = left.rows_gpu.clone(), left.pos_off_gpu.clone()
        rows[choice.slot_index], pos_off[choice.slot_index] = chosen
        return SegmentReads(left.tokens_gpu, rows, pos_off, left.pos_on_gpu)

    def _reuse_kv(
        self, lid: int, k, v, reads: SegmentReads, held: HeldRows | None,
        left_reads: SegmentReads | None = None,
    ) -> None:  # fmt: skip
        """Reused segment tokens take the cached K/V, re-rotated to their positions in this
        prompt (in place in this layer's ``k``, ``v``: [T, H_kv, D]): local heads for every
        segment token (``local_kv="cached"``; under ``"fresh"`` they keep what this layer
        projected); every head for the tokens that left recovery (``held.left``). One
        alignment launch for each of the two, straight into ``k``/``v``; no host
        synchronisation."""
        left = self.left_heads(lid)
        if self.local_kv == "cached" and len(self.consts[lid].local):
            self._align(lid, k, v, self.consts[lid].local, reads)
        if held is not None and held.left.tokens_gpu.numel() and len(left):
            self._align(lid, k, v, left, left_reads or held.left)

    def left_heads(self, lid: int) -> AlignedHeads:
        """The heads that tokens which left recovery take from the cache in layer ``lid``: the
        stored global heads (their local heads come with every segment token's), or under
        ``local_kv="fresh"`` every stored head."""
        consts = self.consts[lid]
        return consts.stored if self.local_kv == "fresh" else consts.stored_global

    def _align(
        self, lid: int, k, v, heads: AlignedHeads, reads: SegmentReads, dst_rows=None
    ) -> None:
        """``k``/``v`` rows ``dst_rows`` (default ``reads.tokens_gpu``) of KV heads
        ``heads.heads`` from the segment region's columns ``heads.cols`` (re-rotated keys,
        copied values; the region has the model's dtype, see :meth:`check_segment_dtype`)."""
        region = self.pool.segments
        dst_rows = reads.tokens_gpu if dst_rows is None else dst_rows
        rope_align(
            region.k[lid], reads.rows_gpu, k, dst_rows, reads.pos_off_gpu,
            reads.pos_on_gpu, self.rope.cos_sin_cache, is_neox=self.rope.is_neox,
            rotary_dim=self.rope.rotary_dim, v_src=region.v[lid], v_dst=v,
            src_heads=heads.cols, dst_heads=heads.heads,
        )  # fmt: skip

    def decode(self, q, k, v, layer: RadixAttention, fb: ForwardBatch, save_kv_cache: bool):
        lid = layer.layer_id
        q, k, v = self._views(q, k, v, layer)
        if save_kv_cache:
            self.pool.write_global(lid, fb.out_cache_loc, k, v)
            if self.pool.ring_len:
                self.pool.write_local(lid, self.decode_rows, k, v)
            if self.layout.restore:
                rpis = self.decode_plan.req_pool_indices_gpu
                self.pool.write_restored(lid, fb.out_cache_loc, rpis, k, v)
        out = q.new_empty(q.shape)
        run_decode(
            self.decode_plan, q, *self.stores(lid), self.req_to_token, self.heads[lid],
            layer.scaling, out=out, promoted=self.pool.promoted_of(lid),
        )  # fmt: skip
        return out.flatten(1)
