"""The layer schedule of segment reuse: deep layers run the FFN on important tokens only.

RedKnot's recovery (REDKNOT.md part 5) runs the FFN of layers ``< dense_layers`` on every
token; deeper layers run it only on the segment tokens that the newest tokens (the question, at
least the last ``recent_n``) attend to most, taken in decreasing mass until ``mass_thresh`` of
the candidates' mass is covered; new (non-segment) tokens and the newest ones always run it.
The others take the residual path: their FFN output is zero.

What becomes of a token that skipped the FFN of a deep layer is the ``skipped`` option:

| ``skipped``  | from the next layer on, the token ...                                          |
| ------------ | ------------------------------------------------------------------------------ |
| ``residual`` | (the paper's wording) goes on along the residual path: its projections and attention are computed, its global heads' K/V recomputed from its stale hidden state |
| ``cached``   | leaves recovery: every head takes its cached, re-aligned K/V and nothing of it is computed (no projection, no attention row, no FFN) |

In the server, the attention backend decides the rows of each layer while it attends
(:func:`redknot.kernels.choose.choose_rows`) and records them in :data:`SCHEDULE`; a hook
around the model's MLP (:func:`around_mlp`) runs the MLP on those rows only. Under
``skipped="cached"`` a hook around the decoder layer (:func:`around_decoder_layer`) hands each
layer only the rows still in recovery (``SCHEDULE.held``): the hidden states are compacted once
when rows leave and scattered back to every row after the last layer, so the projections and the
FFN of a left row are never computed; the backend fills that row's K/V of every head from the
segment cache. Importance
comes from the layer's global heads (causal softmax of the probed queries over every key of the
request, summed over heads and probes: :func:`redknot.kernels.key_mass.key_mass`); local heads,
which see only sink + window, do not vote. A layer whose rank holds no global head (and every
rank under tensor parallelism, where the mass is summed over ranks first) keeps every row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from redknot.attention.trace import phase


@dataclass
class FfnSchedule:
    """Rows of the current forward that run the FFN, per layer (absent: every row)."""

    layer: int = -1  # the layer whose attention ran last (its MLP runs next)
    # layer -> int64 [R] rows (indices into the rows the layer computes) that run its FFN
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    skipped: int = 0  # token-layer FFNs skipped in this forward
    # skipped="cached": batch rows still in recovery (ascending int64; None: every row)
    held: torch.Tensor | None = None  # the rows the current layer computes
    target: torch.Tensor | None = None  # the rows the next layer computes
    full: tuple[torch.Tensor, torch.Tensor] | None = None  # every row's (hidden, residual)
    held_positions: torch.Tensor | None = None  # the positions of the rows ``held``
    left: int = 0  # token-layers left to the cache (nothing computed) in this forward
    last_layer: int = -1  # the model's last layer: rows are scattered back after it

    def reset(self) -> None:
        self.layer = -1
        self.rows.clear()
        self.skipped = 0
        self.held = self.target = self.full = self.held_positions = None
        self.left = 0

    def current(self) -> torch.Tensor | None:
        return self.rows.get(self.layer)


SCHEDULE = FfnSchedule()  # one per process: a scheduler runs one forward at a time


@dataclass(frozen=True)
class SparseFfn:
    """One request of an extend batch whose deep-layer FFN is sparse.

    Positions are absolute in the request; batch rows are ``batch_offset + pos - prefix``."""

    req_pool_idx: int
    batch_offset: int  # the request's first row in the batch
    prefix: int  # tokens before this extend
    length: int  # tokens this extend computes (its last one is the prompt's last)
    probe_start: int  # first probed position: the question, at least the last recent_n
    candidates: torch.Tensor  # int64 [C] positions of segment tokens before probe_start (device)
    index: int = 0  # the request's place in the batch

    @property
    def num_probe(self) -> int:
        return self.prefix + self.length - self.probe_start

    def rows_of(self, positions: torch.Tensor) -> torch.Tensor:
        return positions - self.prefix + self.batch_offset

    @functools.cached_property
    def candidate_rows(self) -> torch.Tensor:
        """``[C]`` int64 batch rows of the candidates (once per batch, not once per layer)."""
        return self.rows_of(self.candidates)


def around_mlp(original, self, x, *args, **kwargs):
    """The model's MLP on the rows the schedule keeps; zeros (the residual path) elsewhere."""
    rows = SCHEDULE.current()
    if rows is None or rows.numel() == x.shape[0]:
        return original(self, x, *args, **kwargs)
    out = x.new_zeros(x.shape)
    if rows.numel():
        out[rows] = original(self, x[rows], *args, **kwargs)
    return out


def _layer_id(layer: Any) -> int:
    return layer.self_attn.attn.layer_id


def around_decoder_layer(original, self, positions, hidden_states, forward_batch, residual):
    """The model's decoder layer on the rows still in recovery (``SCHEDULE.target``).

    The layer's inputs hold the rows ``SCHEDULE.held`` (every row when ``None``); when the
    target differs, they are written back to the full tensors and the target rows gathered. After
    the model's last layer every row is returned: the rows that left keep the hidden state they
    had when they left (only the prompt's last rows are read for logits)."""
    sched = SCHEDULE
    target = sched.target
    if target is None:
        with phase("redknot.decoder_layer.every_row"):
            return original(self, positions, hidden_states, forward_batch, residual)
    if sched.held is not target:
        with phase("redknot.compact"):
            if sched.held is None:
                # before the first layer the residual is not formed yet (None): rows that
                # leave there keep a zero residual, the layer gets None for its rows; the
                # embeddings are copied (they may be the caller's tensor, written back later)
                first = residual is None
                if first:
                    residual = torch.zeros_like(hidden_states)
                    hidden_states = hidden_states.clone()
                sched.full = (hidden_states, residual)
            else:
                first = False
                sched.full[0][sched.held] = hidden_states
                sched.full[1][sched.held] = residual
            hidden_states = sched.full[0][target]
            residual = None if first else sched.full[1][target]
            sched.held_positions = positions[target]  # gathered once, not once per layer
        sched.held = target
    sched.left += sched.full[0].shape[0] - target.numel()
    with phase("redknot.decoder_layer.rows_in_recovery"):
        hidden_states, residual = original(
            self, sched.held_positions, hidden_states, forward_batch, residual
        )
    if _layer_id(self) != sched.last_layer:
        return hidden_states, residual
    full_h, full_r = sched.full
    full_h[target] = hidden_states
    full_r[target] = residual
    sched.held = sched.target = sched.full = sched.held_positions = None
    return full_h, full_r
