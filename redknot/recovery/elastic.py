"""RedKnot's elastic recovery (RedKnot §4.2, Algorithm 1) as hooks of the reference runner.

For a prompt that reuses segments, in every layer of the prefill:

| step              | what happens                                                          |
| ----------------- | --------------------------------------------------------------------- |
| RoPE alignment    | cached keys rotated from ``0..n-1`` to the segment's rows             |
| adaptive restore  | local heads whose edge mass exceeds ``restore_thresh`` become global for the request (:mod:`~redknot.recovery.restore`) |
| global heads      | K/V projected for every row under the new prefix, full causal attention |
| local heads       | segment rows take the cached, aligned K/V (``local_kv="cached"``); attention over sink + window |
| attention rows    | every row (the segment tokens' hidden states are recovered)           |
| sink repair       | the first ``repair_k`` rows of every segment are computed as new text: every head projects their K/V, they run every FFN and never leave recovery |
| FFN, ``layer < dense_layers`` | every row                                                 |
| FFN, deeper       | new rows, the last ``recent_n`` rows, and the important segment rows (:mod:`~redknot.recovery.importance`); the rest keep the residual |

Rows covered by an exact-prefix hit are not computed at all. A prompt without segments is
served exactly like the plain head-class forward (no hook changes anything).
"""

from __future__ import annotations

import torch
from torch import Tensor

from redknot.headmap import LOCAL
from redknot.recovery.base import ReusePolicy
from redknot.recovery.importance import newest_rows, select_important
from redknot.recovery.restore import edge_mass, promote
from redknot.reference import AttentionProbe, LayerContext


class ElasticRecovery(ReusePolicy):
    """The ``redknot`` policy; knobs in :class:`~redknot.recovery.RecoveryOptions`."""

    name = "redknot"
    knobs = (
        "global_fraction",
        "window",
        "sink",
        "dense_layers",
        "mass_thresh",
        "recent_n",
        "restore_thresh",
        "restore_edge",
        "local_kv",
        "skipped",
        "repair_k",
    )
    uses_head_map = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.head_map is None:
            raise ValueError("the redknot policy needs a head map")
        self.dense_layers = min(self.options.dense_layers, self.shape.num_layers)
        self.restored: dict[int, str] = {}  # layer -> classes after restore, for this request
        self.frozen: Tensor | None = None  # [T] bool: rows left to their cache (skipped="cached")

    @property
    def active(self) -> bool:
        return bool(self.served.segments)

    def newest(self, ctx: LayerContext) -> Tensor:
        """The probed rows: the question and at least the last ``recent_n`` rows."""
        start = self.served.question_start - ctx.past_len
        return newest_rows(ctx.num_rows, start, self.options.recent_n, ctx.positions.device)

    # ---- restore ----------------------------------------------------------------------------

    def head_classes(self, layer: int, classes: str) -> str:
        return self.restored.get(layer, classes)

    def restore_classes(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> str:
        opts = self.options
        if (
            not self.active
            or opts.restore_thresh is None
            or LOCAL not in ctx.classes
            or not self.is_prefill(ctx)
        ):
            return ctx.classes
        rows = self.newest(ctx)
        attended = keys.clone()
        if opts.local_kv == "cached":
            local = [h for h, c in enumerate(ctx.classes) if c == LOCAL]
            attended, _ = self.cached_kv(ctx, attended, values.clone(), local, record=False)
        mass = edge_mass(
            q[:, rows],
            attended,
            rows,
            ctx.positions[rows],
            ctx.classes,
            window=ctx.window,
            sink=ctx.sink,
            edge=opts.restore_edge,
            scale=ctx.model.scale,
        )
        self.add_probe_pairs(ctx, rows, ctx.classes)
        classes = promote(ctx.classes, mass, opts.restore_thresh)
        if classes != ctx.classes:
            self.restored[ctx.layer] = classes
        return classes

    # ---- head-aware attention recovery ------------------------------------------------------

    def reused_heads(self, ctx: LayerContext) -> list[int]:
        if self.options.local_kv != "cached":
            return []
        return [h for h, c in enumerate(ctx.classes) if c == LOCAL]

    def repaired(self, ctx: LayerContext) -> Tensor:
        """``[T]`` bool: the first ``repair_k`` rows of every served segment (sink repair)."""
        k = self.options.repair_k
        mask = torch.zeros(ctx.num_rows, dtype=torch.bool, device=ctx.positions.device)
        for start, end in self.segment_spans(ctx):
            mask[start : min(start + k, end)] = True
        return mask

    def edit_kv(self, ctx: LayerContext, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if not self.is_prefill(ctx) or not self.served.segments:
            return keys, values
        heads = self.reused_heads(ctx)
        rows = None if self.options.repair_k == 0 else ~self.repaired(ctx)
        keys, values = self.cached_kv(ctx, keys, values, heads, rows)
        if self.frozen is not None:
            rest = [h for h in range(len(ctx.classes)) if h not in self.reused_heads(ctx)]
            keys, values = self.cached_kv(ctx, keys, values, rest, self.frozen)
        return keys, values

    def choose_attention_rows(self, ctx: LayerContext) -> Tensor | None:
        if self.frozen is None:
            return None
        return torch.nonzero(~self.frozen).flatten()

    # ---- layer schedule (sparse FFN) --------------------------------------------------------

    def _always_rows(self, ctx: LayerContext) -> Tensor:
        """``[T]`` bool: new rows, repaired rows and the last ``recent_n`` rows."""
        always = ~self._segment_mask(ctx)
        if self.options.repair_k:
            always |= self.repaired(ctx)
        always[max(ctx.num_rows - self.options.recent_n, 0) :] = True
        return always

    def _sparse_layer(self, ctx: LayerContext) -> bool:
        return self.active and ctx.layer >= self.dense_layers

    def choose_probe_rows(self, ctx: LayerContext) -> Tensor | None:
        thresh = self.options.mass_thresh
        if (
            self._sparse_layer(ctx)
            and 0.0 < thresh < 1.0
            and not bool(self._always_rows(ctx).all())
        ):
            return self.newest(ctx)
        return super().choose_probe_rows(ctx)

    def choose_ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        if not self._sparse_layer(ctx):
            return None
        always = self._always_rows(ctx)
        open_rows = always.clone() if self.frozen is None else always | self.frozen
        candidates = torch.nonzero(~open_rows).flatten()
        if probe is None:  # mass_thresh 0 or 1, or nothing to choose from
            chosen = candidates if self.options.mass_thresh >= 1.0 else candidates[:0]
        else:
            mass = probe.key_mass.sum(dim=0)[ctx.past_len :]  # [T] over this call's rows
            chosen = select_important(mass, candidates, self.options.mass_thresh)
        always[chosen] = True
        if self.options.skipped == "cached":
            skipped = ~always
            self.frozen = skipped if self.frozen is None else self.frozen | skipped
        return None if bool(always.all()) else torch.nonzero(always).flatten()
