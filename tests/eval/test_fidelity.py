"""The evaluation loop and the CLI on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from redknot.eval import Case, PolicySetting, write_cases
from redknot.eval.cli import build_parser, main, settings_of
from redknot.eval.compose import compose
from redknot.eval.fidelity import evaluate
from redknot.eval.reference_backend import ReferenceBackend
from redknot.recovery import RecoveryOptions

from .conftest import CharTokenizer, tiny_llama

CASES = [
    Case(
        "rag-1",
        ("the cat sat on the mat. " * 3, "a dog ran in the park. " * 3),
        "\nwho sat? ",
        ("cat",),
        system="read: ",
        between=("", "\n"),
    ),
    Case("needle-2", ("x marks the spot. " * 4,), " where? ", ("spot",)),
]
SETTINGS = [
    PolicySetting("full"),
    PolicySetting("naive"),
    PolicySetting("redknot", RecoveryOptions(dense_layers=1, mass_thresh=0.5, recent_n=4)),
    PolicySetting("redknot", RecoveryOptions(dense_layers=3, restore_thresh=None), "redknot-dense"),
]


def test_compose_marks_segments_where_their_tokens_are(backend):
    c = compose(backend.tokenizer, CASES[0])
    tok = backend.tokenizer
    assert c.prefix_len == len("read: ")
    for (s, e), text in zip(c.segments, CASES[0].segments):
        assert list(c.ids[s:e]) == tok(text)["input_ids"]
    assert c.segments[1][0] == c.segments[0][1] + 1  # "\n" between
    assert len(c.ids) == c.segments[1][1] + len(CASES[0].question)


def test_evaluate_scores_every_setting_against_dense(backend, tmp_path):
    result = evaluate(backend, CASES, SETTINGS, work_dir=tmp_path, log=lambda s: None)
    s = result["summary"]
    assert s["full"]["top1"] == s["full"]["top10"] == 1.0
    assert s["full"]["cosine"] == pytest.approx(1.0)
    assert s["full"]["flops_fraction"] == 1.0 and s["full"]["ffn_fraction"] == 1.0
    assert s["naive"]["ffn_fraction"] == s["naive"]["kv_head_fraction"] == 0.0
    assert 0.0 < s["naive"]["flops_fraction"] < s["redknot"]["flops_fraction"] < 1.0
    # needle-2's segment starts the prompt: an exact-prefix hit, nothing of it is recomputed
    rows = {c["id"]: c["settings"]["redknot-dense"] for c in result["per_case"]}
    assert rows["rag-1"]["ffn_fraction"] == 1.0 and rows["needle-2"]["ffn_fraction"] == 0.0
    assert rows["rag-1"]["kv_head_fraction"] == pytest.approx(0.5)
    assert rows["needle-2"]["kv_head_fraction"] == 0.0
    assert result["cases"]["count"] == 2 and result["cases"]["by_kind"] == {"needle": 1, "rag": 1}
    row = result["per_case"][0]
    assert set(row["settings"]) == {"full", "naive", "redknot", "redknot-dense"}
    assert row["prefix_tokens"] == len("read: ")
    json.dumps(result)  # serialisable
    front = result["pareto"]["top1_vs_flops"]
    costs = [s[label]["flops_fraction"] for label in front]
    assert front and costs == sorted(costs) and min(s[x]["flops_fraction"] for x in s) == costs[0]
    again = evaluate(backend, CASES, SETTINGS, work_dir=tmp_path, log=lambda s: None)
    assert again["cases"]["case_settings_reused_from_work_dir"] == 8
    assert again["summary"] == result["summary"]
    # a grown sweep runs only the new setting, scored against the stored reference
    grown = SETTINGS + [PolicySetting("redknot", RecoveryOptions(dense_layers=0), "r0")]
    more = evaluate(backend, CASES, grown, work_dir=tmp_path, log=lambda s: None)
    assert more["cases"]["case_settings_reused_from_work_dir"] == 8
    fresh = evaluate(backend, CASES, grown, log=lambda s: None)
    for label in ("full", "naive", "r0"):
        assert more["summary"][label] == fresh["summary"][label]


def test_a_bfloat16_reference_is_described_and_keeps_its_own_work(backend, tmp_path):
    """``--dtype bfloat16`` (a server's numerics on the reference path) is recorded, and its
    work is never taken for the float32 run's (the stored work is keyed by the backend)."""
    bf16 = ReferenceBackend(
        tiny_llama().to(torch.bfloat16), CharTokenizer(), backend.head_map, model_name="tiny",
        max_new_tokens=4,
    )  # fmt: skip
    assert backend.describe()["dtype"] == "float32" and bf16.describe()["dtype"] == "bfloat16"
    quiet = {"work_dir": tmp_path, "log": lambda s: None}
    evaluate(backend, CASES[:1], SETTINGS[:2], **quiet)
    ran = evaluate(bf16, CASES[:1], SETTINGS[:2], **quiet)
    assert ran["cases"]["case_settings_reused_from_work_dir"] == 0
    assert ran["summary"]["full"]["top1"] == 1.0


def test_settings_need_the_reference(backend):
    with pytest.raises(ValueError, match="full"):
        evaluate(backend, CASES, SETTINGS[1:], log=lambda s: None)


def _args(*extra):
    return build_parser().parse_args(
        ["fidelity", "--cases", "c.jsonl", "--head-map", "m.json", "--out", "o.json", *extra]
    )


def test_cli_builds_the_sweep():
    labels = [s.label for s in settings_of(_args("--dense-layers", "4,8", "--mass-thresh", "0.5"))]
    assert labels == [
        "full",
        "naive",
        "redknot[dense_layers=4,mass_thresh=0.5]",
        "redknot[dense_layers=8,mass_thresh=0.5]",
    ]
    explicit = settings_of(
        _args(
            "--policies",
            "full,redknot",
            "--recent-n",
            "64",
            "--redknot-settings",
            "dense_layers=30;dense_layers=8,skipped=cached,restore_thresh=off",
        )
    )
    assert [s.options.recent_n for s in explicit[1:]] == [64, 64]
    assert explicit[2].options.skipped == "cached" and explicit[2].options.restore_thresh is None
    assert [s.label for s in settings_of(_args("--policies", "full"))] == ["full"]


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--policies", "full,prophetkv"], "unknown policy 'prophetkv'"),
        (["--mass-thresh", "2"], "mass_thresh must lie in"),
        (["--redknot-settings", "dense=3"], "not knob=value"),
        (["--dense-layers", "4,8", "--redknot-settings", "mass_thresh=0.5"], "several values"),
        (["--auto-mode", "cdc-docs"], "--auto-mode cdc-docs needs --auto-chunks N"),
    ],
)
def test_cli_errors_are_clear(tmp_path, capsys, extra, match):
    cases = tmp_path / "c.jsonl"
    write_cases(CASES, cases)
    argv = ["fidelity", "--cases", str(cases), "--head-map", "m.json", "--out", "o.json"]
    with pytest.raises(SystemExit, match=match):
        main(argv + extra)


