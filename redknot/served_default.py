"""Which recovery setting a redknot server serves when its options do not say, and why.

``RedknotConfig.merge`` calls :func:`resolve` with the options given explicitly (config file
and flags) and the served model's signature. The rules, first match wins:

| given                                   | served                                                    |
| --------------------------------------- | --------------------------------------------------------- |
| ``--redknot-all-global``                | every head global (the exact dense computation)           |
| a token-level ``--redknot-policy``      | that policy, every head global; its knobs from the profile's record where it measured that policy |
| ``--redknot-policy redknot``            | the map given, or the calibrated profile found for the model; knobs from its record (the best head-aware setting), else its ``recovery`` block. A map whose record measured more loss than its floor is refused unless ``--redknot-accept-lossy-map`` |
| no policy; a profile (``--redknot-head-map``, or found for the model: :mod:`redknot.headmap.shipped`) with a calibration record | the record's setting: a token-level policy is served with every head global (the map's classes unused), ``redknot`` with the map, ``full`` without reuse |
| no policy; a map without a record       | redknot with the map and its recorded knobs (a warning: its loss is unmeasured) |
| nothing                                 | the generic default (:func:`redknot.headmap.shipped.generic_default`): the best token-level setting that met its floor on a calibrated model, with every head global; none: every prompt in full |

Options given explicitly always win over what a record says; options that only apply to
redknot's recovery are refused next to a record that serves another policy, so that a user
never gets a setting they did not ask for without knowing it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redknot.headmap import HeadMap, HeadMapError
from redknot.headmap.served import ModelSignature, ServedRecord, ServedSetting
from redknot.headmap.shipped import generic_default, profile_for

# Options that only redknot's head-aware recovery reads
REDKNOT_ONLY = (
    "dense_layers", "mass_thresh", "recent_n", "skipped", "local_kv", "restore_thresh",
    "restore_edge", "restore_heads", "repair_k",
)  # fmt: skip
# Recovery knobs a record may set for redknot (the rest of RecoveryOptions is not served)
REDKNOT_KNOBS = (*REDKNOT_ONLY, "window", "sink")
CALIBRATE = (
    "python -m redknot.calibrate --model MODEL --head-map MAP --out PROFILE, then start with "
    "--redknot-head-map PROFILE (docs/calibration.md)"
)


class ServedDefaultError(ValueError):
    """Options that contradict the calibrated default or a refused map."""


@dataclass(frozen=True)
class Resolution:
    """Options to add where not given (``values``, from ``source``), given options to drop
    (``drop``), and the log line saying what is served and why (``message`` at ``level``)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    message: str = ""
    level: int = logging.INFO
    source: str = "the served default"


def _load(path: str) -> HeadMap | None:
    try:
        return HeadMap.load(path)
    except HeadMapError:
        return None  # reported when the configuration resolves its map


def redknot_knobs(hm: HeadMap) -> dict[str, Any]:
    """The knobs recorded for redknot under ``hm``: its ``recovery`` block
    (``HeadMap.recorded_recovery``) with its record's best head-aware setting on top."""
    record = hm.served
    knobs = dict(hm.recorded_recovery())  # what the record's settings were measured on top of
    if record is not None and record.head_aware is not None:
        knobs.update(record.head_aware.setting.knobs)
    return {k: v for k, v in knobs.items() if k in REDKNOT_KNOBS}


def _check_loss(hm: HeadMap, path: str, given: Mapping[str, Any]) -> None:
    record = hm.served
    if record is None or record.head_aware is None or record.head_aware.meets_floor:
        return
    if given.get("accept_lossy_map"):
        return
    m = record.head_aware.measured
    raise ServedDefaultError(
        f"head map {path!r} loses answers: its best head-aware setting "
        f"{record.head_aware.setting.label} kept {m.get('kept', 0):.3f} of the dense-correct "
        f"answers (top-10 {m.get('top10', 0):.3f}) on its calibration cases, below the floor "
        f"(kept >= {record.floor.get('kept')}, top-10 >= {record.floor.get('top10')}). Serve its "
        f"calibrated default ({record.label}) by dropping --redknot-policy redknot, or pass "
        "--redknot-accept-lossy-map to serve the map anyway"
    )


def _redknot(hm: HeadMap, path: str, given: Mapping[str, Any], why: str) -> Resolution:
    _check_loss(hm, path, given)
    knobs = {k: v for k, v in redknot_knobs(hm).items() if k not in given}
    shown = ", ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
    note = f"; recovery defaults recorded in head map {path!r}: {shown}" if knobs else ""
    return Resolution(
        {"head_map": path, **knobs},
        message=f"redknot: serving redknot with head map {path!r} ({why}){note} "
        "(flags override them)",
        source=f"the recovery defaults of head map {path!r}",
    )


