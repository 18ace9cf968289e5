"""SegPagedAttention kernels against dense FlashInfer, heads-folded FlashInfer and SDPA with an
additive mask, side by side on one GPU (Llama-3.1-8B attention: 32 query / 8 KV heads, D=128,
bf16; sink 64 + window 256; local heads in a ring store).

    python benchmarks/segpaged_kernels.py --out benchmarks/results/segpaged_kernels.json

Times are per call of one layer, from CUDA graphs of 20 calls with an L2 flush before each call
(the flush alone is timed and subtracted); methods that cannot be captured are timed eagerly
with ``triton.testing.do_bench`` (also flushing L2) and say so. ``ideal_speedup`` is the ratio of
KV bytes read (decode) or of attention FLOPs (prefill) of dense over redknot, from the exact
key counts of every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from redknot.headmap import ModelShape, synthetic_map
from redknot.kernels.decode import DecodeConfig, DecodeWorkspace, plan_decode, run_decode
from redknot.kernels.extend import ExtendConfig, plan_extend, run_extend
from redknot.kernels.geometry import LayerHeads, SegGeometry
from redknot.pool.layout import HeadLayout

HQ, HKV, D, GRP = 32, 8, 128, 4
SINK, WINDOW = 64, 256
RING_LEN = SINK + WINDOW
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(D)
FRACS = {"1/8": 1 / 8, "4/8": 4 / 8}
DEV = "cuda"

DECODE_VARIANTS = [  # tried on the target cases; the first is DecodeConfig()
    DecodeConfig(),
    *(DecodeConfig(num_stages=3, programs_per_sm=p) for p in (3, 4, 8, 12)),
    *(DecodeConfig(block_n=128, num_stages=3, programs_per_sm=p) for p in (4, 8)),
    DecodeConfig(num_warps=2, num_stages=3, programs_per_sm=8),
    DecodeConfig(num_stages=3, programs_per_sm=8, min_chunk=512),
]
EXTEND_VARIANTS = [  # tried on the target cases; the first is ExtendConfig()
    ExtendConfig(),
    ExtendConfig(num_stages=3),
    ExtendConfig(block_n=32, num_stages=3),
    ExtendConfig(block_m=64, num_warps=4, num_stages=3),
]


# ---- timing -----------------------------------------------------------------------------------


class Timer:
    """Milliseconds per call: on a GPU CUDA graphs with the L2 flushed before each call (eager
    where a call cannot be captured), on a CPU (``device="cpu"``: smoke runs) wall time."""

    def __init__(self, calls: int = 20, repeats: int = 5, device: str = DEV) -> None:
        self.calls, self.repeats, self.device = calls, repeats, device
        if device == "cuda":
            self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
            self._flush_ms = self._graph_ms(lambda: None)

    def _graph_ms(self, fn) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.calls):
                self.flush_buf.zero_()
                fn()
        graph.replay()
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / self.calls)
        del graph
        return sorted(times)[len(times) // 2]

    def __call__(self, fn, eager: bool = False) -> tuple[float, str]:
        fn()  # compile outside any capture
        if self.device != "cuda":
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / self.calls)
            return sorted(times)[len(times) // 2], "cpu_wall"
        torch.cuda.synchronize()
        if not eager:
            try:
                return max(self._graph_ms(fn) - self._flush_ms, 1e-4), "cuda_graph"
            except Exception:  # noqa: BLE001 - some methods cannot be captured; time them eagerly
                torch.cuda.synchronize()
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"), "eager"


# ---- the layer ---------------------------------------------------------------------------------


def layer_of(frac: float) -> tuple[HeadLayout, LayerHeads, SegGeometry]:
    shape = ModelShape("LlamaForCausalLM", 1, HKV, HQ, D)
    hm = synthetic_map(shape, frac, window=WINDOW, sink=SINK)
    layout = HeadLayout.from_head_map(hm)
    geo = SegGeometry.from_layout(layout, local_mode="ring", ring_len=RING_LEN)
    return layout, LayerHeads.from_layout(layout, 0, DEV), geo


def ring_index(pos: torch.Tensor) -> torch.Tensor:
    return torch.where(pos < SINK, pos, SINK + (pos - SINK) % (RING_LEN - SINK))


def local_visible(n: int) -> torch.Tensor:
    """Positions a local head sees from a query at ``n - 1``."""
    pos = torch.arange(n, device=DEV)
    return pos[(pos < SINK) | (n - 1 - pos < WINDOW)]


def local_keys_prefill(L: int) -> int:
    """Sum over queries of the keys a local head sees (min(i + 1, sink + window))."""
    span = SINK + WINDOW
    head = min(L, span)
    return head * (head + 1) // 2 + max(0, L - span) * span


def rand(*shape) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=DTYPE)


def flashinfer_workspace() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device=DEV)


def paged_prefill(q, k_pages, v_pages, workspace=None, backend: str = "auto"):
    """FlashInfer's causal paged prefill of one request, the dense baseline of one layer: queries
    ``q`` ``[E, HQ, D]`` are the last ``E`` of the ``[N, 1, HKV, D]`` keys and values (pages of
    one token). Returns the call to time."""
    import flashinfer

    n, e = k_pages.shape[0], q.shape[0]
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        flashinfer_workspace() if workspace is None else workspace, "NHD", backend=backend
    )
    i32 = {"dtype": torch.int32, "device": DEV}
    w.plan(torch.tensor([0, e], **i32), torch.tensor([0, n], **i32), torch.arange(n, **i32),
           torch.ones(1, **i32), HQ, HKV, D, 1, causal=True, sm_scale=SCALE, q_data_type=DTYPE,
           kv_data_type=DTYPE)  # fmt: skip
    return lambda: w.run(q, (k_pages, v_pages))


def result_header(commit: str, **extra) -> dict:
    """The results file's record of the run (device, date, commit, command, versions, launch
    settings) before its rows."""
    return {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        **extra,
        "extend_config": dataclasses.asdict(ExtendConfig()),
        "rows": [],
    }


def bench_arguments(description: str, out: str) -> argparse.ArgumentParser:
    """The arguments of every one-layer kernel benchmark: ``--out`` (default ``out``) and
    ``--commit``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=out)
    ap.add_argument(
        "--commit",
        default=os.environ.get("REDKNOT_COMMIT", "unknown"),
        help="commit of the code being measured (default: REDKNOT_COMMIT, set by gpu_run.py)",
    )
    return ap


