"""The contract of an evaluation backend: serve a case under several policy settings and
return, per setting, the first token and the greedy answer (and what it cost).

| backend     | where                                              | status              |
| ----------- | -------------------------------------------------- | ------------------- |
| ``reference`` | the pure-PyTorch reference runner, CPU or GPU    | :mod:`.reference_backend` |
| ``server``  | a redknot SGLang server over HTTP (TTFT measured)  | :mod:`.server_backend` |

A backend serves every setting of a case from the same segment caches, in the order given;
the evaluation compares each with the setting named ``full`` (dense prefill, the reference).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from redknot.eval.cases import Case
from redknot.eval.compose import ComposedCase, compose
from redknot.recovery import RecoveryOptions

REFERENCE_LABEL = "full"


@dataclass(frozen=True)
class PolicySetting:
    """A policy (``full``, ``naive``, ``redknot``) with its options, named by ``label``."""

    policy: str
    options: RecoveryOptions | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.policy)

    def to_json(self) -> dict[str, Any]:
        opts = None if self.options is None else self.options.to_json()
        return {"label": self.label, "policy": self.policy, "options": opts}


@dataclass
class PolicyOutput:
    """What one setting produced on one case.

    | field            | meaning                                                         |
    | ---------------- | --------------------------------------------------------------- |
    | ``first_top``    | the first token's 10 best ids, best first                       |
    | ``first_logits`` | ``[vocab]`` float32 logits of the first token, or ``None`` (a server gives top-k only) |
    | ``text``         | the greedy answer, special tokens removed                       |
    | ``flops``        | analytical prefill FLOPs per term and ``total``, or ``None``    |
    | ``fractions``    | recomputed fractions (``attention``, ``ffn``, ``kv_heads``) over segment tokens |
    | ``ttft_s``       | time to first token where measured (GPU server), else ``None``  |
    | ``wall_s``       | wall time of the whole request on the backend (informative only) |
    """

    first_top: list[int]
    first_logits: Tensor | None
    text: str
    tokens: list[int]
    flops: dict[str, int] | None = None
    fractions: dict[str, float | None] = field(default_factory=dict)
    restored_heads: int = 0
    ttft_s: float | None = None
    wall_s: float | None = None


@dataclass(frozen=True)
class CaseShape:
    """Token counts of a composed case: ``prompt`` tokens, of which ``segments`` are reused
    and ``prefix`` come from the exact-prefix part (template head and ``system``)."""

    prompt: int
    segments: int
    prefix: int
    count: int  # reused segments


class FidelityBackend(ABC):
    """Serves cases; one instance per evaluation run."""

    name: str = ""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Model, head map, device and anything else the result file should record."""

    tokenizer: Any = None  # the served model's tokenizer; cases are composed with it

    def composed(self, case: Case) -> ComposedCase:
        """``case`` as this backend serves it: its token ids and the rows it reuses."""
        return compose(self.tokenizer, case)

    def shape_of(self, case: Case) -> CaseShape:
        """Token counts of ``case`` as this backend composes it."""
        c = self.composed(case)
        return CaseShape(len(c.ids), c.segment_tokens, c.prefix_len, len(c.segments))

    @abstractmethod
    def run_case(self, case: Case, settings: Sequence[PolicySetting]) -> dict[str, PolicyOutput]:
        """Serve ``case`` under every setting; keys are the settings' labels."""