def _from_record(record: ServedRecord, path: str, given: Mapping[str, Any]) -> Resolution:
    setting = record.setting
    if setting.head_aware:
        hm = _load(path)
        if hm is not None:
            resolution = _redknot(hm, path, given, "its calibrated default")
            return Resolution(
                {**resolution.values, "policy": "redknot"},
                message=f"redknot: serving the calibrated default of profile {path!r}: "
                f"{record.summary()}. {resolution.message}",
                source=resolution.source,
            )
    stray = [k for k in REDKNOT_ONLY if k in given]
    if stray:
        raise ServedDefaultError(
            f"--redknot-{stray[0].replace('_', '-')} applies to redknot's head-aware recovery, "
            f"but the calibrated default of {path!r} is {setting.label}: add --redknot-policy "
            "redknot to serve the map with redknot, or drop the option"
        )
    if setting.policy == "full" and given.get("segment_fraction"):
        raise ServedDefaultError(
            f"the calibrated default of {path!r} is no segment reuse (no reuse setting met its "
            "floor), but --redknot-segment-fraction asks to cache segments: give "
            "--redknot-policy to choose a reuse policy"
        )
    values = {k: v for k, v in setting.config_values().items() if k not in given}
    how = "every prompt computed in full" if setting.policy == "full" else "every head global"
    return Resolution(
        values,
        drop=("head_map",),
        message=f"redknot: serving the calibrated default of profile {path!r} ({how}): "
        f"{record.summary()}; why: {record.reason} Flags override it.",
        source=f"the calibrated default of profile {path!r}",
    )


def _token_knobs(policy: str, hm: HeadMap | None) -> dict[str, Any]:
    """Knobs a profile's record measured for the token-level ``policy``."""
    record = None if hm is None else hm.served
    if record is None:
        return {}
    for choice in (record.setting, getattr(record.token_level, "setting", None)):
        if isinstance(choice, ServedSetting) and choice.policy == policy:
            return dict(choice.knobs)
    return {}


def resolve(given: Mapping[str, Any], model: ModelSignature | None) -> Resolution:
    """What to serve for the explicitly ``given`` options on ``model`` (``None``: unknown, no
    profile is searched). Raises :class:`ServedDefaultError`."""
    if given.get("all_global"):
        return Resolution()
    path = given.get("head_map")
    hm = _load(path) if path else None
    found = None if path or model is None else profile_for(model)
    if found is not None:
        path, hm = str(found[0]), found[1]
    policy = given.get("policy")
    if policy is not None and policy != "redknot":
        knobs = {k: v for k, v in _token_knobs(policy, hm).items() if k not in given}
        where = f" (knobs measured in profile {path!r})" if knobs else ""
        return Resolution(
            knobs,
            message=f"redknot: serving --redknot-policy {policy}{where}",
            source=f"the {policy} knobs of profile {path!r}",
        )
    if policy == "redknot":
        if hm is None:
            return Resolution()  # no map: the configuration reports it
        why = "given" if given.get("head_map") else "the calibrated profile found for this model"
        return _redknot(hm, path, given, f"--redknot-policy redknot, map {why}")
    if hm is not None and hm.served is not None:
        return _from_record(hm.served, path, given)
    if hm is not None:
        resolution = _redknot(hm, path, given, "given")
        return Resolution(
            resolution.values,
            message=f"{resolution.message}. This map has no calibration record, so its answer "
            f"loss is unmeasured: calibrate it with {CALIBRATE}",
            level=logging.WARNING,
            source=resolution.source,
        )
    if path:
        return Resolution()  # a map that cannot be read: the configuration reports it
    fallback = generic_default()
    values = {k: v for k, v in fallback.setting.config_values().items() if k not in given}
    stray = [k for k in REDKNOT_ONLY if k in given]
    if stray:
        raise ServedDefaultError(
            f"--redknot-{stray[0].replace('_', '-')} applies to redknot's head-aware recovery, "
            "which needs a head map: give --redknot-head-map (made by redknot-profile, "
            "calibrated by python -m redknot.calibrate), or drop the option"
        )
    return Resolution(
        values,
        message="redknot: no calibrated profile for this model; serving "
        + (
            "every prompt in full (dense attention, no segment reuse)"
            if fallback.setting.policy == "full"
            else f"{fallback.setting.label} with every head global"
        )
        + f": {fallback.why}. To serve a setting "
        f"measured on this model, calibrate it: {CALIBRATE}",
        level=logging.WARNING,
    )
