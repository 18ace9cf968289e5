"""The calibrated default of a model: which recovery setting a server serves when its flags do
not say, measured by ``python -m redknot.calibrate`` and kept in the model's profile (the head
map file, key ``served``).

A record names one setting (:class:`ServedSetting`: a policy and its knobs) and why: the
cheapest setting (prefill FLOPs) among the calibrated candidates whose answers keep at least
``floor.kept`` of the answers dense prefill gets right and whose first token keeps at least
``floor.top10`` top-10 overlap, on the calibration cases. It also keeps the best head-aware
setting under the map (``head_aware``: what ``--redknot-policy redknot`` would serve, and
whether it meets the floor; a map whose loss exceeds the floor is refused at startup unless the
user overrides it), the best token-level setting (``token_level``: served for models that have
no profile), every candidate measured, the map's fidelity-against-memory curve and provenance.

File format (inside the head map)::

    "served": {
      "format": "redknot.served/1",
      "setting": {"policy": "epic", "knobs": {"epic_k": 32}},
      "reason": "the cheapest of 21 candidates that keeps ...",
      "floor": {"kept": 0.99, "top10": 0.8},
      "meets_floor": true,
      "measured": {"pooled": {"kept": ..., "top10": ..., "flops_fraction": ...}, "rag_v1": ...},
      "head_aware": {"setting": {...}, "measured": {...}, "meets_floor": false},
      "token_level": {"setting": {...}, "measured": {...}, "meets_floor": true},
      "candidates": [{"label": ..., "kept": ..., "top10": ..., "flops_fraction": ...}, ...],
      "curve": [{"global_fraction": 0.15, "window": 256, "memory_fraction": ..., ...}, ...],
      "model_signature": {"architecture": ..., "hidden_size": ..., ...},
      "provenance": {"tool": "redknot.calibrate", "version": ..., "commit": ..., ...}
    }

The policy ``full`` means no reuse: the server then serves every head global and caches no
segment (dense prefill of every prompt), the faithful choice when no reuse setting meets the
floor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SERVED_FORMAT = "redknot.served/1"
TOKEN_LEVEL = ("naive", "epic", "cacheblend", "sparsex")  # redknot.config.TOKEN_POLICIES
HEAD_AWARE = ("redknot",)
NO_REUSE = "full"
SERVABLE = (NO_REUSE, *HEAD_AWARE, *TOKEN_LEVEL)


class ServedRecordError(ValueError):
    """A ``served`` record that cannot be used; the message says which field is wrong."""


@dataclass(frozen=True)
class ModelSignature:
    """What identifies a model's weights layout well enough to reuse its calibration: the
    attention shape and the sizes of its matrices (the same base model's fine-tunes share it)."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSignature:
        from redknot.headmap.map import ModelShape, config_getter

        get = config_getter(config)
        shape = ModelShape.from_hf_config(config)
        return cls(
            **shape.to_json(),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size", 0) or 0),
            vocab_size=int(get("vocab_size", 0) or 0),
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def matches(self, other: ModelSignature) -> bool:
        """Same sizes; the architecture name only where both know it (GGUF checkpoints load
        under the class name, ``LlamaForCausalLM``, like their Hugging Face originals)."""
        mine, theirs = self.to_json(), other.to_json()
        names = {mine.pop("architecture"), theirs.pop("architecture")} - {"unknown"}
        return mine == theirs and len(names) <= 1


@dataclass(frozen=True)
class ServedSetting:
    """A policy (``full``, ``redknot`` or a token-level one) and the recovery knobs it was
    measured with (``redknot.recovery.RecoveryOptions`` field names; ``window`` and ``sink`` for
    ``redknot`` override the map's)."""

    policy: str
    knobs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in SERVABLE:
            raise ServedRecordError(
                f"served policy {self.policy!r} is not one of {', '.join(SERVABLE)}"
            )

    @property
    def label(self) -> str:
        """``policy[k=v,...]``, as the evaluation labels its settings."""
        if not self.knobs:
            return self.policy
        return self.policy + "[" + ",".join(f"{k}={v}" for k, v in self.knobs.items()) + "]"

    @property
    def head_aware(self) -> bool:
        return self.policy in HEAD_AWARE

    def config_values(self) -> dict[str, Any]:
        """The ``RedknotConfig`` options that serve this setting."""
        if self.policy == NO_REUSE:
            return {"all_global": True, "segment_fraction": 0.0}
        return {"policy": self.policy, **self.knobs}

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "knobs": dict(self.knobs)}

    @classmethod
    def from_json(cls, data: Any, *, what: str = "setting") -> ServedSetting:
        if not isinstance(data, Mapping) or not isinstance(data.get("knobs", {}), Mapping):
            raise ServedRecordError(f"{what} must be {{'policy': ..., 'knobs': {{...}}}}")
        return cls(str(data.get("policy")), dict(data.get("knobs", {})))


@dataclass(frozen=True)
class Choice:
    """One measured setting: its numbers pooled over the calibration cases, and whether they
    meet the floor."""

    setting: ServedSetting
    measured: Mapping[str, Any]
    meets_floor: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "setting": self.setting.to_json(),
            "measured": dict(self.measured),
            "meets_floor": self.meets_floor,
        }

    @classmethod
    def from_json(cls, data: Any, *, what: str) -> Choice | None:
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise ServedRecordError(f"{what} must be an object or null")
        setting = ServedSetting.from_json(data.get("setting"), what=f"{what}.setting")
        return cls(setting, dict(data.get("measured", {})), bool(data.get("meets_floor")))


