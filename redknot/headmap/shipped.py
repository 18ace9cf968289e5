"""Calibrated profiles a server can find for the model it serves, without a flag.

Searched, in this order: the directory named by ``REDKNOT_PROFILES`` (a user's own calibrated
profiles), the profiles shipped in the package (``redknot/profiles/``: the profiled maps of
``configs/heads/``, installed with the package), and ``configs/heads/`` beside the package in a
source checkout. A profile is found for a model when it carries a calibration record
(``served``, :mod:`redknot.headmap.served`) made for a model of the same signature.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import redknot
from redknot import envs
from redknot.headmap.map import HeadMap, HeadMapError
from redknot.headmap.served import ModelSignature, ServedSetting


def profile_dirs() -> list[Path]:
    """The directories searched for calibrated profiles, in order."""
    package = Path(redknot.__file__).resolve().parent
    dirs = [package / "profiles", package.parent / "configs" / "heads"]
    user = envs.REDKNOT_PROFILES.get()
    if user:
        dirs.insert(0, Path(user).expanduser())
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def calibrated_profiles() -> list[tuple[Path, HeadMap]]:
    """Every readable profile with a calibration record in :func:`profile_dirs` (a profile
    shipped twice, in the package and its source checkout, counts once)."""
    found, seen = [], set()
    for directory in profile_dirs():
        for path in sorted(directory.glob("*.json")):
            try:
                if '"served"' not in path.read_text():
                    continue
                hm = HeadMap.load(path)
            except (OSError, HeadMapError, json.JSONDecodeError):
                continue  # not a profile, or a broken one: a profile given by flag reports it
            if hm.served is None or path.name in seen:
                continue
            seen.add(path.name)
            found.append((path, hm))
    return found


def profile_for(model: ModelSignature) -> tuple[Path, HeadMap] | None:
    """The first calibrated profile made for a model of ``model``'s signature, or ``None``."""
    for path, hm in calibrated_profiles():
        signature = hm.served.model_signature
        if signature is not None and signature.matches(model):
            return path, hm
    return None


@dataclass(frozen=True)
class GenericDefault:
    """What a server serves for a model without a profile: a setting every model can serve
    (a token-level policy, or no reuse) and where it was measured."""

    setting: ServedSetting
    why: str


def generic_default() -> GenericDefault:
    """The token-level setting calibration measured best on the models that have a calibrated
    profile here: among their records' best token-level settings that met their floor, the one
    that kept the most dense-correct answers (then the fewest FLOPs). Without any, no reuse."""
    measured = []
    for path, hm in calibrated_profiles():
        choice = hm.served.token_level
        if choice is not None and choice.meets_floor:
            m = choice.measured
            measured.append((-(m.get("kept") or 0.0), m.get("flops_fraction") or 1.0, path, hm))
    if not measured:
        near = [
            (path, hm) for path, hm in calibrated_profiles() if hm.served.token_level is not None
        ]
        hint = ""
        if near:
            path, hm = near[0]
            m = hm.served.token_level.measured.get("pooled", {})
            hint = (
                f" (closest measured: {hm.served.token_level.setting.label} on "
                f"{hm.model_name or path.name}, kept {m.get('kept', 0):.3f} of dense-correct "
                f"answers at {m.get('flops_fraction', 0):.3f} of dense FLOPs; serve it with "
                f"--redknot-policy {hm.served.token_level.setting.policy})"
            )
        return GenericDefault(
            ServedSetting("full"),
            "no calibrated profile here has a reuse setting that meets its floor, so "
            "prompts are computed in full (no segment reuse)" + hint,
        )
    _, _, path, hm = min(measured, key=lambda x: x[:2])
    choice = hm.served.token_level
    m = choice.measured
    return GenericDefault(
        choice.setting,
        f"the token-level setting calibration measured best on {hm.model_name or path.name} "
        f"(profile {path}: kept {m.get('kept', 0):.3f} of dense-correct answers at "
        f"{m.get('flops_fraction', 0):.3f} of dense prefill FLOPs)",
    )
