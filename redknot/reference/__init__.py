"""A pure-PyTorch reference path for Llama-family models under a head map.

| module        | concept                                                           |
| ------------- | ----------------------------------------------------------------- |
| ``rope``      | explicit RoPE, and re-alignment of cached keys to new positions   |
| ``attention`` | causal attention restricted per head class (global / local)       |
| ``stats``     | attention statistics of probed query rows                         |
| ``model``     | the operations of one decoder (embed, qkv, attention out, FFN)    |
| ``kv``        | the per-layer, per-head KV of one sequence                        |
| ``hooks``     | per-layer extension points for recovery policies                  |
| ``runner``    | the layer-by-layer forward and greedy generation                  |
| ``loading``   | loading models from local files and GGUF (no downloads)          |
"""

from redknot.reference.attention import attention_probs, head_class_attention
from redknot.reference.hooks import LayerContext, LayerHooks
from redknot.reference.kv import ReferenceKV
from redknot.reference.loading import ModelLoadError, load_model, resolve_source
from redknot.reference.model import LlamaFamily, UnsupportedModelError
from redknot.reference.rope import Rope, RopeError
from redknot.reference.runner import ForwardResult, Generation, ReferenceRunner
from redknot.reference.stats import AttentionProbe

__all__ = [
    "AttentionProbe",
    "ForwardResult",
    "Generation",
    "LayerContext",
    "LayerHooks",
    "LlamaFamily",
    "ModelLoadError",
    "ReferenceKV",
    "ReferenceRunner",
    "Rope",
    "RopeError",
    "UnsupportedModelError",
    "attention_probs",
    "head_class_attention",
    "load_model",
    "resolve_source",
]
