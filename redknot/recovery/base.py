"""The contract of a segment-reuse policy on the reference runner, and what every policy shares:
serving cached, re-aligned segment KV, and recording what the prefill computed.

A policy is the :class:`~redknot.reference.LayerHooks` of one request. Subclasses decide, per
layer of the prefill, which KV heads take the segments' cached KV (:meth:`reused_heads`) and
which rows compute attention, are probed and run the FFN (``choose_*``; ``None`` = every
row). Decode steps run the plain head-class forward (plus whatever :meth:`head_classes`
returns). Rows handed to the runner are rows of the prefill call: ``position - prefix_len``.

>>> policy = create_policy("redknot", prompt, shape=runner.shape, head_map=hm, options=opts)
>>> served = serve(runner, policy, max_new_tokens=16)     # see redknot.recovery.serve
>>> policy.record.fractions(), served.flops.total
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from redknot.headmap import LOCAL, HeadMap, ModelShape
from redknot.recovery.options import RecoveryOptions
from redknot.recovery.prompt import ReusePrompt, reused_mask
from redknot.recovery.record import LayerRecord, PrefillRecord, visible_keys
from redknot.reference import AttentionProbe, LayerContext, LayerHooks, ReferenceKV, ReferenceRunner


class ReusePolicy(LayerHooks):
    """Base of the policies; by itself it reuses nothing and computes everything."""

    name: ClassVar[str] = ""
    knobs: ClassVar[tuple[str, ...]] = ()  # the RecoveryOptions fields this policy reads
    uses_head_map: ClassVar[bool] = False  # True: serves (and caches segments) under a head map

    def __init__(
        self,
        prompt: ReusePrompt,
        *,
        shape: ModelShape,
        head_map: HeadMap | None = None,
        options: RecoveryOptions | None = None,
    ) -> None:
        self.prompt = prompt
        self.shape = shape
        self.options = options or RecoveryOptions()
        self.head_map = self.serving_map(head_map)
        served = self.served
        self.record = PrefillRecord(
            num_rows=prompt.num_rows,
            prefix_len=served.prefix_len,
            segment_rows=prompt.num_segment_rows,
            num_kv_heads=shape.num_kv_heads,
        )
        self._is_segment = prompt.is_segment_row()
        self._layer: dict = {}

    # ---- what subclasses decide ------------------------------------------------------------

    def prepare(self, runner: ReferenceRunner) -> tuple[list[int], ReferenceKV | None]:
        """Work before the prefill call; returns the tokens the prefill computes (under these
        hooks) and the KV they follow. Default: :attr:`served` after its exact-prefix hit."""
        prompt = self.served
        return list(prompt.ids[prompt.prefix_len :]), prompt.prefix

    def fractions(self) -> dict[str, float | None]:
        """Recomputed fractions of the request (:meth:`PrefillRecord.fractions`)."""
        return self.record.fractions()

    @property
    def served(self) -> ReusePrompt:
        """The prompt as this policy serves it (its prefix hit and segments)."""
        return self.prompt.with_exact_prefix()

    @property
    def every_kv_head(self) -> list[int]:
        """All KV heads of a layer (token-level policies treat every head alike)."""
        return list(range(self.shape.num_kv_heads))

    def serving_map(self, head_map: HeadMap | None) -> HeadMap | None:
        """The head map this policy runs under (``None``: every head global)."""
        if not self.uses_head_map or head_map is None:
            return None
        return self.options.head_map(head_map)

    def reused_heads(self, ctx: LayerContext) -> list[int]:
        """KV heads whose segment rows take the cached, re-aligned KV in this prefill layer."""
        return []

    def choose_attention_rows(self, ctx: LayerContext) -> Tensor | None:
        return None

    def choose_probe_rows(self, ctx: LayerContext) -> Tensor | None:
        return torch.zeros(0, dtype=torch.int64, device=ctx.positions.device)

    def choose_ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        return None

    # ---- helpers ---------------------------------------------------------------------------

    def is_prefill(self, ctx: LayerContext) -> bool:
        return ctx.past_len == self.served.prefix_len

    def new_rows(self, ctx: LayerContext) -> Tensor:
        """``[N]`` int64 rows of the prefill call that belong to no segment."""
        mask = self._segment_mask(ctx)
        return torch.nonzero(~mask).flatten()

    def segment_spans(self, ctx: LayerContext) -> list[tuple[int, int]]:
        """The served segments as ``(start, end)`` rows of the prefill call, ascending."""
        return [(seg.start - ctx.past_len, seg.end - ctx.past_len) for seg in self.served.segments]

    def _segment_mask(self, ctx: LayerContext) -> Tensor:
        """``[T]`` bool over the rows of the prefill call: rows the served segments cover."""
        return reused_mask(self.segment_spans(ctx), ctx.num_rows, ctx.positions.device)

    def cached_kv(
        self,
        ctx: LayerContext,
        keys: Tensor,
        values: Tensor,
        heads: list[int],
        rows: Tensor | None = None,
        *,
        record: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """``keys`` / ``values`` (``[Hkv, past_len + T, d]``) with the segment rows of ``heads``
        replaced, in place, by the cached KV, keys re-aligned from ``0..n-1`` to their rows.
        ``rows``: ``[T]`` bool over this call's rows to restrict the replacement to;
        ``record=False`` for a copy that only informs a decision (not served)."""
        if not heads:
            return keys, values
        index = torch.tensor(heads, device=keys.device)
        rope = ctx.model.rope
        for seg in self.served.segments:
            src = torch.arange(seg.length, device=keys.device)
            if rows is not None:
                src = src[rows[seg.start - ctx.past_len : seg.end - ctx.past_len]]
                if not src.numel():
                    continue
            dst = src + seg.start
            cached_k = seg.cache.keys[ctx.layer].index_select(0, index)[:, src]
            cached_v = seg.cache.values[ctx.layer].index_select(0, index)[:, src]
            aligned = rope.realign(cached_k, src, dst).to(keys.dtype)
            keys[index[:, None], dst[None, :]] = aligned
            values[index[:, None], dst[None, :]] = cached_v.to(values.dtype)
            reused = self._layer.setdefault("reused_rows", {}) if record else {}
            for h in heads:
                reused[h] = reused.get(h, 0) + int(src.numel())
        return keys, values

    def _pairs(self, ctx: LayerContext, rows: Tensor | None, classes: str) -> tuple[int, int]:
        """(global, local) (query, visible key) pairs of ``rows`` over all query heads."""
        positions = ctx.positions if rows is None else ctx.positions[rows]
        group = self.shape.num_attention_heads // self.shape.num_kv_heads
        out = [0, 0]
        for cls in set(classes):
            count = classes.count(cls) * group
            local = cls == LOCAL
            out[local] += count * visible_keys(
                positions, local=local, window=ctx.window, sink=ctx.sink
            )
        return out[0], out[1]

    def add_probe_pairs(self, ctx: LayerContext, rows: Tensor, classes: str) -> None:
        g, loc = self._pairs(ctx, rows, classes)
        self._layer["probe_pairs"] = self._layer.get("probe_pairs", 0) + g + loc

    # ---- LayerHooks ------------------------------------------------------------------------

    def edit_kv(self, ctx: LayerContext, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if not self.is_prefill(ctx):
            return keys, values
        heads = self.reused_heads(ctx) if self.served.segments else []
        return self.cached_kv(ctx, keys, values, heads)

    def attention_rows(self, ctx: LayerContext) -> Tensor | None:
        if not self.is_prefill(ctx):
            return None
        rows = self.choose_attention_rows(ctx)
        self._layer["attention"] = rows
        return rows

    def probe_rows(self, ctx: LayerContext) -> Tensor | None:
        if not self.is_prefill(ctx):
            return None
        rows = self.choose_probe_rows(ctx)
        if rows is not None and rows.numel():
            self.add_probe_pairs(ctx, rows, ctx.classes)
        return rows

    def ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        if not self.is_prefill(ctx):
            return None
        rows = self.choose_ffn_rows(ctx, probe)
        self._layer["ffn"] = rows
        return rows

    def after_layer(self, ctx: LayerContext, hidden: Tensor, probe: AttentionProbe | None) -> None:
        if not self.is_prefill(ctx):
            return
        choices, self._layer = self._layer, {}
        segment = self._segment_mask(ctx)
        original = self._count(segment, None)  # segment rows of the prompt in this call
        attention, ffn = choices.get("attention"), choices.get("ffn")
        reused = choices.get("reused_rows", {})  # KV head -> segment rows served from cache
        compared = choices.get("compared", 0)  # (row, KV head) cached KV compared with fresh KV
        pairs_global, pairs_local = self._pairs(ctx, attention, ctx.classes)
        self.record.layers.append(
            LayerRecord(
                classes=ctx.classes,
                attention_rows=ctx.num_rows if attention is None else int(attention.numel()),
                kv_rows=[ctx.num_rows - reused.get(h, 0) for h in range(self.shape.num_kv_heads)],
                pairs_global=pairs_global,
                pairs_local=pairs_local,
                ffn_rows=ctx.num_rows if ffn is None else int(ffn.numel()),
                probe_pairs=choices.get("probe_pairs", 0),
                realigned=sum(reused.values()) + compared,
                compared=compared,
                segment_attention_rows=self._count(segment, attention),
                segment_kv_rows=original * self.shape.num_kv_heads - sum(reused.values()),
                segment_ffn_rows=self._count(segment, ffn),
            )
        )

    def _count(self, segment: Tensor, rows: Tensor | None) -> int:
        """Rows among ``rows`` (``None``: all) that are segment rows of the *original* prompt
        (a policy serving without reuse still recomputes them)."""
        original = self._is_segment.to(segment.device)[self.served.prefix_len :]
        return int(original.sum()) if rows is None else int(original[rows].sum())
