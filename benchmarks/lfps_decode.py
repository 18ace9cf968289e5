"""Decode attention latency of one layer: full attention, exact Top-k and LFPS, side by side on
one GPU (8B shape: 32 query / 8 KV heads, head_dim 128, bf16; one token per request over a
paged store of ``L`` keys per request; Top-k budget 2% of the keys).

    python3 benchmarks/gpu_run.py bench lfps_decode --lengths 32768,131072 --batches 1,8,32
    TRITON_INTERPRET=1 python benchmarks/lfps_decode.py --small --device cpu --out /tmp/lfps_decode.json  # smoke

Methods (``ms_*`` per call of one layer):

| name                 | what runs                                                               |
| -------------------- | ----------------------------------------------------------------------- |
| ``full``             | FlashInfer's paged decode (page size 1; the faster of its CUDA-core and |
|                      | tensor-core kernels), else redknot's dense decode kernel: ``full_impl`` |
| ``topk_<sel>``       | ``exact_topk`` (score every key, ``torch.topk``) + ``run_sparse_decode``|
| ``lfps_<sel>``       | ``lfps_decode_step``: Eq. 5-6 gathers, candidate kernel, scoring of the |
|                      | candidates, Top-k, Eq. 10 update, ``run_sparse_decode``                  |
| ``attend_<sel>``     | ``run_sparse_decode`` alone over a fixed list of the same width         |

``index_ms_<method>_<sel>`` is the method's time less ``attend``'s: what choosing the keys costs.

With ``--host-kv`` (issue 28 item 3, KV offloaded to host memory): the layer's K/V are also
copied to pinned host memory and the same kernels read them there over PCIe (CUDA's unified
addressing; LFPS's tables, the queries and the page table stay on the GPU):
``lfps_host_<sel>``, ``attend_host_<sel>`` and ``full_host`` (redknot's dense decode kernel over
every host key: what offloading without a sparse index costs); per KV head also
``lfps_host_staged_kv_head`` and ``attend_host_staged_kv_head``, the rows gathered into GPU
staging buffers first (``redknot.kernels.host_stage``). Each host method's output is checked
equal to the same method's over the GPU copy (``host_equal_*``) before it is timed.
With ``--stages``, ``lfps_stages_<sel>`` splits an LFPS step into its kernels (ms per call from
``torch.profiler``, eager calls without the L2 flush: shares, not figures to compare).
With ``--mark-gather``, the step is also timed with each of the mark kernel's two ways to its
Eq. 9 shifts (``redknot.kernels.lfps_index.MARK_GATHER``, gathered by default since 3fbbed5):
``lfps_loads_<sel>`` reads the tables again at every offset, ``lfps_gather_<sel>`` gathers the
shifts from the entries it read; ``gather_equal_<sel>`` says whether both gave the same
selection and output first. (Results before 3fbbed5 have no ``lfps_loads_<sel>``: their
``lfps_<sel>`` was the loads step.) ``--topk-early-exit`` does the same for the Top-k's passes
(``redknot.kernels.lfps_step.TOPK_EARLY_EXIT``, on by default since 031410b; ``lfps_<sel>`` of
earlier results ran every pass): ``lfps_topk_passes_<sel>`` runs every pass,
``lfps_topk_early_<sel>`` stops once the bin found holds exactly the keys still wanted
(``topk_early_equal_<sel>``).
With ``--update-settings BLOCK:WARPS,...``, ``update_settings_kv_head`` times the ``kv_head``
step at each launch setting of its add launch (``UPDATE_BLOCK_K`` Top-K entries and
``UPDATE_WARPS`` warps per program; it adds Eq. 10 and weights the selection's values), each
output compared with the default's first (``max_abs_diff``, over a copy of the same state).

``<sel>`` is ``kv_head`` (one selection per KV head shared by its 4 query heads),
``kv_head_union`` (lists and tables per KV head, each query head's own Top-k of the list, their
union attended: ``lfps_attended_share_*`` is its width over K; ``C = --union-candidate-factor *
K``; how far the heads agree is ``--query-similarity``) or ``query_head`` (one per query head,
the reference's per-head LFPS). LFPS's score tables are
synthetic (log-normal noise, a few strong positions and distances, a local slash band), not from
a model: with the default ``--table-sigma 4`` about 5% of the keys are candidates, between the
paper's Table 4 at 128K (1.7-2%) and SmolLM2's 15% at 8K (``lfps_recall.json``); the measured
share (``lfps_candidate_share_*``) and the rows over capacity (``lfps_overflow_share_*``) are
reported with the times. Candidate capacity ``C = --candidate-factor * K``.

GPU times: median of ``--repeats`` replays of a CUDA graph of ``--calls`` calls with an L2 flush
before each call (the flush alone is timed and subtracted); a method that cannot be captured is
timed eagerly (``triton.testing.do_bench``) and says so in ``timing``. ``--device cpu`` runs
the Triton kernels under the interpreter and times with ``time.perf_counter`` (a smoke test,
not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from segpaged_kernels import Timer
from serving_common import record, write_json

FULL_SHAPE = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMALL_SHAPE = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64}
TARGET = "decode attention >= 5x faster than full attention at 128K (B = 8)"


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- timing -----------------------------------------------------------------------------------


def attempt(row: dict, name: str, timer: Timer, make) -> None:
    """Time ``make()`` (which returns the call) into ``row['ms_' + name]``; errors become notes."""
    try:
        row[f"ms_{name}"], row.setdefault("timing", {})[name] = timer(make())
    except Exception as e:  # noqa: BLE001 - a failing method must not end the run
        row[f"ms_{name}"] = None
        row.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
    if timer.device == "cuda":
        torch.cuda.empty_cache()


# ---- the layer --------------------------------------------------------------------------------


@dataclasses.dataclass
class Layer:
    q: torch.Tensor  # [B, Hq, D]
    k_buffer: torch.Tensor  # [B * L, Hkv, D]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [B, L] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, all L

    @property
    def paged(self):
        return self.req_to_token, self.req_pool_indices, self.seq_lens


def make_layer(B: int, L: int, shape: dict, dtype, device: str, similarity: float = 0.0) -> Layer:
    """Random K/V and queries; ``similarity`` s: each query head is ``sqrt(s)`` times its KV
    head's shared direction plus ``sqrt(1 - s)`` times its own (0: independent heads)."""
    Hq, Hkv, D = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    q = torch.randn(B, Hq, D, device=device)
    shared = torch.randn(B, Hkv, D, device=device).repeat_interleave(Hq // Hkv, 1)
    q = math.sqrt(similarity) * shared + math.sqrt(1.0 - similarity) * q
    return Layer(
        q=q.to(dtype),
        k_buffer=torch.randn(B * L, Hkv, D, device=device, dtype=dtype),
        v_buffer=torch.randn(B * L, Hkv, D, device=device, dtype=dtype),
        req_to_token=torch.arange(B * L, device=device, dtype=torch.int32).view(B, L),
        req_pool_indices=torch.arange(B, device=device),
        seq_lens=torch.full((B,), L, device=device, dtype=torch.int64),
    )


def synthetic_state(B: int, L: int, rows: int, shape: dict, sink: int, sigma: float,
                    device: str, seed: int = 0):  # fmt: skip
    """An ``LfpsBatchState`` covering ``L - 1`` keys: log-normal tables (``sigma``) with 0.2% of
    positions and distances 30x stronger and the first 64 distances 10x (a local band), each
    table summing to 1/2 over the non-sink keys."""
    from redknot.lfps.batch_state import LfpsBatchState

    g = torch.Generator(device=device).manual_seed(seed)
    Hq, Hkv, D = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    Hs = Hq // rows

    def table(by_distance: bool) -> torch.Tensor:
        x = torch.exp(sigma * torch.randn(B, Hs, L, generator=g, device=device))
        strong = torch.rand(B, Hs, L, generator=g, device=device) < 0.002
        x = torch.where(strong, 30.0 * x.mean(), x)
        if by_distance:
            x[..., :64] *= 10.0
            x[..., L - 1 - sink :] = 0.0  # distances no earlier step could have seen
        else:
            x[..., :sink] = 0.0
            x[..., L - 1 :] = 0.0
        return (0.5 * x / x.sum(-1, keepdim=True)).contiguous()

    return LfpsBatchState(
        vertical=table(False),
        slash=table(True),
        scale=torch.ones(B, Hs, device=device),
        mean_key=0.1 * torch.randn(B, Hkv, D, generator=g, device=device),
        mean_value=torch.randn(B, Hkv, D, generator=g, device=device),
        query_stat=torch.full((B, Hq), 1.0 / D, device=device),
        rows=rows,
    )


# ---- methods ----------------------------------------------------------------------------------


def full_attention(layer: Layer, shape: dict, scale: float, device: str):
    """``(calls, impl)``: FlashInfer's decode wrappers if usable (``{tensor_cores: (wrapper,
    kv)}``), else redknot's dense decode call; ``impl`` says which (and why not FlashInfer)."""
    B, Hq, D = layer.q.shape
    Hkv = shape["num_kv_heads"]
    L = layer.req_to_token.shape[1]
    out = torch.empty_like(layer.q)
    why = "flashinfer not usable on the cpu"
    if device == "cuda":
        try:
            import flashinfer

            calls = {}
            for tc in (False, True):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD",
                    use_tensor_cores=tc,
                )  # fmt: skip
                indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * L
                last = torch.ones(B, dtype=torch.int32, device=device)
                w.plan(indptr, layer.req_to_token.view(-1), last, Hq, Hkv, D, 1,
                       q_data_type=layer.q.dtype, kv_data_type=layer.q.dtype,
                       sm_scale=scale)  # fmt: skip
                kv = (layer.k_buffer.unsqueeze(1), layer.v_buffer.unsqueeze(1))
                calls[tc] = (w, kv)
            return calls, f"flashinfer {flashinfer.__version__} BatchDecodeWithPagedKVCacheWrapper"
        except Exception as e:  # noqa: BLE001 - no FlashInfer: the project's dense kernel
            why = f"flashinfer not usable: {type(e).__name__}: {str(e)[:200]}"
    call = dense_decode(layer, layer.k_buffer, layer.v_buffer, shape, scale, device, out)
    return call, f"redknot dense decode (run_decode, every head global); {why}"


