"""Startup correctness gate: before a server serves, each TP rank runs the attention path it will
serve on a short synthetic batch (``redknot.attention.check_batch``) at its exact attention
shape and compares every output with the PyTorch reference attention.

| served path (``RedknotAttnBackend.path``) | what runs                                        |
| ----------------------------------------- | ------------------------------------------------ |
| ``dense`` (every head global, kernel auto) | SGLang's FlashInfer backend, built as the redknot backend builds it |
| ``dense`` under ``--redknot-lfps-offload-gb`` (``offload``) | the same over a pool in pinned host memory, the extend with a prefix on ``redknot.attention.host_extend`` |
| ``segpaged``                              | ``SegPagedRunner`` with every head global, and with each distinct row of this rank's head classes (with adaptive restore: restore columns, and a request that promotes a local head of each row) |

Each runs on a pool and a request table of their own (a few hundred token slots; one layer per
checked head-class row), never on the serving pool, through the same planning and launch calls
as serving: ``prefill``, ``extend`` and ``decode`` (for ``segpaged`` also decode planned as
under CUDA graphs, with its fixed split count). For ``segpaged`` the extend is also run as
segment reuse runs it (:data:`ROW_CASES`): over every third row only, packed into tiles
(``gather_tiles``, the rows still in recovery), and with the attention's log-sum-exp (what the
layer schedule's importance reads), each checked against the reference too; these are the
kernel variants a reusing request would otherwise compile on first use. With segments on, segment
reuse's other kernels are checked the same way (:func:`check_reuse_kernels`: the RoPE
re-alignment of cached K/V in each distinct launch shape of the served region and head map, and
the layer schedule's key mass), and the layer schedule's choice of rows (:func:`check_choice`).
A token policy whose reusing prompts attend on FlashInfer has its rows in recovery checked as
runs (:func:`check_held_rows`, ``redknot.kernels.held_rows``).
The served attention layers (scaling, logit cap) are used as they are.

Tolerance, as the kernel tests: ``|out - ref| <= tol + tol * |ref|`` with ``tol`` 2e-2 for
bfloat16 and 4e-3 for float16 (inputs are standard normal, outputs of order 1).
``--redknot-skip-startup-check`` skips the gate; the kernels are then unverified.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from redknot.attention.check_batch import PHASES, SyntheticBatch, synthetic_requests
from redknot.pool.layout import HeadLayout

logger = logging.getLogger(__name__)

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # atol = rtol, per dtype
SKIP_HINT = (
    "To start anyway, pass --redknot-skip-startup-check (config-file key skip_startup_check): "
    "the attention kernels are then unverified."
)
PATH_NAMES = {
    "dense": "the FlashInfer path (dense dispatch)",
    "segpaged": "the Triton path (redknot's SegPaged kernels)",
    "offload": "the FlashInfer path over pinned host memory, extends with a prefix gathering it "
    "(--redknot-lfps-offload-gb)",
}
_MAX_LINES = 8  # failing cases listed in the error
# The extend as segment reuse runs it: (case name, rows packed into tiles, with the LSE, runs
# each global row's keys are split into: None as served, where the synthetic rows are too short
# to split; 3 for the split launch and its merge)
ROW_CASES = (
    ("extend (every third row, packed)", True, False, None),
    ("extend (with LSE)", False, True, None),
    ("extend (every third row, packed, with LSE)", True, True, None),
    ("extend (every third row, packed, with LSE, keys split in 3)", True, True, 3),
)
_passed: set[tuple] = set()  # what this process already checked (TBO builds two backends)


class StartupCheckError(RuntimeError):
    """The attention path differs from the reference; the message says where and by how much."""


@dataclass(frozen=True)
class ServedAttention:
    """What one rank serves: the attention shape the check reproduces."""

    layout: HeadLayout  # this rank's head classes, sink and window
    dtype: torch.dtype  # of queries, keys and values
    kv_dtype: torch.dtype  # of the KV pool
    device: torch.device
    max_context_len: int  # the model's context length (decode splits under CUDA graphs)
    table_width: int  # columns of the server's req_to_token
    layers: Mapping[int, Any] = field(default_factory=dict)  # layer_id -> served RadixAttention
    model: str = "model"
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, model_runner: Any, layout: HeadLayout) -> ServedAttention:
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.runtime_context import get_parallel

        mc = model_runner.model_config
        layers = {
            m.layer_id: m for m in model_runner.model.modules() if isinstance(m, RadixAttention)
        }
        return cls(
            layout=layout,
            dtype=model_runner.dtype,
            kv_dtype=model_runner.kv_cache_dtype,
            device=torch.device(model_runner.device),
            max_context_len=mc.context_len,
            table_width=model_runner.req_to_token_pool.req_to_token.shape[1],
            layers=layers,
            model=",".join(mc.hf_config.architectures or ["?"]),
            tp_rank=get_parallel().attn_tp_rank,
            tp_size=get_parallel().attn_tp_size,
        )

    def describe(self) -> str:
        lay = self.layout
        return (
            f"{self.model} on TP rank {self.tp_rank}/{self.tp_size}: {lay.num_q_heads} query / "
            f"{lay.num_kv_heads} KV heads, head_dim {lay.head_dim}, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}, "
            f"sink {lay.sink} + window {lay.window}"
        )

    def layer(self, layer_id: int) -> Any:
        """The served attention layer ``layer_id``, or a stand-in with the usual scaling."""
        if layer_id in self.layers:
            return self.layers[layer_id]
        lay = self.layout
        return SimpleNamespace(
            layer_id=layer_id, scaling=lay.head_dim**-0.5, logit_cap=0.0,
            is_cross_attention=False, qk_head_dim=lay.head_dim, v_head_dim=lay.head_dim,
            head_dim=lay.head_dim, tp_q_head_num=lay.num_q_heads, tp_k_head_num=lay.num_kv_heads,
            tp_v_head_num=lay.num_kv_heads, sliding_window_size=-1, attn_type=None,
            k_scale=None, v_scale=None, k_scale_float=None, v_scale_float=None,
        )  # fmt: skip


class _LayerAt:
    """A served attention layer seen at another layer index (that of the check's pool)."""

    def __init__(self, layer: Any, layer_id: int):
        self._layer, self.layer_id = layer, layer_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def checked_rows(layout: HeadLayout, path: str) -> list[tuple[str, int]]:
    """(head-class row, first served layer with it): every head global first, then for
    ``segpaged`` each distinct row of ``layout`` in layer order."""
    every_global = "G" * layout.num_kv_heads
    rows = [(every_global, next((i for i, c in enumerate(layout.classes) if c == every_global), 0))]
    if path == "segpaged":
        for i, row in enumerate(layout.classes):
            if row not in {r for r, _ in rows}:
                rows.append((row, i))
    return rows


@dataclass(frozen=True)
class CaseResult:
    case: str  # phase, "decode (graph plan)" for the CUDA-graph plan
    row: str  # head classes of the checked layer
    layer_id: int  # served layer the row comes from
    max_err: float
    ratio: float  # worst |out - ref| / (tol + tol * |ref|) of any value; <= 1 passes
    bad: int  # values beyond tolerance (NaN included)
    numel: int
    where: str  # the worst value: request, position, query head, KV head and its class


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[float, float, int, tuple]:
    """(max |out - ref|, the largest ratio of error to ``tol + tol * |ref|``, values beyond
    tolerance, index of the value with the largest ratio); NaN counts as infinitely wrong."""
    err = (out.float() - ref).abs().nan_to_num(float("inf"))
    ratio = err / (tol + tol * ref.abs())
    worst = int(ratio.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
    return float(err.max()), float(ratio.max()), int((ratio > 1).sum()), index


# ---- the two paths ---------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Silence the allocation logs of the check's own pool (it is not the serving pool)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _pool(served: ServedAttention, layout: HeadLayout, batch: SyntheticBatch, host_kv=False,
          device_rows: int = 0):  # fmt: skip
    from redknot.pool.kv_pool import RedknotKVPool

    with _quiet("redknot.pool.kv_pool", "sglang.srt.mem_cache.memory_pool"):
        return RedknotKVPool(
            batch.num_slots, 1, served.kv_dtype, layout, num_rings=batch.req_to_token_cpu.shape[0],
            num_snapshots=0, device=str(served.device), host_kv=host_kv, device_rows=device_rows,
        )  # fmt: skip


class SegPagedPath:
    """redknot's runner over the check's pool, planned and run as the backend does."""

    graph_decode = True

    def __init__(self, served: ServedAttention, layout: HeadLayout, batch: SyntheticBatch):
        from redknot.attention.segpaged_runner import SegPagedRunner

        self.req_to_token = batch.req_to_token_cpu.to(served.device)
        rows = self.req_to_token.shape[0]
        self.runner = SegPagedRunner(
            layout, _pool(served, layout, batch), self.req_to_token, max_batch_size=rows,
            max_context_len=served.max_context_len, device=served.device,
        )  # fmt: skip
        self.runner.init_cuda_graph_state(rows, rows)
        batch.promote_in(self.runner.pool.promoted)  # adaptive restore: request 0 promotes

    def plan(self, fb, graph: bool = False) -> None:
        self.runner.plan(fb, for_graph=graph, in_capture=graph)
        if graph:
            self.runner.plan_in_graph(fb)

    def run(self, q, k, v, layer, fb) -> torch.Tensor:
        run = self.runner.decode if fb.forward_mode.is_decode() else self.runner.extend
        return run(q, k, v, layer, fb, True)

    def run_rows(self, q, k, v, layer, packed: bool, with_lse: bool, num_splits: int | None):
        """The planned extend's attention in ``layer`` as segment reuse runs it: every third
        row packed into tiles if ``packed`` (else every row), with the log-sum-exp if
        ``with_lse``, global rows' keys split in ``num_splits`` runs (None: as served); writes
        no store. Returns ``(batch rows, out [A, Hq, D], lse [A, Hq] or None)``."""
        from redknot.attention.extend_state import rows_per_request
        from redknot.kernels.extend import gather_tiles, run_extend

        r, lid = self.runner, layer.layer_id
        plan = r.extend_state.plan
        lay = r.layout
        q = q.view(-1, lay.num_q_heads, lay.head_dim)
        picked = torch.arange(plan.num_tokens, device=q.device)
        if packed:
            keep = torch.arange(plan.num_tokens) % 3 == 0
            counts = rows_per_request(keep, plan.qo_indptr_cpu).tolist()
            picked = picked[keep.to(q.device)]
            plan, q = gather_tiles(plan, picked, counts), q[picked]
        out = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if with_lse else None
        run_extend(
            plan, q, k.to(q.dtype), v.to(q.dtype), *r.stores(lid), r.req_to_token, r.heads[lid],
            layer.scaling, out=out, lse=lse, num_splits=num_splits,
            promoted=r.pool.promoted_of(lid),
        )  # fmt: skip
        return picked, out, lse


class _RunnerWith:
    """The server's model runner with the check's own pools in place of the serving ones."""

    def __init__(self, model_runner: Any, **overrides: Any):
        self._runner = model_runner
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class DensePath:
    """SGLang's FlashInfer backend over the check's pool (every head global; CUDA only)."""

    graph_decode = False
    host_kv = False

    def __init__(self, served, layout, batch, model_runner):
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        rows, width = batch.req_to_token_cpu.shape
        req_pool = ReqToTokenPool(rows - 1, width, str(served.device), enable_memory_saver=False)
        req_pool.req_to_token.copy_(batch.req_to_token_cpu)
        # a server whose offloaded store starts in GPU memory (redknot.pool.vmm) is checked over
        # such a store: its first half in GPU memory, the rest in host memory
        tiered = getattr(getattr(model_runner, "token_to_kv_pool", None), "device_rows", 0)
        rows = batch.num_slots // 2 if self.host_kv and tiered else 0
        self.pool = pool = _pool(served, layout, batch, host_kv=self.host_kv, device_rows=rows)
        self.req_to_token = req_pool.req_to_token
        runner = _RunnerWith(
            model_runner, req_to_token_pool=req_pool, token_to_kv_pool=pool,
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        )  # fmt: skip
        self.backend = FlashInferAttnBackend(runner, init_new_workspace=False)

    def plan(self, fb, graph: bool = False) -> None:
        self.backend.init_forward_metadata(fb)

    def run(self, q, k, v, layer, fb) -> torch.Tensor:
        return self.backend.forward(q, k, v, layer, fb, save_kv_cache=True)


class OffloadPath(DensePath):
    """The dense path over a pool in pinned host memory, as ``--redknot-lfps-offload-gb``
    serves: FlashInfer where no request has a prefix (and for decode), the host-prefix extend
    (``redknot.attention.host_extend``) where one has."""

    host_kv = True

    def __init__(self, served, layout, batch, model_runner):
        from redknot.attention.host_extend import HostPrefixExtend

        super().__init__(served, layout, batch, model_runner)
        self.extend = HostPrefixExtend(
            layout.num_q_heads, layout.num_kv_heads, layout.head_dim, served.dtype,
            self.req_to_token,
        )  # fmt: skip
        self.gathers = False  # the planned batch runs on the host-prefix extend

    def plan(self, fb, graph: bool = False) -> None:
        self.gathers = fb.forward_mode.is_extend() and self.extend.plan(fb)
        if not self.gathers:
            super().plan(fb, graph)

    def run(self, q, k, v, layer, fb) -> torch.Tensor:
        if not self.gathers:
            return super().run(q, k, v, layer, fb)
        lid, pool = layer.layer_id, self.pool
        hkv, d = pool.layout.num_kv_heads, pool.layout.head_dim
        pool.write_global(lid, fb.out_cache_loc, k.view(-1, hkv, d), v.view(-1, hkv, d))
        return self.extend.forward(q, k, v, layer, pool.k_global[lid], pool.v_global[lid])


# ---- the gate --------------------------------------------------------------------------------


def run_startup_check(
    served: ServedAttention, path: str, model_runner: Any = None, seed: int = 0
) -> list[CaseResult]:
    """Run ``path`` ("dense", "offload" or "segpaged") on the synthetic batch and compare with
    the reference; raise ``StartupCheckError`` naming every case beyond tolerance."""
    start = time.perf_counter()
    rows = checked_rows(served.layout, path)
    lay = served.layout
    layout = HeadLayout(
        classes=tuple(r for r, _ in rows), num_q_heads=lay.num_q_heads, head_dim=lay.head_dim,
        window=lay.window, sink=lay.sink, restore=lay.restore,
    )  # fmt: skip
    requests = synthetic_requests(lay.sink, lay.window, served.table_width)
    batch = SyntheticBatch(layout, requests, served.dtype, served.device, served.table_width, seed)
    tol = TOLERANCE.get(served.dtype, TOLERANCE[torch.bfloat16])  # other dtypes fail to run
    results: list[CaseResult] = []
    doing = "building it"
    try:
        if path in ("dense", "offload"):
            cls = OffloadPath if path == "offload" else DensePath
            runner: Any = cls(served, layout, batch, model_runner)
        else:
            runner = SegPagedPath(served, layout, batch)
        cases = [(phase, False) for phase in PHASES] + [("decode", True)] * runner.graph_decode
        for phase, graph in cases:
            doing = phase + (" (graph plan)" if graph else "")
            results += _run_case(served, runner, batch, rows, phase, graph, tol)
    except Exception as e:
        raise StartupCheckError(
            f"redknot startup check could not run {PATH_NAMES[path]} ({doing}) for "
            f"{served.describe()}: {type(e).__name__}: {e}. {SKIP_HINT}"
        ) from e
    failed = [r for r in results if r.bad]
    if failed:
        raise StartupCheckError(_failure_message(served, path, tol, failed))
    logger.info(
        "redknot startup check passed (%s): %s matches the PyTorch reference on %d head-class "
        "row(s), %d requests (%d tokens), %s; max |out - ref| %.2g, at most %.2f of the "
        "tolerance %g + %g * |ref|; %.2f s",
        served.describe(), PATH_NAMES[path], len(rows), len(requests),
        sum(r.length for r in requests), ", ".join(dict.fromkeys(r.case for r in results)),
        max(r.max_err for r in results), max(r.ratio for r in results), tol, tol,
        time.perf_counter() - start,
    )  # fmt: skip
    return results


def _run_case(served, runner, batch, rows, phase: str, graph: bool, tol: float):
    """Plan one forward of every request, run it in each checked layer, compare."""
    lay = served.layout
    case = phase + (" (graph plan)" if graph else "")
    fb = batch.forward_batch(phase, runner.req_to_token)
    runner.plan(fb, graph=graph)
    results = []
    for i, (row, layer_id) in enumerate(rows):
        layer = _LayerAt(served.layer(layer_id), i)
        qkv = batch.qkv_of(i, phase)
        rows_too = phase == "extend" and not graph and isinstance(runner, SegPagedPath)
        if rows_too:  # read-only, so before the layer's new keys are written to the stores
            ref, ref_lse = batch.reference_with_lse(i, phase, layer.scaling)
            for name, packed, with_lse, splits in ROW_CASES:
                picked, out, lse = runner.run_rows(*qkv, layer, packed, with_lse, splits)
                pairs = [(name, out, ref[picked])]
                if with_lse:
                    pairs.append((name + ": log-sum-exp", lse, ref_lse[picked]))
                for label, got, want in pairs:
                    err = compare(got, want, tol)
                    results.append(_result(label, batch, phase, row, layer_id, err, picked,
                                            got.numel()))  # fmt: skip
        else:
            ref = batch.reference(i, phase, layer.scaling)
        out = runner.run(*qkv, layer, fb).view(-1, lay.num_q_heads, lay.head_dim)
        results.append(_result(case, batch, phase, row, layer_id, compare(out, ref, tol), None,
                               out.numel()))  # fmt: skip
    return results


def _result(case, batch, phase, row, layer_id, err, picked, numel) -> CaseResult:
    """A case's result, its worst value located (``picked``: the batch rows the output holds,
    None for every row)."""
    max_err, ratio, bad, (t, hq, *_) = err
    b, pos = batch.locate(phase, t if picked is None else int(picked[t]))
    r, h = batch.requests[b], hq // batch.layout.group_size
    promoted = batch.promoted.get((b, batch.layout.classes.index(row))) == h  # its check layer
    kind = "global" if row[h] == "G" else "local, promoted by the request" if promoted else "local"
    where = (
        f"request {b} (prefix {r.prefix}, {r.new} new) position {pos}, query head {hq} "
        f"(KV head {h}, {kind})"
    )
    return CaseResult(case, row, layer_id, max_err, ratio, bad, numel, where)


def _failure_message(served, path, tol, failed: list[CaseResult]) -> str:
    dtype = str(served.dtype).removeprefix("torch.")
    header = (
        f"redknot startup check failed for {served.describe()}: {PATH_NAMES[path]} differs from "
        f"the PyTorch reference attention (tolerance |out - ref| <= {tol:g} + {tol:g} * |ref| "
        f"for {dtype}):"
    )
    lines = [header]
    for r in failed[:_MAX_LINES]:
        lines.append(
            f"  - {r.case}, head classes {r.row} (of layer {r.layer_id}): max |out - ref| "
            f"{r.max_err:.3g}, {r.bad} of {r.numel} values beyond tolerance, worst at {r.where}"
        )
    if len(failed) > _MAX_LINES:
        lines.append(f"  - and {len(failed) - _MAX_LINES} more case(s)")
    lines.append(f"Serving would compute wrong attention on this device. {SKIP_HINT}")
    return "\n".join(lines)


def check_backend(backend: Any, model_runner: Any, skip: bool) -> None:
    """The gate as the redknot backend runs it once built (each TP rank, before serving)."""
    served = ServedAttention.of(model_runner, backend.layout)
    if skip:
        logger.warning(
            "redknot startup check skipped (--redknot-skip-startup-check) for %s: the "
            "attention kernels (%s) are unverified",
            served.describe(), PATH_NAMES[backend.path],
        )  # fmt: skip
        return
    # under --redknot-lfps-offload-gb the dense path serves over host memory
    path = "offload" if getattr(backend, "host_extend", None) is not None else backend.path
    paths = (path, backend.segpaged is not None and backend.dense is not None)
    key = (paths, served.layout, served.dtype, served.kv_dtype, served.device)
    if key not in _passed:
        run_startup_check(served, path, model_runner)
        segpaged = backend.segpaged
        if segpaged is not None and backend.dense is not None:  # both paths serve (per batch)
            run_startup_check(served, "dense", model_runner)
        if segpaged is not None and segpaged.dense_layers < backend.layout.num_layers:
            check_choice(served.device, check_votes=segpaged.tp_size > 1)
        if segpaged is not None and segpaged.rope is not None:
            check_reuse_kernels(segpaged, served)
        if segpaged is not None and segpaged.held_attention is not None:
            check_held_rows(segpaged.held_attention, served)
        _passed.add(key)
        if served.device.type == "cuda":
            torch.cuda.empty_cache()  # the check's tensors, before CUDA-graph capture sizes memory


def check_held_rows(held: Any, served: ServedAttention, seed: int = 0) -> None:
    """The attention of a token policy's rows in recovery on FlashInfer
    (``redknot.kernels.held_rows``, as runs: what the server plans) against its PyTorch
    reference, on two synthetic requests (one after a cached prefix) holding the first 16
    rows of each of three segments and a question, in the served dtype and device. Raises
    ``StartupCheckError``."""
    from redknot.kernels.extend import ExtendConfig
    from redknot.kernels.held_rows import RowRuns, held_rows_reference

    lay = served.layout
    hq, hk, d = lay.num_q_heads, lay.num_kv_heads, lay.head_dim
    g = torch.Generator().manual_seed(seed)
    prefix, lens = [37, 0], [3 * 96 + 24, 2 * 96 + 24]
    keep = torch.zeros(sum(lens), dtype=torch.bool)
    qo = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    for b, n in enumerate(lens):
        for start in range(0, n - 24, 96):
            keep[int(qo[b]) + start : int(qo[b]) + start + 16] = True
        keep[int(qo[b + 1]) - 24 : int(qo[b + 1])] = True
    width = max(p + n for p, n in zip(prefix, lens))
    req_to_token = torch.randperm(2 * width, generator=g).view(2, width).to(torch.int32)
    dev = served.device
    req_to_token, rpi = req_to_token.to(dev), torch.tensor([1, 0], device=dev)
    q = torch.randn((int(keep.sum()), hq, d), generator=g).to(served.dtype).to(dev)
    k, v = (torch.randn((2 * width, hk, d), generator=g).to(served.dtype).to(dev) for _ in "kv")
    scale = served.layer(0).scaling
    tol = TOLERANCE.get(served.dtype, TOLERANCE[torch.bfloat16])
    try:
        plan = held.plan(keep, qo, torch.tensor(prefix, dtype=torch.int32), rpi, req_to_token,
                         ExtendConfig().block_q(lay.group_size))  # fmt: skip
        if not isinstance(plan, RowRuns):
            raise TypeError(f"planned {type(plan).__name__} where runs pay")
        out = held.run(q, k, v, scale)
    except Exception as e:
        raise StartupCheckError(
            f"redknot startup check could not run the rows in recovery on FlashInfer "
            f"(redknot/kernels/held_rows.py) for {served.describe()}: {type(e).__name__}: {e}. "
            f"{_HELD_HINT} {SKIP_HINT}"
        ) from e
    ref = held_rows_reference(q, k, v, keep, qo, torch.tensor(prefix), rpi, req_to_token, scale)
    max_err, _, bad, _ = compare(out, ref.float(), tol)
    if bad:
        raise StartupCheckError(
            f"redknot startup check failed for {served.describe()}: the rows in recovery on "
            f"FlashInfer (redknot/kernels/held_rows.py, {plan.describe()}) differ from the "
            f"reference: max |out - ref| {max_err:.3g}, {bad} values beyond {tol:g} + {tol:g} "
            f"* |ref|. {_HELD_HINT} {SKIP_HINT}"
        )
    logger.info(
        "redknot startup check passed: a token policy's rows in recovery on FlashInfer (%s) "
        "match the reference; max |out - ref| %.2g", plan.describe(), max_err,
    )  # fmt: skip


_HELD_HINT = (
    "Reusing prompts would be computed wrong on this device: serve with --redknot-kernel triton "
    "(redknot's Triton kernels for every reusing prompt)."
)


def check_choice(device: torch.device, check_votes: bool = False, seed: int = 0) -> None:
    """The layer schedule's choice of rows (``redknot.kernels.choose``) against its reference
    on a synthetic request of 3000 candidates (ties and rows already out of recovery included),
    on the serving device; raises ``StartupCheckError`` when it differs or cannot run."""
    from redknot.kernels.choose import choose_rows
    from redknot.kernels.reference import choose_rows_reference

    g = torch.Generator().manual_seed(seed)
    mass = (torch.rand(4000, generator=g) * 64).floor() / 64  # ties
    candidates = torch.sort(torch.randperm(4000, generator=g)[:3000]).values
    rows = candidates + 5
    keep = torch.rand(4010, generator=g) > 0.2
    mass, candidates, rows, keep = (x.to(device) for x in (mass, candidates, rows, keep))
    try:
        for thresh in (0.3, 0.5, 0.9):
            want, count = choose_rows_reference(mass, candidates, rows, thresh, keep, check_votes)
            got = keep.clone()
            skipped = torch.zeros(1, dtype=torch.int32, device=device)
            choose_rows(mass, candidates, rows, thresh, got, skipped, 0, check_votes=check_votes)
            differ = int((got != want).sum())
            if differ or int(skipped[0]) != count:
                raise StartupCheckError(
                    f"redknot startup check: the layer schedule's choice of rows "
                    f"(redknot/kernels/choose.py) differs from its reference at mass_thresh "
                    f"{thresh} on {device}: {differ} rows differ, {int(skipped[0])} counted "
                    f"instead of {count}. Serve without --redknot-dense-layers (or with "
                    f"--redknot-dense-layers equal to the model's layer count). {SKIP_HINT}"
                )
    except StartupCheckError:
        raise
    except Exception as e:
        raise StartupCheckError(
            f"redknot startup check could not run the layer schedule's choice of rows on "
            f"{device}: {type(e).__name__}: {e}. {SKIP_HINT}"
        ) from e
    logger.info("redknot startup check passed: the layer schedule's choice of rows on %s", device)


# ---- segment reuse's other kernels -----------------------------------------------------------

_MASS_TOL = 1e-3  # key mass: float32 sums of probabilities from the same inputs on both sides


def reuse_launches(runner: Any) -> list[tuple[str, int]]:
    """(launch, first layer with its shape) for every distinct kernel launch segment reuse makes
    on this rank (what :meth:`SegPagedRunner._reuse_kv`, ``_blend`` and ``_probe_mass`` launch):

    | launch    | when                                               | distinct by                |
    | --------- | -------------------------------------------------- | -------------------------- |
    | ``local`` | every reusing request, in layers with local heads (``local_kv="cached"``) | region width, local heads |
    | ``left``  | rows leave recovery (layer schedule, token policy) | region width, heads they take |
    | ``blend`` | CacheBlend's check layer                           | region width               |
    | ``mass``  | the layer schedule's deep layers with global heads | global heads               |
    """
    lay = runner.layout
    widths = [len(h) for h in runner.pool.segments.heads]
    schedule = runner.dense_layers < lay.num_layers
    leave = schedule or runner.policy is not None
    seen: dict[tuple, tuple[str, int]] = {}
    for lid, consts in enumerate(runner.consts):
        local = len(consts.local) if runner.local_kv == "cached" else 0
        left = len(runner.left_heads(lid))
        keys = [("local", widths[lid], local)] if local else []
        if leave and left:
            keys.append(("left", widths[lid], left))
        if schedule and lid >= runner.dense_layers and lay.num_global(lid):
            keys.append(("mass", lay.num_global(lid)))
        for key in keys:
            seen.setdefault(key, (key[0], lid))
    policy = runner.policy
    if policy is not None and policy.name == "cacheblend":
        lid = policy.blend_check_layer
        seen.setdefault(("blend", widths[lid]), ("blend", lid))
    return list(seen.values())


def check_reuse_kernels(runner: Any, served: ServedAttention, seed: int = 0) -> int:
    """Segment reuse's RoPE re-alignment (``redknot.kernels.rope_align``) and, under the layer
    schedule, its key mass (``redknot.kernels.key_mass``), launched as a reusing request
    launches them (:func:`reuse_launches`: the served region's head columns, the layer's K/V as
    views of one projection output, the model's RoPE table) on a synthetic request, against
    their PyTorch references. Compiles the variants a first reusing request would otherwise
    compile. Raises ``StartupCheckError``; returns the number of launches checked."""
    start = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    launches = reuse_launches(runner)
    try:
        for name, lid in launches:
            if name == "mass":
                _check_mass(runner, served, lid, g)
            else:
                _check_align(runner, served, name, lid, g)
    except StartupCheckError:
        raise
    except Exception as e:
        raise StartupCheckError(
            f"redknot startup check could not run segment reuse's {_kernel_of(name)} "
            f"({name} launch) for {served.describe()}: {type(e).__name__}: {e}. {_REUSE_HINT} "
            f"{SKIP_HINT}"
        ) from e
    logger.info(
        "redknot startup check passed: segment reuse's kernels (%s) match their references on "
        "%s; %.2f s", ", ".join(f"{n} of layer {lid}" for n, lid in launches) or "none",
        served.device, time.perf_counter() - start,
    )  # fmt: skip
    return len(launches)


def _kernel_of(launch: str) -> str:
    if launch == "mass":
        return "key mass (redknot/kernels/key_mass.py)"
    return "RoPE re-alignment (redknot/kernels/rope_align.py)"  # local, left, blend


_REUSE_HINT = (
    "Reused segments would be computed wrong on this device: serve without segment reuse "
    "(--redknot-segment-fraction 0), or without the layer schedule (no --redknot-dense-layers) "
    "if only the key mass fails."
)


def _layer_kv(served: ServedAttention, rows: int, g: torch.Generator):
    """Queries, keys and values of ``rows`` tokens as a layer sees them: views of one
    projection output ``[rows, (Hq + 2 H_kv) * D]`` (the strides SGLang's attention passes)."""
    lay = served.layout
    hq, hk, d = lay.num_q_heads, lay.num_kv_heads, lay.head_dim
    qkv = torch.randn((rows, (hq + 2 * hk) * d), generator=g).to(served.dtype).to(served.device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(rows, hq, d), k.view(rows, hk, d), v.view(rows, hk, d)


def _reuse_failure(served, name: str, lid: int, what: str, err, tol: float) -> None:
    max_err, _, bad, _ = err
    if bad:
        raise StartupCheckError(
            f"redknot startup check failed for {served.describe()}: segment reuse's "
            f"{_kernel_of(name)} differs from its reference ({name} launch, shaped as in "
            f"layer {lid}; {what}): max |out - ref| {max_err:.3g}, {bad} values beyond "
            f"{tol:g} + {tol:g} * |ref|. {_REUSE_HINT} {SKIP_HINT}"
        )


def _check_align(runner, served: ServedAttention, name: str, lid: int, g) -> None:
    """One RoPE re-alignment launch as ``_align`` (``local``, ``left``: head columns of the
    region to KV heads of the layer's K/V) or ``_blend`` (every region column to a buffer)."""
    from redknot.kernels.rope_align import rope_align
    from redknot.kernels.rope_reference import rope_align_reference

    region, rope, dev = runner.pool.segments, runner.rope, served.device
    width, d = region.k[lid].shape[1], served.layout.head_dim
    n, src_rows, dst_len = 40, 64, 48
    k_src, v_src = (torch.randn((src_rows, width, d), generator=g).to(region.dtype).to(dev)
                    for _ in range(2))  # fmt: skip
    if name == "blend":
        k_dst, v_dst = (x.new_empty((dst_len, width, d)).normal_() for x in (k_src, v_src))
        heads = {}
    else:
        _, k_dst, v_dst = _layer_kv(served, dst_len, g)
        pair = runner.consts[lid].local if name == "local" else runner.left_heads(lid)
        heads = {"src_heads": pair.cols, "dst_heads": pair.heads}
    max_pos = rope.cos_sin_cache.shape[0]
    index = {
        "src_rows": torch.randperm(src_rows, generator=g)[:n],
        "dst_rows": torch.randperm(dst_len, generator=g)[:n],
        "pos_off": torch.randint(0, min(max_pos, 4096), (n,), generator=g),
        "pos_on": torch.randint(0, max_pos, (n,), generator=g),
    }
    index["pos_on"][:4] = index["pos_off"][:4]  # a key at its own position: copied bit for bit
    index = {k: t.to(dev) for k, t in index.items()}
    want_k, want_v = rope_align_reference(
        k_src, index["src_rows"], k_dst, index["dst_rows"], index["pos_off"], index["pos_on"],
        rope.cos_sin_cache, is_neox=rope.is_neox, v_src=v_src, v_dst=v_dst, **heads,
    )  # fmt: skip
    rope_align(
        k_src, index["src_rows"], k_dst, index["dst_rows"], index["pos_off"], index["pos_on"],
        rope.cos_sin_cache, is_neox=rope.is_neox, rotary_dim=rope.rotary_dim, v_src=v_src,
        v_dst=v_dst, **heads,
    )  # fmt: skip
    tol = TOLERANCE.get(served.dtype, TOLERANCE[torch.bfloat16])
    _reuse_failure(served, name, lid, "keys", compare(k_dst, want_k.float(), tol), tol)
    _reuse_failure(served, name, lid, "values", compare(v_dst, want_v.float(), 0.0), 0.0)


def _check_mass(runner, served: ServedAttention, lid: int, g) -> None:
    """One key-mass launch as ``_probe_mass``: probed queries of a request's last rows, their
    log-sum-exp over every key they see, the keys read from a global store through a request
    table row."""
    from redknot.kernels.key_mass import key_mass
    from redknot.kernels.reference import key_mass_reference, probe_lse

    lay, dev = served.layout, served.device
    num_g, grp, d = lay.num_global(lid), lay.group_size, lay.head_dim
    end, probes, rows, slots = 200, 16, 24, 256
    q, _, _ = _layer_kv(served, rows, g)
    store = torch.randn((slots, num_g, d), generator=g).to(served.dtype).to(dev)
    table = torch.zeros((3, served.table_width), dtype=torch.int32)
    table[1, :end] = torch.randperm(slots, generator=g)[:end].to(torch.int32)
    table = table.to(dev)
    q_heads = runner.consts[lid].global_queries
    scale = served.layer(lid).scaling
    q_row0, pos0 = rows - probes, end - probes
    probed = q[q_row0:, q_heads.long()].view(probes, num_g, grp, d)
    keys = store[table[1, :end].long()]
    q_pos = torch.arange(pos0, end, device=dev)
    lse = torch.zeros((rows, lay.num_q_heads), dtype=torch.float32, device=dev)
    lse[q_row0:, q_heads.long()] = probe_lse(probed, keys, q_pos, scale).view(probes, -1)
    want = key_mass_reference(probed, keys, q_pos, scale)
    got = key_mass(q, lse, store, table, 1, q_row0, pos0, probes, end, q_heads, scale)
    _reuse_failure(served, "mass", lid, "mass per key", compare(got, want, _MASS_TOL), _MASS_TOL)
