"""Analytical prefill FLOPs of what a policy computed (a :class:`PrefillRecord`).

A multiply-add counts 2 FLOPs. Per layer, with ``D`` hidden size, ``I`` FFN size, ``Hq`` /
``Hkv`` query / KV heads of dim ``d``:

| term          | FLOPs                                                               |
| ------------- | ------------------------------------------------------------------- |
| ``q_proj``    | ``2 D Hq d`` per attention row                                      |
| ``kv_proj``   | ``4 D d`` per (row, KV head) projected                              |
| ``o_proj``    | ``2 Hq d D`` per attention row                                      |
| ``attention_global`` / ``attention_local`` | ``4 d`` per (query row, visible key) pair per query head (``QK^T`` and ``PV``) |
| ``ffn``       | ``2 m D I`` per FFN row (``m`` = 3 matrices for gated MLPs, else 2) |
| ``probe``     | ``2 d`` per probed (query, key) pair per query head (importance, restore and sparse-Q scores) |
| ``rope_align``| ``3 d`` per re-aligned cached key (row, KV head)                    |
| ``deviation`` | ``6 d`` per (row, KV head) whose cached K and V are compared with fresh ones (difference, square, sum over ``2 d`` elements) |
| ``lm_head``   | ``2 D V`` per logits row                                            |

Norms, RoPE of fresh rows, softmax, top-k sorting and the residual adds are left out (linear in
the rows, or ``T log T`` comparisons, and small). Exact-prefix rows cost nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from redknot.recovery.record import PrefillRecord

TERMS = (
    "q_proj",
    "kv_proj",
    "o_proj",
    "attention_global",
    "attention_local",
    "ffn",
    "probe",
    "rope_align",
    "deviation",
    "lm_head",
)


@dataclass(frozen=True)
class FlopShape:
    """The sizes FLOPs depend on."""

    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    ffn_matrices: int = 3

    @classmethod
    def from_hf_config(cls, config) -> FlopShape:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        act = getattr(config, "hidden_act", "silu")
        return cls(
            hidden=int(config.hidden_size),
            intermediate=int(config.intermediate_size),
            num_q_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
            ffn_matrices=3 if act in ("silu", "swish", "gelu_pytorch_tanh", "gelu") else 2,
        )


@dataclass(frozen=True)
class FlopCount:
    """FLOPs per term (see the module docstring), summed over layers."""

    q_proj: int
    kv_proj: int
    o_proj: int
    attention_global: int
    attention_local: int
    ffn: int
    probe: int
    rope_align: int
    deviation: int
    lm_head: int

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TERMS)

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def prefill_flops(shape: FlopShape, record: PrefillRecord) -> FlopCount:
    """FLOPs of ``record``'s prefill for a model of ``shape``."""
    D, d, Hq = shape.hidden, shape.head_dim, shape.num_q_heads
    terms = dict.fromkeys(TERMS, 0)
    for layer in record.layers:
        terms["q_proj"] += 2 * D * Hq * d * layer.attention_rows
        terms["o_proj"] += 2 * Hq * d * D * layer.attention_rows
        terms["kv_proj"] += 4 * D * d * sum(layer.kv_rows)
        terms["attention_global"] += 4 * d * layer.pairs_global
        terms["attention_local"] += 4 * d * layer.pairs_local
        terms["ffn"] += 2 * shape.ffn_matrices * D * shape.intermediate * layer.ffn_rows
        terms["probe"] += 2 * d * layer.probe_pairs
        terms["rope_align"] += 3 * d * layer.realigned
        terms["deviation"] += 6 * d * layer.compared
    terms["lm_head"] = 2 * D * shape.vocab * record.logits_rows
    return FlopCount(**terms)