@dataclass(frozen=True)
class ServedRecord:
    """The calibrated default of one model (see the module docstring for every field)."""

    setting: ServedSetting
    reason: str
    floor: Mapping[str, float]
    meets_floor: bool
    measured: Mapping[str, Any] = field(default_factory=dict)
    head_aware: Choice | None = None
    token_level: Choice | None = None
    candidates: tuple[Mapping[str, Any], ...] = ()
    curve: tuple[Mapping[str, Any], ...] = ()
    model_signature: ModelSignature | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.setting.label

    def pooled(self) -> Mapping[str, Any]:
        """The served setting's numbers over every calibration case."""
        return self.measured.get("pooled", {})

    def summary(self) -> str:
        """One line: the setting, its numbers and the floor, for logs."""
        m = self.pooled()

        def fmt(key: str) -> str:
            value = m.get(key)
            return "?" if value is None else f"{value:.3f}"

        return (
            f"{self.label}: kept {fmt('kept')} of dense-correct answers, top-10 {fmt('top10')}, "
            f"{fmt('flops_fraction')} of dense prefill FLOPs on {m.get('cases', '?')} "
            f"calibration cases (floor: kept >= {self.floor.get('kept')}, top-10 >= "
            f"{self.floor.get('top10')})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SERVED_FORMAT,
            "setting": self.setting.to_json(),
            "reason": self.reason,
            "floor": dict(self.floor),
            "meets_floor": self.meets_floor,
            "measured": dict(self.measured),
            "head_aware": None if self.head_aware is None else self.head_aware.to_json(),
            "token_level": None if self.token_level is None else self.token_level.to_json(),
            "candidates": [dict(c) for c in self.candidates],
            "curve": [dict(c) for c in self.curve],
            "model_signature": (
                None if self.model_signature is None else self.model_signature.to_json()
            ),
            "provenance": dict(self.provenance),
        }

    @classmethod
    def from_json(cls, data: Any) -> ServedRecord:
        if not isinstance(data, Mapping):
            raise ServedRecordError(f"served must be an object, got {type(data).__name__}")
        if data.get("format") != SERVED_FORMAT:
            raise ServedRecordError(
                f"served format is {data.get('format')!r}, expected {SERVED_FORMAT!r}"
            )
        floor = data.get("floor")
        if not isinstance(floor, Mapping) or not {"kept", "top10"} <= set(floor):
            raise ServedRecordError("served.floor must give 'kept' and 'top10'")
        signature = data.get("model_signature")
        try:
            signature = None if signature is None else ModelSignature(**signature)
        except TypeError as e:
            raise ServedRecordError(f"served.model_signature is malformed: {e}") from None
        return cls(
            setting=ServedSetting.from_json(data.get("setting"), what="served.setting"),
            reason=str(data.get("reason", "")),
            floor={k: float(v) for k, v in floor.items()},
            meets_floor=bool(data.get("meets_floor")),
            measured=dict(data.get("measured", {})),
            head_aware=Choice.from_json(data.get("head_aware"), what="served.head_aware"),
            token_level=Choice.from_json(data.get("token_level"), what="served.token_level"),
            candidates=tuple(dict(c) for c in data.get("candidates", ())),
            curve=tuple(dict(c) for c in data.get("curve", ())),
            model_signature=signature,
            provenance=dict(data.get("provenance", {})),
        )
