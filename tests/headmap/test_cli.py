from __future__ import annotations

import json

from redknot.headmap import HeadMap
from redknot.headmap.cli import main, read_model_config

from .test_map import scored_map

CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def write_config(tmp_path, **changes):
    path = tmp_path / "model-x"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    return path


def test_synth_writes_a_labelled_map(tmp_path, capsys):
    model = write_config(tmp_path)
    out = tmp_path / "maps" / "x.json"
    args = ["synth", "--model-config", str(model), "--global-fraction", "0.25", "--out", str(out)]
    assert main(args + ["--window", "128", "--sink", "16", "--seed", "2"]) == 0
    hm = HeadMap.load(out)
    assert hm.is_synthetic and hm.num_global == 6 and hm.model_name == "model-x"
    assert (hm.window, hm.sink, hm.model.head_dim) == (128, 16, 64)
    assert hm.provenance["model_config"] == str(model) and "commit" in hm.provenance
    assert "SYNTHETIC" in capsys.readouterr().out
    # the same arguments give the same map; the config file itself is accepted too
    again = tmp_path / "again.json"
    main(
        [
            "synth",
            "--model-config",
            str(model / "config.json"),
            "--global-fraction",
            "0.25",
            "--out",
            str(again),
            "--window",
            "128",
            "--sink",
            "16",
            "--seed",
            "2",
        ]
    )
    assert HeadMap.load(again).classes == hm.classes


def test_show_validate_and_threshold(tmp_path, capsys):
    path = tmp_path / "scored.json"
    scored_map(0.25).save(path)
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "profiled; 4 global heads (25.0%)" in shown and "layer   3" in shown

    config = {**CONFIG, "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 16}
    model = write_config(tmp_path, **config)
    assert main(["validate", str(path), "--model-config", str(model), "--tp", "2"]) == 0
    assert main(["validate", str(path), "--model-config", str(model), "--tp", "3"]) == 2
    assert "cannot be split over --tp 3" in capsys.readouterr().err
    other = write_config(tmp_path, num_hidden_layers=6)
    assert main(["validate", str(path), "--model-config", str(other)]) == 2
    assert "num_layers: map has 4, model has 6" in capsys.readouterr().err

    wider = tmp_path / "wider.json"
    assert main(["threshold", str(path), "--global-fraction", "0.5", "--out", str(wider)]) == 0
    assert HeadMap.load(wider).num_global == 8


def test_errors_name_the_problem(tmp_path, capsys):
    assert (
        main(
            [
                "synth",
                "--model-config",
                str(tmp_path / "none"),
                "--global-fraction",
                "0.1",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 8}')
    assert (
        main(
            [
                "synth",
                "--model-config",
                str(bad),
                "--global-fraction",
                "0.1",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 2
    )
    assert "not a usable config.json" in capsys.readouterr().err
    assert (
        main(
            [
                "synth",
                "--model-config",
                str(write_config(tmp_path)),
                "--global-fraction",
                "1.5",
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
        == 2
    )
    assert "global_fraction" in capsys.readouterr().err
    synthetic = tmp_path / "s.json"
    main(
        [
            "synth",
            "--model-config",
            str(write_config(tmp_path)),
            "--global-fraction",
            "0.1",
            "--out",
            str(synthetic),
        ]
    )
    assert (
        main(
            [
                "threshold",
                str(synthetic),
                "--global-fraction",
                "0.5",
                "--out",
                str(tmp_path / "t.json"),
            ]
        )
        == 2
    )
    assert "only profiled maps" in capsys.readouterr().err


def test_read_model_config_of_the_shared_shapes(tmp_path):
    shape, name = read_model_config(write_config(tmp_path))
    assert name == "model-x" and shape.num_kv_heads == 4 and shape.head_dim == 64


def test_commit_of_a_source_copy_without_git_comes_from_redknot_commit(tmp_path, monkeypatch):
    from redknot.headmap.provenance import git_commit

    monkeypatch.delenv("REDKNOT_COMMIT", raising=False)
    assert git_commit(tmp_path) == (None, None)  # not a checkout, nothing set
    monkeypatch.setenv("REDKNOT_COMMIT", "7873c50")
    assert git_commit(tmp_path) == ("7873c50", None)
    # a checkout whose metadata is not the run's (a GPU machine's copy): the named commit wins
    assert git_commit() == ("7873c50", None)
    monkeypatch.delenv("REDKNOT_COMMIT")
    assert git_commit()[0] not in (None, "7873c50")  # this checkout's own