def save_row(result: dict, row: dict, out: str) -> None:
    """``row`` added to ``result`` and the whole written to ``out``, after every case (a run cut
    short keeps what it measured)."""
    result["rows"].append(row)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


def attempt(row: dict, name: str, timer: Timer, make, eager: bool = False) -> None:
    """Time ``make()`` (which returns the call to time) into ``row[name]``; errors become notes."""
    try:
        fn = make()
        row[f"ms_{name}"], row.setdefault("timing", {})[name] = timer(fn, eager)
    except torch.OutOfMemoryError:
        row[f"ms_{name}"] = None
        row.setdefault("notes", []).append(f"{name}: skipped, out of GPU memory")
    except Exception as e:  # noqa: BLE001 - a failing baseline must not end the run
        row[f"ms_{name}"] = None
        row.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
    torch.cuda.empty_cache()


def best_of(row: dict, name: str) -> None:
    """``ms_<name>``: the faster of the FlashInfer kernels measured for it (the stronger baseline)."""
    times = [v for k, v in row.items() if k.startswith(f"ms_{name}_") and v]
    row[f"ms_{name}"] = min(times) if times else None


# ---- decode -----------------------------------------------------------------------------------


def decode_segpaged(row, B, L, heads, geo, q, r2t, timer, variants) -> None:
    """redknot and the heads-folded FlashInfer call, both over the head-segmented stores."""
    import flashinfer

    G = heads.num_global
    rows = torch.arange(B, device=DEV)
    seq = torch.full((B,), L, device=DEV, dtype=torch.int64)
    kg, vg = rand(B * L, max(G, 1), D), rand(B * L, max(G, 1), D)
    kl, vl = rand(B * RING_LEN, max(HKV - G, 1), D), rand(B * RING_LEN, max(HKV - G, 1), D)
    out = torch.empty_like(q)
    ws = DecodeWorkspace(geo, B, 256, DEV)

    def redknot(cfg: DecodeConfig):
        def make():
            plan = plan_decode(geo, ws, seq, rows, seq_lens_cpu=seq.cpu(), heavy_heads=G,
                               config=cfg)  # fmt: skip
            row.setdefault("num_splits", {})[str(cfg)] = plan.num_splits
            return lambda: run_decode(plan, q, kg, vg, kl, vl, r2t, heads, SCALE, out=out)

        return make

    attempt(row, "redknot", timer, redknot(DecodeConfig()))
    if variants:
        row["variants"] = []
        for cfg in DECODE_VARIANTS[1:]:
            v = {}
            attempt(v, "redknot", timer, redknot(cfg))
            row["variants"].append({"config": dataclasses.asdict(cfg), "ms": v["ms_redknot"]})

    def folded(tensor_cores: bool):
        # one decode call over (request, KV head) rows in one head-folded pool
        pool_k = torch.cat([kg.view(-1, D), kl.view(-1, D)]).view(-1, 1, 1, D)
        pool_v = torch.cat([vg.view(-1, D), vl.view(-1, D)]).view(-1, 1, 1, D)
        off = kg.shape[0] * kg.shape[1]
        is_local, column = heads.is_local_gpu.tolist(), heads.column_gpu.tolist()
        lv = ring_index(local_visible(L))
        idx, lens = [], []
        for b in range(B):
            for h in range(HKV):
                if is_local[h]:
                    idx.append(off + (b * RING_LEN + lv) * kl.shape[1] + column[h])
                else:
                    idx.append((b * L + torch.arange(L, device=DEV)) * kg.shape[1] + column[h])
                lens.append(idx[-1].numel())
        indices = torch.cat(idx).to(torch.int32)
        indptr = torch.zeros(B * HKV + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens), 0, out=indptr[1:])
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            flashinfer_workspace(), "NHD", use_tensor_cores=tensor_cores
        )
        w.plan(indptr.to(DEV), indices, torch.ones(B * HKV, dtype=torch.int32, device=DEV),
               GRP, 1, D, 1, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=SCALE)  # fmt: skip
        qf = q.view(B * HKV, GRP, D)
        return lambda: w.run(qf, (pool_k, pool_v))

    attempt(row, "folded_flashinfer_cuda_cores", timer, lambda: folded(False))
    attempt(row, "folded_flashinfer_tensor_cores", timer, lambda: folded(True))
    best_of(row, "folded_flashinfer")


