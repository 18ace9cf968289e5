"""The one configuration of a redknot server. CLI flags and config-file keys derive from it.

Every field is reachable as ``--redknot-<field>`` on ``sglang.launch_server`` (underscores
become dashes), as a key of the JSON/YAML file given by ``--redknot-config FILE``, and as a
``redknot_<field>`` keyword of ``sgl.Engine``. Flags override file values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redknot import served_default
from redknot.api.options import AutoSegmentsOption, ChatSegments, parse_namespaces
from redknot.headmap import HeadMap, HeadMapError, ModelShape
from redknot.headmap.served import ModelSignature
from redknot.served_default import ServedDefaultError

KERNEL_CHOICES = ("auto", "triton")
LFPS_CHOICES = ("off", "lfps", "topk")  # redknot.lfps.serving
LFPS_SELECTION_CHOICES = ("query-head", "kv-head", "kv-head-union")
CAPTURE_CHOICES = ("on", "off")  # redknot.api.capture
SKIPPED_CHOICES = ("cached", "residual")  # redknot.attention.ffn_schedule
LOCAL_KV_CHOICES = ("cached", "fresh")  # redknot.recovery.options.LOCAL_KV_SOURCES
REUSE_GATE_CHOICES = ("auto", "record", "always")  # redknot.costmodel.gate
SEGMENT_HEAD_CHOICES = ("local", "all")  # what a cached segment keeps (redknot.pool.segment_region)
TOKEN_POLICIES = ("naive", "epic", "cacheblend", "sparsex", "samkv")  # attention.token_policy
POLICY_CHOICES = ("redknot", *TOKEN_POLICIES)
# Reference-path policies the server does not serve, and why (python -m redknot.eval runs them)
REFERENCE_ONLY_POLICIES = {
    "redknot+sparseq": "the hybrid of head classes and SparseX's sparse-Q choice was measured and "
    "not kept in the server: it does not move the fidelity-TTFT front (README, 'Reuse policies "
    "side by side'); evaluate it on the reference path with python -m redknot.eval fidelity "
    "--policies full,redknot+sparseq",
}
logger = logging.getLogger(__name__)


class RedknotConfigError(ValueError):
    """An option value that cannot work; the message says what to change."""


def _opt(help: str, **kw) -> Any:
    return field(metadata={"help": help}, **kw)


@dataclass(frozen=True)
class RedknotConfig:
    head_map: str | None = _opt(
        "Path of the head-class map (JSON) made for the served model by redknot-profile.",
        default=None,
    )
    all_global: bool = _opt(
        "Treat every KV head as global: the exact dense computation (no map needed).",
        default=False,
    )
    window: int | None = _opt(
        "Local heads' window in tokens (overrides the map's value).", default=None
    )
    sink: int | None = _opt("Local heads' sink tokens (overrides the map's value).", default=None)
    kernel: str = _opt(
        "Attention kernels: 'auto' sends dense-equivalent work to FlashInfer and the rest to "
        "redknot's Triton kernels; 'triton' runs redknot's Triton kernels for everything.",
        default="auto",
    )
    segment_fraction: float = _opt(
        "Fraction of the KV-cache budget reserved for cached segments (the K/V of their "
        "--redknot-segment-heads for every segment token); 0 disables segment caching.",
        default=0.05,
    )
    segment_heads: str | None = _opt(
        "Heads whose K/V a cached segment keeps: 'local' (what RedKnot's recovery reads; global "
        "heads are recomputed) or 'all' (also what rows that leave recovery read, "
        "--redknot-skipped cached, and token-level policies). Not given: 'all' when "
        "--redknot-dense-layers is given with --redknot-skipped cached, else 'local'.",
        default=None,
    )
    chat_segments: str = _opt(
        "Segments in OpenAI chat requests: 'off', 'messages' (every message's content is a "
        "reusable segment) or 'min-tokens:N' (messages of N tokens or more).",
        default="off",
    )
    dense_layers: int | None = _opt(
        "Segment reuse: layers below this run the FFN on every token; deeper layers only on the "
        "segment tokens the newest tokens attend to most. Not given: the head map's recorded "
        "value, else every layer runs every FFN; the model's layer count turns it off.",
        default=None,
    )
    mass_thresh: float = _opt(
        "Segment reuse: deeper layers run the FFN on the fewest segment tokens holding this "
        "fraction of the newest tokens' attention mass (1 keeps every token).",
        default=0.5,
    )
    skipped: str = _opt(
        "Segment reuse, layers from --redknot-dense-layers on: a segment token that skips a "
        "layer's FFN 'cached': leaves recovery, from the next layer on every head takes its "
        "cached K/V and nothing of it is computed (the reference path's default; needs "
        "--redknot-segment-heads all); 'residual': goes on along the residual path and its "
        "projections and attention keep being computed.",
        default="cached",
    )
    local_kv: str = _opt(
        "Segment reuse: the K/V of local heads for the reused tokens a layer computes: "
        "'cached' (the segment's cached K/V, re-rotated to the new positions: RedKnot's "
        "recovery) or 'fresh' (the K/V this prompt's projections compute, as global heads'; "
        "tokens that left recovery still take the cache). Not given: the head map's recorded "
        "value, else 'cached'.",
        default="cached",
    )
    recent_n: int = _opt(
        "Segment reuse: the newest tokens (the question, at least this many) whose attention "
        "decides importance and restore; they always run the FFN.",
        default=128,
    )
    restore_thresh: float | None = _opt(
        "Segment reuse, adaptive restore: a local head whose attention mass on the oldest "
        "--redknot-restore-edge tokens of its window (from the newest tokens) exceeds this in a "
        "layer is promoted to full attention for that request, in the prefill and every decode "
        "step. Not given: the head map's recorded value, else off.",
        default=None,
    )
    restore_edge: int = _opt(
        "Segment reuse, adaptive restore: width in tokens of the oldest edge of a local head's "
        "window.",
        default=32,
    )
    restore_heads: int | None = _opt(
        "Segment reuse, adaptive restore: most local heads a request may promote per layer (the "
        "largest edge masses first). Every token slot keeps this many more heads per layer, "
        "counted in the KV budget. Not given: 1 when --redknot-restore-thresh is set; 0 turns "
        "restore off.",
        default=None,
    )
    policy: str = _opt(
        "How reused segment tokens are recovered: 'redknot' (head classes: global heads "
        "recomputed, local heads reuse the cache; the head map decides), or a token-level "
        "policy that recomputes some tokens in every head and reuses the cache for the rest: "
        "'naive' (no segment token), 'epic' (the first --redknot-epic-k of every segment), "
        "'cacheblend' (the --redknot-blend-ratio of largest KV deviation in "
        "--redknot-blend-check-layer), 'sparsex' (SparseX's sparse-Q selection after "
        "--redknot-sparseq-boundary full layers), 'samkv' (SamKV: a request holds only its "
        "documents' anchors and the --redknot-samkv-budget of their middle blocks each layer "
        "chooses; docs/samkv.md). Token-level policies serve every head global.",
        default="redknot",
    )
    epic_k: int = _opt(
        "Policy 'epic': the first tokens of every reused segment recomputed in every layer.",
        default=16,
    )
    blend_check_layer: int = _opt(
        "Policy 'cacheblend': every token is recomputed up to this layer, where the KV "
        "deviation of the reused tokens chooses which go on.",
        default=1,
    )
    blend_ratio: float = _opt(
        "Policy 'cacheblend': fraction of each request's reused tokens recomputed after the "
        "check layer (those of largest KV deviation).",
        default=0.15,
    )
    sparseq_boundary: int = _opt(
        "Policy 'sparsex': layers below this recompute every token; the last of them chooses "
        "(>= 1 in the server).",
        default=5,
    )
    sparseq_k: int = _opt(
        "Policy 'sparsex': the top-k reused rows by the attention mass of the non-reused queries.",
        default=512,
    )
    sparseq_block: int = _opt(
        "Policy 'sparsex': reused rows recomputed on each side of a run of non-reused rows.",
        default=16,
    )
    samkv_block: int = _opt("Policy 'samkv': tokens per block of a document.", default=64)
    samkv_budget: float = _opt(
        "Policy 'samkv': fraction of each document's middle blocks a request holds (each layer "
        "chooses which, from the question's queries).",
        default=0.15,
    )
    samkv_init_blocks: int = _opt(
        "Policy 'samkv': blocks at each document's start kept and recomputed (anchors).",
        default=1,
    )
    samkv_local_blocks: int = _opt(
        "Policy 'samkv': blocks at each document's end kept and recomputed (anchors).",
        default=2,
    )
    samkv_min_tokens: int = _opt(
        "Policy 'samkv': a request is served as its documents' anchors and kept blocks only when "
        "its stored documents hold at least this many tokens; below, it is computed in full "
        "(exact). Measured on the 8B shape (one H100, ttft_samkv.json): the cut answered 1.70x "
        "sooner than flashinfer at 4K document tokens in 8 documents (1.92x in 2) and 3.50x at "
        "8K; 2K in 8 documents cannot drop a block of 64.",
        default=4096,
    )
    samkv_bias: str = _opt(
        "Policy 'samkv': 'on' adds the personalized bias of the paper's Eq. 1 (the other "
        "documents' local queries) to the question's query; 'off' leaves it out.",
        default="on",
    )
    namespaces: str | None = _opt(
        "Comma-separated segment namespaces requests may use ('default' is always there). "
        "Without it, a namespace is created on first use (a request or a registration).",
        default=None,
    )
    reuse_gate: str = _opt(
        "Segment reuse: 'auto' serves a marked request with its stored segments only when the "
        "cost model (redknot.costmodel, the device's measured record) predicts reuse faster "
        "than recomputing the prompt, else recomputes it (logged with the reason), the "
        "record's predictions corrected by the forward times this server measures "
        "(redknot.costmodel.measured; with one tensor-parallel rank, else the record alone); "
        "'record' decides by the record alone; 'always' reuses every hit (for measuring).",
        default="auto",
    )
    cost_record: str | None = _opt(
        "Segment reuse: the cost-model record (JSON from benchmarks/reuse_cost.py) the reuse "
        "gate uses; not given: the shipped record of this GPU, else the H100's (logged).",
        default=None,
    )
    accept_lossy_map: bool = _opt(
        "Serve --redknot-policy redknot with a head map whose calibration record measured more "
        "answer loss than its floor (refused at startup without this flag).",
        default=False,
    )
    capture: str = _opt(
        "Capture on miss: 'on' stores a marked segment that misses (its standalone K/V computed "
        "after the request's first token); 'off' stores only registered segments.",
        default="on",
    )
    capture_step_tokens: int = _opt(
        "Captures on miss wait while user requests do; with none waiting, at most this many "
        "prompt tokens of captures start in one prefill batch, so a request that arrives then "
        "waits for one such step (redknot.integration.capture_order). Measured on the 8B shape "
        "(H200) with a fixed step: at 2048 the first token of a request that arrives behind "
        "captures takes 1.127x as long (p50) and the most is reused; at 1024, 1.073x and less "
        "is reused (docs/reuse.md).",
        default=2048,
    )
    capture_step_fraction: float = _opt(
        "A step of captures is also at most this fraction of the shortest of the last 8 user "
        "prompts (and at least 256 tokens), so that short prompts wait little behind captures "
        "(0: the fixed --redknot-capture-step-tokens only).",
        default=0.1,
    )
    auto_segments: str = _opt(
        "Segments in unmarked prompts: 'off', or 'cdc' (a /generate prompt's tokens are cut "
        "into content-defined chunks, a chat request's message contents are segments, long "
        "ones cut into chunks too; looked up and captured in namespace 'auto'; "
        "docs/auto_segments.md), or 'cdc-edges' (cdc, and the documents' heads and tails that "
        "straddling chunks lose are learned from repeated misses and made segments: on the "
        "8B shape's replayed RAG traffic 0.87 of prompt tokens reused instead of 0.78, EPIC "
        "3.8x flashinfer's TTFT), or 'cdc-docs' (cdc-edges, and a document between a learned "
        "head and tail is one segment, as registered: with --redknot-policy epic 0.92 of the "
        "replayed RAG prompt tokens reused, 5.7x flashinfer's TTFT, and SmolLM2's answers kept "
        "as with registered documents; the mode for RAG traffic). Off by default: measured "
        "0.86-0.94x flashinfer's TTFT on chat traffic (H100 and H200 side by side, 8B shape), "
        "and on the shipped model nothing is reused.",
        default="off",
    )
    auto_chunk_tokens: int = _opt(
        "--redknot-auto-segments cdc: average chunk length in tokens (chunks are a quarter to "
        "four times this; shorter ones, and those below the reuse gate's break-even, are not "
        "segments).",
        default=256,
    )
    auto_capture_after: int = _opt(
        "--redknot-auto-segments cdc: an automatic segment is captured the N-th time a request "
        "misses it (default 2: chunks seen once, such as those that straddle two documents of an "
        "unmarked prompt, cost no capture prefill and no region pages; 1 captures at first "
        "sight).",
        default=2,
    )
    auto_capture_in_place: str = _opt(
        "--redknot-auto-segments: 'on' makes the request that misses an automatic chunk due for "
        "capture store it from its own prefill (its K/V computed after everything before it in "
        "that prompt, keys rotated back to positions from 0): no capture prefill is sent for it. "
        "'off' captures it apart after --redknot-auto-capture-context tokens. Learned edges and "
        "cdc-docs documents are captured apart either way.",
        default="on",
    )
    auto_capture_context: int = _opt(
        "--redknot-auto-segments: an automatic segment is captured after the K tokens that "
        "preceded it in the prompt that missed it (computed and not stored; its keys rotated "
        "back to positions from 0; segments that missed one after the other are captured in "
        "one prompt, each after the ones before it), so that a chunk cut inside a document "
        "keeps what its document's text before it means to it; 0 captures each alone. Measured "
        "on SmolLM2's RAG cases under cdc-docs (reference path): 64 keeps 15 of 16 "
        "dense-correct answers with CacheBlend and with EPIC (registered documents: 15, 13), "
        "alone 12 and 11, 32 and 128 fewer than 64 (docs/auto_segments.md).",
        default=64,
    )
    namespace_fraction: float = _opt(
        "Largest fraction of the segment region one namespace may hold; beyond it a new segment "
        "evicts that namespace's own least recently used ones, never another namespace's.",
        default=1.0,
    )
    lfps: str = _opt(
        "Sparse decode of long requests: 'off' (dense), 'lfps' (LFPS: each step attends the sink "
        "tokens and the keys predicted from score tables of past attention, docs/lfps.md) or "
        "'topk' (the exact Top-k of every key's score at every step, the same budget). Needs "
        "every head global (--redknot-all-global or a token-level policy). Off by default: "
        "it kept SmolLM2's long-case answers and decodes 1.3-1.8x faster from 8 requests at "
        "32-90K tokens (8B shape, H200), but its prefill is about a fifth slower and one request "
        "decodes slower (docs/lfps.md).",
        default="off",
    )
    lfps_budget: float = _opt(
        "--redknot-lfps: keys attended per head and step besides the sinks, a fraction of the "
        "request's keys if below 1, else a count.",
        default=0.02,
    )
    lfps_selection: str = _opt(
        "--redknot-lfps: 'kv-head' (one selection per KV head, shared by its query heads), "
        "'kv-head-union' (lists and tables per KV head, every query head choosing its own "
        "Top-k of the list, the union attended; with --redknot-lfps-candidate-factor 8 it "
        "recalls 0.87-0.89 of each head's exact Top-k on SmolLM2 where kv-head recalls "
        "0.61-0.66, and decodes about 2x slower than kv-head) or 'query-head' (every query "
        "head selects its own keys, LFPS as published; slowest). Default kv-head: it kept every "
        "dense-correct answer on SmolLM2's long cases, as kv-head-union did, and decodes "
        "fastest (docs/lfps.md).",
        default="kv-head",
    )
    lfps_min_tokens: int = _opt(
        "--redknot-lfps: requests whose prompt is shorter than this decode densely.",
        default=2048,
    )
    lfps_max_requests: int | None = _opt(
        "--redknot-lfps: requests that may decode sparsely at once (each holds score tables as "
        "long as the context in every layer, reserved from the KV budget at startup); others "
        "decode densely. Default 8, or under --redknot-lfps-offload-gb as many requests of the "
        "full context as the host store holds (at least 8): there a dense decode reads every "
        "key across PCIe.",
        default=None,
    )
    lfps_decay: float = _opt(
        "--redknot-lfps lfps: decay of the score tables (Eq. 4, 10).", default=0.95
    )
    lfps_lam: float = _opt(
        "--redknot-lfps lfps: lambda of the candidate thresholds (Eq. 8; higher: fewer).",
        default=0.2,
    )
    lfps_sparsity_threshold: float = _opt(
        "--redknot-lfps lfps: a head whose estimated sink share exceeds this takes the "
        "sink-plus-mean output (Eq. 6; the paper's 0.85); above 1 turns that off. Default 2 "
        "(off): at 0.85 it lost 5 of SmolLM2's 8 dense-correct long-case answers, off it lost "
        "none (docs/lfps.md).",
        default=2.0,
    )
    lfps_candidate_factor: int = _opt(
        "--redknot-lfps lfps: candidates scored per step, as a multiple of the budget (the "
        "highest-priority ones are kept when more qualify).",
        default=4,
    )
    lfps_offload_gb: float = _opt(
        "--redknot-lfps: hold the KV in the GPU's KV budget and beyond it in this many GiB of "
        "pinned host memory (per tensor-parallel rank), one store, so that more or longer "
        "requests are held than the GPU fits; kernels read the host part over PCIe, and "
        "requests with LFPS state read only the keys they score and attend. Where the driver "
        "cannot map both memories into one range the KV is in host memory only (logged). 0 "
        "(default): KV in GPU memory (docs/lfps.md).",
        default=0.0,
    )
    skip_startup_check: bool = _opt(
        "Start without the startup check of the attention kernels against the PyTorch "
        "reference (redknot.attention.startup_check); the kernels are then unverified.",
        default=False,
    )

    def __post_init__(self) -> None:
        self._resolve_policy()
        if self.head_map is not None and self.all_global:
            raise RedknotConfigError(
                "--redknot-head-map and --redknot-all-global exclude each other: "
                "give a map, or ask for every head global, not both"
            )
        if self.head_map is None and not self.all_global:
            raise RedknotConfigError(
                "--redknot-policy redknot needs a head map: pass --redknot-head-map PATH (made "
                "by redknot-profile and calibrated by python -m redknot.calibrate; shipped maps "
                "are in configs/heads/), leave --redknot-policy out to serve the calibrated "
                "default, or pass --redknot-all-global for the exact dense computation"
            )
        if self.kernel not in KERNEL_CHOICES:
            raise RedknotConfigError(
                f"--redknot-kernel {self.kernel!r} is not one of {', '.join(KERNEL_CHOICES)}"
            )
        if isinstance(self.capture_step_fraction, bool) or not (
            isinstance(self.capture_step_fraction, (int, float))
            and 0 <= self.capture_step_fraction <= 1
        ):
            raise RedknotConfigError(
                "--redknot-capture-step-fraction must be a number in [0, 1] (0: the fixed "
                f"--redknot-capture-step-tokens only), got {self.capture_step_fraction!r}"
            )
        if isinstance(self.segment_fraction, bool) or not (
            isinstance(self.segment_fraction, (int, float)) and 0 <= self.segment_fraction <= 0.9
        ):
            raise RedknotConfigError(
                "--redknot-segment-fraction must be a number in [0, 0.9] (0 disables segments), "
                f"got {self.segment_fraction!r}"
            )
        if self.skipped not in SKIPPED_CHOICES:
            raise RedknotConfigError(
                f"--redknot-skipped {self.skipped!r} is not one of {', '.join(SKIPPED_CHOICES)}"
            )
        if self.local_kv not in LOCAL_KV_CHOICES:
            raise RedknotConfigError(
                f"--redknot-local-kv {self.local_kv!r} is not one of {', '.join(LOCAL_KV_CHOICES)}"
            )
        if self.reuse_gate not in REUSE_GATE_CHOICES:
            raise RedknotConfigError(
                f"--redknot-reuse-gate {self.reuse_gate!r} is not one of "
                f"{', '.join(REUSE_GATE_CHOICES)}"
            )
        if self.cost_record is not None:
            from redknot.costmodel.record import CostRecord, CostRecordError

            try:
                CostRecord.read(self.cost_record)
            except CostRecordError as e:
                raise RedknotConfigError(f"--redknot-cost-record: {e}") from None
        self._resolve_restore()
        leaves = self.dense_layers is not None and self.skipped == "cached"
        if self.segment_heads is None:  # frozen dataclass: resolve the default once
            object.__setattr__(self, "segment_heads", "all" if leaves else "local")
        if self.segment_heads not in SEGMENT_HEAD_CHOICES:
            raise RedknotConfigError(
                f"--redknot-segment-heads {self.segment_heads!r} is not one of "
                f"{', '.join(SEGMENT_HEAD_CHOICES)}"
            )
        for name in ("capture", "auto_capture_in_place", "samkv_bias"):  # on/off options
            if getattr(self, name) not in CAPTURE_CHOICES:
                raise RedknotConfigError(
                    f"--redknot-{name.replace('_', '-')} {getattr(self, name)!r} is not one of "
                    f"{', '.join(CAPTURE_CHOICES)}"
                )
        if isinstance(self.namespace_fraction, bool) or not (
            isinstance(self.namespace_fraction, (int, float)) and 0 < self.namespace_fraction <= 1
        ):
            raise RedknotConfigError(
                "--redknot-namespace-fraction must be a number in (0, 1], "
                f"got {self.namespace_fraction!r}"
            )
        for parse in (
            lambda: ChatSegments.parse(self.chat_segments),
            lambda: parse_namespaces(self.namespaces),
            lambda: AutoSegmentsOption.parse(
                self.auto_segments,
                self.auto_chunk_tokens,
                self.auto_capture_after,
                self.auto_capture_context,
            ),
        ):
            try:
                parse()
            except ValueError as e:
                raise RedknotConfigError(str(e)) from None
        for name in ("mass_thresh", "blend_ratio", "restore_thresh", "samkv_budget"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value <= 1):
                flag = name.replace("_", "-")
                raise RedknotConfigError(
                    f"--redknot-{flag} must be a number in [0, 1], got {value!r}"
                )
        for name, low in (("dense_layers", 0), ("recent_n", 1), ("epic_k", 0), ("restore_edge", 1),
                          ("capture_step_tokens", 1), ("lfps_min_tokens", 1),
                          ("lfps_max_requests", 1), ("lfps_candidate_factor", 1),
                          ("restore_heads", 0),
                          ("blend_check_layer", 0), ("sparseq_boundary", 1), ("sparseq_k", 0),
                          ("sparseq_block", 0), ("samkv_block", 1), ("samkv_init_blocks", 0),
                          ("samkv_local_blocks", 0), ("samkv_min_tokens", 0)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):  # fmt: skip
                flag = name.replace("_", "-")
                raise RedknotConfigError(
                    f"--redknot-{flag} must be an integer >= {low}, got {value!r}"
                )
        self._check_lfps()
        for name in ("window", "sink"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (name == "window")):
                raise RedknotConfigError(
                    f"--redknot-{name} must be an integer >= {int(name == 'window')}, "
                    f"got {value!r}"
                )

    def _check_lfps(self) -> None:
        """LFPS decode's options (redknot.lfps.serving)."""
        for name, choices in (("lfps", LFPS_CHOICES), ("lfps_selection", LFPS_SELECTION_CHOICES)):
            if getattr(self, name) not in choices:
                flag = name.replace("_", "-")
                raise RedknotConfigError(
                    f"--redknot-{flag} {getattr(self, name)!r} is not one of {', '.join(choices)}"
                )
        for name, low, high in (("lfps_budget", 0.0, None), ("lfps_decay", 0.0, 1.0)):
            value = getattr(self, name)
            if not (value > low and (high is None or value < high)):
                flag = name.replace("_", "-")
                bound = f"in ({low:g}, {high:g})" if high is not None else f"> {low:g}"
                raise RedknotConfigError(
                    f"--redknot-{flag} must be a number {bound}, got {value!r}"
                )
        if self.lfps_budget >= 1 and self.lfps_budget != int(self.lfps_budget):
            raise RedknotConfigError(
                f"--redknot-lfps-budget {self.lfps_budget!r}: a count of keys (>= 1) must be a "
                "whole number; a fraction of the keys is below 1"
            )
        offload = self.lfps_offload_gb
        if isinstance(offload, bool) or not (isinstance(offload, (int, float)) and offload >= 0):
            raise RedknotConfigError(
                f"--redknot-lfps-offload-gb must be a number of GiB >= 0, got {offload!r}"
            )
        if self.lfps == "off":
            if offload:
                raise RedknotConfigError(
                    f"--redknot-lfps-offload-gb {offload:g} keeps the KV in host memory, where "
                    "only LFPS's sparse decode reads it fast enough to serve: add --redknot-lfps "
                    "lfps (or topk), or drop --redknot-lfps-offload-gb"
                )
            return
        if offload and self.segment_fraction:
            raise RedknotConfigError(
                f"--redknot-lfps-offload-gb {offload:g} with a segment region "
                f"(--redknot-segment-fraction {self.segment_fraction:g}): segment reuse over host "
                "memory is not built; pass --redknot-segment-fraction 0 to offload"
            )
        if not self.all_global:
            raise RedknotConfigError(
                f"--redknot-lfps {self.lfps} needs every head global (--redknot-all-global, or "
                "a token-level --redknot-policy): sparse decode of the global heads of a map with "
                "local heads is not built"
            )
        if self.kernel != "auto":
            raise RedknotConfigError(
                f"--redknot-lfps {self.lfps} needs --redknot-kernel auto: the requests it does "
                "not serve decode on FlashInfer"
            )
        if self.lfps == "topk" and self.lfps_selection == "kv-head-union":
            raise RedknotConfigError(
                "--redknot-lfps-selection kv-head-union is a rule of --redknot-lfps lfps (each "
                "query head's own Top-k of the list's candidates); exact Top-k takes kv-head "
                "or query-head"
            )

    def _resolve_restore(self) -> None:
        """Adaptive restore is on with a threshold and at least one restore column; the columns
        default to 1 with a threshold, 0 without one (frozen dataclass: resolved once)."""
        if self.restore_heads is None:
            on = self.restore_thresh is not None and not self.all_global
            object.__setattr__(self, "restore_heads", 1 if on else 0)
        elif self.restore_heads and self.restore_thresh is None:
            raise RedknotConfigError(
                f"--redknot-restore-heads {self.restore_heads} needs --redknot-restore-thresh "
                "(or a head map that records restore_thresh): it sets how many heads restore "
                "may promote"
            )
        elif self.restore_heads and self.all_global:
            raise RedknotConfigError(
                "--redknot-restore-heads cannot be combined with every head global: there is "
                "no local head to restore"
            )

    @property
    def restore(self) -> bool:
        """Whether adaptive restore is served."""
        return self.restore_thresh is not None and bool(self.restore_heads)

    def _resolve_policy(self) -> None:
        """A token-level policy serves every head global, reads every head of a cached segment
        and excludes the layer schedule of redknot's own recovery."""
        if self.policy in REFERENCE_ONLY_POLICIES:
            raise RedknotConfigError(
                f"--redknot-policy {self.policy} is not served: "
                f"{REFERENCE_ONLY_POLICIES[self.policy]}"
            )
        if self.policy not in POLICY_CHOICES:
            raise RedknotConfigError(
                f"--redknot-policy {self.policy!r} is not one of {', '.join(POLICY_CHOICES)}"
            )
        if self.policy == "redknot":
            return
        flag = f"--redknot-policy {self.policy}"
        conflicts = [
            (self.head_map is not None, "--redknot-head-map (it serves every head global)"),
            (self.dense_layers is not None, "--redknot-dense-layers (redknot's own recovery)"),
            (self.segment_heads == "local", "--redknot-segment-heads local (it reads every head)"),
            (self.segment_fraction == 0, "--redknot-segment-fraction 0 (nothing to reuse)"),
            (self.local_kv != "cached", f"--redknot-local-kv {self.local_kv} (local heads)"),
            (
                self.restore_thresh is not None or bool(self.restore_heads),
                "--redknot-restore-thresh / --redknot-restore-heads (local heads)",
            ),
        ]
        for bad, what in conflicts:
            if bad:
                raise RedknotConfigError(f"{flag} cannot be combined with {what}")
        object.__setattr__(self, "all_global", True)  # frozen dataclass: resolved once
        object.__setattr__(self, "segment_heads", "all")

    @property
    def rows_leave(self) -> str | None:
        """The option that makes reused tokens leave recovery (nothing of them computed from
        some layer on, so no input-token logprob of theirs), or None."""
        if self.policy != "redknot":
            return f"--redknot-policy {self.policy}"
        if self.dense_layers is not None and self.skipped == "cached":
            return f"--redknot-dense-layers {self.dense_layers} (--redknot-skipped cached)"
        return None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str) -> RedknotConfig:
        return cls(**cls._checked(values, source=source))

    @classmethod
    def _checked(cls, values: Mapping[str, Any], *, source: str) -> dict:
        """``values`` without the ``None`` ones, each of its field's type (or an error naming
        ``source``)."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise RedknotConfigError(
                f"{source}: unknown redknot option(s) {unknown}; "
                f"known options are {cls.field_names()}"
            )
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        clean = {}
        for name, value in values.items():
            if value is None:
                continue
            want_int = "int" in hints[name]
            want_bool = hints[name] == "bool"
            if "float" in hints[name] and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise RedknotConfigError(f"{source}: {name} must be a number, got {value!r}")
            if want_bool and not isinstance(value, bool):
                raise RedknotConfigError(f"{source}: {name} must be true or false, got {value!r}")
            if want_int and (isinstance(value, bool) or not isinstance(value, int)):
                raise RedknotConfigError(f"{source}: {name} must be an integer, got {value!r}")
            clean[name] = value
        return clean

    @classmethod
    def from_file(cls, path: str) -> dict:
        """Read a config file into a dict of options (validated when merged)."""
        p = Path(path)
        if not p.is_file():
            raise RedknotConfigError(f"redknot config file {path!r} does not exist")
        text = p.read_text()
        try:
            if p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:
            raise RedknotConfigError(f"redknot config file {path!r} is not valid: {e}") from e
        if not isinstance(data, dict):
            raise RedknotConfigError(f"redknot config file {path!r} must hold a mapping")
        if data.get("head_map") and not Path(data["head_map"]).is_absolute():
            data["head_map"] = str((p.parent / data["head_map"]).resolve())
        return data

    @classmethod
    def merge(
        cls,
        file_path: str | None,
        overrides: Mapping[str, Any],
        num_layers: int | None = None,
        *,
        model: ModelSignature | None = None,
    ) -> RedknotConfig:
        """File values, then explicitly given overrides (``None`` means not given), then, for
        what neither gives, the setting served by default for the model
        (:func:`redknot.served_default.resolve`: the calibrated record of its profile, the map's
        recorded knobs, or the generic default), logged with why. ``model``: the served model's
        signature (profiles are searched for it); with ``num_layers`` (or ``model``), a
        ``dense_layers`` of that many (every FFN runs) is the same as none."""
        values: dict = cls.from_file(file_path) if file_path else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        source = f"redknot options (file {file_path!r} and flags)" if file_path else "redknot flags"
        given = cls._checked(values, source=source)
        try:
            resolution = served_default.resolve(given, model)
        except ServedDefaultError as e:
            raise RedknotConfigError(str(e)) from None
        for name in resolution.drop:
            given.pop(name, None)
        taken = cls._checked(
            {k: v for k, v in resolution.values.items() if k not in given},
            source=resolution.source,
        )
        if resolution.message:
            logger.log(resolution.level, resolution.message)
        values = {**taken, **given}
        num_layers = model.num_layers if num_layers is None and model else num_layers
        if num_layers is not None and values.get("dense_layers") == num_layers:
            del values["dense_layers"]  # the layer schedule off (segments keep local heads)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RedknotConfig:
        return cls.from_mapping(json.loads(text), source="REDKNOT_RESOLVED_CONFIG")

    # ---- the head map this configuration serves --------------------------------------------

    def resolve_head_map(
        self,
        model: ModelShape,
        *,
        tp_size: int = 1,
        context_len: int | None = None,
        model_name: str = "",
    ) -> HeadMap:
        """The validated head map for ``model``; raises ``HeadMapError`` if it does not fit."""
        if self.all_global:
            hm = HeadMap.every_head_global(model, model_name=model_name)
            window = self.window if self.window is not None else hm.window
            sink = self.sink if self.sink is not None else hm.sink
            hm = dataclasses.replace(hm, window=window, sink=sink)
        else:
            hm = HeadMap.load(self.head_map)
            if self.window is not None or self.sink is not None:
                hm = dataclasses.replace(
                    hm,
                    window=hm.window if self.window is None else self.window,
                    sink=hm.sink if self.sink is None else self.sink,
                )
        source = "the all-global map" if self.all_global else f"head map {self.head_map!r}"
        hm.validate_against(model, tp_size=tp_size, context_len=context_len, source=source)
        return hm


__all__ = ["KERNEL_CHOICES", "HeadMapError", "RedknotConfig", "RedknotConfigError"]