def dense_decode(layer: Layer, k_buf, v_buf, shape: dict, scale: float, device: str, out):
    """A call of redknot's dense decode kernel (every head global) over ``k_buf`` / ``v_buf``
    (any store the kernel can read) into ``out``."""
    from redknot.kernels.decode import DecodeWorkspace, plan_decode, run_decode
    from redknot.kernels.geometry import LayerHeads, SegGeometry

    B, Hq, D = layer.q.shape
    Hkv = shape["num_kv_heads"]
    geo = SegGeometry(Hq, Hkv, D, sink=4, window=1)
    ids = torch.arange(Hkv, dtype=torch.int32, device=device)
    heads = LayerHeads(torch.zeros_like(ids), ids, ids.clone(), tuple(range(Hkv)))
    ws = DecodeWorkspace(geo, B, 256, device)
    plan = plan_decode(geo, ws, layer.seq_lens, layer.req_pool_indices,
                       seq_lens_cpu=layer.seq_lens.cpu())  # fmt: skip
    small = layer.k_buffer[:1]

    def call():
        run_decode(plan, layer.q, k_buf, v_buf, small, small, layer.req_to_token, heads, scale,
                   out=out)  # fmt: skip

    return call


def run_case(B: int, L: int, args, shape: dict, timer: Timer, params) -> dict:
    from redknot.kernels.lfps_index import exact_topk
    from redknot.kernels.sparse_decode import plan_sparse_decode, run_sparse_decode
    from redknot.lfps.batched import LfpsBudgets, lfps_decode_step

    dev, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float16
    Hq, Hkv, D = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
    grp, sink = Hq // Hkv, params.num_sink
    scale = 1.0 / math.sqrt(D)
    k = params.budget_for(L - sink)
    budgets = LfpsBudgets(candidates=min(L, args.candidate_factor * k), topk=k)
    union = LfpsBudgets(candidates=min(L, args.union_candidate_factor * k), topk=k, union=grp)
    row = {"L": L, "B": B, "topk": k, "candidates": budgets.candidates,
           "union_candidates": union.candidates}  # fmt: skip
    layer = make_layer(B, L, shape, dtype, dev, args.query_similarity)
    out = torch.empty_like(layer.q)

    full, impl = full_attention(layer, shape, scale, dev)
    row["full_impl"] = impl
    if isinstance(full, dict):  # FlashInfer: both kernels, the faster is "full"
        for tc, (w, kv) in full.items():
            name = f"full_flashinfer_{'tensor' if tc else 'cuda'}_cores"
            attempt(row, name, timer, lambda w=w, kv=kv: lambda: w.run(layer.q, kv))
        times = [row[f"ms_full_flashinfer_{c}_cores"] for c in ("cuda", "tensor")]
        row["ms_full"] = min([t for t in times if t], default=None)
    else:
        attempt(row, "full", timer, lambda: full)

    selections = (("kv_head", grp, budgets), ("kv_head_union", grp, union),
                  ("query_head", 1, budgets))  # fmt: skip
    for sel, rows, bud in selections:
        if sel not in args.selections:
            continue
        width = bud.width
        plan = plan_sparse_decode(batch_size=B, num_q_heads=Hq, head_dim=D, rows=rows,
                                  width=width, num_sink=sink, device=dev)  # fmt: skip
        row.setdefault("num_splits", {})[sel] = plan.num_splits

        def topk_call(plan=plan, rows=rows):
            idx = exact_topk(layer.q, layer.k_buffer, *layer.paged, k=k, num_sink=sink,
                             sm_scale=scale, width=L, rows=rows)  # fmt: skip
            run_sparse_decode(plan, layer.q, layer.k_buffer, layer.v_buffer, *layer.paged, idx,
                              scale, out=out)  # fmt: skip

        if bud.union == 1:  # exact Top-k has no union variant
            attempt(row, f"topk_{sel}", timer, lambda f=topk_call: f)
        fixed = torch.randint(sink, L, (B, Hq // rows, width), device=dev, dtype=torch.int32)
        attempt(row, f"attend_{sel}", timer, lambda plan=plan, fixed=fixed: lambda: (
            run_sparse_decode(plan, layer.q, layer.k_buffer, layer.v_buffer, *layer.paged,
                              fixed, scale, out=out)))  # fmt: skip
        del fixed

        state = synthetic_state(B, L, rows, shape, sink, args.table_sigma, dev)
        probe = state.clone()
        res = lfps_decode_step(layer.q, layer.k_buffer, layer.v_buffer, *layer.paged, probe,
                               params, bud, plan=plan)  # fmt: skip
        count = res.candidate_count.float()
        row[f"lfps_candidate_share_{sel}"] = float(count.mean()) / (L - sink)
        row[f"lfps_overflow_share_{sel}"] = float((count > bud.candidates).float().mean())
        row[f"lfps_bypass_share_{sel}"] = float(res.bypass.float().mean())
        row[f"lfps_attended_share_{sel}"] = float((res.selected >= 0).sum(-1).float().mean()) / k
        del probe, res

        def lfps_call(state=state, plan=plan, bud=bud):
            return lfps_decode_step(layer.q, layer.k_buffer, layer.v_buffer, *layer.paged, state,
                             params, bud, plan=plan)  # fmt: skip

        attempt(row, f"lfps_{sel}", timer, lambda f=lfps_call: f)
        if args.stages:
            row[f"lfps_stages_{sel}"] = stage_times(lfps_call, dev)
        for switch in SWITCHES:
            if getattr(args, switch):
                switch_variants(row, sel, lfps_call, state, timer, dev, args.stages, switch)
        if sel == "kv_head" and args.update_settings:
            step = functools.partial(lfps_decode_step, layer.q, layer.k_buffer, layer.v_buffer,
                                     *layer.paged, params=params, budgets=bud, plan=plan)  # fmt: skip
            row[f"update_settings_{sel}"] = update_settings(step, state, args.update_settings,
                                                            timer)  # fmt: skip
        del state

    if args.host_kv:
        host_kv_methods(row, layer, args, shape, timer, params, budgets)
    full_ms = row.get("ms_full")
    for name in [n[3:] for n in list(row) if n.startswith(("ms_topk_", "ms_lfps_"))]:
        if full_ms and row.get(f"ms_{name}"):
            row[f"speedup_{name}"] = full_ms / row[f"ms_{name}"]
        attend = row.get(f"ms_attend_{name.split('_', 1)[1]}")
        if attend and row.get(f"ms_{name}"):  # the selection's share of the method's time
            row[f"index_ms_{name}"] = row[f"ms_{name}"] - attend
    return row


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, pinned where there is a GPU (the kernels read it over PCIe)."""
    out = t.cpu()
    return out.pin_memory() if torch.cuda.is_available() else out


def host_staged(row, layer, hk, hv, state, plan, params, budgets, timer, dev) -> None:
    """Lists per KV head over host K/V through staging buffers (``stage_rows``): the
    candidates' keys and the selected rows gathered first, then scored and attended on the GPU
    (``lfps_host_staged_kv_head``; ``attend_host_staged_kv_head``: a random list staged and
    attended); each checked equal to the unstaged run first."""
    from redknot.kernels.host_stage import stage_rows
    from redknot.kernels.sparse_decode import run_sparse_decode
    from redknot.lfps.batched import host_stages, lfps_decode_step

    B, _, D = layer.q.shape
    Hkv, L = hk.shape[1], layer.req_to_token.shape[1]
    sink, k, scale = params.num_sink, budgets.topk, 1.0 / math.sqrt(D)
    stage = host_stages(B, Hkv, D, params, budgets, hk.dtype, dev)
    a, b = state.clone(), state.clone()
    want = lfps_decode_step(layer.q, hk, hv, *layer.paged, a, params, budgets, plan=plan)
    got = lfps_decode_step(layer.q, hk, hv, *layer.paged, b, params, budgets, plan=plan,
                           stage=stage)  # fmt: skip
    row["host_equal_lfps_staged_kv_head"] = bool(
        torch.equal(got.output, want.output) and torch.equal(got.selected, want.selected)
    )
    del a, b, want, got

    def lfps_call():
        lfps_decode_step(layer.q, hk, hv, *layer.paged, state, params, budgets, plan=plan,
                         stage=stage)  # fmt: skip

    attempt(row, "lfps_host_staged_kv_head", timer, lambda: lfps_call)
    fixed = torch.randint(sink, L, (B, Hkv, k), device=dev, dtype=torch.int32)
    out = torch.empty_like(layer.q)

    def attend_call():
        st = stage_rows(stage[1], hk, hv, *layer.paged, fixed)
        run_sparse_decode(plan, layer.q, st.k, st.v, st.req_to_token, st.req_pool_indices,
                          st.seq_lens, st.indices, scale, out=out)  # fmt: skip

    attempt(row, "attend_host_staged_kv_head", timer, lambda: attend_call)


def host_kv_methods(row: dict, layer: Layer, args, shape: dict, timer, params, budgets) -> None:
    """``--host-kv``: LFPS, its attention alone and full attention over K/V in host memory."""
    from redknot.kernels.sparse_decode import plan_sparse_decode, run_sparse_decode
    from redknot.lfps.batched import lfps_decode_step

    dev = args.device
    B, Hq, D = layer.q.shape
    Hkv, L = shape["num_kv_heads"], layer.req_to_token.shape[1]
    sink, k, scale = params.num_sink, budgets.topk, 1.0 / math.sqrt(D)
    hk, hv = host_copy(layer.k_buffer), host_copy(layer.v_buffer)
    row["host_kv_bytes"] = 2 * hk.numel() * hk.element_size()
    out = torch.empty_like(layer.q)
    for sel, rows in (("kv_head", Hq // Hkv), ("query_head", 1)):
        if sel not in args.selections:
            continue
        plan = plan_sparse_decode(batch_size=B, num_q_heads=Hq, head_dim=D, rows=rows, width=k,
                                  num_sink=sink, device=dev)  # fmt: skip
        fixed = torch.randint(sink, L, (B, Hq // rows, k), device=dev, dtype=torch.int32)
        want = run_sparse_decode(plan, layer.q, layer.k_buffer, layer.v_buffer, *layer.paged,
                                 fixed, scale).clone()  # fmt: skip
        got = run_sparse_decode(plan, layer.q, hk, hv, *layer.paged, fixed, scale)
        row[f"host_equal_attend_{sel}"] = bool(torch.equal(got, want))
        attempt(row, f"attend_host_{sel}", timer, lambda plan=plan, fixed=fixed: lambda: (
            run_sparse_decode(plan, layer.q, hk, hv, *layer.paged, fixed, scale, out=out)
        ))  # fmt: skip
        del fixed
        state = synthetic_state(B, L, rows, shape, sink, args.table_sigma, dev)
        a, b = state.clone(), state.clone()
        want = lfps_decode_step(layer.q, layer.k_buffer, layer.v_buffer, *layer.paged, a,
                                params, budgets, plan=plan)  # fmt: skip
        got = lfps_decode_step(layer.q, hk, hv, *layer.paged, b, params, budgets, plan=plan)
        row[f"host_equal_lfps_{sel}"] = bool(
            torch.equal(got.output, want.output) and torch.equal(got.selected, want.selected)
        )
        del a, b, want, got

        def lfps_call(state=state, plan=plan):
            lfps_decode_step(layer.q, hk, hv, *layer.paged, state, params, budgets, plan=plan)

        attempt(row, f"lfps_host_{sel}", timer, lambda f=lfps_call: f)
        if sel == "kv_head":
            host_staged(row, layer, hk, hv, state, plan, params, budgets, timer, dev)
        del state
    full_host = dense_decode(layer, hk, hv, shape, scale, dev, out)
    full_host()
    got = out.clone()
    dense_decode(layer, layer.k_buffer, layer.v_buffer, shape, scale, dev, out)()
    row["host_equal_full"] = bool(torch.equal(got, out))

    attempt(row, "full_host", timer, lambda: full_host)


def update_settings(step, state, settings: list[tuple[int, int]], timer: Timer) -> list[dict]:
    """The step (``step(state)``) at each ``(UPDATE_BLOCK_K, UPDATE_WARPS)``: its output's
    largest difference from the default setting's on a copy of ``state``, and its time."""
    from redknot.kernels import lfps_step

    default = (lfps_step.UPDATE_BLOCK_K, lfps_step.UPDATE_WARPS)
    want = step(state.clone()).output.float()
    out = []
    try:
        for block, warps in settings:
            lfps_step.UPDATE_BLOCK_K, lfps_step.UPDATE_WARPS = block, warps
            entry = {"block": block, "num_warps": warps}
            try:
                got = step(state.clone()).output.float()
                entry["max_abs_diff"] = float((got - want).abs().max())
                entry["ms"], _ = timer(lambda: step(state))
            except Exception as e:  # noqa: BLE001 (a setting that fails is a finding)
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print("update setting", entry, flush=True)
            out.append(entry)
    finally:
        lfps_step.UPDATE_BLOCK_K, lfps_step.UPDATE_WARPS = default
    return out


# the step's two-way settings timed side by side: option -> (module, attribute, the names of
# its False and True settings in ``lfps_<name>_<sel>``, the key of their equality check)
SWITCHES = {
    "mark_gather": ("lfps_index", "MARK_GATHER", ("loads", "gather"), "gather_equal"),
    "topk_early_exit": ("lfps_step", "TOPK_EARLY_EXIT", ("topk_passes", "topk_early"),
                        "topk_early_equal"),
}  # fmt: skip


def switch_variants(row, sel, call, state, timer, dev, stages: bool, switch: str) -> None:
    """The step at both settings of ``SWITCHES[switch]`` (a module attribute read at each call):
    ``lfps_<off name>_<sel>`` and ``lfps_<on name>_<sel>``, after ``<key>_<sel>`` checked both
    steps' selections and outputs equal on copies of the same state; the attribute is restored."""
    import importlib

    module_name, attr, names, key = SWITCHES[switch]
    module = importlib.import_module(f"redknot.kernels.{module_name}")
    default = getattr(module, attr)
    try:
        results = []
        for on in (False, True):
            setattr(module, attr, on)
            results.append(call_with_state(call, state.clone()))
        (sel_a, out_a), (sel_b, out_b) = results
        row[f"{key}_{sel}"] = bool(torch.equal(sel_a, sel_b) and torch.equal(out_a, out_b))
        for on, name in zip((False, True), names):
            setattr(module, attr, on)
            attempt(row, f"lfps_{name}_{sel}", timer, lambda: call)
            if stages:
                row[f"lfps_{name}_stages_{sel}"] = stage_times(call, dev)
    finally:
        setattr(module, attr, default)


def call_with_state(call, state) -> tuple[torch.Tensor, torch.Tensor]:
    """``call``'s step on ``state`` (a copy): its selection and output."""
    res = call(state=state)
    return res.selected.clone(), res.output.clone()


def stage_times(call, device: str, calls: int = 10, top: int = 16) -> dict[str, float]:
    """Milliseconds per call of each kernel (GPU; operator self time on the CPU) of ``call``,
    from ``torch.profiler`` over ``calls`` eager calls after one warm-up: where a method's time
    goes, not a figure to compare (eager, no L2 flush)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    gpu = device == "cuda"
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
        if gpu:
            torch.cuda.synchronize()
    field = "self_device_time_total" if gpu else "self_cpu_time_total"
    times = {e.key: getattr(e, field) / 1000.0 / calls for e in prof.key_averages()}
    ranked = sorted(((t, k) for k, t in times.items() if t > 0), reverse=True)
    return {k[:120]: round(t, 4) for t, k in ranked[:top]}


def summary(rows: list[dict], long: int, batch: int) -> dict:
    """The issue's target at (``long``, ``batch``) where that case ran."""
    out = {"target": TARGET}
    names = [n for _, _, pair, _ in SWITCHES.values() for n in pair]
    for row in rows:
        if row["L"] == long and row["B"] == batch:
            for sel in ("kv_head", "kv_head_union", "query_head"):
                for name in [f"lfps_{sel}"] + [f"lfps_{n}_{sel}" for n in names]:
                    if row.get(f"speedup_{name}"):
                        out[f"speedup_{name}"] = round(row[f"speedup_{name}"], 2)
                        out[f"met_{name}"] = row[f"speedup_{name}"] >= 5.0
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072", help="keys per request, comma-separated")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated")
    ap.add_argument("--budget", type=float, default=0.02, help="Top-k share of the keys")
    ap.add_argument("--candidate-factor", type=int, default=4,
                    help="LFPS candidate capacity C in multiples of the Top-k width")  # fmt: skip
    ap.add_argument("--table-sigma", type=float, default=4.0,
                    help="log-normal spread of the synthetic LFPS tables (4: about 5%% of the "
                         "keys are candidates; 3: about 13%%)")  # fmt: skip
    ap.add_argument("--union-candidate-factor", type=int, default=8,
                    help="C of the kv_head_union selection, in Top-k widths")  # fmt: skip
    ap.add_argument("--query-similarity", type=float, default=0.0,
                    help="share of a query head's variance common to its KV head's group (0: "
                    "independent heads, the union's widest case)")  # fmt: skip
    ap.add_argument("--selections", default="kv_head,kv_head_union,query_head")
    ap.add_argument("--calls", type=int, default=None, help="calls per CUDA graph (20; 1 small)")
    ap.add_argument("--repeats", type=int, default=None, help="timed replays (5; 1 small)")
    ap.add_argument(
        "--stages",
        action="store_true",
        help="also record LFPS's time per kernel (torch.profiler, eager)",
    )
    ap.add_argument("--mark-gather", action="store_true",
                    help="also time each step with each way of the mark kernel to its shifts "
                    "(lfps_loads_<sel>, lfps_gather_<sel>; their selections checked equal)")  # fmt: skip
    ap.add_argument("--topk-early-exit", action="store_true",
                    help="also time each step with the Top-k's passes run to the last and "
                    "stopped early (lfps_topk_passes_<sel>, lfps_topk_early_<sel>; their "
                    "selections checked equal)")  # fmt: skip
    ap.add_argument("--update-settings", default="",
                    help="BLOCK:WARPS,... launch settings of the kv_head step's add launch to "
                    "time (see the module docstring)")  # fmt: skip
    ap.add_argument("--host-kv", action="store_true",
                    help="also LFPS, its attention and full attention over K/V in pinned host "
                    "memory (issue 28 item 3)")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true",
                    help="tiny shape (4 query / 2 KV heads, D = 64) for a smoke run")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/lfps_decode.json")
    args = ap.parse_args(argv)
    args.update_settings = [tuple(map(int, item.split(":"))) for item in
                            args.update_settings.split(",") if item]  # fmt: skip
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from redknot.kernels.sparse_decode import SparseDecodeConfig
    from redknot.lfps import LfpsParams

    shape = dict(SMALL_SHAPE if args.small else FULL_SHAPE)
    lengths, batches = parse_ints(args.lengths), parse_ints(args.batches)
    if args.small and args.lengths == ap.get_default("lengths"):
        lengths, batches = [300, 600], [1, 2]
    args.calls = args.calls or (1 if args.small else 20)
    args.repeats = args.repeats or (1 if args.small else 5)
    params = LfpsParams(budget=args.budget)
    timer = Timer(args.calls, args.repeats, device=args.device)
    shape["dtype"] = "bfloat16" if args.device == "cuda" else "float16"
    result = record(
        shape=shape, lfps_params=dataclasses.asdict(params),
        candidate_factor=args.candidate_factor, table_sigma=args.table_sigma,
        union_candidate_factor=args.union_candidate_factor,
        query_similarity=args.query_similarity,
        sparse_decode_config=dataclasses.asdict(SparseDecodeConfig()),
        timing=(f"median of {args.repeats} replays of a CUDA graph of {args.calls} calls, L2 "
                "flushed before each call (flush subtracted)" if args.device == "cuda"
                else "CPU wall time under the Triton interpreter (smoke test only)"),
        rows=[],
    )  # fmt: skip
    for L in lengths:
        for B in batches:
            t0 = time.time()
            row = run_case(B, L, args, shape, timer, params)
            row["wall_s"] = round(time.time() - t0, 1)
            result["rows"].append(row)
            result["summary"] = summary(result["rows"], max(lengths), 8)
            brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                     if k.startswith(("ms_", "speedup_"))}  # fmt: skip
            print(f"L={L} B={B}", brief, flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
