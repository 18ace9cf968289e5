from __future__ import annotations

import pytest

from redknot.headmap import HeadMapError, ModelShape, reclassify, synthetic_map
from redknot.headmap.ranking import combine_scores, rank_normalize, select_global

from .test_map import SHAPE, scored_map


def test_rank_normalize_orders_and_averages_ties():
    assert rank_normalize([[3.0, 1.0], [2.0, 10.0]]) == [[2 / 3, 0.0], [1 / 3, 1.0]]
    assert rank_normalize([[1.0, 1.0], [5.0, 0.0]]) == [[0.5, 0.5], [1.0, 0.0]]
    assert rank_normalize([[4.0]]) == [[0.5]]


def test_combine_weights_ranks_not_raw_values():
    big = [[1000.0, 0.0]]  # huge scale must not dominate
    small = [[0.0, 0.001]]
    assert combine_scores({"a": big, "b": small}, {"a": 1, "b": 1}) == [[0.5, 0.5]]
    assert combine_scores({"a": big, "b": small}, {"a": 3, "b": 1}) == [[0.75, 0.25]]
    with pytest.raises(HeadMapError, match="unknown scores"):
        combine_scores({"a": big}, {"c": 1})
    with pytest.raises(HeadMapError, match="positive sum"):
        combine_scores({"a": big}, {"a": 0})


def test_select_global_takes_the_top_fraction_with_stable_ties():
    ranking = [[0.9, 0.1, 0.5], [0.5, 0.2, 0.8]]
    classes, thresholds = select_global(ranking, 0.5)
    assert classes == ("GLG", "LLG")
    assert thresholds["num_global"] == 3 and thresholds["lowest_global_score"] == 0.5
    assert thresholds["highest_local_score"] == 0.5  # the tie went to the lower layer
    assert select_global(ranking, 0.0)[0] == ("LLL", "LLL")
    assert select_global(ranking, 1.0)[0] == ("GGG", "GGG")
    with pytest.raises(HeadMapError):
        select_global(ranking, 1.2)


def test_map_from_scores_marks_the_highest_combined_heads():
    hm = scored_map(0.25)
    combined = hm.scores["combined"]
    chosen = {(layer, h) for layer in range(4) for h in range(4) if hm.is_global(layer, h)}
    assert len(chosen) == 4
    lowest_chosen = min(combined[layer][h] for layer, h in chosen)
    assert all(
        combined[layer][h] <= lowest_chosen
        for layer in range(4)
        for h in range(4)
        if (layer, h) not in chosen
    )


def test_reclassify_rethresholds_the_stored_ranking():
    hm = scored_map(0.25)
    wider = reclassify(hm, 0.5)
    assert wider.num_global == 8 and wider.scores == hm.scores
    assert all(
        wider.is_global(layer, h) for layer in range(4) for h in range(4) if hm.is_global(layer, h)
    )
    assert wider.provenance["thresholds"]["derived_from_fraction"] == 0.25
    with pytest.raises(HeadMapError, match="only profiled maps"):
        reclassify(synthetic_map(SHAPE, 0.25), 0.5)


@pytest.mark.parametrize("fraction", [0.0, 0.125, 0.15, 0.5, 1.0])
def test_synthetic_map_fraction_is_spread_over_layers(fraction):
    shape = ModelShape("LlamaForCausalLM", 32, 8, 32, 128)
    hm = synthetic_map(shape, fraction, seed=3)
    assert hm.num_global == round(fraction * 256) and hm.is_synthetic
    per_layer = [row.count("G") for row in hm.classes]
    assert max(per_layer) - min(per_layer) <= 1
