from __future__ import annotations

import json

import pytest

from redknot.headmap import (
    FORMAT,
    HeadMap,
    HeadMapError,
    ModelShape,
    kv_heads_of_rank,
    map_from_scores,
    synthetic_map,
)

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=4, num_kv_heads=4, num_attention_heads=8, head_dim=16
)


def scored_map(fraction: float = 0.25) -> HeadMap:
    grid = [[(7 * layer + 3 * head) % 11 / 10 for head in range(4)] for layer in range(4)]
    other = [[layer / 4 + head / 40 for head in range(4)] for layer in range(4)]
    return map_from_scores(
        SHAPE,
        {"long_range_mass": grid, "prefix_kv_deviation": other},
        global_fraction=fraction,
        weights={"long_range_mass": 1, "prefix_kv_deviation": 1},
        window=32,
        sink=4,
        dense_layers=1,
        model_name="tiny",
        provenance={"tool": "test", "calibration": {"description": "none"}},
    )


def test_round_trip_keeps_everything(tmp_path):
    hm = scored_map()
    path = tmp_path / "sub" / "map.json"
    hm.save(path)
    back = HeadMap.load(path)
    assert back == hm
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["model"]["name"] == "tiny"
    assert set(data["scores"]) == {"long_range_mass", "prefix_kv_deviation", "combined"}
    assert data["provenance"]["thresholds"]["num_global"] == 4


def test_unknown_keys_are_ignored_for_compatibility():
    data = scored_map().to_json()
    data["future_field"] = {"x": 1}
    assert HeadMap.from_json(data).classes == scored_map().classes


def test_validate_against_the_model():
    hm = scored_map()
    hm.validate_against(SHAPE, tp_size=2)
    hm.validate_against(SHAPE, tp_size=8)  # KV heads replicated over 8 ranks
    for field, value in (
        ("num_layers", 5),
        ("num_kv_heads", 8),
        ("head_dim", 32),
        ("num_attention_heads", 16),
    ):
        other = ModelShape(**{**SHAPE.__dict__, field: value})
        with pytest.raises(HeadMapError, match=field):
            hm.validate_against(other)
    with pytest.raises(HeadMapError, match="cannot be split over --tp 3"):
        hm.validate_against(SHAPE, tp_size=3)
    with pytest.raises(HeadMapError, match="context length"):
        hm.validate_against(SHAPE, context_len=20)


def test_tensor_parallel_slices():
    hm = synthetic_map(SHAPE, 0.5, seed=1)
    assert kv_heads_of_rank(4, 2, 1) == [2, 3]
    assert kv_heads_of_rank(4, 8, 5) == [2]
    for layer, row in enumerate(hm.classes):
        assert hm.classes_of_rank(2, 0)[layer] + hm.classes_of_rank(2, 1)[layer] == row
        assert hm.classes_of_rank(8, 7)[layer] == row[3]
    with pytest.raises(HeadMapError, match="outside"):
        kv_heads_of_rank(4, 2, 2)


def _broken(**changes) -> dict:
    data = scored_map().to_json()
    for key, value in changes.items():
        data[key] = value
    return data


@pytest.mark.parametrize(
    "data,message",
    [
        (_broken(format="redknot.headmap/0"), "format"),
        (_broken(classes=["GLLL"] * 3), "lists 3 layers"),
        (_broken(classes=["GLL", "LLLL", "LLLL", "LLLL"]), "layer 0"),
        (_broken(classes=["GXLL", "LLLL", "LLLL", "LLLL"]), "'G' \\(global\\)"),
        (_broken(window=0), "window"),
        (_broken(sink=-1), "sink"),
        (_broken(dense_layers=9), "dense_layers"),
        (_broken(scores={"x": [[0.0] * 4] * 3}), "grid"),
        (_broken(scores={"x": [[float("nan")] * 4] * 4}), "non-finite"),
        (_broken(model={"num_layers": 4}), "malformed"),
        ([1, 2], "JSON object"),
    ],
)
def test_malformed_maps_are_clear_errors(data, message):
    with pytest.raises(HeadMapError, match=message):
        HeadMap.from_json(data)


def test_load_errors(tmp_path):
    with pytest.raises(HeadMapError, match="does not exist"):
        HeadMap.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HeadMapError, match="not readable JSON"):
        HeadMap.load(bad)


def test_shape_from_hugging_face_configs():
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "head_dim": 128,
    }
    assert ModelShape.from_hf_config(qwen3) == ModelShape("Qwen3ForCausalLM", 36, 8, 32, 128)
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert ModelShape.from_hf_config(llama) == ModelShape("unknown", 2, 4, 4, 16)