def decode_case(B: int, L: int, frac_name: str, timer: Timer, variants: bool) -> dict:
    import flashinfer

    _, heads, geo = layer_of(FRACS[frac_name])
    G = heads.num_global
    row = {"phase": "decode", "B": B, "L": L, "global_frac": frac_name, "num_global_heads": G}
    local_n = min(L, SINK + WINDOW)
    bytes_dense = B * HKV * L * 2 * D * 2
    bytes_ours = B * (G * L + (HKV - G) * local_n) * 2 * D * 2
    row["ideal_speedup"] = bytes_dense / bytes_ours
    row["bytes_redknot"], row["bytes_dense"] = bytes_ours, bytes_dense

    q = rand(B, HQ, D)
    r2t = torch.arange(B * L, device=DEV, dtype=torch.int32).view(B, L)
    decode_segpaged(row, B, L, heads, geo, q, r2t, timer, variants)

    kd, vd = rand(B * L, 1, HKV, D), rand(B * L, 1, HKV, D)

    def dense(tensor_cores: bool):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            flashinfer_workspace(), "NHD", use_tensor_cores=tensor_cores
        )
        indptr = torch.arange(B + 1, dtype=torch.int32, device=DEV) * L
        w.plan(indptr, r2t.view(-1), torch.ones(B, dtype=torch.int32, device=DEV), HQ, HKV, D,
               1, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=SCALE)  # fmt: skip
        return lambda: w.run(q, (kd, vd))

    # SGLang's flashinfer backend takes the tensor-core kernel for GQA groups >= 4
    attempt(row, "dense_flashinfer_cuda_cores", timer, lambda: dense(False))
    attempt(row, "dense_flashinfer_tensor_cores", timer, lambda: dense(True))
    best_of(row, "dense_flashinfer")

    def sdpa():
        mask = torch.zeros(1, HQ, 1, L, device=DEV, dtype=DTYPE)
        hidden = torch.ones(L, dtype=torch.bool, device=DEV)
        hidden[local_visible(L)] = False
        for h in range(HKV):
            if heads.is_local_gpu[h]:
                mask[0, h * GRP : (h + 1) * GRP, 0, hidden] = float("-inf")
        q4 = q.view(B, HQ, 1, D)
        k4, v4 = (t.view(B, L, HKV, D).transpose(1, 2) for t in (kd, vd))
        return lambda: F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=SCALE, enable_gqa=True
        )

    attempt(row, "sdpa_mask", timer, sdpa, eager=True)
    return finish(row)


