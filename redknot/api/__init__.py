"""redknot's request API: mark reusable segments in requests, register and manage them.

Light to import (no SGLang or FastAPI): the HTTP pieces live in ``server``, ``routes``,
``middleware``, ``chat`` and ``control`` and are loaded by the plugin's hooks.
"""

from __future__ import annotations

from redknot.api.markers import segment, strip_markers
from redknot.api.marks import (
    Registration,
    SegmentMark,
    SegmentMarkError,
    encode_marks,
    registration_of,
    segment_id,
    segments_of,
)

__all__ = [
    "Registration",
    "SegmentMark",
    "SegmentMarkError",
    "encode_marks",
    "registration_of",
    "segment",
    "segment_id",
    "segments_of",
    "strip_markers",
]
