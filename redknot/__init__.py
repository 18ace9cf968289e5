"""redknot: head-aware KV-cache management for SGLang."""

__version__ = "0.1.0"

# The SGLang release every integration point of this package was written against.
SGLANG_VERSION = "0.5.17"