def test_cli_reports_a_bad_case_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: missing field"):
        main(["fidelity", "--cases", str(bad), "--head-map", "m.json", "--out", "o.json"])


def _composed(n: int, segments: tuple[tuple[int, int], ...], seed: int = 0):
    import random

    from redknot.eval.compose import ComposedCase

    rng = random.Random(seed)
    return ComposedCase(tuple(rng.randrange(3, 50_000) for _ in range(n)), segments, 10)


def test_auto_chunks_are_the_servers_chunks_inside_a_segment():
    from redknot.api.auto import AutoSegments
    from redknot.api.options import AutoSegmentsOption
    from redknot.eval.compose import auto_chunked

    segments = ((40, 1500), (1510, 2900))
    composed = _composed(3000, segments)
    got = auto_chunked(composed, 64)
    every = AutoSegments(AutoSegmentsOption.parse("cdc", 64)).spans(list(composed.ids))
    inside = [(a, b) for a, b in every if any(s <= a and b <= e for s, e in segments)]
    assert got.ids == composed.ids and got.prefix_len == composed.prefix_len
    assert list(got.segments) == inside and len(inside) >= 20
    assert len(inside) < len(every)  # those across a segment's edge are computed in full
    # the limit: one segment over the whole prompt keeps every chunk
    whole = auto_chunked(_composed(3000, ((0, 3000),)), 64)
    assert list(whole.segments) == every
    assert auto_chunked(_composed(3000, ()), 64).segments == ()


