"""What a prefill costs over a KV store in pinned host memory (``--redknot-lfps-offload-gb``).

Each step an extend of an LFPS request runs per layer, timed with the pool's global store in
GPU memory and in pinned host memory (``redknot.pool.host_memory``) side by side, 8B shape
(8 KV / 32 query heads, D 128, bf16), one request of ``--tokens`` tokens:

- ``write``: the pool's write of the extend's K/V (``RedknotKVPool.write_global``, SGLang's
  K+V store kernel);
- ``gather``: the request's keys and values read back through its slots (``k_buffer[slots]``,
  what LFPS's table build reads);
- ``build``: LFPS's table build (``redknot.lfps.serving.build_tables``) from the last 64 queries
  over those keys;
- ``paged_prefill``: FlashInfer's paged prefill of a ``--chunk``-token chunk over the rest of
  the request as its prefix (what a chunked prompt's later chunks read);
- ``ragged_prefill``: FlashInfer's ragged prefill of the whole request (K/V of the extend
  itself, in GPU memory either way: a prompt in one chunk).

Medians of ``--reps`` CUDA-event timings after a warm-up call.

    python benchmarks/offload_probe.py --out $OUT/offload_probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

HQ, HKV, D = 32, 8, 128


def measure(host: bool, tokens: int, chunk: int, reps: int) -> dict:
    import flashinfer

    from redknot.headmap import ModelShape, synthetic_map
    from redknot.lfps import LfpsParams
    from redknot.lfps.serving import build_tables
    from redknot.pool.kv_pool import RedknotKVPool
    from redknot.pool.layout import HeadLayout

    shape = ModelShape("LlamaForCausalLM", num_layers=1, num_kv_heads=HKV,
                       num_attention_heads=HQ, head_dim=D)  # fmt: skip
    layout = HeadLayout.from_head_map(synthetic_map(shape, 1.0))
    pool = RedknotKVPool(tokens + 16, 1, torch.bfloat16, layout, 2, 0, "cuda", host_kv=host)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(tokens, device="cuda", generator=gen) + 1
    kb, vb = pool.k_global[0], pool.v_global[0]
    out = {}
    out["write_ms"] = common.event_ms(lambda: pool.write_global(0, slots, k, v), reps)
    out["gather_ms"] = common.event_ms(lambda: (kb[slots], vb[slots]), reps)
    params = LfpsParams(budget=0.02)
    out["build_ms"] = common.event_ms(
        lambda: build_tables(q[-64:], kb[slots], vb[slots], params, HQ // HKV, D**-0.5), reps
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    qo = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    last = torch.ones(1, dtype=torch.int32, device="cuda")
    paged.plan(qo, kv_indptr, slots.int(), last, HQ, HKV, D, 1, causal=True,
               q_data_type=torch.bfloat16)  # fmt: skip
    qc = q[-chunk:]
    out["paged_prefill_ms"] = common.event_ms(
        lambda: paged.run(qc, (kb.unsqueeze(1), vb.unsqueeze(1))), reps
    )
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    ind = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    ragged.plan(ind, ind, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16)
    out["ragged_prefill_ms"] = common.event_ms(lambda: ragged.run(q, k, v), reps)
    torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/offload_probe.json"))
    args = ap.parse_args()
    figures = {where: measure(where == "host_memory", args.tokens, args.chunk, args.reps)
               for where in ("gpu_memory", "host_memory")}  # fmt: skip
    figures["host_over_gpu"] = {
        k: figures["host_memory"][k] / figures["gpu_memory"][k] for k in figures["gpu_memory"]
    }
    settings = {"tokens": args.tokens, "chunk": args.chunk, "reps": args.reps,
                "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}}  # fmt: skip
    common.write_json(args.out, common.record(settings=settings, **figures))
    print(figures, flush=True)


if __name__ == "__main__":
    main()
