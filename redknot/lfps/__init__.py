"""LFPS: decode-time sparse indexing from historical vertical/slash attention (PyTorch reference).

``build_state`` runs once after prefill (Eq. 4 and the per-head priors); ``lfps_step`` runs once
per decode step (Eq. 5-10). ``docs/lfps.md`` lists what is implemented and what is not.
"""

from __future__ import annotations

from redknot.lfps.params import LfpsParams
from redknot.lfps.state import LfpsState, build_state
from redknot.lfps.step import LfpsStepResult, lfps_step

__all__ = ["LfpsParams", "LfpsState", "LfpsStepResult", "build_state", "lfps_step"]
