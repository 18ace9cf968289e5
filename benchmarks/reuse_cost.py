"""Fit the reuse cost model's device record from measured TTFTs (``benchmarks/ttft.py`` results).

The cost model (``redknot.costmodel.model``) predicts a forward's time from the work of each
layer and a device record of constants (``redknot.costmodel.record``). This script takes TTFTs
measured by ``benchmarks/ttft.py`` on one GPU (plain prompts and prompts that reuse cached
segments under every served policy, at several sizes, with ``reuse_gate=always`` so that every
reusing prompt really reuses), predicts each of them with the model, and fits the record's
constants by least squares on the logarithms (every point weighs the same relative error). The
record is written with its provenance: the inputs, the device, the fitted and the fixed
constants, and each point's measured and predicted TTFT.

    python benchmarks/ttft.py --points 512x4,1024x8,2048x8,4096x8,8192x8 \\
        --variants flashinfer,redknot-g0.125,redknot-all-global[kernel=triton],\\
    redknot-g0.125-reuse-sparse-cached[reuse_gate=always],epic[reuse_gate=always],\\
    cacheblend[reuse_gate=always],sparsex[reuse_gate=always] --out /tmp/cost_ttft.json
    python benchmarks/reuse_cost.py --fit /tmp/cost_ttft.json \\
        --out redknot/costmodel/records/nvidia-h100-80gb-hbm3.json

``--check RECORD --fit FILES`` prints measured against predicted without fitting. A result of
another model than ``--model``'s is given as ``PATH@MODEL_DIR`` and fitted with the others (the
shipped H100 record: the 8B shape and SmolLM2, whose host-bound prompts identify the host
constants that the 8B points leave free; docs/performance.md has its command).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_common as common
import ttft

from redknot.costmodel.model import ModelCosts, PromptWork, Recovery, ReuseCostModel
from redknot.costmodel.record import HOST_KINDS, POLICY_CHOICES, CostRecord
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool.layout import HeadLayout

# name -> (start, low, high); bounds keep every constant physical
PARAMS = {
    "fixed_ms": (9.0, 0.0, 100.0),
    "gemm_tflops": (600.0, 50.0, 990.0),
    "attn_tflops": (300.0, 10.0, 990.0),
    "attn_tflops_flashinfer": (600.0, 10.0, 990.0),  # the flashinfer baseline's attention
    "bandwidth_gbs": (2800.0, 500.0, 3400.0),
    **{f"host_{k}": (0.5, 0.02, 20.0) for k in HOST_KINDS},
    **{f"choose_{p}": (2.0, 0.0, 200.0) for p in POLICY_CHOICES},
    "plan_ms": (1.0, 0.0, 50.0),
    "plan_ms_per_ktok": (0.5, 0.0, 20.0),
}


def to_record(
    values: dict, device: str, margin: float, provenance: dict, host_probe_ms: float | None = None
) -> CostRecord:
    return CostRecord(
        device=device,
        gemm_tflops=values["gemm_tflops"],
        attn_tflops=values["attn_tflops"],
        bandwidth_gbs=values["bandwidth_gbs"],
        host_ms={k: values[f"host_{k}"] for k in HOST_KINDS},
        choose_ms={p: values[f"choose_{p}"] for p in POLICY_CHOICES},
        plan_ms=values["plan_ms"],
        plan_ms_per_ktok=values["plan_ms_per_ktok"],
        fixed_ms=values["fixed_ms"],
        margin=margin,
        host_probe_ms=host_probe_ms,
        provenance=provenance,
    )


def host_probe_of(results: list[dict]) -> float | None:
    """The fitting machine's host probe (``host_probe_ms`` of ``benchmarks/ttft.py``): the
    median over the results, None (the record's host constants then never scaled) when one
    lacks it."""
    probes = [r.get("host_probe_ms") for r in results]
    if None in probes:
        print("a result has no host_probe_ms: the record will not scale to other hosts")
        return None
    return round(statistics.median(probes), 5)


def variant_model(name: str, cfg: dict, chunk: int | None):
    """(costs, recovery, reuses, uses flashinfer's attention) of a ``benchmarks/ttft.py``
    variant on the model of ``cfg``."""
    base, knobs = ttft.parse_variant(name.split("@")[0])  # flashinfer@N: a merged run's
    fraction, all_global, reuse, dense_layers, skipped, policy = ttft.VARIANTS[base]
    shape = ModelShape.from_hf_config(cfg)
    g = 1.0 if all_global or fraction is None else fraction
    hmap = synthetic_map(shape, g, window=ttft.WINDOW, sink=ttft.SINK)
    layout = HeadLayout.from_head_map(hmap)
    costs = ModelCosts.of(cfg, layout)
    recovery = Recovery(
        policy or "redknot",
        shape.num_layers,
        dense_layers if dense_layers is not None else shape.num_layers,
        skipped=skipped or "cached",
        **{k: v for k, v in knobs.items() if k in Recovery.__dataclass_fields__},
    )
    return costs, recovery, reuse, fraction is None


def points_of(results: list[dict], question: int, tags: list[str] | None = None) -> list[tuple]:
    """``(variant, point, prompt, measured ms, baseline)`` of every measured point whose reusing
    prompts all hit (and, with a gate, were all served with reuse). ``baseline`` names the
    flashinfer run a point is compared with, as ``benchmarks/ttft.py`` compares it: a merged
    result's ``baselines``, else its own file's ``flashinfer``, else the first file's of the
    same tag. ``tags`` (one per result, e.g. its model) prefix the variant names, so that the
    results of several models are fitted together and each is compared with its own model's
    flashinfer."""
    tags = tags or [""] * len(results)
    first = {}
    for f, r in enumerate(results):
        if "flashinfer" in r["variants"]:
            first.setdefault(tags[f], f)
    out = []
    for f, res in enumerate(results):
        tag = tags[f]
        own = f if "flashinfer" in res["variants"] else first.get(tag)
        for raw, var in res["variants"].items():
            name = tag + raw
            if raw.split("@")[0] == "flashinfer":
                baseline = (f, name)
            elif raw in res.get("baselines", {}):
                baseline = (f, tag + res["baselines"][raw])
            else:
                baseline = (own, tag + "flashinfer")
            for key, row in var.get("points", {}).items():
                if row.get("every_segment_hit") is False:
                    continue
                if (
                    baseline[1] != name
                    and any(s != "reuse" for s in row.get("served", []))
                    and (ttft.VARIANTS[ttft.parse_variant(raw)[0]][2])
                ):
                    continue  # a gate served some of them without reuse: not a reuse time
                length, segments = row["length"], row["segments"]
                per = length // segments
                segs = tuple((1 + i * per, per) for i in range(segments))
                work = PromptWork(row["prompt_tokens"], 0, segs)
                ms = statistics.median(row["ttft_samples_s"]) * 1e3
                out.append((name, key, work, ms, baseline))
    return out


def predict(values: dict, models: dict, points) -> list[float]:
    out = []
    for name, _, work, _, _ in points:
        costs, recovery, reuse, flashinfer = models[name]
        v = dict(values)
        if flashinfer:
            v["attn_tflops"] = values["attn_tflops_flashinfer"]
        record = to_record(v, "fit", 0.0, {})
        model = ReuseCostModel(costs, recovery, record)
        out.append(values["fixed_ms"] + model.batch_ms([work], [reuse]))
    return out


def decisions(values: dict, models: dict, points, margin: float) -> list[dict]:
    """What a server's reuse gate with these constants decides at each measured point of a
    reusing variant (``redknot.costmodel.gate.ReuseGate.decide``: reuse when predicted at most
    ``1 - margin`` of recomputing), next to the measured reuse TTFT and the flashinfer TTFT of
    the same point (what recomputing costs where the engine recomputes on FlashInfer);
    ``right``: the gate chose the faster of the two as measured."""
    plain = {(base, key): ms for name, key, _, ms, base in points if base[1] == name}
    record = to_record(values, "fit", margin, {})
    out = []
    for name, key, work, ms, base in points:
        costs, recovery, reuse, _ = models[name]
        if not reuse or (base, key) not in plain:
            continue
        plain_ms = plain[base, key]
        model = ReuseCostModel(costs, recovery, record)
        reuses = bool(
            model.batch_ms([work], [True]) <= (1 - margin) * model.batch_ms([work], [False])
        )
        out.append({"variant": name, "point": key, "gate": "reuse" if reuses else "recompute",
                    "reuse_ms": round(ms, 2), "flashinfer_ms": round(plain_ms, 2),
                    "right": reuses == bool(ms < plain_ms)})  # fmt: skip
    return out


def flashinfer_tflops(record: CostRecord) -> float:
    """The attention throughput a record's fit gave flashinfer's prefill: a fitted or a held
    constant of its provenance (``attn_tflops`` for a record without it)."""
    for kind in ("fitted", "held"):
        value = record.provenance.get(kind, {}).get("attn_tflops_flashinfer")
        if value is not None:
            return value
    return record.attn_tflops


def fit(points, models: dict, fixed: dict) -> tuple[dict, list[str]]:
    """Least squares on log TTFT over the constants not in ``fixed``; returns every value and
    the names of the constants the data could not move (left at their start)."""
    from scipy.optimize import least_squares

    free = [k for k in PARAMS if k not in fixed]
    measured = [p[3] for p in points]

    def values_of(x) -> dict:
        return {**fixed, **dict(zip(free, x))}

    def residuals(x):
        return [math.log(p / m) for p, m in zip(predict(values_of(x), models, points), measured)]

    x0 = [PARAMS[k][0] for k in free]
    bounds = ([PARAMS[k][1] for k in free], [PARAMS[k][2] for k in free])
    sol = least_squares(residuals, x0, bounds=bounds, diff_step=1e-3, x_scale="jac")
    unmoved = [k for k, col in zip(free, sol.jac.T) if not any(abs(c) > 1e-9 for c in col)]
    return values_of(sol.x), unmoved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--fit", required=True,
        help="comma-separated benchmarks/ttft.py results, each PATH or PATH@MODEL_DIR (a result "
        "of another model than --model's, fitted with the others)",
    )  # fmt: skip
    ap.add_argument("--model", default=common.DEFAULT_MODEL, help="model dir with config.json")
    ap.add_argument(
        "--fix", default="", help="constants held, e.g. bandwidth_gbs=2800,host_plain=0.3"
    )
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--check", default=None, help="a record to compare with, nothing fitted")
    ap.add_argument("--out", default=None, help="where to write the fitted record")
    args = ap.parse_args()
    inputs = [item.partition("@")[::2] for item in args.fit.split(",")]
    paths = [path for path, _ in inputs]
    model_dirs = [model or args.model for _, model in inputs]
    names = {}  # model dir -> its tag's name, unique even where two dirs share a base name
    for m in dict.fromkeys(model_dirs):
        name = Path(m).name
        names[m] = name if name not in names.values() else f"{name}#{len(names)}"
    tags = [names[m] + ":" if m != args.model else "" for m in model_dirs]
    configs = {m: json.loads(Path(m, "config.json").read_text()) for m in set(model_dirs)}
    results = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["device"] for r in results}
    if len(devices) != 1:
        raise SystemExit(f"--fit: results of several devices {sorted(devices)}: fit one device")
    question = results[0].get("question", 64)
    models = {tag + n: variant_model(n, configs[m], None)
              for r, m, tag in zip(results, model_dirs, tags) for n in r["variants"]}  # fmt: skip
    points = points_of(results, question, tags)
    if args.check:
        record = CostRecord.read(args.check)
        values = {"fixed_ms": record.fixed_ms, "gemm_tflops": record.gemm_tflops,
                  "attn_tflops": record.attn_tflops, "bandwidth_gbs": record.bandwidth_gbs,
                  "attn_tflops_flashinfer": flashinfer_tflops(record),
                  "plan_ms": record.plan_ms, "plan_ms_per_ktok": record.plan_ms_per_ktok,
                  **{f"host_{k}": v for k, v in record.host_ms.items()},
                  **{f"choose_{k}": record.choose_ms.get(k, 0.0) for k in POLICY_CHOICES}}  # fmt: skip
    else:
        fixed = {}
        for item in filter(None, args.fix.split(",")):
            key, _, value = item.partition("=")
            if key not in PARAMS:
                raise SystemExit(f"--fix: {key!r} is not one of {', '.join(PARAMS)}")
            fixed[key] = float(value)
        values, unmoved = fit(points, models, fixed)
    rows = [
        {"variant": n, "point": k, "measured_ms": round(m, 2), "predicted_ms": round(p, 2)}
        for (n, k, _, m, _), p in zip(points, predict(values, models, points))
    ]
    for r in rows:
        print(
            f"{r['variant']:45s} {r['point']:10s} {r['measured_ms']:9.2f} {r['predicted_ms']:9.2f}"
        )
    errors = [abs(math.log(r["predicted_ms"] / r["measured_ms"])) for r in rows]
    print(f"mean |log error| {statistics.mean(errors):.3f}, max {max(errors):.3f}")
    chosen = decisions(values, models, points, args.margin)
    for d in chosen:
        print(
            f"gate {d['variant']:45s} {d['point']:10s} {d['gate']:9s} reuse {d['reuse_ms']:7.2f} "
            f"flashinfer {d['flashinfer_ms']:7.2f}{'' if d['right'] else '  (the slower)'}"
        )
    if args.check or not args.out:
        return
    provenance = common.record(
        inputs=[{"path": p, "model": Path(m).name, "commit": r.get("commit"),
                 "date": r.get("date"), "command": r.get("command")}
                for p, m, r in zip(paths, model_dirs, results)],
        model=Path(args.model).name,
        fitted={k: round(v, 4) for k, v in values.items() if k not in fixed},
        held=fixed,
        not_identified=unmoved,
        points=rows,
        mean_abs_log_error=round(statistics.mean(errors), 4),
        decisions=chosen,
    )  # fmt: skip
    provenance.pop("device")
    device = devices.pop()
    record = to_record({k: round(v, 4) for k, v in values.items()}, device, args.margin,
                       provenance, host_probe_of(results))  # fmt: skip
    common.write_json(args.out, record.to_json())
    print("wrote", args.out)


if __name__ == "__main__":
    main()
