"""LFPS selection quality: ``recall_vs_exact_topk`` (the paper's overlap rate, Eq. 2) per length.

Real attention: SmolLM2 (or ``--model``) reads a prompt made of the RAG cases' documents, cut to
``L + steps`` tokens; one teacher-forced forward gives every layer's post-RoPE Q/K/V. Per layer,
``build_state`` uses the queries of the last ``history`` prompt positions, then ``steps`` decode
steps run LFPS on the following positions (teacher-forced: the keys and queries are the dense
model's, the selection does not feed back). Synthetic: Gaussian Q/K with planted vertical and
slash logits plus noise. Runs on the CPU; writes one JSON with device, date, commit and command.

    python benchmarks/lfps_recall.py --lengths 1024 2048 4096 --out benchmarks/results/lfps_recall.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from redknot.lfps import LfpsParams, build_state, lfps_step
from redknot.lfps.metrics import recall_vs_exact_topk, recall_vs_group_topk


def prompt_ids(tokenizer, cases: Path, num_tokens: int) -> torch.Tensor:
    """The cases' documents concatenated (in file order, repeated as needed), cut to
    ``num_tokens``; ``[num_tokens]`` int64."""
    texts = []
    for line in cases.read_text().splitlines():
        row = json.loads(line)
        texts.extend(row["segments"])
    ids: list[int] = []
    while len(ids) < num_tokens:
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) >= num_tokens:
                break
    return torch.tensor(ids[:num_tokens])


@torch.no_grad()
def model_qkv(family, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Dense causal forward; per layer ``(q [Hq, T, d], k [Hq, T, d], v [Hq, T, d])`` with K/V
    expanded to the query heads."""
    positions = torch.arange(ids.shape[0])
    hidden = family.embed(ids)
    out = []
    g = family.group_size
    for layer in range(family.num_layers):
        q, k, v = family.qkv(layer, hidden, positions)
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=family.scale
        )
        hidden = hidden + family.attn_output(layer, o)
        hidden = hidden + family.ffn(layer, hidden)
        out.append((q.float(), k.float(), v.float()))
    return out


def run_lfps(q, k, v, prompt_len: int, steps: int, params: LfpsParams) -> dict:
    """LFPS over ``steps`` teacher-forced positions after ``prompt_len``; per-step averages over
    the heads that did not bypass, plus the bypass and candidate shares."""
    state = build_state(
        q[:, :prompt_len][:, -params.history_steps :], k[:, :prompt_len], v[:, :prompt_len], params
    )
    recalls, cand, bypass = [], [], []
    for t in range(prompt_len, prompt_len + steps):
        res = lfps_step(q[:, t], k[:, : t + 1], v[:, : t + 1], state, params)
        kk = params.budget_for(t + 1 - params.num_sink)
        rec = recall_vs_exact_topk(q[:, t], k[:, : t + 1], res.selected, kk, params.num_sink)
        active = ~res.bypass
        if bool(active.any()):
            recalls.append(float(rec[active].mean()))
            cand.append(float(res.candidates[active].float().sum(-1).mean()) / (t + 1))
        bypass.append(float(res.bypass.float().mean()))
        state = res.state
    return {
        "recall": sum(recalls) / max(len(recalls), 1),
        "candidate_share": sum(cand) / max(len(cand), 1),
        "bypass_share": sum(bypass) / len(bypass),
    }


