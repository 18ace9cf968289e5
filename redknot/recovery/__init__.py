"""Recovery of reused segments on the reference path (RedKnot §4.2, REDKNOT.md part 5).

| module        | concept                                                               |
| ------------- | --------------------------------------------------------------------- |
| ``options``   | the knobs (:class:`RecoveryOptions`), one frozen dataclass            |
| ``prompt``    | a composed prompt: tokens, segment rows, cached KV, exact-prefix hit  |
| ``base``      | the policy contract (``LayerHooks`` of one request) and KV reuse      |
| ``elastic``   | RedKnot's elastic recovery (``redknot``)                              |
| ``baselines`` | the limits: dense (``full``) and head-class (``headclass``) prefill, naive reuse (``naive``) |
| ``tokenwise`` | token-level recovery: one recompute set for every head               |
| ``cacheblend``| CacheBlend: tokens of largest KV deviation (``cacheblend``)           |
| ``epic``      | EPIC: the first tokens of every segment (``epic``)                    |
| ``sparseq``   | SparseX's sparse-Q token selection (top-k, overflow, tail)            |
| ``sparsex``   | SparseX: full layers, then the sparse-Q set (``sparsex``)             |
| ``samkv``     | SamKV: sparse multi-document KV, selected blocks recomputed (``samkv``; reference path only) |
| ``hybrid``    | head classes plus sparse-Q in deep layers (``redknot+sparseq``; reference path only) |
| ``importance``| token importance for the sparse FFN, top-k of a score                 |
| ``restore``   | adaptive restore of local heads (edge mass)                           |
| ``record``    | what a prefill computed, recomputed fractions                         |
| ``flops``     | analytical prefill FLOPs of a record                                  |
| ``serve``     | prefill + greedy decoding of one request under a policy               |
"""

from redknot.recovery.base import ReusePolicy
from redknot.recovery.baselines import FullPrefill, HeadClassPrefill, NaiveReuse
from redknot.recovery.cacheblend import CacheBlend, kv_deviation
from redknot.recovery.elastic import ElasticRecovery
from redknot.recovery.epic import Epic
from redknot.recovery.flops import FlopCount, FlopShape, prefill_flops
from redknot.recovery.hybrid import ElasticSparseQ
from redknot.recovery.importance import newest_rows, select_important, top_rows
from redknot.recovery.options import KNOBS, RecoveryOptions, RecoveryOptionsError
from redknot.recovery.prompt import ReusePrompt, Segment, cache_kv
from redknot.recovery.record import LayerRecord, PrefillRecord, visible_keys
from redknot.recovery.restore import edge_mass, promote
from redknot.recovery.samkv import SamKV
from redknot.recovery.serve import POLICIES, Served, create_policy, serve
from redknot.recovery.sparseq import SparseQSelection, select_tokens
from redknot.recovery.sparsex import SparseX
from redknot.recovery.tokenwise import TokenRecovery

__all__ = [
    "KNOBS",
    "POLICIES",
    "CacheBlend",
    "ElasticRecovery",
    "ElasticSparseQ",
    "Epic",
    "FlopCount",
    "FlopShape",
    "FullPrefill",
    "HeadClassPrefill",
    "LayerRecord",
    "NaiveReuse",
    "PrefillRecord",
    "RecoveryOptions",
    "RecoveryOptionsError",
    "ReusePolicy",
    "ReusePrompt",
    "SamKV",
    "Segment",
    "Served",
    "SparseQSelection",
    "SparseX",
    "TokenRecovery",
    "cache_kv",
    "create_policy",
    "edge_mass",
    "kv_deviation",
    "newest_rows",
    "prefill_flops",
    "promote",
    "select_important",
    "select_tokens",
    "serve",
    "top_rows",
    "visible_keys",
]