# ---- prefill ----------------------------------------------------------------------------------


def prefill_case(L: int, frac_name: str, timer: Timer, variants: bool) -> dict:
    import flashinfer

    from redknot.kernels.flashinfer_global import (
        FlashInferGlobalRows,
        run_extend_flashinfer_global,
    )

    _, heads, geo = layer_of(FRACS[frac_name])
    G = heads.num_global
    row = {"phase": "prefill", "B": 1, "L": L, "global_frac": frac_name, "num_global_heads": G}
    pairs_dense = HKV * L * (L + 1) // 2
    pairs_ours = G * L * (L + 1) // 2 + (HKV - G) * local_keys_prefill(L)
    row["ideal_speedup"] = pairs_dense / pairs_ours
    row["flops_redknot"] = 4 * D * GRP * pairs_ours
    row["flops_dense"] = 4 * D * GRP * pairs_dense

    q, k, v = rand(L, HQ, D), rand(L, HKV, D), rand(L, HKV, D)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    r2t = torch.zeros(1, L, dtype=torch.int32, device=DEV)
    kg = vg = rand(1, max(G, 1), D)  # no prefix: the global store is not read
    kl, vl = rand(RING_LEN, max(HKV - G, 1), D), rand(RING_LEN, max(HKV - G, 1), D)
    out = torch.empty_like(q)

    def redknot(cfg: ExtendConfig, skip_global: bool = False):
        def make():
            plan = plan_extend(geo, rows, [0], [L], config=cfg)
            return lambda: run_extend(plan, q, k, v, kg, vg, kl, vl, r2t, heads, SCALE, out=out,
                                      skip_global=skip_global)  # fmt: skip

        return make

    def redknot_fi_global(cfg: ExtendConfig | None = None, overlap: bool = False):
        """FlashInfer for the global rows and the Triton kernel for the local rows; with
        ``overlap`` the FlashInfer call runs on a side stream next to the Triton launch."""

        def make():
            plan = plan_extend(geo, rows, [0], [L], config=cfg or ExtendConfig())
            fi = FlashInferGlobalRows(geo, DEV)
            fi.plan(plan, r2t, {G}, DTYPE, SCALE)
            if not overlap:
                return lambda: run_extend_flashinfer_global(
                    fi, plan, q, k, v, kg, vg, kl, vl, r2t, heads, SCALE, out=out
                )
            side = torch.cuda.Stream()

            def call():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fi.run(q, k, v, kg, vg, heads, out)
                run_extend(plan, q, k, v, kg, vg, kl, vl, r2t, heads, SCALE, out=out,
                           skip_global=True)  # fmt: skip
                torch.cuda.current_stream().wait_stream(side)

            return call

        return make

    attempt(row, "redknot", timer, redknot(ExtendConfig()))
    if variants:
        row["variants"] = []
        for cfg in EXTEND_VARIANTS:
            res = {}
            if cfg != ExtendConfig():
                attempt(res, "redknot", timer, redknot(cfg))
            attempt(res, "local_rows_only", timer, redknot(cfg, skip_global=True))
            attempt(res, "fi_global", timer, redknot_fi_global(cfg))
            attempt(res, "fi_global_overlap", timer, redknot_fi_global(cfg, overlap=True))
            res.pop("timing", None)
            row["variants"].append({"config": dataclasses.asdict(cfg), **res})

    attempt(row, "redknot_local_rows_only", timer, redknot(ExtendConfig(), skip_global=True))
    attempt(row, "redknot_fi_global", timer, redknot_fi_global())
    attempt(row, "redknot_fi_global_overlap", timer, redknot_fi_global(overlap=True))

    def flashinfer_global_rows_only():
        plan = plan_extend(geo, rows, [0], [L])
        fi = FlashInferGlobalRows(geo, DEV)
        fi.plan(plan, r2t, {G}, DTYPE, SCALE)
        return lambda: fi.run(q, k, v, kg, vg, heads, out)

    attempt(row, "flashinfer_global_rows_only", timer, flashinfer_global_rows_only)

    indptr = torch.tensor([0, L], dtype=torch.int32)

    def dense():
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(flashinfer_workspace(), "NHD")
        w.plan(indptr, indptr, HQ, HKV, D, causal=True, sm_scale=SCALE, q_data_type=DTYPE)
        return lambda: w.run(q, k, v)

    attempt(row, "dense_flashinfer", timer, dense)

    def folded():
        g_heads = list(heads.global_heads)
        l_heads = [h for h in range(HKV) if h not in g_heads]
        qh = lambda hs: [h * GRP + i for h in hs for i in range(GRP)]
        q_g, k_g, v_g = q[:, qh(g_heads)].contiguous(), k[:, g_heads], v[:, g_heads]
        n = len(l_heads)
        q_l = q[:, qh(l_heads)].view(L, n, GRP, D).transpose(0, 1).reshape(n * L, GRP, D)
        k_l = k[:, l_heads].transpose(0, 1).reshape(n * L, 1, D)
        v_l = v[:, l_heads].transpose(0, 1).reshape(n * L, 1, D)
        wg = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(flashinfer_workspace(), "NHD")
        wg.plan(indptr, indptr, G * GRP, G, D, causal=True, sm_scale=SCALE, q_data_type=DTYPE)
        wl = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(flashinfer_workspace(), "NHD")
        lp = torch.arange(n + 1, dtype=torch.int32) * L
        wl.plan(lp, lp, GRP, 1, D, causal=True, window_left=WINDOW - 1, sm_scale=SCALE,
                q_data_type=DTYPE)  # fmt: skip

        def call():
            wg.run(q_g, k_g.contiguous(), v_g.contiguous())
            wl.run(q_l, k_l, v_l)

        return call

    attempt(row, "folded_flashinfer", timer, folded)

    mask_bytes = HQ * L * L * 2
    if mask_bytes > 16 << 30:
        row["ms_sdpa_mask"] = None
        row.setdefault("notes", []).append(
            f"sdpa_mask: skipped, the [1, {HQ}, {L}, {L}] bf16 mask alone is "
            f"{mask_bytes / 2**30:.0f} GiB"
        )
    else:

        def sdpa():
            i = torch.arange(L, device=DEV)
            causal = i[None, :] <= i[:, None]
            local = causal & ((i[None, :] < SINK) | (i[:, None] - i[None, :] < WINDOW))
            mask = torch.zeros(1, HQ, L, L, device=DEV, dtype=DTYPE)
            for h in range(HKV):
                vis = local if heads.is_local_gpu[h] else causal
                mask[0, h * GRP : (h + 1) * GRP].masked_fill_(~vis, float("-inf"))
            q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            return lambda: F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=mask, scale=SCALE, enable_gqa=True
            )

        attempt(row, "sdpa_mask", timer, sdpa, eager=True)
    return finish(row)


