"""``--attention-backend redknot``: head-class attention for SGLang.

Every (layer, KV head) is global (attends every earlier token) or local (attends its sink and
its recent window), as the head map says. Two execution paths, chosen once at startup:

- ``dense``: when every head is global and ``--redknot-kernel auto``, the computation is exactly
  dense attention and is dispatched to SGLang's FlashInfer backend, the fastest dense kernels on
  the GPU machine.
- ``segpaged``: redknot's SegPagedAttention kernels (one launch per layer over all requests and
  all KV heads, local rows limited to sink + window), used for every map with local heads and
  for all maps under ``--redknot-kernel triton``.

Every head global under a token-level policy (``--redknot-policy cacheblend|epic|...``, the
all-global maps of small models) takes both, per batch: an extend in which some request reads
cached segment K/V runs on the SegPaged kernels; every other extend and every decode step is
exactly dense attention over the same pool (the global K/V buffers are laid out as SGLang's) and
runs on FlashInfer, so the requests a reusing server does not reuse for run a dense server's
kernels. An extend that fills segments (a registration, a capture) is one of those: after each
layer FlashInfer ran, the segments' rows of the layer's new K/V are written to the region (their
keys rotated back to positions from 0 when captured after a context), as the SegPaged path
writes them. (Before, such a server ran every batch on the SegPaged kernels and answered
SmolLM2's unmarked 512-2K-token prompts 1.1-1.7x slower than a dense server, H100;
docs/performance.md.) A plain extend that reuses segments under such a policy attends on
FlashInfer too: its layers that compute every row through SGLang's FlashInfer extend, those that
compute only the rows in recovery as runs of consecutive rows (``redknot.kernels.held_rows``;
``SegPagedRunner.use_flashinfer`` says when the Triton kernel stays).

Under ``--redknot-lfps`` (every head global) long requests decode on LFPS's sparse step
(``redknot.lfps.serving``): an extend builds their state after each layer, SGLang's decode
graphs run the step for every row (requests without state list every key), and a batch no
graph can serve splits its rows between the step and FlashInfer.

Planning happens once per batch (``init_forward_metadata*``); ``forward_extend`` and
``forward_decode`` only write KV and launch. Once built, the backend checks its path against the
PyTorch reference on a synthetic batch (``redknot.attention.startup_check``) before the server
serves; ``--redknot-skip-startup-check`` skips that.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from redknot.attention.token_policy import TokenPolicy
from redknot.config import RedknotConfig

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _check_model(model_runner: ModelRunner) -> None:
    mc = model_runner.model_config
    problems = []
    if model_runner.use_mla_backend:
        problems.append("MLA attention (DeepSeek-style) has no KV heads to classify")
    if model_runner.is_hybrid_swa:
        problems.append("the model already mixes sliding-window and full layers")
    if model_runner.sliding_window_size is not None:
        problems.append("the model has its own sliding-window attention")
    if mc.is_encoder_decoder or mc.is_multimodal:
        problems.append("encoder-decoder and multimodal models are not supported")
    if mc.head_dim not in (64, 128):
        problems.append(f"head_dim {mc.head_dim} is not supported (64 or 128)")
    if problems:
        archs = ",".join(mc.hf_config.architectures or ["?"])
        raise ValueError(
            f"--attention-backend redknot cannot serve {archs}: " + "; ".join(problems)
        )


def _check_dense_path(pool) -> None:
    """The all-global FlashInfer path neither fills nor reads cached segments: a segment region
    reserved for it would take memory and make every registration fail."""
    if getattr(pool, "segments", None) is not None:
        raise ValueError(
            "--redknot-all-global with --redknot-kernel auto serves through FlashInfer, which "
            "does not cache or reuse segments, but a segment region is reserved "
            "(--redknot-segment-heads all): start with --redknot-segment-fraction 0 for dense "
            "serving, --redknot-kernel triton to reuse segments through redknot's kernels, or "
            "--redknot-policy naive|epic|cacheblend|sparsex for a token-level policy"
        )


def _check_sparse_layers(model_runner: ModelRunner, runner, config: RedknotConfig) -> None:
    """The sparse layers (``--redknot-dense-layers``, or a token-level ``--redknot-policy``)
    need redknot's hooks on the model's classes; rows that leave recovery read every head of a
    cached segment. (They change the rows each layer computes from request to request, which a
    captured prefill graph cannot: extend batches that reuse segments run eagerly, see
    :meth:`RedknotAttnBackend.needs_eager_extend`.)"""
    from redknot.attention import ffn_schedule
    from redknot.integration.plugin import wraps

    token_policy = config.policy != "redknot"
    what = (
        f"--redknot-policy {config.policy}"
        if token_policy
        else f"--redknot-dense-layers {config.dense_layers} (skipped={config.skipped})"
    )
    layer = next((m for m in model_runner.model.modules() if hasattr(m, "mlp")), None)
    if layer is None:
        raise ValueError(f"{what} needs a model with decoder layers that have an mlp")
    needs = [] if token_policy else [(type(layer.mlp), ffn_schedule.around_mlp)]
    leaves = token_policy or config.skipped == "cached"
    if leaves:
        needs.append((type(layer), ffn_schedule.around_decoder_layer))
    for cls, fn in needs:
        if not wraps(cls.forward, fn):
            raise ValueError(
                f"{what} needs redknot's hook on {cls.__module__}.{cls.__qualname__}.forward, "
                "which this model does not have (hooked: Llama and Qwen2 decoder layers and "
                f"MLPs): serve it without {what.split()[0]}"
            )
    if not leaves:
        return
    region = runner.pool.segments
    for layer, heads in enumerate(region.heads):
        missing = [h for h in runner.layout.global_heads(layer) if h not in heads]
        if missing:
            raise ValueError(
                f"{what} reads the cached K/V of every head of a segment token that leaves "
                f"recovery, but cached segments keep only the local heads (layer {layer} lacks "
                f"heads {missing}): start with --redknot-segment-heads all"
                + ("" if token_policy else " (or --redknot-skipped residual)")
            )


def _flashinfer(model_runner: ModelRunner) -> AttentionBackend:
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(model_runner, init_new_workspace=model_runner.init_new_workspace)


def _held_attention(model_runner: ModelRunner, layout, dense: AttentionBackend):
    """FlashInfer over the rows a token policy's reusing extend still computes
    (``redknot.kernels.held_rows``), on the dense backend's workspace and prefill kernels."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from redknot.kernels.held_rows import HeldRowsAttention

    # the runs are planned at the model's attention scale (its first layer's; a layer with
    # another one restates it, HeldRowsAttention.run)
    first = next((m for m in model_runner.model.modules() if isinstance(m, RadixAttention)), None)
    return HeldRowsAttention.on_flashinfer(
        dense.workspace_buffer, layout.num_q_heads, layout.num_kv_heads, layout.head_dim,
        model_runner.dtype, backend=getattr(dense, "prefill_backend", "auto"),
        sm_scale=None if first is None else first.scaling,
    )  # fmt: skip