def test_auto_chunks_serve_the_same_prompt_with_chunk_segments(backend):
    """The dense reference is the same prompt either way; the reusing settings see the chunks."""
    case = Case("c", ("the cat sat on the mat. " * 12, "a dog ran in the park. " * 12), "who?",
                ("cat",), system="read: ")  # fmt: skip
    settings = [PolicySetting("full"), PolicySetting("naive")]
    plain = evaluate(backend, [case], settings, log=lambda s: None)
    backend.auto_chunk_tokens = 16
    try:
        chunked = evaluate(backend, [case], settings, log=lambda s: None)
        described = backend.describe()["segments"]
    finally:
        backend.auto_chunk_tokens = None
    assert described.startswith("auto chunks of ~16 tokens")
    row, crow = plain["per_case"][0], chunked["per_case"][0]
    assert row["prompt_tokens"] == crow["prompt_tokens"]
    assert row["settings"]["full"]["output"] == crow["settings"]["full"]["output"]
    assert row["segments"] == 2 and crow["segments"] > 2
    assert crow["segment_tokens"] < row["segment_tokens"]


def test_auto_chunks_are_refused_where_they_mean_nothing(tmp_path):
    cases = tmp_path / "c.jsonl"
    write_cases(CASES, cases)
    argv = ["fidelity", "--cases", str(cases), "--out", "o.json"]
    with pytest.raises(SystemExit, match="--auto-chunks is for --backend reference"):
        main(argv + ["--backend", "server", "--server", "u", "--reference-server", "v",
                     "--auto-chunks", "64"])  # fmt: skip
    with pytest.raises(SystemExit, match="--auto-chunks must be at least 16"):
        main(argv + ["--head-map", "m.json", "--auto-chunks", "8"])


class _CharTokenizer:
    """One token per character (a stand-in tokenizer for composing cases)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}


def _random_docs(n: int, chars: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz ."
    return [f"Doc {seed}-{k}: " + "".join(rng.choice(letters) for _ in range(chars))
            for k in range(n)]  # fmt: skip


@pytest.mark.parametrize("mode", ["cdc-edges", "cdc-docs"])
def test_learned_modes_serve_what_their_store_holds_after_warm_up(mode):
    """``auto_learned``: the same prompt, marked with spans the mode's store holds after the
    case's documents were served beside others (none reaching into the prompt's head, none
    overlapping); nothing before any warm-up. (Whole documents under ``cdc-docs``:
    ``tests/api/test_auto_segments.py``, through the server's capture path.)"""
    from redknot.eval.compose import auto_learned, compose

    tok = _CharTokenizer()
    case = Case("c", tuple(_random_docs(3, 1500, 1)), "\n\nQuestion: which?", ("a",),
                system="Read.\n\n", between=("", "\n\n", "\n\n"))  # fmt: skip
    pool = tuple(_random_docs(6, 1500, 2))
    plain = compose(tok, case)
    got = auto_learned(tok, case, 64, mode, pool)
    assert got.ids == plain.ids and got.prefix_len == plain.prefix_len
    assert got.segment_tokens > 0.5 * plain.segment_tokens
    assert all(a >= plain.prefix_len for a, _ in got.segments)
    assert all(b <= c for (_, b), (c, _) in zip(got.segments, got.segments[1:]))
    assert auto_learned(tok, case, 64, mode, pool, orders=0).segments == ()
    assert got.contexts is None


@pytest.mark.parametrize("mode", ["cdc-edges", "cdc-docs"])
def test_learned_modes_record_what_preceded_a_span_where_it_was_stored(mode):
    """``context_tokens``: the same spans, each with the tokens it was computed after in the
    warm-up prompt that stored it (the K before it, or before the first of a run of spans
    stored together from that prompt, and the run's spans before it), which are not always this
    prompt's (documents change neighbours)."""
    from redknot.eval.compose import auto_learned

    tok = _CharTokenizer()
    case = Case("c", tuple(_random_docs(3, 1500, 1)), "\n\nQuestion: which?", ("a",),
                system="Read.\n\n", between=("", "\n\n", "\n\n"))  # fmt: skip
    pool = tuple(_random_docs(6, 1500, 2))
    alone = auto_learned(tok, case, 64, mode, pool)
    got = auto_learned(tok, case, 64, mode, pool, context_tokens=48)
    assert got.segments == alone.segments
    assert len(got.contexts) == len(got.segments)
    assert all(len(c) >= 48 for c in got.contexts)  # longer: after a run's earlier spans
    assert any(len(c) > 48 for c in got.contexts) and any(len(c) == 48 for c in got.contexts)
    ids = got.ids
    here = [tuple(ids[max(0, a - len(c)) : a]) for (a, _), c in zip(got.segments, got.contexts)]
    assert any(c == h for c, h in zip(got.contexts, here))  # a chunk inside its document
    if mode == "cdc-edges":  # a piece stored where another document preceded it
        assert any(c != h for c, h in zip(got.contexts, here))
