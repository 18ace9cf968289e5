"""What a server serves when its flags do not say (redknot.served_default): the calibrated record
of the model's profile, the generic default without one, the refusal of a lossy map, and the
calibration that writes the record (redknot.calibrate)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from redknot import calibrate
from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import HeadMap
from redknot.headmap.served import ModelSignature
from redknot.headmap.shipped import generic_default, profile_for

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "heads" / "smollm2-135m-instruct.json"
SMOLLM2 = ModelSignature("LlamaForCausalLM", 30, 3, 9, 64, 576, 1536, 49152)
OTHER = ModelSignature("LlamaForCausalLM", 4, 2, 4, 16, 64, 128, 1000)


def test_the_shipped_profile_records_no_reuse_with_provenance():
    """On SmolLM2 no reuse setting keeps >= 0.99 of the dense-correct answers (issue 25's
    floor): the record serves every prompt in full and names the closest token-level setting."""
    record = HeadMap.load(SHIPPED).served
    assert record is not None and record.label == "full" and record.meets_floor
    assert record.floor == {"kept": 0.99, "top10": 0.85}
    assert record.token_level.setting.label == "cacheblend[blend_ratio=0.5]"
    assert not record.token_level.meets_floor and "--redknot-policy cacheblend" in record.reason
    assert record.head_aware.setting.policy == "redknot" and not record.head_aware.meets_floor
    prov = record.provenance
    assert prov["tool"] == "redknot.calibrate" and prov["commit"] and prov["floor"]
    assert "benchmarks/cases/rag_v1.jsonl" in prov["cases"] and prov["metric"]
    assert "benchmarks/cases/long_v1.jsonl" in prov["cases"]  # both case sets pooled
    assert record.model_signature.matches(SMOLLM2)


def test_profile_given_serves_its_record(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {"head_map": str(SHIPPED)}, model=SMOLLM2)
    assert config.all_global and config.segment_fraction == 0.0 and config.head_map is None
    assert "calibrated default" in caplog.text and "why:" in caplog.text
    # a record naming a token-level policy is served from the profile, every head global
    data = json.loads(SHIPPED.read_text())
    data["served"]["setting"] = {"policy": "cacheblend", "knobs": {"blend_ratio": 0.15}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    config = RedknotConfig.merge(None, {"head_map": str(tmp_path / "p.json")}, model=SMOLLM2)
    assert (config.policy, config.blend_ratio, config.all_global) == ("cacheblend", 0.15, True)
    assert config.head_map is None


def test_no_map_for_a_calibrated_model_finds_its_profile(caplog):
    assert profile_for(SMOLLM2)[0].name == SHIPPED.name
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {}, model=SMOLLM2)
    assert config.all_global and config.segment_fraction == 0.0
    assert SHIPPED.name in caplog.text


def test_no_profile_serves_the_generic_default_and_says_how_to_calibrate(caplog):
    assert profile_for(OTHER) is None
    fallback = generic_default()
    assert fallback.setting.policy == "full"  # no measured reuse setting met its floor
    assert "--redknot-policy cacheblend" in fallback.why  # the closest one, named
    for model in (OTHER, None):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="redknot.config"):
            config = RedknotConfig.merge(None, {}, model=model)
        assert config.all_global and config.segment_fraction == 0.0
        assert "no calibrated profile" in caplog.text and "redknot.calibrate" in caplog.text
        assert caplog.records[-1].levelno == logging.WARNING
    with pytest.raises(RedknotConfigError, match="needs a head map"):
        RedknotConfig.merge(None, {"dense_layers": 4}, model=OTHER)


def test_a_map_below_its_floor_is_refused_for_redknot_unless_overridden(caplog):
    given = {"head_map": str(SHIPPED), "policy": "redknot"}
    with pytest.raises(RedknotConfigError, match="loses answers.*accept-lossy-map"):
        RedknotConfig.merge(None, given, model=SMOLLM2)
    with caplog.at_level(logging.INFO, logger="redknot.config"):
        config = RedknotConfig.merge(None, {**given, "accept_lossy_map": True}, model=SMOLLM2)
    assert config.policy == "redknot" and config.head_map == str(SHIPPED)
    assert config.dense_layers == 8  # the knobs recorded for redknot


def test_flags_win_over_the_record():
    epic = RedknotConfig.merge(None, {"policy": "epic", "epic_k": 64}, model=SMOLLM2)
    assert (epic.policy, epic.epic_k) == ("epic", 64)
    dense = RedknotConfig.merge(None, {"all_global": True}, model=SMOLLM2)
    assert dense.policy == "redknot" and dense.all_global
    with pytest.raises(RedknotConfigError, match="applies to redknot's head-aware recovery"):
        RedknotConfig.merge(None, {"head_map": str(SHIPPED), "dense_layers": 4}, model=SMOLLM2)


def _summary(kept, top10, flops, n=10, nc=8):
    return {"kept": kept, "top10": top10, "flops_fraction": flops, "cases": n,
            "dense_correct_cases": nc, "contains": kept, "exact_match": 0.0, "f1": 0.0}  # fmt: skip


def test_calibration_picks_the_cheapest_faithful_setting_or_no_reuse(tmp_path):
    hm = HeadMap.load(SHIPPED)
    sets = {
        "a": {
            "full": _summary(1, 1, 1),
            "redknot": _summary(0.6, 0.8, 0.2),
            "epic[epic_k=16]": _summary(0.95, 0.9, 0.05),
            "cacheblend[blend_ratio=0.15]": _summary(1.0, 0.9, 0.2),
            "headclass": _summary(1.0, 1.0, 0.01),
        },
    }
    floor = {"kept": 0.9, "top10": 0.85}
    record = calibrate.build_record(hm, sets, floor=floor, signature=SMOLLM2, provenance={})
    assert record.label == "epic[epic_k=16]"  # cheapest meeting the floor; headclass not servable
    assert record.token_level.setting.label == "epic[epic_k=16]"
    assert record.head_aware.setting.policy == "redknot" and not record.head_aware.meets_floor
    again = calibrate.build_record(hm, sets, floor=floor, signature=SMOLLM2, provenance={})
    assert again.to_json() == record.to_json()  # deterministic
    strict = calibrate.build_record(hm, sets, floor={"kept": 1.0, "top10": 0.95},
                                    signature=SMOLLM2, provenance={})  # fmt: skip
    assert strict.label == "full"
    path = tmp_path / "p.json"
    from dataclasses import replace

    replace(hm, served=strict).save(path)
    served = RedknotConfig.merge(None, {"head_map": str(path)}, model=SMOLLM2)
    assert served.all_global and served.segment_fraction == 0.0  # no reuse at all


def test_calibrate_cli_from_a_result_and_the_profiles_dir(tmp_path, monkeypatch):
    result = {"summary": {"full": _summary(1, 1, 1), "naive": _summary(1.0, 0.9, 0.01)},
              "commit": "abc"}  # fmt: skip
    src = tmp_path / "r.json"
    src.write_text(json.dumps(result))
    out = tmp_path / "profiles" / "mine.json"
    out.parent.mkdir()
    plain = json.loads(SHIPPED.read_text())
    plain.pop("served")
    (tmp_path / "map.json").write_text(json.dumps(plain))
    rc = calibrate.main(["--head-map", str(tmp_path / "map.json"), "--out", str(out),
                         "--model", "/no/such/model", "--from-result", f"set={src}"])  # fmt: skip
    assert rc == 0
    record = HeadMap.load(out).served
    assert record.label == "naive" and record.provenance["sources"][0].startswith(str(src))
    assert record.model_signature is None  # no config to read: found only by flag
    served = RedknotConfig.merge(None, {"head_map": str(out)}, model=OTHER)
    assert served.policy == "naive" and served.all_global
    # a user's profiles directory: its token-level setting that met the floor becomes the
    # generic default of models without a profile
    monkeypatch.setenv("REDKNOT_PROFILES", str(out.parent))
    assert generic_default().setting.policy == "naive"
    assert RedknotConfig.merge(None, {}, model=OTHER).policy == "naive"


def test_server_without_map_starts_on_the_generic_default(sglang_plugins, llama_dir):
    from sglang.srt.server_args import prepare_server_args

    from redknot.integration.server_args import published_config

    argv = ["--model-path", str(llama_dir), "--load-format", "dummy", "--device", "cpu",
            "--attention-backend", "redknot"]  # fmt: skip
    prepare_server_args(argv)
    config = published_config()
    assert config.all_global and config.segment_fraction == 0.0  # no startup error


def test_the_package_ships_the_profile():
    """An installed package (no configs/ beside it) finds the profile in redknot/profiles/."""
    linked = ROOT / "redknot" / "profiles" / SHIPPED.name
    assert linked.resolve() == SHIPPED.resolve()
