"""Recovery knob defaults recorded with a head map: the server and the reference path take them
where the knob is not given; flags and config files override them."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import HeadMap

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "heads" / "smollm2-135m-instruct.json"
SYNTHETIC = ROOT / "configs" / "heads" / "synthetic" / "llama-3.1-8b-g0.125.json"


def _map_with(tmp_path: Path, name: str = "map.json", **changes) -> str:
    """The shipped SmolLM2 map with top-level keys changed (``recovery`` replaced), without its
    calibration record (``served``: tests/integration/test_served_default.py) unless given."""
    data = json.loads(SHIPPED.read_text())
    data.pop("served", None)
    data.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _plain(tmp_path: Path) -> str:
    """The shipped map as a map without a calibration record: served with redknot."""
    return _map_with(tmp_path, "plain.json")


def test_the_shipped_map_records_what_its_fidelity_sweep_chose():
    recorded = HeadMap.load(SHIPPED).recorded_recovery()
    assert recorded == {
        "dense_layers": 8, "mass_thresh": 0.5, "recent_n": 128, "skipped": "cached",
        "restore_thresh": None, "local_kv": "cached",
    }  # fmt: skip
    assert "fidelity.json" in HeadMap.load(SHIPPED).provenance["recovery_source"]
    assert HeadMap.load(SYNTHETIC).recorded_recovery() == {}  # every layer dense, no block


def test_server_takes_the_recorded_knobs_and_flags_override_them(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {"head_map": _plain(tmp_path)}, num_layers=30)
    assert (config.dense_layers, config.mass_thresh, config.recent_n) == (8, 0.5, 128)
    assert config.skipped == "cached" and config.segment_heads == "all"  # rows leave: every head
    assert (
        "recovery defaults recorded in head map" in caplog.text and "dense_layers=8" in caplog.text
    )

    flags = {"head_map": _plain(tmp_path), "dense_layers": 4, "mass_thresh": 0.3}
    config = RedknotConfig.merge(None, flags, num_layers=30)
    assert (config.dense_layers, config.mass_thresh, config.recent_n) == (4, 0.3, 128)

    file = tmp_path / "redknot.json"
    file.write_text(json.dumps({"head_map": _plain(tmp_path), "skipped": "residual"}))
    config = RedknotConfig.merge(str(file), {"recent_n": 64}, num_layers=30)
    assert (config.skipped, config.recent_n, config.dense_layers) == ("residual", 64, 8)
    assert config.segment_heads == "local"  # residual rows never read a segment's global heads

    # as many dense layers as the model has: the schedule is off, segments keep local heads
    config = RedknotConfig.merge(None, {"head_map": _plain(tmp_path), "dense_layers": 30}, 30)
    assert config.dense_layers is None and config.segment_heads == "local"
    config = RedknotConfig.merge(None, {"head_map": str(_map_with(tmp_path, dense_layers=30))}, 30)
    assert config.dense_layers is None and config.segment_heads == "local"


def test_recorded_knobs_apply_to_redknot_only_and_are_checked(tmp_path, caplog):
    epic = RedknotConfig.merge(None, {"policy": "epic"})
    assert epic.dense_layers is None  # a token-level policy excludes the layer schedule
    assert RedknotConfig.merge(None, {"head_map": str(SYNTHETIC)}).dense_layers is None
    missing = RedknotConfig.merge(None, {"head_map": str(tmp_path / "none.json")})
    assert missing.dense_layers is None  # the missing map is reported when the map is resolved

    bad = _map_with(tmp_path, recovery={"mass_thresh": "high"})
    with pytest.raises(RedknotConfigError, match=r"recovery defaults of head map .*mass_thresh"):
        RedknotConfig.merge(None, {"head_map": bad})

    config = RedknotConfig.merge(None, {"head_map": _map_with(tmp_path, recovery={})})
    assert config.dense_layers == 8  # the map's own dense_layers, without a recovery block


def test_restore_is_served_recorded_or_given_and_checked(tmp_path, caplog):
    """Adaptive restore: a recorded threshold turns it on with one restore column per layer,
    flags override the threshold, the edge and the column count, 0 columns turn it off, and
    inconsistent options are refused."""
    restoring = _map_with(tmp_path, recovery={"restore_thresh": 0.1, "restore_edge": 16})
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {"head_map": restoring}, num_layers=30)
    assert (config.restore_thresh, config.restore_edge, config.restore_heads) == (0.1, 16, 1)
    assert config.restore and "restore_thresh=0.1" in caplog.text
    given = RedknotConfig.merge(None, {"head_map": restoring, "restore_thresh": 0.3,
                                       "restore_heads": 2, "restore_edge": 8}, 30)  # fmt: skip
    assert (given.restore_thresh, given.restore_edge, given.restore_heads) == (0.3, 8, 2)
    off = RedknotConfig.merge(None, {"head_map": restoring, "restore_heads": 0}, 30)
    assert not off.restore and off.restore_heads == 0
    shipped = RedknotConfig.merge(None, {"head_map": _plain(tmp_path)}, 30)
    assert not shipped.restore and shipped.restore_heads == 0  # the shipped map records null
    with pytest.raises(RedknotConfigError, match="--redknot-restore-heads 2 needs"):
        RedknotConfig(head_map=str(SHIPPED), restore_heads=2)
    with pytest.raises(RedknotConfigError, match="restore-thresh must be a number in"):
        RedknotConfig(head_map=str(SHIPPED), restore_thresh=1.5)
    with pytest.raises(RedknotConfigError, match="no local head to restore"):
        RedknotConfig(all_global=True, restore_thresh=0.1, restore_heads=1)
    with pytest.raises(RedknotConfigError, match="cannot be combined with --redknot-restore"):
        RedknotConfig(policy="epic", restore_thresh=0.1)
    with pytest.raises(RedknotConfigError, match="restore-edge must be an integer >= 1"):
        RedknotConfig(head_map=str(SHIPPED), restore_thresh=0.1, restore_edge=0)
    assert RedknotConfig(all_global=True, restore_thresh=0.1).restore_heads == 0


def test_local_kv_is_served_recorded_or_given_and_checked(tmp_path, caplog):
    fresh_map = _map_with(tmp_path, recovery={"dense_layers": 8, "local_kv": "fresh"})
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {"head_map": fresh_map}, num_layers=30)
    assert config.local_kv == "fresh" and "local_kv=fresh" in caplog.text
    assert "for the reference path" not in caplog.text  # served, not warned about
    given = RedknotConfig.merge(None, {"head_map": fresh_map, "local_kv": "cached"}, 30)
    assert given.local_kv == "cached"  # a flag overrides the map
    assert RedknotConfig.merge(None, {"head_map": str(SYNTHETIC)}).local_kv == "cached"
    with pytest.raises(RedknotConfigError, match="--redknot-local-kv 'stale' is not one of"):
        RedknotConfig(head_map=str(SHIPPED), local_kv="stale")
    with pytest.raises(RedknotConfigError, match="cannot be combined with --redknot-local-kv"):
        RedknotConfig(policy="epic", local_kv="fresh")
    from redknot.config import LOCAL_KV_CHOICES
    from redknot.recovery.options import LOCAL_KV_SOURCES

    assert LOCAL_KV_CHOICES == LOCAL_KV_SOURCES  # the server serves what the reference path runs


def test_the_reference_path_takes_the_same_recorded_knobs():
    from redknot.eval.cli import build_parser, default_options

    args = build_parser().parse_args(
        ["fidelity", "--cases", "x.jsonl", "--head-map", str(SHIPPED), "--out", "o.json"]
    )
    options = default_options(args)
    assert options.restore_thresh is None and options.dense_layers == 8
    assert options.mass_thresh == 0.5 and options.local_kv == "cached"
    plain = argparse.Namespace(head_map=str(SYNTHETIC), backend="reference")
    assert default_options(plain).restore_thresh == 0.1  # nothing recorded: the built-in default