def _on_cuda(model_runner: ModelRunner) -> bool:
    return torch.device(model_runner.device).type == "cuda"


class RedknotAttnBackend(AttentionBackend):
    """SGLang attention backend applying a head-class map."""

    lfps = None  # LFPS decode (redknot.lfps.serving.LfpsServing) under --redknot-lfps
    lfps_plan = None  # the decode batch's LFPS part (redknot.lfps.serving.DecodePlan)
    lfps_dense_batch = None  # the batch of its other rows, planned on FlashInfer
    lfps_graph = False  # the decode batch being captured or replayed runs LFPS's graph path
    lfps_graph_rows = None  # (out_cache_loc, rows) of the batch about to replay a decode graph
    host_extend = None  # extends with a prefix in a host store (redknot.attention.host_extend)
    host_batch = False  # the extend being run is one

    def __init__(self, model_runner: ModelRunner, config: RedknotConfig):
        super().__init__()
        _check_model(model_runner)
        from sglang.srt.runtime_context import get_parallel

        from redknot.integration.server_args import rank_layout

        mc = model_runner.model_config
        tp_size, tp_rank = get_parallel().attn_tp_size, get_parallel().attn_tp_rank
        self.config = config
        self.layout = rank_layout(config, mc)
        expected = (mc.get_num_kv_heads(tp_size), mc.num_attention_heads // tp_size)
        if expected != (self.layout.num_kv_heads, self.layout.num_q_heads):
            raise ValueError(
                f"rank {tp_rank} serves {expected[0]} KV / {expected[1]} query heads but the "
                f"head map slice has {self.layout.num_kv_heads} / {self.layout.num_q_heads}"
            )
        self.dense: AttentionBackend | None = None
        self.segpaged = None
        dense_exact = self.layout.all_global and config.kernel == "auto"
        if dense_exact and config.policy == "redknot":
            _check_dense_path(model_runner.token_to_kv_pool)
            self.dense = _flashinfer(model_runner)
            self.path = "dense"
        else:
            from redknot.attention.segpaged_runner import SegPagedRunner

            self.segpaged = SegPagedRunner.from_model_runner(model_runner, self.layout)
            self.path = "segpaged"
            self._set_layer_schedule(model_runner, config, tp_size)
            # no restore columns (they would widen the global buffers FlashInfer reads)
            if dense_exact and not self.layout.restore and _on_cuda(model_runner):
                self.dense = _flashinfer(model_runner)
                if self.segpaged.policy is not None and self.segpaged.pool.segments is not None:
                    self.segpaged.use_flashinfer(
                        self.dense, _held_attention(model_runner, self.layout, self.dense)
                    )
        self.dense_batch = self.segpaged is None  # the batch being run goes to FlashInfer
        self.lfps_pool = model_runner.token_to_kv_pool
        # --redknot-lfps-offload-gb: extends with a prefix gather it from the host store
        if getattr(self.lfps_pool, "host_kv", False) is True:
            from redknot.attention.host_extend import HostPrefixExtend

            self.host_extend = HostPrefixExtend(
                self.layout.num_q_heads, self.layout.num_kv_heads, self.layout.head_dim,
                model_runner.dtype, model_runner.req_to_token_pool.req_to_token,
            )  # fmt: skip
        self.lfps = (
            _lfps_serving(model_runner, config, self.dense, self.host_extend is not None)
            if config.lfps != "off"
            else None
        )
        logger.info(
            "redknot backend (TP rank %d/%d): %s path%s, %d global / %d local KV heads per rank",
            tp_rank,
            tp_size,
            self.path,
            (
                " for extends that reuse, register or capture a segment, FlashInfer for the "
                "other extends and every decode step"
                if self.segpaged is not None and self.dense is not None
                else ""
            ),
            sum(self.layout.num_global(i) for i in range(self.layout.num_layers)),
            sum(self.layout.num_local(i) for i in range(self.layout.num_layers)),
        )
        # Built, with the model and the pool in place and the server not yet serving: check
        # the path against the reference (raises StartupCheckError, which stops the server).
        from redknot.attention.startup_check import check_backend

        check_backend(self, model_runner, skip=config.skip_startup_check)

    def _set_layer_schedule(self, model_runner: ModelRunner, config: RedknotConfig, tp: int):
        """Segment reuse's sparse layers from ``--redknot-dense-layers`` on (opt-in: without the
        option every layer runs every FFN on every token)."""
        from redknot.headmap import ModelShape

        layers = ModelShape.from_hf_config(model_runner.model_config.hf_config).num_layers
        dense = layers if config.dense_layers is None else config.dense_layers
        if dense > layers:
            raise ValueError(
                f"--redknot-dense-layers {dense} exceeds the model's {layers} layers: give at "
                f"most {layers} (that many turns FFN skipping off)"
            )
        runner = self.segpaged
        runner.dense_layers, runner.mass_thresh = dense, config.mass_thresh
        runner.recent_n, runner.tp_size, runner.skipped = config.recent_n, tp, config.skipped
        runner.local_kv = config.local_kv
        runner.policy = TokenPolicy.of(config)
        if config.restore:
            runner.restore_thresh, runner.restore_edge = config.restore_thresh, config.restore_edge
            _warn_restore_scope(model_runner, runner)
        if runner.pool.segments is None:
            return
        if runner.policy is not None:
            if runner.policy.select_layer >= layers:
                flag = (
                    f"--redknot-blend-check-layer {config.blend_check_layer}"
                    if config.policy == "cacheblend"
                    else f"--redknot-sparseq-boundary {config.sparseq_boundary}"
                )
                raise ValueError(
                    f"{flag} chooses in layer {runner.policy.select_layer}, which the model "
                    f"(layers 0-{layers - 1}) does not have: choose in a layer below {layers}"
                )
            _check_sparse_layers(model_runner, runner, config)
            logger.info(
                "redknot segment reuse: policy %s (%s); the reused tokens it does "
                "not keep take the cached K/V of every head",
                runner.policy.name,
                runner.policy.describe(),
            )
            return
        if config.local_kv == "fresh":
            logger.info(
                "redknot segment reuse: local heads take the K/V this prompt computes "
                "(--redknot-local-kv fresh)%s",
                "" if dense < layers else "; without the layer schedule no cached K/V is read",
            )
        if dense >= layers:
            return
        _check_sparse_layers(model_runner, runner, config)
        logger.info(
            "redknot segment reuse: FFN on every token below layer %d, above it on the segment "
            "tokens holding %.2f of the newest %d tokens' attention mass; the others %s",
            dense,
            config.mass_thresh,
            config.recent_n,
            (
                "leave recovery (cached K/V of every head from the next layer on)"
                if config.skipped == "cached"
                else "take the residual path"
            ),
        )

    def needs_eager_extend(self, forward_batch: ForwardBatch) -> bool:
        """True for an extend batch that SGLang's prefill CUDA graph must not replay: one that
        reuses cached segments while the rows each layer computes depend on the request (the
        layer schedule of ``--redknot-dense-layers``, or a token-level policy); a graph would
        replay the rows of its capture. Every other batch may replay (SGLang's own gate
        decides). Called by redknot's hook on ``PrefillCudaGraphRunner.can_run_graph``."""
        if self.lfps is not None and self.lfps.wants_extend(forward_batch):
            return True  # the LFPS state is built per layer from the extend's queries
        if self.host_extend is not None and any(forward_batch.extend_prefix_lens_cpu or ()):
            return True  # a prefix in host memory: gathered, not read by a graph's kernels
        return self.segpaged is not None and self.segpaged.rows_vary(forward_batch)

    def needs_eager_decode(self, forward_batch: ForwardBatch) -> bool:
        """Under ``--redknot-lfps``: True for a decode batch that no decode graph can serve (a
        request without LFPS state too long to list every key of); for any other, the rows its
        graph is to take (kept for :meth:`init_forward_metadata_out_graph`, which sees only a
        padded view of the batch). Called by redknot's hook on
        ``DecodeCudaGraphRunner.can_run_graph``, right before SGLang replays a graph."""
        if self.lfps is None:
            return False
        if not self.lfps.fits_graph(forward_batch):
            return True
        if getattr(forward_batch, "rids", None) is not None:
            rows = self.lfps.graph_rows(forward_batch)
            self.lfps_graph_rows = (forward_batch.out_cache_loc, rows)
        return False

    # ---- planning: once per batch ------------------------------------------------------------
    #
    # Only the dense path: every call goes to FlashInfer. Only the SegPaged path: every call to
    # the runner. Both (every head global, a token-level policy): decode goes to FlashInfer,
    # an extend to the runner when it touches a segment, else to FlashInfer; the runner's
    # per-forward state is reset either way (its layer hooks then pass every row through).

    def _to_dense(self, forward_batch: ForwardBatch) -> bool:
        """Whether this batch runs on FlashInfer, decided once when it is planned."""
        if self.segpaged is None:
            return True
        if self.dense is None:
            return False
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return True
        if mode in (mode.EXTEND, mode.MIXED):
            return not self.segpaged.needs_kernels(forward_batch)
        return False  # idle: nothing runs

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.lfps_graph = self.host_batch = False
        if self.lfps is not None and self._plan_lfps(forward_batch):
            return None
        if self.host_extend is not None and forward_batch.forward_mode.is_extend():
            self.host_batch = self.host_extend.plan(forward_batch)
            if self.host_batch:
                self.dense_batch = True
                if self.segpaged is not None:
                    self.segpaged.plan_dense(forward_batch)
                return None
        self.dense_batch = self._to_dense(forward_batch)
        if not self.dense_batch:
            return self.segpaged.plan(forward_batch)
        if self.segpaged is not None:
            self.segpaged.plan_dense(forward_batch)
        return self.dense.init_forward_metadata(forward_batch)

    def _plan_lfps(self, forward_batch: ForwardBatch) -> bool:
        """LFPS's part of planning an eager batch; True when it planned the batch itself (a
        decode batch with LFPS rows: those rows on LFPS, the others on FlashInfer)."""
        self.lfps_plan = None
        mode = forward_batch.forward_mode
        if mode.is_decode():
            self.lfps.extend_rows = []
            self.lfps_plan = self.lfps.plan_decode(forward_batch)
        elif mode.is_extend():
            self.lfps.plan_extend(forward_batch)
        if self.lfps_plan is None:
            return False
        self.dense_batch = True
        if self.segpaged is not None:
            self.segpaged.begin_forward()
        plan = self.lfps_plan
        self.lfps_dense_batch = None
        if plan.dense_rows_list:
            self.lfps_dense_batch = _sub_batch(forward_batch, plan.dense_rows, plan.dense_rows_list)
            self.dense.init_forward_metadata(self.lfps_dense_batch)
        return True

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.lfps is not None:
            self.lfps.init_graph_state(max_bs, self.lfps_pool.device)
        if self.dense is not None:
            self.dense.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.segpaged is not None:
            self.segpaged.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ):
        # graphs: decode (SGLang's decode graphs), or every extend of a full prefill graph,
        # which its path keeps (a captured graph replays the kernels of its capture). Under
        # --redknot-lfps every decode graph runs LFPS's step (_begin_lfps_graph); extends that
        # build LFPS state never replay a graph (needs_eager_extend)
        self.lfps_plan = None
        self.lfps_graph = self.host_batch = False
        if self.lfps is not None:
            self.lfps.extend_rows = []
            if forward_batch.forward_mode.is_decode():
                return self._begin_lfps_graph(forward_batch, in_capture)
        self.dense_batch = self.segpaged is None or (
            self.dense is not None and forward_batch.forward_mode.is_decode()
        )
        if not self.dense_batch:
            return self.segpaged.plan(forward_batch, for_graph=True, in_capture=in_capture)
        if self.segpaged is not None:
            self.segpaged.begin_forward()
        return self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)

    def _begin_lfps_graph(self, forward_batch, in_capture: bool) -> None:
        """A decode graph under ``--redknot-lfps``: every row on LFPS's kernels (rows without
        state list every key), the rows of the real batch found by ``needs_eager_decode``."""
        rows = None
        if not in_capture:
            kept = self.lfps_graph_rows
            if kept is None or kept[0] is not forward_batch.out_cache_loc:
                raise RuntimeError(
                    "redknot LFPS: a decode graph is replayed for a batch its can_run_graph "
                    "hook did not see (redknot.integration.plugin): the LFPS rows are unknown"
                )
            rows = kept[1]
        self.lfps_graph_rows = None
        self.lfps.begin_graph(forward_batch.batch_size, rows)
        self.lfps_graph = self.dense_batch = True
        if self.segpaged is not None:
            self.segpaged.begin_forward()

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        if self.lfps_graph:
            return None
        if self.dense_batch:
            return self.dense.init_forward_metadata_in_graph(forward_batch)
        self.segpaged.plan_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        if self.dense is not None:
            return self.dense.get_cuda_graph_seq_len_fill_value()
        return 1

    def on_after_cuda_graph_warmup(self):
        if self.dense is not None:
            return self.dense.on_after_cuda_graph_warmup()

    # ---- running: once per layer ------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        if self.host_batch:
            lid, pool = layer.layer_id, self.lfps_pool
            self._write_kv(k, v, layer, forward_batch, save_kv_cache)
            out = self.host_extend.forward(
                q, k, v, layer, pool.get_key_buffer(lid), pool.get_value_buffer(lid)
            )
        elif self.dense_batch:
            out = self.dense.forward_extend(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
            writes = self.segpaged is not None and self.segpaged.dense_writes is not None
            if writes and save_kv_cache:  # registrations in a FlashInfer batch
                self.segpaged.write_segments(layer, k, v)
        else:
            out = self.segpaged.extend(q, k, v, layer, forward_batch, save_kv_cache)
        if self.lfps is not None and self.lfps.extend_rows:
            lid = layer.layer_id
            pool = self.lfps_pool
            self.lfps.after_extend(
                lid, q, pool.get_key_buffer(lid), pool.get_value_buffer(lid), layer.scaling
            )
        return out

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        if self.lfps_graph:
            return self._lfps_graph_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if self.lfps_plan is not None:
            return self._lfps_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if self.dense is not None:
            return self.dense.forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
        return self.segpaged.decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _write_kv(self, k, v, layer, forward_batch, save_kv_cache) -> None:
        """Every row's new K/V into the pool (LFPS's decode paths, before anyone attends)."""
        if save_kv_cache and k is not None:
            hkv, d = layer.tp_k_head_num, layer.head_dim
            self.lfps_pool.write_global(layer.layer_id, forward_batch.out_cache_loc,
                                        k.view(-1, hkv, d), v.view(-1, hkv, d))  # fmt: skip

    def _lfps_graph_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        """A decode graph's batch: every row's K/V written, every row on LFPS's kernels."""
        lid, pool = layer.layer_id, self.lfps_pool
        hq, d = layer.tp_q_head_num, layer.head_dim
        self._write_kv(k, v, layer, forward_batch, save_kv_cache)
        out = self.lfps.decode_graph(
            lid, q.view(-1, hq, d), pool.get_key_buffer(lid), pool.get_value_buffer(lid),
            forward_batch.req_pool_indices, forward_batch.seq_lens, layer.scaling,
        )  # fmt: skip
        return out.reshape(-1, hq * d)

    def _lfps_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        """A decode batch with LFPS rows: every row's K/V written, then the LFPS rows attend
        their selection and the others run on FlashInfer."""
        plan, lid = self.lfps_plan, layer.layer_id
        pool = self.lfps_pool
        hq, d = layer.tp_q_head_num, layer.head_dim
        self._write_kv(k, v, layer, forward_batch, save_kv_cache)
        q = q.view(-1, hq, d)
        out = q.new_empty(q.shape)
        if self.lfps_dense_batch is not None:
            dense_q = q.index_select(0, plan.dense_rows).reshape(-1, hq * d)
            out[plan.dense_rows] = self.dense.forward_decode(
                dense_q, None, None, layer, self.lfps_dense_batch, save_kv_cache=False
            ).view(-1, hq, d)
        out[plan.lfps_rows] = self.lfps.decode(
            lid, q.index_select(0, plan.lfps_rows).contiguous(), pool.get_key_buffer(lid),
            pool.get_value_buffer(lid), plan, layer.scaling,
        )  # fmt: skip
        return out.view(-1, hq * d)


def _warn_restore_scope(model_runner: ModelRunner, runner) -> None:
    """Adaptive restore's log line at startup, with its scope (redknot.attention.restore)."""
    chunk = model_runner.server_args.chunked_prefill_size
    context = model_runner.model_config.context_len
    logger.info(
        "redknot segment reuse: adaptive restore promotes at most %d local head(s) per layer "
        "and request whose edge mass (the oldest %d window tokens) exceeds %.3g; %d more "
        "head(s) per layer in every token slot",
        runner.layout.restore, runner.restore_edge, runner.restore_thresh, runner.layout.restore,
    )  # fmt: skip
    if runner.pool.segments is None:
        logger.warning(
            "redknot: adaptive restore is on but segment caching is off "
            "(--redknot-segment-fraction 0): no request reuses a segment, none is restored, "
            "and the restore columns cost memory for nothing"
        )
    elif chunk is not None and 0 < chunk < context:
        logger.warning(
            "redknot: adaptive restore needs a reusing prompt in one extend: prompts longer "
            "than --chunked-prefill-size %d (and prompts that hit a cached prefix) are served "
            "without restore; pass --chunked-prefill-size -1 to restore every prompt up to the "
            "context length (%d)",
            chunk, context,
        )  # fmt: skip


def _lfps_serving(model_runner: ModelRunner, config: RedknotConfig, dense, host_kv: bool):
    """LFPS decode (``--redknot-lfps``) over the pool's reserved state, or a clear refusal
    (``host_kv``: the pool's store is in host memory)."""
    from redknot.lfps.params import LfpsParams
    from redknot.lfps.serving import LfpsServing, union_of

    pool = model_runner.token_to_kv_pool
    store = getattr(pool, "lfps_store", None)
    problems = []
    if dense is None:
        problems.append("its other requests decode on FlashInfer, which this path lacks")
    if not _on_cuda(model_runner):
        problems.append("its kernels need CUDA")
    if getattr(model_runner.model_config.hf_config, "attn_logit_softcapping", None):
        problems.append("the model caps attention logits, which its kernels do not")
    if store is None:
        problems.append("no LFPS state was reserved in the KV pool")
    if problems:
        raise ValueError(f"--redknot-lfps {config.lfps} cannot serve here: " + "; ".join(problems))
    budget = config.lfps_budget
    params = LfpsParams(
        budget=budget if budget < 1 else int(budget), decay=config.lfps_decay, lam=config.lfps_lam,
        sparsity_threshold=config.lfps_sparsity_threshold,
    )  # fmt: skip
    serving = LfpsServing(
        config.lfps, params, store.shape, store, model_runner.req_to_token_pool.req_to_token,
        min_tokens=config.lfps_min_tokens, candidate_factor=config.lfps_candidate_factor,
        union=union_of(config.lfps_selection, store.shape.num_q_heads, store.shape.num_kv_heads),
        host_kv_dtype=pool.dtype if host_kv else None,
    )  # fmt: skip
    model_runner.req_to_token_pool.redknot_lfps = serving  # its free hook releases rows
    logger.info(
        "redknot: %s decode for requests of %d prompt tokens or more, at most %d at once: %s of "
        "the keys per %s and step besides %d sinks%s. Decode batches replay CUDA graphs with "
        "budgets for %d keys (requests without LFPS state list all of theirs); a batch with a "
        "longer such request runs eagerly, its other requests on FlashInfer",
        "LFPS" if config.lfps == "lfps" else "exact Top-k",
        config.lfps_min_tokens, store.slots,
        f"{budget:g}" if budget < 1 else f"{int(budget)}", config.lfps_selection,
        params.num_sink,
        f", {config.lfps_candidate_factor}x candidates" if config.lfps == "lfps" else "",
        serving.graph_topk,
    )  # fmt: skip
    return serving


def _sub_batch(forward_batch: ForwardBatch, rows: torch.Tensor, rows_list: list[int]):
    """The decode batch of ``rows`` only, for planning FlashInfer over them (a shallow copy)."""
    import copy

    sub = copy.copy(forward_batch)
    seq_cpu = forward_batch.seq_lens_cpu[rows_list]
    sub.batch_size = len(rows_list)
    sub.req_pool_indices = forward_batch.req_pool_indices[rows]
    sub.seq_lens = forward_batch.seq_lens[rows]
    sub.seq_lens_cpu = seq_cpu
    sub.seq_lens_sum = int(seq_cpu.sum())
    sub.out_cache_loc = forward_batch.out_cache_loc[rows]
    return sub
