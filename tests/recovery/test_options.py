"""Recovery options: ranges, overrides, head-map window and sink."""

from __future__ import annotations

import pytest

from redknot.headmap import HeadMap, ModelShape
from redknot.recovery import KNOBS, RecoveryOptions, RecoveryOptionsError


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"window": 0}, "window"),
        ({"sink": -1}, "sink"),
        ({"dense_layers": -2}, "dense_layers"),
        ({"mass_thresh": 1.5}, "mass_thresh"),
        ({"recent_n": 0}, "recent_n"),
        ({"restore_thresh": -0.1}, "restore_thresh"),
        ({"restore_edge": 0}, "restore_edge"),
        ({"local_kv": "stale"}, "local_kv"),
        ({"blend_check_layer": -1}, r"blend_check_layer must be >= 0"),
        ({"blend_ratio": 1.2}, r"blend_ratio must lie in \[0, 1\]"),
        ({"blend_ratio": -0.1}, r"blend_ratio must lie in \[0, 1\]"),
        ({"epic_k": -1}, r"epic_k must be >= 0 tokens"),
        ({"sparseq_boundary": -1}, r"sparseq_boundary must be >= 0"),
        ({"sparseq_k": -5}, r"sparseq_k must be >= 0 tokens"),
        ({"sparseq_block": -1}, r"sparseq_block must be >= 0 tokens"),
        ({"samkv_block": 0}, r"samkv_block must be >= 1"),
        ({"samkv_stable_layers": 0}, r"samkv_stable_layers must be >= 1"),
        ({"samkv_local_blocks": -1}, r"samkv_local_blocks must be >= 0 blocks"),
        ({"samkv_budget": 1.5}, r"samkv_budget must lie in \[0, 1\] or be None"),
        ({"samkv_recompute": "some"}, r"samkv_recompute must be one of selective, anchors"),
        ({"samkv_spread": "row"}, r"samkv_spread must be one of layer, document"),
        ({"samkv_spread": "document"}, r"samkv_spread 'document' shares a budget"),
        ({"samkv_update": "blend"}, r"samkv_update must be one of overwrite, fusion"),
        ({"samkv_block_score": "max"}, r"samkv_block_score must be one of mean, token-max"),
        ({"samkv_outlier_sigma": -1.0}, r"samkv_outlier_sigma must be >= 0"),
    ],
)
def test_out_of_range_options_are_refused(knobs, match):
    with pytest.raises(RecoveryOptionsError, match=match):
        RecoveryOptions(**knobs)


def test_replace_checks_names_and_values():
    opts = RecoveryOptions()
    assert opts.replace(mass_thresh=0.9).mass_thresh == 0.9
    with pytest.raises(RecoveryOptionsError, match="unknown recovery option"):
        opts.replace(dense_layer=3)
    with pytest.raises(RecoveryOptionsError, match="mass_thresh"):
        opts.replace(mass_thresh=2.0)
    assert set(KNOBS) == set(opts.to_json())


def test_window_and_sink_override_the_map():
    hm = HeadMap.every_head_global(ModelShape("LlamaForCausalLM", 2, 2, 4, 16), window=64, sink=4)
    assert RecoveryOptions().head_map(hm) is hm
    moved = RecoveryOptions(window=128, sink=0).head_map(hm)
    assert (moved.window, moved.sink, moved.classes) == (128, 0, hm.classes)


def test_every_policy_reads_known_knobs_and_the_cli_sweeps_each_over_its_own():
    from redknot.eval.cli import build_parser, settings_of
    from redknot.recovery import POLICIES

    for cls in POLICIES.values():
        assert set(cls.knobs) <= set(KNOBS), cls.name
    args = build_parser().parse_args(
        [
            "fidelity",
            "--cases",
            "c.jsonl",
            "--head-map",
            "m.json",
            "--out",
            "o.json",
            "--policies",
            "full,naive,cacheblend,epic,sparsex,redknot+sparseq",
            "--blend-ratio",
            "0.15,0.3",
            "--epic-k",
            "16",
            "--sparseq-boundary",
            "0,5",
            "--dense-layers",
            "4,8",  # read by redknot only, which is not asked for
        ]
    )
    settings = settings_of(args)
    assert [s.label for s in settings] == [
        "full",
        "naive",
        "cacheblend[blend_ratio=0.15]",
        "cacheblend[blend_ratio=0.3]",
        "epic[epic_k=16]",
        "sparsex[sparseq_boundary=0]",
        "sparsex[sparseq_boundary=5]",
        "redknot+sparseq[sparseq_boundary=0]",
        "redknot+sparseq[sparseq_boundary=5]",
    ]
    assert settings[3].options.blend_ratio == 0.3 and settings[3].options.epic_k == 16
    with pytest.raises(RecoveryOptionsError, match="blend_ratio must lie in"):
        args.blend_ratio = [2.0]
        settings_of(args)


def test_samkv_knobs_parse_on_the_command_line():
    from redknot.eval.cli import build_parser, settings_of

    args = build_parser().parse_args(
        ["fidelity", "--cases", "c.jsonl", "--head-map", "m.json", "--out", "o.json",
         "--policies", "samkv", "--samkv-bias", "off,on", "--samkv-budget", "none",
         "--samkv-update", "fusion", "--samkv-block-score", "mean,token-max"]
    )  # fmt: skip
    settings = settings_of(args)
    assert [s.options.samkv_block_score for s in settings[1:]] == ["mean", "token-max"] * 2
    assert [s.options.samkv_bias for s in settings[1:]] == [False, False, True, True]
    assert all(s.options.samkv_budget is None for s in settings[1:])
    assert all(s.options.samkv_update == "fusion" for s in settings[1:])
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["fidelity", "--cases", "c", "--out", "o", "--samkv-bias", "maybe"]
        )
