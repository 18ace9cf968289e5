"""The cost of an extend batch served with segment reuse or without it, predicted on the host.

What the planner knows of each request (tokens it computes, where its segment hits lie, the
served policy) gives, layer by layer, the rows each layer computes, the rows whose FFN runs and
the tokens whose K/V are read from the segment cache (:func:`layer_plan`). A device record
(:class:`redknot.costmodel.record.CostRecord`) turns those into GPU time (matrix products bound
by FLOPs or by reading the layer's weights, attention by FLOPs, cache reads by bandwidth) and
host time (per layer, by the path the layer takes). The forward is a pipeline: the GPU runs a
layer once the host has issued it, and a layer that synchronises (the importance choice of a
deep redknot layer, a policy's choice) makes the host wait for the GPU (:meth:`forward_ms`).

>>> model = ReuseCostModel(ModelCosts.of(hf_config, layout), Recovery.of(config, 32), record)
>>> prompt = PromptWork(computed=8256, segments=((1, 1024),) * 8)   # (offset, tokens) each
>>> model.reuse_ms([prompt], [True]), model.reuse_ms([prompt], [False])
>>> model.break_even_prompt_tokens(segment_tokens=1024)   # smallest prompt where reuse pays

Rows that leave under the redknot layer schedule are predicted as if attention were uniform
(each deep layer keeps ``mass_thresh`` of the remaining candidates), the most rows the schedule
keeps: real attention, more concentrated, keeps fewer, so the predicted reuse is an upper bound
of its compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redknot.costmodel.record import CostRecord

MAX_CONTEXT = 1 << 17  # break-even searches stop here
REUSE_KINDS = ("full", "held", "schedule")  # host paths of a layer that reuses (layer_plan)


@dataclass(frozen=True)
class ModelCosts:
    """One tensor-parallel rank's share of the served model, as far as its cost depends on it."""

    num_layers: int
    hidden: int
    num_q_heads: int  # rank-local
    num_kv_heads: int  # rank-local
    head_dim: int
    intermediate: int  # rank-local FFN width
    global_heads: tuple[int, ...]  # rank-local global KV heads of each layer
    ring: int  # keys a local head attends (sink + window)
    dtype_bytes: int = 2

    @classmethod
    def of(cls, hf_config: Any, layout: Any, tp_size: int = 1, dtype_bytes: int = 2) -> ModelCosts:
        """From a Hugging Face config (object or dict) and the rank's ``HeadLayout``."""
        get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k)
        return cls(
            num_layers=layout.num_layers,
            hidden=int(get("hidden_size")),
            num_q_heads=layout.num_q_heads,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            intermediate=int(get("intermediate_size")) // tp_size,
            global_heads=tuple(layout.num_global(i) for i in range(layout.num_layers)),
            ring=layout.sink + layout.window,
            dtype_bytes=dtype_bytes,
        )

    @property
    def proj_flops(self) -> int:
        """FLOPs of one row's q, k, v and o projections in one layer."""
        return 2 * self.hidden * self.head_dim * (2 * self.num_q_heads + 2 * self.num_kv_heads)

    @property
    def ffn_flops(self) -> int:
        """FLOPs of one row's gated FFN in one layer."""
        return 2 * 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> int:
        """Bytes of one layer's weights (each read at least once per forward)."""
        return (self.proj_flops + self.ffn_flops) // 2 * self.dtype_bytes

    def attn_flops(self, layer: int, rows: float, keys: float) -> float:
        """Attention FLOPs of ``rows`` query rows that each see ``keys`` earlier tokens."""
        g = self.global_heads[layer]
        heads_keys = g * keys + (self.num_kv_heads - g) * min(keys, self.ring)
        return 4 * self.head_dim * (self.num_q_heads // self.num_kv_heads) * rows * heads_keys

    def causal_attn_flops(self, layer: int, prefix: int, rows: int) -> float:
        """Attention FLOPs of every row of an extend of ``rows`` tokens after ``prefix``."""
        g, n, r = self.global_heads[layer], prefix + rows, self.ring
        full = (n * (n + 1) - prefix * (prefix + 1)) / 2  # sum of (position + 1)
        lo = min(prefix, r)  # positions below the ring see position + 1 keys, the rest r
        hi = min(n, r)
        ring = (hi * (hi + 1) - lo * (lo + 1)) / 2 + max(n - max(prefix, r), 0) * r
        heads_keys = g * full + (self.num_kv_heads - g) * ring
        return 4 * self.head_dim * (self.num_q_heads // self.num_kv_heads) * heads_keys


@dataclass(frozen=True)
class Recovery:
    """What a reusing extend computes, from the served configuration
    (``redknot.config.RedknotConfig``)."""

    policy: str  # redknot | naive | epic | cacheblend | sparsex
    num_layers: int
    dense_layers: int  # redknot: deeper layers run the layer schedule (num_layers: none)
    mass_thresh: float = 0.5
    skipped: str = "cached"
    local_kv: str = "cached"
    epic_k: int = 16
    blend_check_layer: int = 1
    blend_ratio: float = 0.15
    sparseq_boundary: int = 5
    sparseq_k: int = 512
    sparseq_block: int = 16

    @classmethod
    def of(cls, config: Any, num_layers: int) -> Recovery:
        dense = num_layers if config.dense_layers is None else min(config.dense_layers, num_layers)
        return cls(
            config.policy, num_layers, dense, config.mass_thresh, config.skipped,
            config.local_kv, config.epic_k, config.blend_check_layer, config.blend_ratio,
            config.sparseq_boundary, config.sparseq_k, config.sparseq_block,
        )  # fmt: skip

    def describe(self) -> str:
        if self.policy != "redknot":
            return f"policy {self.policy}"
        if self.dense_layers >= self.num_layers:
            return "redknot, no layer schedule"
        return f"redknot, layer schedule from layer {self.dense_layers} (skipped={self.skipped})"


@dataclass(frozen=True)
class PromptWork:
    """One request of an extend batch as the planner sees it."""

    computed: int  # prompt tokens the request computes (after its exact-prefix hit)
    prefix: int = 0  # tokens of its exact-prefix hit (not computed)
    segments: tuple[tuple[int, int], ...] = ()  # (offset in the computed tokens, tokens) per hit

    def __post_init__(self) -> None:
        assert self.computed >= 0 and self.prefix >= 0
        assert all(0 <= o and 0 < n and o + n <= self.computed for o, n in self.segments)

    @property
    def reused(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True)
class LayerWork:
    """One request's work in one layer."""

    seg_rows: float  # reused segment tokens whose projections and attention are computed
    new_rows: int  # the other computed tokens (new text, the question)
    seg_ffn: float  # reused segment tokens whose FFN runs
    left: float  # reused tokens that left recovery: every head's K/V from the cache
    local_read: float  # reused tokens whose local heads' K/V come from the cache
    kind: str  # host path: plain | full | held | schedule
    choose: str | None = None  # a token policy choosing its rows in this layer


def layer_plan(rec: Recovery, work: PromptWork, reuse: bool, completes: bool = True):
    """``work``'s :class:`LayerWork` in every layer (``reuse``: with its segment hits reused;
    ``completes``: this extend ends the prompt, where redknot's layer schedule acts)."""
    seg, new = work.reused, work.computed - work.reused
    plain = LayerWork(0, work.computed, 0, 0, 0, "plain")
    if not reuse or seg == 0:
        return [plain] * rec.num_layers
    full = LayerWork(seg, new, seg, 0, seg if rec.policy == "redknot" else 0, "full")
    if rec.policy == "redknot":
        if not completes or rec.dense_layers >= rec.num_layers:
            return [full] * rec.num_layers
        layers, m, kept = [full] * rec.dense_layers, rec.mass_thresh, float(seg)
        for _ in range(rec.dense_layers, rec.num_layers):
            if rec.skipped == "residual":  # every row computed, FFN on the chosen ones
                layers.append(LayerWork(seg, new, seg * m, 0, seg, "schedule"))
                continue
            layers.append(LayerWork(kept, new, kept * m, seg - kept, kept, "schedule"))
            kept *= m
        return layers
    if rec.policy in ("naive", "epic"):
        k = rec.epic_k if rec.policy == "epic" else 0
        stay = float(sum(min(k, n) for _, n in work.segments))
        return [LayerWork(stay, new, stay, seg - stay, 0, "held")] * rec.num_layers
    if rec.policy == "cacheblend":
        choose_at = rec.blend_check_layer
        stay = float(min(seg, round(rec.blend_ratio * seg)))
    else:  # sparsex
        choose_at = rec.sparseq_boundary - 1
        stay = float(min(seg, rec.sparseq_k + 2 * rec.sparseq_block * len(work.segments)))
    choose_at = min(choose_at, rec.num_layers - 1)
    layers = [full] * choose_at + [LayerWork(seg, new, seg, 0, 0, "full", rec.policy)]
    held = LayerWork(stay, new, stay, seg - stay, 0, "held")
    return layers + [held] * (rec.num_layers - choose_at - 1)


def chunks_of(work: PromptWork, chunk: int | None) -> list[tuple[PromptWork, bool]]:
    """``work`` split into SGLang's prefill chunks of ``chunk`` tokens (None: one extend), each
    with whether it completes the prompt."""
    if not chunk or chunk <= 0 or work.computed <= chunk:
        return [(work, True)]
    out = []
    for start in range(0, work.computed, chunk):
        end = min(start + chunk, work.computed)
        segs = tuple(
            (max(o, start) - start, min(o + n, end) - max(o, start))
            for o, n in work.segments
            if o < end and o + n > start
        )
        out.append((PromptWork(end - start, work.prefix + start, segs), end == work.computed))
    return out


class ReuseCostModel:
    """Predicted time of an extend batch with and without reuse, and the break-even sizes."""

    def __init__(
        self,
        costs: ModelCosts,
        recovery: Recovery,
        record: CostRecord,
        chunk: int | None = None,
    ) -> None:
        self.costs, self.recovery, self.record, self.chunk = costs, recovery, record, chunk

    def _gpu_ms(self, layer: int, parts: Sequence[tuple[PromptWork, LayerWork]]) -> float:
        c, r = self.costs, self.record
        matmul = weights = attn = cached = 0.0
        local = c.num_kv_heads - c.global_heads[layer]
        for work, lw in parts:
            matmul += (lw.seg_rows + lw.new_rows) * c.proj_flops
            matmul += (lw.seg_ffn + lw.new_rows) * c.ffn_flops
            end = work.prefix + work.computed
            if lw.kind == "plain":
                attn += c.causal_attn_flops(layer, work.prefix, work.computed)
            else:  # reused rows at the prompt's middle on average, the new ones at its end
                attn += c.attn_flops(layer, lw.seg_rows, work.prefix + work.computed / 2)
                attn += c.attn_flops(layer, lw.new_rows, end)
            heads = lw.left * c.num_kv_heads + lw.local_read * local
            cached += heads * c.head_dim * 2 * c.dtype_bytes * 2  # K and V, read and written
        weights = c.weight_bytes / (r.bandwidth_gbs * 1e6)
        matmul /= r.gemm_tflops * 1e9
        return (
            max(matmul, weights) + attn / (r.attn_tflops * 1e9) + cached / (r.bandwidth_gbs * 1e6)
        )

    def layer_host_ms(self, kind: str) -> float:
        """Host time to issue one layer of ``kind`` (the record's ``host_ms``), where a ``full``
        layer never takes less than a ``plain`` one: it runs the plain layer's code on every row
        and re-rotates the reused K/V in. A fit whose small plain prompts were GPU-bound can put
        the GPU's time into the plain layer's host constant (the H200 record fitted before this
        rule: 0.744 ms against 0.269 for ``full``); scaled up on a slower host, that made
        recomputing look slower than a reuse that computes every row (the 1/8 map without dense
        layers, reused at 1K at 0.76-1.0x its recompute, ``ttft_settled_policies_h200.json``)."""
        host = self.record.host_ms
        return max(host["full"], host["plain"]) if kind == "full" else host[kind]

    def forward_ms(self, parts: Sequence[tuple[PromptWork, list[LayerWork]]]) -> float:
        """One forward of the given requests (each with its layers' work): host and GPU as a
        pipeline, a choosing layer making the host wait for the GPU."""
        r = self.record
        reused = sum(w.reused for w, layers in parts if layers and layers[0].kind != "plain")
        host = r.plan_ms + r.plan_ms_per_ktok * reused / 1024 if reused else 0.0
        gpu = host
        # a layer's step depends only on its global heads and its requests' work there (the
        # same LayerWork objects, layer_plan repeating them): layers alike are worked out once,
        # as a gate decides per request on the scheduler's host
        steps: dict[tuple, tuple[float, float, bool]] = {}
        heads = self.costs.global_heads
        for layer in range(self.costs.num_layers):
            lws = tuple(layers[layer] for _, layers in parts)
            key = (heads[layer], *map(id, lws))
            step = steps.get(key)
            if step is None:
                kinds = {lw.kind for lw in lws}
                kind = next(k for k in ("schedule", "held", "full", "plain") if k in kinds)
                step = steps[key] = (
                    self.layer_host_ms(kind) + sum(r.choose_ms.get(lw.choose, 0.0) for lw in lws),
                    self._gpu_ms(layer, [(w, lw) for (w, _), lw in zip(parts, lws)]),
                    kind == "schedule" or any(lw.choose for lw in lws),  # host waits for GPU
                )
            host_ms, gpu_ms, waits = step
            start = max(gpu, host)
            host += host_ms
            gpu = max(start + gpu_ms, host)
            if waits:  # the choice reads counts back: the host waits
                host = max(host, gpu)
        return max(host, gpu)

    def batch_ms(self, works: Sequence[PromptWork], reuse: Sequence[bool]) -> float:
        """The extend(s) that compute ``works`` (``reuse[i]``: request i reuses its hits)."""
        chunk = self.chunk if self.chunk and self.chunk > 0 else None
        if chunk is None or sum(w.computed for w in works) <= chunk:
            parts = [(w, layer_plan(self.recovery, w, u)) for w, u in zip(works, reuse)]
            return self.forward_ms(parts)
        total = 0.0  # a batch over the chunk budget: each request chunk by chunk
        for w, u in zip(works, reuse):
            for piece, last in chunks_of(w, self.chunk):
                total += self.forward_ms([(piece, layer_plan(self.recovery, piece, u, last))])
        return total

    def choose(self, works: Sequence[PromptWork]) -> tuple[list[bool], float, float]:
        """Which requests of the batch reuse their hits: ``(reuse, predicted ms, ms without
        any reuse)``. Starting from every request with a hit, drop the one whose removal
        saves most while that helps; reuse is kept only when the batch is predicted at most
        ``1 - margin`` of its time without reuse."""
        plain = [False] * len(works)
        base = self.batch_ms(works, plain)
        chosen = [w.reused > 0 for w in works]
        best = self.batch_ms(works, chosen) if any(chosen) else base
        while sum(chosen) > 1:
            trials = []
            for i in (i for i, c in enumerate(chosen) if c):
                trial = list(chosen)
                trial[i] = False
                trials.append((self.batch_ms(works, trial), i))
            ms, i = min(trials)
            if ms >= best:
                break
            chosen[i], best = False, ms
        if not any(chosen) or best > (1 - self.record.margin) * base:
            return plain, base, base
        return chosen, best, base

    def reuse_floor_ms(self) -> float:
        """A lower bound of any reusing extend's time, whatever it reuses: the host time to
        issue it with every layer on the cheapest path a reusing layer takes
        (:meth:`forward_ms` never ends before its host part; a chunked prompt has at least one
        such extend)."""
        r = self.record
        return r.plan_ms + self.costs.num_layers * min(self.layer_host_ms(k) for k in REUSE_KINDS)

    def pays(self, work: PromptWork) -> bool:
        """Whether a request alone in its batch is served with reuse."""
        return self.choose([work])[0][0]

    def break_even_prompt_tokens(
        self, segment_tokens: int, question: int = 64, limit: int = MAX_CONTEXT
    ) -> int | None:
        """The smallest prompt made of segments of ``segment_tokens`` (all hits) and a
        ``question`` of new tokens that is served with reuse, or None up to ``limit`` tokens.
        Assumes that more segments of the same length never make reuse pay less."""
        if segment_tokens <= 0:
            raise ValueError(f"segment_tokens must be positive, got {segment_tokens}")

        def pays(n: int) -> bool:
            segs = tuple((i * segment_tokens, segment_tokens) for i in range(n))
            return self.pays(PromptWork(n * segment_tokens + question, 0, segs))

        most = max((limit - question) // segment_tokens, 0)
        n = 1
        while n < most and not pays(n):
            n *= 2
        n = min(n, most)
        if n == 0 or not pays(n):
            return None
        low = n // 2  # pays(low) is False (or low == 0)
        while n - low > 1:
            mid = (low + n) // 2
            low, n = (low, mid) if pays(mid) else (mid, n)
        return n * segment_tokens + question

    def min_segment_tokens(self, prompt_tokens: int = 8192, question: int = 64) -> int | None:
        """The shortest segment such that a ``prompt_tokens`` prompt made of such segments (all
        hits) and a ``question`` is served with reuse, or None: the shortest chunk worth
        storing for prompts of that size (``redknot.segcache.gate`` exposes it)."""
        room = prompt_tokens - question

        def pays(s: int) -> bool:
            n = room // s
            segs = tuple((i * s, s) for i in range(n))
            return n > 0 and self.pays(PromptWork(n * s + question, 0, segs))

        s = 1
        while s < room and not pays(s):
            s *= 2
        s = min(s, room)
        if s <= 0 or not pays(s):
            return None
        low = s // 2
        while s - low > 1:
            mid = (low + s) // 2
            low, s = (low, mid) if pays(mid) else (mid, s)
        return s
