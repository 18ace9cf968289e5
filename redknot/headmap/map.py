"""The head-class map: which (layer, KV head) pairs keep every token (global) and which keep
only ``sink + window`` tokens (local), with the scores and provenance that produced it.

File format (JSON, ``"format": "redknot.headmap/1"``)::

    {
      "format": "redknot.headmap/1",
      "model": {"name": "...", "architecture": "LlamaForCausalLM", "num_layers": 30,
                "num_kv_heads": 3, "num_attention_heads": 9, "head_dim": 64},
      "window": 256,            # recent tokens a local head attends (itself included)
      "sink": 64,               # first tokens every local head also attends
      "dense_layers": 8,        # recovery runs the FFN on every token below this layer
      "classes": ["GLL", ...],  # one string per layer, one character per KV head: G or L
      "scores": {"long_range_mass": [[...]], ...},   # per (layer, KV head), optional
      "recovery": {...},        # recovery knob defaults chosen for this model, optional
      "served": {...},          # the calibrated default setting (redknot.headmap.served), optional
      "provenance": {"tool": "...", "version": "...", "commit": "...", "synthetic": false, ...}
    }

A local head at query position ``i`` attends key positions ``j <= i`` with ``j < sink`` or
``i - j < window``. Window and sink apply to every local head of the map.

Maps written by ``redknot-profile`` carry, besides the keys above (readers must ignore keys
they do not know; ``legend`` is informative only):

* ``scores``: ``long_range_mass``, ``needle_mass``, ``local_output_error``,
  ``prefix_kv_deviation`` (see :mod:`redknot.profiler.scores`) and ``combined``, the ranking
  the classes were thresholded on (higher = more global);
* ``provenance``: ``tool``, ``version``, ``commit``, ``dirty``, ``date``, ``synthetic``
  (false), ``model_source``, ``config`` (every profiler option), ``calibration``
  (``description``, ``version``, ``prompts_digest``), ``scores`` (each score's definition),
  ``ranking`` (``score``, ``weights``, ``normalisation``), ``thresholds`` (``global_fraction``,
  ``num_global``, ``num_heads``, ``lowest_global_score``, ``highest_local_score``),
  ``dense_layers_source``, ``device``, ``seconds``.

Synthetic maps (``python -m redknot.headmap synth``) have ``"synthetic": true``: their
global heads are placed at random, for memory and speed measurements only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redknot.headmap.served import ServedRecord, ServedRecordError

FORMAT = "redknot.headmap/1"
GLOBAL = "G"
LOCAL = "L"


class HeadMapError(ValueError):
    """A head map that cannot be used: unreadable, malformed, or made for another model."""


def config_getter(config: Any) -> Any:
    """``get(key, default)`` over a Hugging Face config object or a ``config.json`` dict; a
    multimodal config without its own layer count is read through its ``text_config``."""
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    text_config = get("text_config", None)
    if text_config is not None and get("num_hidden_layers", None) is None:
        return config_getter(text_config)
    return get


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a model, as far as a head map depends on it."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Read the shape from a Hugging Face config object or a ``config.json`` dict."""
        get = config_getter(config)
        num_heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        head_dim = get("head_dim", None) or hidden // num_heads
        archs = get("architectures", None) or ["unknown"]
        return cls(
            architecture=str(archs[0]),
            num_layers=int(get("num_hidden_layers")),
            num_kv_heads=int(get("num_key_value_heads", None) or num_heads),
            num_attention_heads=num_heads,
            head_dim=int(head_dim),
        )

    def to_json(self) -> dict:
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
        }


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads (global indices) that tensor-parallel rank ``tp_rank`` holds.

    Mirrors SGLang: with ``num_kv_heads >= tp_size`` the heads are split evenly; with fewer
    KV heads than ranks each head is replicated on ``tp_size // num_kv_heads`` ranks.
    """
    if not 0 <= tp_rank < tp_size:
        raise HeadMapError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise HeadMapError(
                f"{num_kv_heads} KV heads cannot be split over --tp {tp_size}: "
                "choose a TP size that divides the number of KV heads"
            )
        per_rank = num_kv_heads // tp_size
        return list(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    if tp_size % num_kv_heads:
        raise HeadMapError(
            f"--tp {tp_size} is not a multiple of the model's {num_kv_heads} KV heads"
        )
    return [tp_rank // (tp_size // num_kv_heads)]


@dataclass(frozen=True)
class HeadMap:
    """Head classes of one model. ``classes[layer][head]`` is ``"G"`` or ``"L"``."""

    model: ModelShape
    classes: tuple[str, ...]
    window: int
    sink: int
    dense_layers: int
    model_name: str = ""
    scores: Mapping[str, Sequence[Sequence[float]]] = field(default_factory=dict)
    recovery: Mapping[str, Any] = field(default_factory=dict)
    provenance: Mapping[str, Any] = field(default_factory=dict)
    served: ServedRecord | None = None  # the calibrated default (redknot.calibrate)

    def __post_init__(self) -> None:
        self._check_consistency()

    # ---- queries -------------------------------------------------------------------------

    def recorded_recovery(self) -> dict[str, Any]:
        """The recovery knob defaults recorded for this model (knob -> value): the ``recovery``
        block, and ``dense_layers`` when it leaves some layer's FFN sparse."""
        out = {k: v for k, v in self.recovery.items() if k != "dense_layers"}
        if self.dense_layers < self.model.num_layers:
            out["dense_layers"] = self.dense_layers
        return out

    def is_global(self, layer: int, kv_head: int) -> bool:
        return self.classes[layer][kv_head] == GLOBAL

    def global_heads(self, layer: int) -> list[int]:
        return [h for h, c in enumerate(self.classes[layer]) if c == GLOBAL]

    def local_heads(self, layer: int) -> list[int]:
        return [h for h, c in enumerate(self.classes[layer]) if c == LOCAL]

    @property
    def num_global(self) -> int:
        return sum(row.count(GLOBAL) for row in self.classes)

    @property
    def global_fraction(self) -> float:
        return self.num_global / (self.model.num_layers * self.model.num_kv_heads)

    @property
    def all_global(self) -> bool:
        return self.num_global == self.model.num_layers * self.model.num_kv_heads

    @property
    def is_synthetic(self) -> bool:
        return bool(self.provenance.get("synthetic", False))

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def every_head_global(
        cls, model: ModelShape, *, window: int = 256, sink: int = 64, model_name: str = ""
    ) -> HeadMap:
        """The map under which redknot computes exactly what dense attention computes."""
        return cls(
            model=model,
            classes=tuple(GLOBAL * model.num_kv_heads for _ in range(model.num_layers)),
            window=window,
            sink=sink,
            dense_layers=model.num_layers,
            model_name=model_name,
            provenance={"tool": "redknot", "synthetic": True, "kind": "all-global"},
        )

    # ---- validation ----------------------------------------------------------------------

    def _check_consistency(self) -> None:
        if self.window < 1:
            raise HeadMapError(f"window must be >= 1 token, got {self.window}")
        if self.sink < 0:
            raise HeadMapError(f"sink must be >= 0 tokens, got {self.sink}")
        if not 0 <= self.dense_layers <= self.model.num_layers:
            raise HeadMapError(
                f"dense_layers={self.dense_layers} must lie in [0, {self.model.num_layers}]"
            )
        if len(self.classes) != self.model.num_layers:
            raise HeadMapError(
                f"the map lists {len(self.classes)} layers but declares "
                f"num_layers={self.model.num_layers}"
            )
        for layer, row in enumerate(self.classes):
            if len(row) != self.model.num_kv_heads or set(row) - {GLOBAL, LOCAL}:
                raise HeadMapError(
                    f"layer {layer}: classes {row!r} must be {self.model.num_kv_heads} "
                    f"characters, each {GLOBAL!r} (global) or {LOCAL!r} (local)"
                )
        for name, grid in self.scores.items():
            if len(grid) != self.model.num_layers or any(
                len(r) != self.model.num_kv_heads for r in grid
            ):
                raise HeadMapError(
                    f"scores[{name!r}] must be a {self.model.num_layers} x "
                    f"{self.model.num_kv_heads} grid"
                )
            if any(not math.isfinite(float(x)) for r in grid for x in r):
                raise HeadMapError(f"scores[{name!r}] contains a non-finite value")

    def validate_against(
        self,
        model: ModelShape,
        *,
        tp_size: int = 1,
        context_len: int | None = None,
        source: str = "head map",
    ) -> None:
        """Raise ``HeadMapError`` unless this map fits ``model`` served with ``tp_size`` ranks."""
        fields = ("num_layers", "num_kv_heads", "num_attention_heads", "head_dim")
        wrong = [
            f"{f}: map has {getattr(self.model, f)}, model has {getattr(model, f)}"
            for f in fields
            if getattr(self.model, f) != getattr(model, f)
        ]
        if wrong:
            name = f" (made for {self.model_name})" if self.model_name else ""
            raise HeadMapError(
                f"{source}{name} does not match the served model ({model.architecture}): "
                + "; ".join(wrong)
                + ". Profile this model with `redknot-profile --model ...` or pass the map "
                "made for it."
            )
        for rank in range(tp_size):
            kv_heads_of_rank(model.num_kv_heads, tp_size, rank)
        if context_len is not None and self.sink + self.window > context_len:
            raise HeadMapError(
                f"{source}: sink ({self.sink}) + window ({self.window}) exceeds the context "
                f"length {context_len}; choose a smaller window or a longer --context-length"
            )

    # ---- tensor-parallel slice -----------------------------------------------------------

    def classes_of_rank(self, tp_size: int, tp_rank: int) -> tuple[str, ...]:
        """Per-layer class strings of the KV heads held by one TP rank, in rank-local order."""
        heads = kv_heads_of_rank(self.model.num_kv_heads, tp_size, tp_rank)
        return tuple("".join(row[h] for h in heads) for row in self.classes)

    # ---- (de)serialisation ---------------------------------------------------------------

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "format": FORMAT,
            "model": {"name": self.model_name, **self.model.to_json()},
            "window": self.window,
            "sink": self.sink,
            "dense_layers": self.dense_layers,
            "legend": {GLOBAL: "global: every token", LOCAL: "local: sink + window"},
            "classes": list(self.classes),
        }
        if self.scores:
            out["scores"] = {k: [list(map(float, r)) for r in v] for k, v in self.scores.items()}
        if self.recovery:
            out["recovery"] = dict(self.recovery)
        if self.served is not None:
            out["served"] = self.served.to_json()
        out["provenance"] = dict(self.provenance)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "head map") -> HeadMap:
        if not isinstance(data, Mapping):
            raise HeadMapError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise HeadMapError(f"{source}: format is {data.get('format')!r}, expected {FORMAT!r}")
        try:
            m = data["model"]
            model = ModelShape(
                architecture=str(m.get("architecture", "unknown")),
                num_layers=int(m["num_layers"]),
                num_kv_heads=int(m["num_kv_heads"]),
                num_attention_heads=int(m["num_attention_heads"]),
                head_dim=int(m["head_dim"]),
            )
            return cls(
                model=model,
                classes=tuple(str(r) for r in data["classes"]),
                window=int(data["window"]),
                sink=int(data["sink"]),
                dense_layers=int(data.get("dense_layers", model.num_layers)),
                model_name=str(m.get("name", "")),
                scores=dict(data.get("scores", {})),
                recovery=dict(data.get("recovery", {})),
                provenance=dict(data.get("provenance", {})),
                served=(
                    None if data.get("served") is None else ServedRecord.from_json(data["served"])
                ),
            )
        except (HeadMapError, ServedRecordError) as e:
            raise HeadMapError(f"{source}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise HeadMapError(f"{source}: malformed head map ({type(e).__name__}: {e})") from e

    @classmethod
    def load(cls, path: str | Path) -> HeadMap:
        path = Path(path)
        if not path.is_file():
            raise HeadMapError(
                f"head map {str(path)!r} does not exist; pass the path of a map written by "
                "`redknot-profile` (shipped maps live in configs/heads/)"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeadMapError(f"head map {str(path)!r} is not readable JSON: {e}") from e
        return cls.from_json(data, source=f"head map {str(path)!r}")

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
