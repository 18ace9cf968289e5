"""Per-layer extension points of the reference runner: what a recovery policy plugs into.

The runner computes one layer as follows; each step marked ``hook`` calls the method of
:class:`LayerHooks` with the same name (the base class changes nothing, which gives the plain
head-class forward)::

    classes = hook head_classes(layer, map classes)       # e.g. keep a restored head global
    q, k, v = norm, projections, RoPE at the rows' positions, for every new row
    K, V    = cat(past KV, k, v)                          # [Hkv, past_len + T, d], row = position
    classes = hook restore_classes(ctx, q, K, V)          # e.g. promote a local head (restore)
    K, V    = hook edit_kv(ctx, K, V)                     # e.g. cached, re-aligned segment KV
    rows    = hook attention_rows(ctx) or every new row   # rows whose attention is computed
    x[rows] += o_proj(attention(q[rows], K, V, classes))  # other rows: residual path
    probe   = statistics of hook probe_rows(ctx) (default: the last ``probe_last`` rows)
    rows    = hook ffn_rows(ctx, probe) or every new row  # e.g. important tokens only
    x[rows] += ffn(x[rows])                               # other rows: residual path
    hook after_layer(ctx, x, probe)

Rows are indices into the tokens of the current forward call (``0 .. T-1``), always ascending;
the KV handed to ``edit_kv`` also holds the ``past_len`` rows of earlier calls in front.

How a segment-reuse policy plugs in (a sketch of RedKnot's Algorithm 1 in these terms; the
segment occupies rows ``[s, e)`` and ``cached`` is its standalone :class:`ReferenceKV`)::

    class ReuseLocalHeads(LayerHooks):
        def edit_kv(self, ctx, keys, values):            # local heads reuse the cache
            if ctx.past_len:                             # decode steps: already in place
                return keys, values
            local = [h for h, c in enumerate(ctx.classes) if c == "L"]
            src, dst = torch.arange(e - s), torch.arange(s, e)
            keys[local, s:e] = ctx.model.rope.realign(cached.keys[ctx.layer][local], src, dst)
            values[local, s:e] = cached.values[ctx.layer][local]
            return keys, values

        def probe_rows(self, ctx):                       # the question's queries
            return torch.arange(e, ctx.num_rows)

        def ffn_rows(self, ctx, probe):                  # sparse FFN above dense_layers
            if ctx.layer < dense_layers:
                return None
            return important_rows(probe.key_mass.sum(0))  # plus new and recent rows

Global heads need nothing: their KV is computed fresh for every row under the new prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from redknot.reference.model import LlamaFamily
from redknot.reference.stats import AttentionProbe


@dataclass(frozen=True)
class LayerContext:
    """What a hook knows about the layer being computed.

    | field        | shape / type | meaning                                                |
    | ------------ | ------------ | ------------------------------------------------------ |
    | ``layer``    | int          | layer index                                            |
    | ``positions``| [T] int64    | positions of this call's rows (``past_len + i``)       |
    | ``past_len`` | int          | KV rows from earlier calls (0 for a prefill from scratch) |
    | ``classes``  | str          | this layer's head classes for this request, ``G``/``L`` per KV head |
    | ``window``, ``sink`` | int  | the local heads' visible set                           |
    | ``model``    | LlamaFamily  | the model (its ``rope`` re-aligns cached keys)         |
    """

    layer: int
    positions: Tensor
    past_len: int
    classes: str
    window: int
    sink: int
    model: LlamaFamily

    @property
    def num_rows(self) -> int:
        return int(self.positions.numel())


class LayerHooks:
    """Base class of per-layer policies; every method's default keeps the plain forward."""

    def head_classes(self, layer: int, classes: str) -> str:
        """Head classes of ``layer`` for this request (same length, ``G``/``L`` per KV head)."""
        return classes

    def restore_classes(self, ctx: LayerContext, q: Tensor, keys: Tensor, values: Tensor) -> str:
        """Head classes for the rest of this layer, decided from the fresh ``q`` (``[Hq, T, d]``)
        and ``keys`` / ``values`` (``[Hkv, past_len + T, d]``, before ``edit_kv``); the
        ``ctx`` of ``edit_kv`` and attention carries the result. Must keep the length."""
        return ctx.classes

    def edit_kv(self, ctx: LayerContext, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Replace KV rows, per head, before attention. ``keys``/``values``:
        ``[Hkv, past_len + T, d]``, keys rotated to their row's position (use
        ``ctx.model.rope.realign`` on keys computed elsewhere). The result is also what the
        runner keeps as this sequence's KV."""
        return keys, values

    def attention_rows(self, ctx: LayerContext) -> Tensor | None:
        """Ascending ``[R]`` int64 rows that compute attention, or ``None`` for all rows."""
        return None

    def probe_rows(self, ctx: LayerContext) -> Tensor | None:
        """Ascending rows to collect :class:`AttentionProbe` statistics for, or ``None`` for
        the runner's default (its ``probe_last`` argument). An empty tensor probes nothing."""
        return None

    def ffn_rows(self, ctx: LayerContext, probe: AttentionProbe | None) -> Tensor | None:
        """Ascending ``[R]`` int64 rows that run the FFN, or ``None`` for all rows."""
        return None

    def after_layer(self, ctx: LayerContext, hidden: Tensor, probe: AttentionProbe | None) -> None:
        """Observe the residual stream ``[T, D]`` after the layer."""