# ---- report -----------------------------------------------------------------------------------


def finish(row: dict) -> dict:
    dense, ours = row.get("ms_dense_flashinfer"), row.get("ms_redknot")
    for name in ("redknot", "redknot_fi_global", "redknot_fi_global_overlap", "folded_flashinfer",
                 "sdpa_mask"):  # fmt: skip
        ms = row.get(f"ms_{name}")
        if dense and ms:
            row[f"speedup{'' if name == 'redknot' else '_' + name}"] = dense / ms
    if row.get("speedup"):
        row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]
    for name in ("fi_global", "fi_global_overlap"):
        if row.get(f"speedup_redknot_{name}"):
            row[f"fraction_of_ideal_{name}"] = row[f"speedup_redknot_{name}"] / row["ideal_speedup"]
    for v in row.get("variants", []):
        dense = row.get("ms_dense_flashinfer")
        for name in ("redknot", "fi_global", "fi_global_overlap"):
            if dense and v.get(f"ms_{name}"):
                v[f"fraction_of_ideal_{name}"] = dense / v[f"ms_{name}"] / row["ideal_speedup"]
    if ours and row.get("ms_sdpa_mask"):
        row["redknot_over_sdpa_mask"] = row["ms_sdpa_mask"] / ours
    if ours and "bytes_redknot" in row:
        row["redknot_GBps"] = row["bytes_redknot"] / ours / 1e6
        if dense:
            row["dense_flashinfer_GBps"] = row["bytes_dense"] / dense / 1e6
    if ours and "flops_redknot" in row:
        row["redknot_TFLOPs"] = row["flops_redknot"] / ours / 1e9
        if dense:
            row["dense_flashinfer_TFLOPs"] = row["flops_dense"] / dense / 1e9
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = bench_arguments(__doc__.splitlines()[0], "benchmarks/results/segpaged_kernels.json")
    ap.add_argument("--no-variants", action="store_true", help="skip the tuning variants")
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    args = ap.parse_args()
    timer = Timer()
    cases = [("prefill", 1, L, f) for f in FRACS for L in (32768, 8192)]
    cases += [("decode", B, L, f) for f in FRACS for B in (32, 1) for L in (32768, 8192, 131072)]
    cases.sort(key=lambda c: (c[3] != "1/8", c[1:3] not in ((1, 32768), (32, 32768))))
    result = result_header(args.commit, decode_config=dataclasses.asdict(DecodeConfig()))
    for phase, B, L, frac in cases:
        name = f"{phase} B={B} L={L} global={frac}"
        if args.only and args.only not in name:
            continue
        variants = not args.no_variants and frac == "1/8" and (phase == "prefill" or L == 32768)
        t0 = time.time()
        if phase == "decode":
            row = decode_case(B, L, frac, timer, variants)
        else:
            row = prefill_case(L, frac, timer, variants)
        row["wall_s"] = round(time.time() - t0, 1)
        save_row(result, row, args.out)
        brief = {k: row.get(k) for k in ("ms_redknot", "ms_dense_flashinfer", "speedup",
                                          "ideal_speedup", "fraction_of_ideal")}  # fmt: skip
        print(name, json.dumps(brief), flush=True)


if __name__ == "__main__":
    main()
