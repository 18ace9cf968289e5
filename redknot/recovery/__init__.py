"""Recovery of reused segments on the reference path (RedKnot §4.2, REDKNOT.md part 5).

| module        | concept                                                               |
| ------------- | --------------------------------------------------------------------- |
| ``options``   | the knobs (:class:`RecoveryOptions`), one frozen dataclass            |
| ``prompt``    | a composed prompt: tokens, segment rows, cached KV, exact-prefix hit  |
| ``base``      | the policy contract (``LayerHooks`` of one request) and KV reuse      |
| ``elastic``   | RedKnot's elastic recovery (``redknot``)                              |
| ``baselines`` | the limits: dense prefill (``full``) and naive reuse (``naive``)      |
| ``importance``| token importance for the sparse FFN                                   |
| ``restore``   | adaptive restore of local heads (edge mass)                           |
| ``record``    | what a prefill computed, recomputed fractions                         |
| ``flops``     | analytical prefill FLOPs of a record                                  |
| ``serve``     | prefill + greedy decoding of one request under a policy               |
"""

from redknot.recovery.base import ReusePolicy
from redknot.recovery.baselines import FullPrefill, NaiveReuse
from redknot.recovery.elastic import ElasticRecovery
from redknot.recovery.flops import FlopCount, FlopShape, prefill_flops
from redknot.recovery.importance import newest_rows, select_important
from redknot.recovery.options import KNOBS, RecoveryOptions, RecoveryOptionsError
from redknot.recovery.prompt import ReusePrompt, Segment, cache_kv
from redknot.recovery.record import LayerRecord, PrefillRecord, visible_keys
from redknot.recovery.restore import edge_mass, promote
from redknot.recovery.serve import POLICIES, Served, create_policy, serve

__all__ = [
    "KNOBS",
    "POLICIES",
    "ElasticRecovery",
    "FlopCount",
    "FlopShape",
    "FullPrefill",
    "LayerRecord",
    "NaiveReuse",
    "PrefillRecord",
    "RecoveryOptions",
    "RecoveryOptionsError",
    "ReusePolicy",
    "ReusePrompt",
    "Segment",
    "Served",
    "cache_kv",
    "create_policy",
    "edge_mass",
    "newest_rows",
    "prefill_flops",
    "promote",
    "select_important",
    "serve",
    "visible_keys",
]
