"""SamKV on the reference path (``samkv``): sparse multi-context KV with local recomputation
(SamKV §3, appendix A).

| module       | concept                                                                 |
| ------------ | ----------------------------------------------------------------------- |
| ``layout``   | a document cut into anchors (initial, local) and whole middle blocks    |
| ``query``    | position-free pooled queries; the personalized query of Eq. 1           |
| ``selection``| block keys, anchor-based Top-P (Eq. 2), stable-layer mean (Eq. 3), retention across documents |
| ``forward``  | a forward over a per-layer sparse layout: recomputation rules, overwrite / fusion (Eq. 4), padding removed |
| ``policy``   | the ``samkv`` policy: the steps in order, fallbacks, ``sequence_ratio`` / ``recompute_ratio`` |
"""

from redknot.recovery.samkv.forward import (
    SparseLayout,
    SparseResult,
    cosine_fusion,
    sparse_forward,
    visible_mask,
)
from redknot.recovery.samkv.layout import DocumentBlocks, cut_document
from redknot.recovery.samkv.policy import SAMKV_KNOBS, SamKV, SamkvReport
from redknot.recovery.samkv.query import personalized_queries, pooled, position_free
from redknot.recovery.samkv.selection import (
    BlockSelection,
    block_keys,
    normalised,
    scores,
    select_blocks,
    token_max_scores,
    top_p_ratio,
)

__all__ = [
    "SAMKV_KNOBS",
    "BlockSelection",
    "DocumentBlocks",
    "SamKV",
    "SamkvReport",
    "SparseLayout",
    "SparseResult",
    "block_keys",
    "cosine_fusion",
    "cut_document",
    "normalised",
    "personalized_queries",
    "pooled",
    "position_free",
    "scores",
    "select_blocks",
    "sparse_forward",
    "token_max_scores",
    "top_p_ratio",
    "visible_mask",
]
