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
