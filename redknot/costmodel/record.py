"""Measured constants of the reuse cost model, one record per device, with their provenance.

A record holds what the cost model (:mod:`redknot.costmodel.model`) cannot derive from the
model's shape: how fast this device runs the model's matrix products and attention, its memory
bandwidth, and the host time the server spends issuing one decoder layer on each of its paths
(a plain extend, a reusing extend that computes every row, one that computes the rows still in
recovery, one that also chooses the next layer's rows). They are measured by
``benchmarks/reuse_cost.py`` on the GPU (TTFT of plain and reusing prompts at several sizes,
fitted by least squares) and shipped as JSON in ``redknot/costmodel/records/``, named by the
device, with the commit, date, command and inputs that produced them.

Why a shipped record and not a measurement at startup: the host constants are those of the
server's own code path under a real forward (a few hundred milliseconds of synthetic prompts
would need the whole model, segments stored in the cache and every policy's path), and every
tensor-parallel rank must take the same decision for the same batch (they run one forward
together): a record read from one file gives every rank the same constants, a per-rank timing
would not. What a startup measurement can give is how fast this host is against the fitting
machine's (:mod:`redknot.costmodel.host_probe`, taken as the slowest rank's so that the ranks
agree), which scales the record's host constants when the record carries its own probe.
A server on a device without a record uses the H100's (:data:`FALLBACK`) and says
so at startup; ``--redknot-cost-record PATH`` takes a record measured on
the user's machine.

| field            | unit         | meaning                                                        |
| ---------------- | ------------ | -------------------------------------------------------------- |
| gemm_tflops      | 1e12 FLOP/s  | projections and FFN (2 FLOPs per multiply-add)                  |
| attn_tflops      | 1e12 FLOP/s  | attention, 4 * head_dim FLOPs per (query head, key) pair        |
| bandwidth_gbs    | 1e9 B/s      | a layer's weights read, cached K/V re-rotated into the forward  |
| host_ms          | ms per layer | host time to issue one layer, per path (:data:`HOST_KINDS`)      |
| choose_ms        | ms           | one-off host time of a policy's choice layer (cacheblend, sparsex) |
| plan_ms          | ms           | host time of planning a reusing extend beyond a plain one       |
| plan_ms_per_ktok | ms           | ... per 1024 reused tokens                                      |
| fixed_ms         | ms           | the rest of a TTFT (scheduling, sampling, the first decode step); the same for both ways, so it does not enter the decision |
| margin           | fraction     | reuse is served only when predicted at most ``1 - margin`` of recomputing |
| host_probe_ms    | ms           | :func:`redknot.costmodel.host_probe.probe_ms` on the machine the record was fitted on (absent: the host constants are not scaled to the serving machine) |

The host constants (``host_ms``, ``choose_ms``, ``plan_ms``, ``plan_ms_per_ktok``, ``fixed_ms``)
hold for a host as fast as the fitting machine's; :meth:`CostRecord.scaled` multiplies them by
the serving machine's probe over ``host_probe_ms`` (:mod:`redknot.costmodel.host_probe`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RECORDS_DIR = Path(__file__).resolve().parent / "records"
FALLBACK = "nvidia-h100-80gb-hbm3"  # the record a device without its own record uses

# Host paths of one decoder layer (redknot.costmodel.model.layer_plan says which layer is which):
HOST_KINDS = (
    "plain",  # an extend that reuses nothing
    "full",  # a reusing extend's layer that computes every row (reused K/V re-rotated in)
    "held",  # a layer that computes only the rows still in recovery (the others left)
    "schedule",  # a redknot deep layer: rows in recovery, then the importance choice (1 sync)
)
POLICY_CHOICES = ("cacheblend", "sparsex")  # policies with a choice layer of their own


class CostRecordError(ValueError):
    """A cost record that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class CostRecord:
    device: str
    gemm_tflops: float
    attn_tflops: float
    bandwidth_gbs: float
    host_ms: dict[str, float]
    choose_ms: dict[str, float] = field(default_factory=dict)
    plan_ms: float = 0.0
    plan_ms_per_ktok: float = 0.0
    fixed_ms: float = 0.0
    margin: float = 0.05
    host_probe_ms: float | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it was read from

    def __post_init__(self) -> None:
        where = self.source or "cost record"
        for name in ("gemm_tflops", "attn_tflops", "bandwidth_gbs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise CostRecordError(f"{where}: {name} must be a positive number, got {value!r}")
        missing = [k for k in HOST_KINDS if k not in self.host_ms]
        if missing:
            raise CostRecordError(f"{where}: host_ms lacks {missing} (needs {list(HOST_KINDS)})")
        unknown = sorted(set(self.host_ms) - set(HOST_KINDS)) + sorted(
            set(self.choose_ms) - set(POLICY_CHOICES)
        )
        if unknown:
            raise CostRecordError(f"{where}: unknown keys {unknown}")
        numbers = [*self.host_ms.values(), *self.choose_ms.values(), self.plan_ms,
                   self.plan_ms_per_ktok, self.fixed_ms]  # fmt: skip
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in numbers):
            raise CostRecordError(f"{where}: host times must be numbers >= 0")
        if not 0 <= self.margin < 1:
            raise CostRecordError(f"{where}: margin must be in [0, 1), got {self.margin!r}")
        probe = self.host_probe_ms
        if probe is not None and (
            isinstance(probe, bool) or not isinstance(probe, (int, float)) or probe <= 0
        ):
            raise CostRecordError(f"{where}: host_probe_ms must be a positive number or absent")

    def scaled(self, factor: float) -> CostRecord:
        """This record with its host constants multiplied by ``factor`` (a host ``factor``
        times slower than the fitting machine's); the GPU's constants unchanged."""
        return replace(
            self,
            host_ms={k: v * factor for k, v in self.host_ms.items()},
            choose_ms={k: v * factor for k, v in self.choose_ms.items()},
            plan_ms=self.plan_ms * factor,
            plan_ms_per_ktok=self.plan_ms_per_ktok * factor,
            fixed_ms=self.fixed_ms * factor,
        )

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> CostRecord:
        known = {f for f in cls.__dataclass_fields__ if f != "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostRecordError(f"{source or 'cost record'}: unknown fields {unknown}")
        try:
            return cls(**data, source=source)
        except TypeError as e:
            raise CostRecordError(f"{source or 'cost record'}: {e}") from None

    @classmethod
    def read(cls, path: str | Path) -> CostRecord:
        p = Path(path)
        if not p.is_file():
            raise CostRecordError(f"cost record {str(p)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise CostRecordError(f"cost record {str(p)!r} is not JSON: {e}") from None
        return cls.from_json(data, source=str(p))

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("source")
        if data["host_probe_ms"] is None:
            data.pop("host_probe_ms")
        return data


def file_name(device: str) -> str:
    """The record file of ``device`` (``torch.cuda.get_device_name()``): lower case, words
    joined by dashes (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.json``)."""
    return "-".join(device.lower().replace("_", " ").split()) + ".json"


def record_for(device: str, path: str | None = None) -> tuple[CostRecord, str]:
    """The record the server uses on ``device``, and a sentence saying which and why:
    ``path`` when given, else the shipped record of this device, else the fallback."""
    if path is not None:
        record = CostRecord.read(path)
        return record, f"the record {path} (--redknot-cost-record), measured on {record.device}"
    own = RECORDS_DIR / file_name(device)
    if own.is_file():
        record = CostRecord.read(own)
        return record, f"the shipped record of this device ({own.name})"
    record = CostRecord.read(RECORDS_DIR / f"{FALLBACK}.json")
    return record, (
        f"no record measured on {device!r}: the constants of {record.device} stand in; "
        "measure this device with benchmarks/reuse_cost.py and pass --redknot-cost-record"
    )
