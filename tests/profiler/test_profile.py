from __future__ import annotations

import json

import pytest

from redknot.headmap import HeadMap
from redknot.profiler import ProfileConfig, ProfileError, profile
from redknot.profiler.cli import main
from redknot.reference import ReferenceRunner

from .conftest import ByteEncoder, tiny_llama

SMALL = {
    "global_fraction": 0.25,
    "window": 32,
    "sink": 4,
    "calib_size": 4,
    "calib_lengths": (160, 200),
    "segment_length": 96,
    "prefix_lengths": (40, 80),
    "probe_last": 8,
}


def run(tmp_path, name, **overrides):
    config = ProfileConfig(
        model="tiny", out=str(tmp_path / f"{name}.json"), **{**SMALL, **overrides}
    )
    runner = ReferenceRunner(tiny_llama(layers=4))
    return profile(runner, ByteEncoder(), config, model_name="tiny", progress=False)


def test_same_seed_same_map_and_rerun_resumes(tmp_path):
    first = run(tmp_path, "a")
    second = run(tmp_path, "b")  # another work dir: computed from scratch
    assert first.computed == second.computed == 4 + 2 and first.reused == 0
    assert first.head_map.classes == second.head_map.classes
    assert first.head_map.scores == second.head_map.scores
    hm = first.head_map
    assert hm.num_global == 2 and hm.window == 32 and hm.sink == 4 and hm.dense_layers == 1
    assert set(hm.scores) == {
        "long_range_mass",
        "needle_mass",
        "local_output_error",
        "prefix_kv_deviation",
        "combined",
    }
    assert hm.provenance["thresholds"]["num_global"] == 2 and not hm.is_synthetic
    resumed = run(tmp_path, "a", global_fraction=0.5)  # same work dir, other ranking
    assert resumed.computed == 0 and resumed.reused == 6
    assert resumed.head_map.scores == hm.scores and resumed.head_map.num_global == 4
    other_seed = run(tmp_path, "a", seed=1)
    assert other_seed.computed == 6
    assert other_seed.head_map.scores["long_range_mass"] != hm.scores["long_range_mass"]


def test_interrupted_run_keeps_finished_prompts(tmp_path, monkeypatch):
    import redknot.profiler.pipeline as P

    calls = {"n": 0}
    real = P.prefix_scores

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(P, "prefix_scores", failing)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "c")
    monkeypatch.setattr(P, "prefix_scores", real)
    again = run(tmp_path, "c")
    assert again.reused == 5 and again.computed == 1


def test_context_too_short_is_a_clear_error(tmp_path):
    config = ProfileConfig(model="tiny", out=str(tmp_path / "x.json"), **SMALL)
    runner = ReferenceRunner(tiny_llama(max_positions=150))
    with pytest.raises(ProfileError, match="context is 150 tokens"):
        profile(runner, ByteEncoder(), config, model_name="tiny", progress=False)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"calib_lengths": (300,), "window": 256, "sink": 64}, "too short"),
        ({"global_fraction": 1.5}, "global-fraction"),
        ({"window": 0}, "window"),
        ({"weights": (("long_range_mass", -1.0),)}, "weights"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ProfileError, match=message):
        ProfileConfig(model="m", out="o.json", **{**SMALL, **overrides})


def test_cli_end_to_end(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "map.json"
    argv = [
        "--model",
        str(tiny_checkpoint),
        "--out",
        str(out),
        "--global-fraction",
        "0.5",
        "--window",
        "32",
        "--sink",
        "4",
        "--calib-size",
        "4",
        "--calib-lengths",
        "120,150",
        "--segment-length",
        "60",
        "--prefix-lengths",
        "30,50",
        "--probe-last",
        "8",
        "--weights",
        "local_output_error=1,prefix_kv_deviation=1",
        "--quiet",
    ]
    assert main(argv) == 0
    hm = HeadMap.load(out)
    assert hm.num_global == 2 and hm.model.num_layers == 2 and hm.model_name == tiny_checkpoint.name
    assert hm.provenance["ranking"]["weights"] == {
        "local_output_error": 1.0,
        "prefix_kv_deviation": 1.0,
    }
    assert hm.provenance["config"]["calib_lengths"] == [120, 150]
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "map.work").is_dir()
    data = json.loads(out.read_text())
    assert data["format"] == "redknot.headmap/1"


def test_cli_errors(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "m.json")]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["--model", "m", "--out", "m.json", "--calib-lengths", "100"]) == 2
    assert "too short" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "m", "--out", "m.json", "--weights", "oops"])
