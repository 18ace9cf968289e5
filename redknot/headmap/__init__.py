"""Head-class maps: load, validate, save, and synthesise."""

from redknot.headmap.map import (
    FORMAT,
    GLOBAL,
    LOCAL,
    HeadMap,
    HeadMapError,
    ModelShape,
    kv_heads_of_rank,
)
from redknot.headmap.synthetic import synthetic_map

__all__ = [
    "FORMAT",
    "GLOBAL",
    "LOCAL",
    "HeadMap",
    "HeadMapError",
    "ModelShape",
    "kv_heads_of_rank",
    "synthetic_map",
]
