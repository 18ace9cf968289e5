"""How many concurrent 32K-token requests SGLang admits: flashinfer backend vs redknot.

Each variant starts an ``sgl.Engine`` on the 8B shape with dummy weights and the same
``--mem-fraction-static``, then reads the pool the scheduler actually allocated (token slots and
request slots). A request of ``L`` prompt tokens and ``N`` new tokens needs ``L + N`` token slots
and one request slot, so SGLang admits ``min(request_slots, token_slots // (L + N))`` of them at
once (``redknot-g0.125-noseg``: the tuned 1/8 map without the segment region that segment
reuse stores into, 5% of the KV budget by default). The memory-ratio ideal is the KV bytes of
one such request under dense attention over its bytes under redknot (global heads for every
token, a ring of sink + window for the local heads).

    python benchmarks/capacity.py --out benchmarks/results/capacity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common

VARIANTS = {  # name -> (global fraction or None for the flashinfer backend, tune request slots,
    #                   keep the segment region: --redknot-segment-fraction 0 where not)
    "flashinfer": (None, False, True),
    "redknot-g0.125-default": (0.125, False, True),
    "redknot-g0.125": (0.125, True, True),
    "redknot-g0.15-default": (0.15, False, True),
    "redknot-g0.15": (0.15, True, True),
    "redknot-g0.125-noseg": (0.125, True, False),  # a server that reuses nothing
}


def kv_bytes_per_request(fraction, length, shape, ring):
    """K+V bytes (bf16) of one request of ``length`` tokens; ``fraction`` None means dense."""
    per_head_token = 2 * shape.head_dim * 2
    heads = shape.num_layers * shape.num_kv_heads
    if fraction is None:
        return heads * length * per_head_token
    g = round(fraction * heads)
    return g * length * per_head_token + (heads - g) * min(length, ring) * per_head_token


def child(args) -> None:
    import sglang as sgl

    fraction, tune, segments = VARIANTS[args.child]
    extra = {
        "mem_fraction_static": args.mem_fraction_static,
        "cuda_graph_max_bs_decode": 8,
        "disable_prefill_cuda_graph": True,
    }
    if fraction is None:
        extra["attention_backend"] = "flashinfer"
    else:
        extra["attention_backend"] = "redknot"
        extra["redknot_head_map"] = common.synthetic_map_file(args.model, fraction, "/tmp")
        if tune:
            extra["max_running_requests"] = args.slots
        if not segments:
            extra["redknot_segment_fraction"] = 0.0
    engine = sgl.Engine(**common.engine_kwargs(args.model, args.prompt_len + 1024, **extra))
    try:
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    tokens = int(info["max_total_num_tokens"])
    states = info.get("internal_states") or [{}]
    slots = int(states[0].get("effective_max_running_requests_per_dp") or 0)
    need = args.prompt_len + args.new_tokens
    admitted = min(slots, tokens // need) if slots else tokens // need
    print(
        "RESULT "
        + json.dumps(
            {"max_total_num_tokens": tokens, "max_running_requests": slots, "admitted": admitted}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=common.DEFAULT_MODEL)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument(
        "--slots",
        type=int,
        default=0,
        help="request slots of the tuned redknot variants (0: derived from the "
        "flashinfer run and the memory ratio)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(common.ROOT / "benchmarks/results/capacity.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    from redknot.headmap import ModelShape

    shape = ModelShape.from_hf_config(json.loads(Path(args.model, "config.json").read_text()))
    base = common.forward_args(args, "model", "prompt_len", "new_tokens", "mem_fraction_static")
    results = {}
    for name in args.variants.split(","):
        fraction, tune, _ = VARIANTS[name]
        slots = args.slots
        if tune and not slots and "flashinfer" in results and "error" not in results["flashinfer"]:
            # What a user sizing for 32K requests would pass: the dense count times the ratio.
            dense = kv_bytes_per_request(None, args.prompt_len + args.new_tokens, shape, 320)
            ours = kv_bytes_per_request(fraction, args.prompt_len + args.new_tokens, shape, 320)
            slots = int(results["flashinfer"]["admitted"] * dense / ours) + 2
        results[name] = common.run_child(__file__, base + ["--child", name, "--slots", str(slots)])
        results[name]["global_fraction"] = fraction
        results[name]["requested_slots"] = slots if tune else None
        print(name, results[name], flush=True)

    dense_count = results.get("flashinfer", {}).get("admitted")
    summary = {}
    for name, res in results.items():
        fraction = res["global_fraction"]
        if fraction is None or "error" in res or not dense_count:
            continue
        need = args.prompt_len + args.new_tokens
        ideal = kv_bytes_per_request(None, need, shape, 320) / kv_bytes_per_request(
            fraction, need, shape, 320
        )
        ratio = res["admitted"] / dense_count
        summary[name] = {
            "admitted": res["admitted"],
            "ratio_vs_flashinfer": ratio,
            "memory_ratio_ideal": ideal,
            "fraction_of_ideal": ratio / ideal,
        }
    common.write_json(args.out, common.record(
        model=args.model, load_format="dummy", prompt_len=args.prompt_len,
        new_tokens=args.new_tokens, mem_fraction_static=args.mem_fraction_static,
        sink=64, window=256, flashinfer_admitted=dense_count, variants=results, summary=summary,
    ))  # fmt: skip
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
