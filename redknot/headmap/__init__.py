"""Head-class maps: load, validate, save, synthesise, and build from profiler scores.

The file format is defined in :mod:`redknot.headmap.map`. ``python -m redknot.headmap`` makes
synthetic maps, prints, validates and re-thresholds maps (:mod:`redknot.headmap.cli`).
"""

from redknot.headmap.map import (
    FORMAT,
    GLOBAL,
    LOCAL,
    HeadMap,
    HeadMapError,
    ModelShape,
    kv_heads_of_rank,
)
from redknot.headmap.ranking import map_from_scores, rank_normalize, reclassify
from redknot.headmap.synthetic import synthetic_map

__all__ = [
    "FORMAT",
    "GLOBAL",
    "LOCAL",
    "HeadMap",
    "HeadMapError",
    "ModelShape",
    "kv_heads_of_rank",
    "map_from_scores",
    "rank_normalize",
    "reclassify",
    "synthetic_map",
]
