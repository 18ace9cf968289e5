"""SegPagedAttention: attention over head-segmented KV stores, one launch per layer.

Decode: ``plan_decode`` once per batch, ``run_decode`` per layer (CUDA-graph capturable).
Extend / prefill: ``plan_extend`` once per batch, ``run_extend`` per layer; optionally the global
heads through FlashInfer (``redknot.kernels.flashinfer_global``, GPU only).
Semantics: ``redknot.kernels.reference``; head tables and addressing: ``geometry``.
"""

from redknot.kernels.decode import (
    DecodeConfig,
    DecodePlan,
    DecodeWorkspace,
    choose_num_splits,
    plan_decode,
    run_decode,
)
from redknot.kernels.extend import ExtendConfig, ExtendPlan, plan_extend, run_extend
from redknot.kernels.geometry import LOCAL_MODES, LayerHeads, SegGeometry

__all__ = [
    "LOCAL_MODES",
    "DecodeConfig",
    "DecodePlan",
    "DecodeWorkspace",
    "ExtendConfig",
    "ExtendPlan",
    "LayerHeads",
    "SegGeometry",
    "choose_num_splits",
    "plan_decode",
    "plan_extend",
    "run_decode",
    "run_extend",
]

# RoPE alignment of cached keys (fused copy + delta-RoPE); reference: ``rope_reference``.
from redknot.kernels.rope_align import (
    AlignableRope,
    RopeAlignConfig,
    alignable_rope,
    rope_align,
)

__all__ += ["AlignableRope", "RopeAlignConfig", "alignable_rope", "rope_align"]
