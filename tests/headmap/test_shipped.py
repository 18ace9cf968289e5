"""The head maps shipped in configs/heads/ load, describe themselves and fit their models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from redknot.headmap import HeadMap, ModelShape, reclassify

ROOT = Path(__file__).resolve().parents[2]
HEADS = ROOT / "configs" / "heads"
MODELS = ROOT.parent / "shared" / "models"
SYNTHETIC = sorted((HEADS / "synthetic").glob("*.json"))
EXPECTED_SYNTHETIC = {
    "llama-3.1-8b-g0.125.json",
    "llama-3.1-8b-g0.15.json",
    "llama-3.1-8b-g0.5.json",
    "mistral-7b-g0.125.json",
    "qwen3-8b-g0.125.json",
}


def test_the_expected_synthetic_maps_are_shipped():
    assert EXPECTED_SYNTHETIC <= {p.name for p in SYNTHETIC}


@pytest.mark.parametrize("path", SYNTHETIC, ids=lambda p: p.name)
def test_synthetic_maps_are_labelled_and_fit(path):
    hm = HeadMap.load(path)
    assert hm.is_synthetic and hm.provenance["commit"] and hm.provenance["version"]
    model, fraction = re.fullmatch(r"(.+)-g([0-9.]+)\.json", path.name).groups()
    assert hm.num_global == round(float(fraction) * hm.model.num_layers * hm.model.num_kv_heads)
    config = MODELS / model / "config.json"
    if not config.is_file():
        pytest.skip(f"{config} is not available in this checkout")
    shape = ModelShape.from_hf_config(json.loads(config.read_text()))
    hm.validate_against(shape, tp_size=8)


def test_profiled_smollm2_map_describes_itself():
    hm = HeadMap.load(HEADS / "smollm2-135m-instruct.json")
    assert hm.model == ModelShape("LlamaForCausalLM", 30, 3, 9, 64)
    assert not hm.is_synthetic
    prov = hm.provenance
    for key in ("tool", "version", "commit", "calibration", "ranking", "thresholds", "config"):
        assert prov.get(key), key
    assert prov["thresholds"]["num_global"] == hm.num_global
    for name in ("long_range_mass", "prefix_kv_deviation", "combined"):
        assert name in hm.scores


def test_half_global_smollm2_map_is_the_profiled_map_rethresholded():
    profiled = HeadMap.load(HEADS / "smollm2-135m-instruct.json")
    half = HeadMap.load(HEADS / "smollm2-135m-instruct-g0.5.json")
    assert half.classes == reclassify(profiled, 0.5).classes
    assert half.num_global == 45 and half.scores == profiled.scores
