"""The knobs of segment recovery, in one frozen dataclass.

Every tool that serves or evaluates recovery (the reference policies in this package, the
fidelity evaluation, later the SGLang backend) takes a :class:`RecoveryOptions`; CLI flags are
derived from its fields (:data:`KNOBS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from redknot.headmap import HeadMap, reclassify

LocalKV = Literal["cached", "fresh"]
LOCAL_KV_SOURCES = ("cached", "fresh")
Skipped = Literal["residual", "cached"]
SKIPPED_MODES = ("residual", "cached")
SamkvRecompute = Literal["selective", "anchors", "all", "none"]
SAMKV_RECOMPUTE_MODES = ("selective", "anchors", "all", "none")
SamkvSpread = Literal["layer", "document"]
SAMKV_SPREADS = ("layer", "document")
SamkvUpdate = Literal["overwrite", "fusion"]
SAMKV_UPDATE_MODES = ("overwrite", "fusion")
SamkvBlockScore = Literal["mean", "token-max", "attention"]
SAMKV_BLOCK_SCORES = ("mean", "token-max", "attention")


class RecoveryOptionsError(ValueError):
    """A recovery option out of range; the message names the option and its range."""


@dataclass(frozen=True)
class RecoveryOptions:
    """How the recovery policies treat a prompt that reuses cached segments (each policy reads
    its own knobs: ``ReusePolicy.knobs``).

    | field            | meaning                                                              |
    | ---------------- | -------------------------------------------------------------------- |
    | ``global_fraction`` | head-aware policies: re-threshold the (profiled) head map to this fraction of global heads on its stored ranking; ``None``: the map as it is |
    | ``window``       | tokens a local head attends back from a query (itself included); ``None``: the head map's |
    | ``sink``         | first tokens of the prompt every local head also attends; ``None``: the map's |
    | ``dense_layers`` | layers ``< dense_layers`` run the FFN on every token (clipped to the model's layers) |
    | ``mass_thresh``  | deeper layers run the FFN on the segment tokens holding this fraction of the newest tokens' attention mass (0: none, 1: all) |
    | ``recent_n``     | the newest tokens: probed for importance and restore, and always run the FFN |
    | ``restore_thresh`` | promote a local head to global for this request when its edge mass exceeds this; ``None``: never |
    | ``restore_edge`` | width in tokens of the oldest edge of a window (see :mod:`redknot.recovery.restore`) |
    | ``local_kv``     | ``cached``: local heads take a segment's cached, re-aligned KV; ``fresh``: recompute it |
    | ``repair_k``     | ``redknot``: the first ``repair_k`` tokens of every reused segment are computed as new text (every head's K/V projected, FFN in every layer, never left to the cache): the segment's attention-sink repair (EPIC) inside head-aware recovery; 0: off |
    | ``skipped``      | a segment token that skipped the FFN of a deep layer: ``residual`` (the paper) goes on along the residual path and its global heads' KV is recomputed from it; ``cached`` leaves recovery, from the next layer on every head takes its cached KV and nothing of it is computed |
    | ``blend_check_layer`` | ``cacheblend``: layers ``<= blend_check_layer`` recompute every token; the KV deviation is measured in this layer |
    | ``blend_ratio``  | ``cacheblend``: fraction of the segment tokens (largest KV deviation) recomputed above the check layer, in ``[0, 1]`` |
    | ``epic_k``       | ``epic``: the first ``epic_k`` tokens of every segment are recomputed in every layer |
    | ``sparseq_boundary`` | ``sparsex`` and ``redknot+sparseq``: layers ``< sparseq_boundary`` recompute every token (global heads, for the hybrid); 0: sparse from the first layer |
    | ``sparseq_k``    | ``sparsex`` and ``redknot+sparseq``: the top-k budget, reused tokens ranked by the attention mass of the non-reused queries |
    | ``sparseq_block``| ``sparsex`` and ``redknot+sparseq``: overflow block, reused tokens recomputed on each side of a non-reused span |
    | ``samkv_block``  | ``samkv``: tokens per KV block (the unit of selection) |
    | ``samkv_init_blocks`` / ``samkv_local_blocks`` | ``samkv``: blocks at the start / end of every document kept in full (the anchors) |
    | ``samkv_stable_layers`` | ``samkv``: the layers whose Top-P ratios are averaged (``N*`` of Eq. 3): this many, the last ones unless ``samkv_stable_from`` says where they start |
    | ``samkv_stable_from`` | ``samkv``: the first of the ``samkv_stable_layers`` layers of ``N*`` (``None``: the last layers); ``redknot.recovery.samkv.calibrate`` (appendix A.2) chooses it per model |
    | ``samkv_bias``   | ``samkv``: add the personalized bias of Eq. 1 to the query vector of each document |
    | ``samkv_budget`` | ``samkv``: ``None``: the paper's adaptive block count (Eq. 2-3, retained total / documents); a number in ``[0, 1]``: that fraction of the middle blocks, in every layer |
    | ``samkv_recompute`` | ``samkv``: ``selective`` (anchors and high-attention tokens of kept blocks), ``anchors`` only (the server's rule), ``all`` kept tokens, or ``none`` |
    | ``samkv_spread`` | ``samkv`` with a budget: ``layer`` (the paper: every layer keeps the budget's blocks across documents, normalised scores) or ``document`` (the server's rule: each document keeps the budget's share of its own blocks in every layer) |
    | ``samkv_update`` | ``samkv``: recomputed KV ``overwrite``s the cached KV, or ``fusion`` (Eq. 4) |
    | ``samkv_block_score`` | ``samkv``: a block's score, ``mean`` (the paper: its tokens' mean key against the query) ``token-max`` (not the paper: its best token's score; the anchors' likewise) or ``attention`` (not the paper: the attention the question's tokens pay its tokens over every document's cached keys at their prompt positions, per token; the anchors' likewise) |
    | ``samkv_outlier_sigma`` | ``samkv``: a kept middle token is recomputed when its attention in its own document exceeds the mean by this many standard deviations (PauTa: 3) |

    The ``redknot`` defaults and what the sweep in ``benchmarks/results/fidelity.json``
    (SmolLM2-135M-Instruct, the profiled 15%-global map, window 256, sink 64, 9 cases of
    ``rag_v1``; ``python -m redknot.eval fidelity``) says of them:

    * ``dense_layers=8``: top-1 0.667 at 0.24 of dense FLOPs; 4 gives the same fidelity at
      0.15 (on the front), 16 the same at 0.43, and running every FFN (30) is no better (0.556).
      8 is kept as the safer margin until an 8B-class model is measured.
    * ``mass_thresh=0.5``: 0.3 and 0.7 measured the same on this case set.
    * ``recent_n=128``: the paper's value; it covers every question of the case set.
    * ``restore_thresh=0.1``, ``restore_edge=32``: restores ~3 heads per request; off measured
      the same fidelity at 0.23 of dense FLOPs instead of 0.24.
    * ``local_kv="cached"``: the point of reuse; ``fresh`` is the limit used in tests.
    * ``skipped="cached"``: ``residual`` (the paper's wording) broke the answers here (top-1
      0.111, no answer contained).

    The knobs of the token-level policies are the published settings, not tuned here:
    CacheBlend's check layer 1 and ~15% of the tokens, EPIC's 16 initial tokens, SparseX's
    block of 16 (vLLM's block size) and a boundary at ~17% of SmolLM2's 30 layers (SparseX
    §3.4: 15-20% for small dense models). SparseX gives no value for ``k``; 512 is ~15% of the
    segment tokens of the ``rag_v1`` case set. SamKV's are its paper's (§4.1: blocks of 64, one
    initial and two local blocks; A.2: the last 4-5 layers are stable, 4 for Llama-3.1-8B).
    """

    global_fraction: float | None = None
    window: int | None = None
    sink: int | None = None
    dense_layers: int = 8
    mass_thresh: float = 0.5
    recent_n: int = 128
    restore_thresh: float | None = 0.1
    restore_edge: int = 32
    local_kv: LocalKV = "cached"
    skipped: Skipped = "cached"
    repair_k: int = 0
    blend_check_layer: int = 1
    blend_ratio: float = 0.15
    epic_k: int = 16
    sparseq_boundary: int = 5
    sparseq_k: int = 512
    sparseq_block: int = 16
    samkv_block: int = 64
    samkv_init_blocks: int = 1
    samkv_local_blocks: int = 2
    samkv_stable_layers: int = 4
    samkv_stable_from: int | None = None
    samkv_bias: bool = True
    samkv_budget: float | None = None
    samkv_recompute: SamkvRecompute = "selective"
    samkv_spread: SamkvSpread = "layer"
    samkv_update: SamkvUpdate = "overwrite"
    samkv_block_score: SamkvBlockScore = "mean"
    samkv_outlier_sigma: float = 3.0

    def __post_init__(self) -> None:
        if self.global_fraction is not None and not 0.0 <= self.global_fraction <= 1.0:
            raise RecoveryOptionsError(
                f"global_fraction must lie in [0, 1] or be None, got {self.global_fraction}"
            )
        if self.window is not None and self.window < 1:
            raise RecoveryOptionsError(f"window must be >= 1 token, got {self.window}")
        if self.sink is not None and self.sink < 0:
            raise RecoveryOptionsError(f"sink must be >= 0 tokens, got {self.sink}")
        if self.dense_layers < 0:
            raise RecoveryOptionsError(f"dense_layers must be >= 0, got {self.dense_layers}")
        if not 0.0 <= self.mass_thresh <= 1.0:
            raise RecoveryOptionsError(f"mass_thresh must lie in [0, 1], got {self.mass_thresh}")
        if self.recent_n < 1:
            raise RecoveryOptionsError(f"recent_n must be >= 1 token, got {self.recent_n}")
        if self.restore_thresh is not None and not 0.0 <= self.restore_thresh <= 1.0:
            raise RecoveryOptionsError(
                f"restore_thresh must lie in [0, 1] or be None (off), got {self.restore_thresh}"
            )
        if self.restore_edge < 1:
            raise RecoveryOptionsError(f"restore_edge must be >= 1 token, got {self.restore_edge}")
        if self.skipped not in SKIPPED_MODES:
            raise RecoveryOptionsError(
                f"skipped must be one of {', '.join(SKIPPED_MODES)}, got {self.skipped!r}"
            )
        if self.local_kv not in LOCAL_KV_SOURCES:
            raise RecoveryOptionsError(
                f"local_kv must be one of {', '.join(LOCAL_KV_SOURCES)}, got {self.local_kv!r}"
            )
        for name in ("blend_check_layer", "sparseq_boundary"):
            if getattr(self, name) < 0:
                raise RecoveryOptionsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.blend_ratio <= 1.0:
            raise RecoveryOptionsError(f"blend_ratio must lie in [0, 1], got {self.blend_ratio}")
        for name in ("epic_k", "sparseq_k", "sparseq_block", "repair_k"):
            if getattr(self, name) < 0:
                raise RecoveryOptionsError(f"{name} must be >= 0 tokens, got {getattr(self, name)}")
        self._check_samkv()

    def _check_samkv(self) -> None:
        for name in ("samkv_block", "samkv_stable_layers"):
            if getattr(self, name) < 1:
                raise RecoveryOptionsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samkv_stable_from is not None and self.samkv_stable_from < 0:
            raise RecoveryOptionsError(
                f"samkv_stable_from must be a layer >= 0 or None (the last layers), "
                f"got {self.samkv_stable_from}"
            )
        for name in ("samkv_init_blocks", "samkv_local_blocks"):
            if getattr(self, name) < 0:
                raise RecoveryOptionsError(f"{name} must be >= 0 blocks, got {getattr(self, name)}")
        if self.samkv_budget is not None and not 0.0 <= self.samkv_budget <= 1.0:
            raise RecoveryOptionsError(
                f"samkv_budget must lie in [0, 1] or be None (adaptive), got {self.samkv_budget}"
            )
        if self.samkv_recompute not in SAMKV_RECOMPUTE_MODES:
            raise RecoveryOptionsError(
                f"samkv_recompute must be one of {', '.join(SAMKV_RECOMPUTE_MODES)}, "
                f"got {self.samkv_recompute!r}"
            )
        if self.samkv_spread not in SAMKV_SPREADS:
            raise RecoveryOptionsError(
                f"samkv_spread must be one of {', '.join(SAMKV_SPREADS)}, got {self.samkv_spread!r}"
            )
        if self.samkv_spread == "document" and self.samkv_budget is None:
            raise RecoveryOptionsError(
                "samkv_spread 'document' shares a budget among each document's own blocks: set "
                "samkv_budget (the adaptive count is cut across documents)"
            )
        if self.samkv_block_score not in SAMKV_BLOCK_SCORES:
            raise RecoveryOptionsError(
                f"samkv_block_score must be one of {', '.join(SAMKV_BLOCK_SCORES)}, "
                f"got {self.samkv_block_score!r}"
            )
        if self.samkv_update not in SAMKV_UPDATE_MODES:
            raise RecoveryOptionsError(
                f"samkv_update must be one of {', '.join(SAMKV_UPDATE_MODES)}, "
                f"got {self.samkv_update!r}"
            )
        if not self.samkv_outlier_sigma >= 0.0:
            raise RecoveryOptionsError(
                f"samkv_outlier_sigma must be >= 0 standard deviations, "
                f"got {self.samkv_outlier_sigma}"
            )

    def replace(self, **changes: Any) -> RecoveryOptions:
        """A copy with some fields changed (checked like a new instance)."""
        unknown = set(changes) - set(KNOBS)
        if unknown:
            raise RecoveryOptionsError(
                f"unknown recovery option(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(KNOBS)}"
            )
        return dataclasses.replace(self, **changes)

    def head_map(self, head_map: HeadMap) -> HeadMap:
        """``head_map`` re-thresholded to ``global_fraction`` and with this request's
        ``window`` and ``sink`` (each when set)."""
        if self.global_fraction is not None and self.global_fraction != head_map.global_fraction:
            head_map = reclassify(head_map, self.global_fraction)
        window = head_map.window if self.window is None else self.window
        sink = head_map.sink if self.sink is None else self.sink
        if (window, sink) == (head_map.window, head_map.sink):
            return head_map
        return dataclasses.replace(head_map, window=window, sink=sink)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


KNOBS = tuple(f.name for f in dataclasses.fields(RecoveryOptions))
