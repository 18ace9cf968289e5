"""Serve one request that reuses segments on the reference runner: prefill under a policy,
then greedy decoding; return the answer, the first token's logits, and what was computed.

>>> prompt = ReusePrompt(ids, (Segment(40, 540, cache_kv(runner, ids[40:540], hm)),))
>>> policy = create_policy("redknot", prompt, shape=runner.shape, head_map=hm)
>>> out = serve(runner, policy, max_new_tokens=16, stop_token_ids=[eos])
>>> out.generation.tokens, out.flops.total, out.fractions["ffn"]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redknot.headmap import HeadMap, ModelShape
from redknot.recovery.base import ReusePolicy
from redknot.recovery.baselines import FullPrefill, HeadClassPrefill, NaiveReuse
from redknot.recovery.cacheblend import CacheBlend
from redknot.recovery.elastic import ElasticRecovery
from redknot.recovery.epic import Epic
from redknot.recovery.flops import FlopCount, FlopShape, prefill_flops
from redknot.recovery.hybrid import ElasticSparseQ
from redknot.recovery.options import RecoveryOptions
from redknot.recovery.prompt import ReusePrompt
from redknot.recovery.samkv import SamKV
from redknot.recovery.sparsex import SparseX
from redknot.reference import Generation, ReferenceRunner

POLICIES: dict[str, type[ReusePolicy]] = {
    cls.name: cls
    for cls in (
        FullPrefill,
        HeadClassPrefill,
        NaiveReuse,
        ElasticRecovery,
        CacheBlend,
        Epic,
        SparseX,
        ElasticSparseQ,
        SamKV,
    )
}


def create_policy(
    name: str,
    prompt: ReusePrompt,
    *,
    shape: ModelShape,
    head_map: HeadMap | None = None,
    options: RecoveryOptions | None = None,
) -> ReusePolicy:
    """A fresh policy (hooks of one request) by name: one of :data:`POLICIES`."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](prompt, shape=shape, head_map=head_map, options=options)


@dataclass(frozen=True, eq=False)
class Served:
    """One served request: the greedy ``generation`` (its ``first_logits`` ``[vocab]``), the
    prefill ``record``, its ``flops`` and recomputed ``fractions``."""

    policy: str
    generation: Generation
    flops: FlopCount
    fractions: dict[str, float | None]
    restored_heads: int


def serve(
    runner: ReferenceRunner,
    policy: ReusePolicy,
    *,
    max_new_tokens: int = 16,
    stop_token_ids: Sequence[int] = (),
) -> Served:
    """Prefill what ``policy.prepare`` hands over (by default ``policy.served``: its
    exact-prefix hit as past KV, the rest under the policy's hooks) and decode greedily."""
    ids, past = policy.prepare(runner)
    generation = runner.generate(
        ids,
        head_map=policy.head_map,
        hooks=policy,
        past=past,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
    )
    hm = policy.head_map
    restored = 0 if hm is None else policy.record.restored_heads(hm.classes)
    return Served(
        policy=policy.name,
        generation=generation,
        flops=prefill_flops(FlopShape.from_hf_config(runner.model.config), policy.record),
        fractions=policy.fractions(),
        restored_heads=restored,
    )
