"""Offline head profiler: scores every (layer, KV head) on generated calibration prompts and
writes the model's head-class map.

| module        | concept                                                           |
| ------------- | ----------------------------------------------------------------- |
| ``config``    | the run's frozen configuration (CLI flags derive from it)         |
| ``words``     | word lists the calibration text is built from                     |
| ``calibration`` | needle prompts and segment cases, deterministic for a seed      |
| ``scores``    | per-prompt scores on the reference path                           |
| ``workdir``   | per-prompt score cache that makes runs resumable                  |
| ``pipeline``  | the run: prompts -> scores -> ranking -> head map                 |
| ``cli``       | ``redknot-profile`` / ``python -m redknot.profiler``              |
"""

from redknot.profiler.calibration import HFTextEncoder, TextEncoder
from redknot.profiler.config import ProfileConfig, ProfileError
from redknot.profiler.pipeline import ProfileRun, calibration_set, profile

__all__ = [
    "HFTextEncoder",
    "ProfileConfig",
    "ProfileError",
    "ProfileRun",
    "TextEncoder",
    "calibration_set",
    "profile",
]
