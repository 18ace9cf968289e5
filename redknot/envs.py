"""Environment variables read by redknot. Declared here and read nowhere else.

| variable                   | meaning                                                                |
| -------------------------- | ---------------------------------------------------------------------- |
| REDKNOT_RESOLVED_CONFIG    | JSON of the validated ``RedknotConfig``, set by the launcher process   |
|                            | so that every spawned scheduler process serves the same configuration. |
| REDKNOT_CONFIG             | path of a redknot config file, used when no ``--redknot-config`` flag  |
|                            | is given (for ``sgl.Engine`` users who cannot pass CLI flags).         |
| REDKNOT_PROFILES           | a directory of calibrated profiles (head maps with a ``served`` record) |
|                            | searched first for the served model (``redknot.headmap.shipped``).     |
| REDKNOT_COMMIT             | commit of a source copy without ``.git`` (the GPU machine's), recorded |
|                            | in results and map provenance where git cannot say it.                 |
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class _EnvVar:
    name: str

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        return value if value else None

    def set(self, value: str) -> None:
        os.environ[self.name] = value

    def clear(self) -> None:
        os.environ.pop(self.name, None)


REDKNOT_RESOLVED_CONFIG = _EnvVar("REDKNOT_RESOLVED_CONFIG")
REDKNOT_CONFIG = _EnvVar("REDKNOT_CONFIG")
REDKNOT_COMMIT = _EnvVar("REDKNOT_COMMIT")
REDKNOT_PROFILES = _EnvVar("REDKNOT_PROFILES")