def run_lfps_shared(
    q,
    k,
    v,
    prompt_len: int,
    steps: int,
    params: LfpsParams,
    kv_heads: int,
    factor: int,
    widen: float = 1.0,
    union: bool = False,
) -> dict:
    """``run_lfps`` for the GPU path's shared selection (``redknot.lfps.batched``, its PyTorch
    reference): one candidate list and one Top-k per KV head, serving its ``Hq / Hkv`` query
    heads, with ``C = factor * K`` candidates as the decode benchmark runs it. Recall is each
    query head's own (its exact Top-k, at ``params.budget``, against the shared selection of
    ``widen`` times that budget); ``recall_group_topk``: each KV head's, against the exact Top-k
    of the engine's ``topk`` with lists per KV head (a key ranked by its highest logit over the
    group); ``overflow_share``: steps and KV heads whose candidates
    exceeded ``C`` (the list then keeps the highest priorities). ``union``: each query head
    takes its own Top-k of the list, the KV head attends their union (``attended_share``: its
    keys over the budget)."""
    import dataclasses

    from redknot.lfps.batch_state import pack_states
    from redknot.lfps.batched import LfpsBudgets, lfps_decode_step

    exact = params
    params = dataclasses.replace(params, budget=params.budget * widen)

    H, T, _ = q.shape
    rows = H // kv_heads
    hist = q[:, :prompt_len][:, -params.history_steps :]
    ref = build_state(hist, k[:, :prompt_len], v[:, :prompt_len], params)
    state = pack_states([ref], prompt_len + steps, rows, kv_heads)
    k_buffer = k[::rows].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v_buffer = v[::rows].transpose(0, 1).contiguous()
    req_to_token = torch.arange(T, dtype=torch.int32)[None]
    top = params.budget_for(prompt_len + steps - params.num_sink)
    budgets = LfpsBudgets(candidates=min(factor * top, T), topk=top, union=rows if union else 1)
    recalls, group_recalls, cand, bypass, over, attended = [], [], [], [], [], []
    for t in range(prompt_len, prompt_len + steps):
        seq = torch.tensor([t + 1])
        res = lfps_decode_step(q[None, :, t], k_buffer, v_buffer, req_to_token,
                               torch.tensor([0]), seq, state, params, budgets,
                               kernels=False)  # fmt: skip
        chosen = torch.zeros(H // rows, t + 1, dtype=torch.bool)
        sel = res.selected[0].long()
        chosen.scatter_(1, sel.clamp(min=0), sel >= 0)
        kk = exact.budget_for(t + 1 - params.num_sink)
        active = ~res.bypass[0]
        grouped = recall_vs_group_topk(q[:, t], k[:, : t + 1], chosen, kk, params.num_sink,
                                       rows, active)  # fmt: skip
        chosen = chosen.repeat_interleave(rows, 0)
        rec = recall_vs_exact_topk(q[:, t], k[:, : t + 1], chosen, kk, params.num_sink)
        if bool(active.any()):
            recalls.append(float(rec[active].mean()))
            group_recalls.append(float(grouped.nanmean()))
        count = res.candidate_count[0].float()
        attended.append(float((sel >= 0).sum(-1).float().mean()) / kk)
        cand.append(float(count.mean()) / (t + 1))
        over.append(float((count > budgets.candidates).float().mean()))
        bypass.append(float(res.bypass.float().mean()))
    return {
        "recall": sum(recalls) / max(len(recalls), 1),
        "recall_group_topk": sum(group_recalls) / max(len(group_recalls), 1),
        "candidate_share": sum(cand) / len(cand),
        "bypass_share": sum(bypass) / len(bypass),
        "overflow_share": sum(over) / len(over),
        "attended_share": sum(attended) / len(attended),
    }


def shared_list_bound(q, k, prompt_len: int, steps: int, params: LfpsParams, kv_heads: int):
    """What any list of ``K`` keys shared by a KV head's query heads can recall of each query
    head's own exact Top-k, from the exact logits (no prediction, no candidate limit): the
    best such list holds the keys in the most of its heads' Top-k sets (``recall``: the optimum,
    since the recall is a sum over keys), and the engine's exact Top-k per KV head
    (``recall_max_logit``: keys ranked by their highest logit over the group). Every head
    counted (no bypass); steps ``prompt_len .. prompt_len + steps - 1``."""
    H = q.shape[0]
    rows = H // kv_heads
    best, by_max = [], []
    for t in range(prompt_len, prompt_len + steps):
        kk = params.budget_for(t + 1 - params.num_sink)
        logits = torch.einsum("hd,hnd->hn", q[:, t], k[:, : t + 1])[:, params.num_sink :]
        own = torch.zeros_like(logits, dtype=torch.bool)
        own.scatter_(1, torch.topk(logits, kk, dim=-1).indices, True)  # [H, N]
        group = own.view(kv_heads, rows, -1)
        count = group.sum(1).float()  # [Hkv, N]: heads whose Top-k holds the key
        top_logit = logits.view(kv_heads, rows, -1).amax(1)
        # most heads first, then the highest logit (a strictly smaller tie-break term)
        span = (top_logit.amax(-1, keepdim=True) - top_logit.amin(-1, keepdim=True)).clamp(min=1)
        rank = count + 0.5 * (top_logit - top_logit.amin(-1, keepdim=True)) / span
        for chosen, out in ((torch.topk(rank, kk, -1).indices, best),
                            (torch.topk(top_logit, kk, -1).indices, by_max)):  # fmt: skip
            hits = torch.gather(group, 2, chosen[:, None, :].expand(-1, rows, -1))
            out.append(float(hits.float().mean()))
    return {"recall": sum(best) / len(best), "recall_max_logit": sum(by_max) / len(by_max)}


def synthetic_qkv(n: int, heads: int, dim: int, seed: int):
    """Gaussian Q/K/V plus planted logits: 8 vertical positions and 4 slash distances per head.

    Returns ``(q, k, v)`` ``[heads, n, dim]``: ``k_j += a * u`` at the vertical positions and
    ``q_t`` carries ``u``; the slash part is added to the logits through a per-position code
    (``q_t . c_{t-d}`` large), built as in the property test but with random codes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, dim, generator=gen)
    k = torch.randn(heads, n, dim, generator=gen)
    v = torch.randn(heads, n, dim, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(heads, 1, dim, generator=gen), dim=-1)
    a = 4.0 * math.sqrt(dim)
    for h in range(heads):
        pos = torch.randperm(n - 8, generator=gen)[:8] + 4
        k[h, pos] += a * u[h, 0]
        for dist in (0, 1, 3, 9):
            k[h, : n - dist] += 0.5 * a / 4 * q[h, dist:] / q[h, dist:].norm(dim=-1, keepdim=True)
    q = q / q.norm(dim=-1, keepdim=True) * 4 + u
    return q, k, v


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cases", type=Path, default=Path("benchmarks/cases/rag_v1.jsonl"))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--lam", type=float, default=0.2)
    p.add_argument("--history", type=int, default=64)
    p.add_argument("--skip-model", action="store_true", help="synthetic data only")
    p.add_argument(
        "--selection", choices=("query_head", "kv_head", "kv_head_union", "kv_head_bound"),
        default="query_head",
        help="query_head: the reference step (a selection per query head); kv_head: the GPU "
        "path's shared selection per KV head (redknot.lfps.batched, PyTorch reference), C = "
        "--candidate-factor x K; kv_head_union: its lists and tables per KV head, each query "
        "head's own Top-k of the list, their union attended; kv_head_bound: no LFPS, the best "
        "any shared list of K keys can recall per query head (shared_list_bound)",
    )  # fmt: skip
    p.add_argument("--candidate-factor", type=int, default=4)
    p.add_argument(
        "--shared-widen", type=float, default=1.0,
        help="kv_head: the shared selection keeps this many times --budget (recall is still "
        "against each query head's exact Top-k at --budget)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    params = LfpsParams(budget=args.budget, lam=args.lam, history_steps=args.history)
    torch.set_grad_enabled(False)
    rows = []
    family = tokenizer = None
    if not args.skip_model:
        from redknot.reference.loading import load_model
        from redknot.reference.model import LlamaFamily

        model, tokenizer, _ = load_model(args.model)
        family = LlamaFamily(model)
    for n in args.lengths:
        t0 = time.time()
        q, k, v = synthetic_qkv(n + args.steps, 4, 64, seed=n)
        row = {"data": "synthetic", "length": n, **run_lfps(q, k, v, n, args.steps, params)}
        rows.append(row)
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
        if family is None:
            continue
        t0 = time.time()
        qkv = model_qkv(family, prompt_ids(tokenizer, args.cases, n + args.steps))
        if args.selection == "kv_head_bound":
            kv_heads = family.shape.num_kv_heads
            per_layer = [shared_list_bound(q, k, n, args.steps, params, kv_heads)
                         for q, k, _ in qkv]  # fmt: skip
        elif args.selection != "query_head":
            kv_heads = family.shape.num_kv_heads
            union = args.selection == "kv_head_union"
            shared = (kv_heads, args.candidate_factor, args.shared_widen, union)
            per_layer = [
                run_lfps_shared(q, k, v, n, args.steps, params, *shared) for q, k, v in qkv
            ]
        else:
            per_layer = [run_lfps(q, k, v, n, args.steps, params) for q, k, v in qkv]
        row = {
            "data": args.model,
            "length": n,
            **{key: sum(r[key] for r in per_layer) / len(per_layer) for key in per_layer[0]},
            "recall_per_layer": [round(r["recall"], 4) for r in per_layer],
        }
        rows.append(row)
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
    lfps_shared = args.selection in ("kv_head", "kv_head_union")  # candidates, widening
    result = {
        "device": f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": "python benchmarks/lfps_recall.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "params": {
            "budget": args.budget,
            "lam": args.lam,
            "history": args.history,
            "steps": args.steps,
            "decay": params.decay,
            "sparsity_threshold": params.sparsity_threshold,
            "num_sink": params.num_sink,
            "selection": args.selection,
            "candidate_factor": (args.candidate_factor if lfps_shared else None),
            "shared_widen": args.shared_widen if lfps_shared else None,
        },
        "note": "teacher-forced: Q/K/V of the dense model, recall averaged over non-bypass heads, "
        "steps and layers; candidate_share = keys scored exactly / keys",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
