"""``benchmarks/ttft.py``'s engine process (``child``) on the CPU, SGLang's engine stood in for:
every point of a dense and a reusing variant is measured and reported, with and without the
profiler's point list (a GPU run is the only other way to reach this code)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ttft
from serving_common import PHASES

from .standin import child_result, model_dir, stand_in_engine


class FakeEngine:
    """Answers ``generate`` at once; counts prompts served with and without reuse as the
    server's stats do, and records profiler starts."""

    profiles: ClassVar[list] = []
    prompts: ClassVar[list] = []  # "marked" / "plain", in the order sent (registrations left out)

    def __init__(self, **kwargs):
        self.kwargs, self.reused, self.recomputed = kwargs, 0, 0

    def generate(self, input_ids, sampling_params):
        if sampling_params.get("max_new_tokens") != 0:
            FakeEngine.prompts.append("marked" if "custom_params" in sampling_params else "plain")
            if "custom_params" in sampling_params:
                self.reused += 1
        return {"meta_info": {}}

    def get_server_info(self):
        segments = {"hits": self.reused, "misses": 0}
        gate = {"served_with_reuse": self.reused, "served_without_reuse": self.recomputed}
        return {"internal_states": [{"redknot_segments": segments, "redknot_reuse_gate": gate}]}

    def start_profile(self, output_dir, **kwargs):
        FakeEngine.profiles.append(Path(output_dir).name)

    def stop_profile(self):
        pass

    def shutdown(self):
        pass


@pytest.mark.parametrize("variant", ["flashinfer", "cacheblend"])
@pytest.mark.parametrize("profile", ["", "1024x2"])
def test_child_measures_every_point(variant, profile, tmp_path, monkeypatch, capsys):
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, FakeEngine)
    FakeEngine.profiles, FakeEngine.prompts = [], []
    argv = ["ttft.py", "--child", variant, "--model", str(model), "--points", "512x2,1024x2",
            "--reps", "2", "--own-recompute"]  # fmt: skip
    if profile:
        argv += ["--profile-dir", str(tmp_path / "prof"), "--profile-points", profile]
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    points = child_result(capsys)["points"]
    assert sorted(points) == ["1024x2", "512x2"]
    for key, row in points.items():
        assert len(row["ttft_samples_s"]) == 2 and row["ttft_s"] >= 0
        if variant == "cacheblend":  # marked prompts, and the engine's own recompute
            assert len(row["own_recompute_samples_s"]) == 2
            assert len(row["own_recompute_paired"]) == 2
            # two more prompts under the profiler: the process's first profile (thrown away)
            # and the point's
            profiled = 2 * (key == profile)
            assert row["served"] == ["reuse"] * (3 + profiled) and row["every_segment_hit"]
    # the throwaway first profile under PROFILE_DIR-warmup/VARIANT, then the point's
    assert FakeEngine.profiles == ([variant, f"{variant}-1024x2"] if profile else [])
    if variant == "cacheblend":  # each rep's pair back to back, every other one recompute first
        pairs = ["marked", "plain", "plain", "marked", "marked", "plain"]  # warm-up, reps 1, 2
        profiled = [["marked"] * 2 * (profile == key) for key in ("512x2", "1024x2")]
        # the server's warm-up prompt, then each point's pairs and profiled prompts
        assert FakeEngine.prompts == ["plain"] + pairs + profiled[0] + pairs + profiled[1]


class UngatedEngine(FakeEngine):
    """A server whose reuse gate decides nothing (``reuse_gate=always``): its counters stay 0."""

    def get_server_info(self):
        info = super().get_server_info()
        info["internal_states"][0]["redknot_reuse_gate"] = {
            "served_with_reuse": 0, "served_without_reuse": 0
        }  # fmt: skip
        return info


def test_points_no_gate_decided_say_nothing_of_how_they_were_served(tmp_path, monkeypatch, capsys):
    """Under ``reuse_gate=always`` no gate counts a prompt: the row has no ``served`` list (an
    empty one would read as none of the prompts reused)."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, UngatedEngine)
    argv = ["ttft.py", "--child", "cacheblend[reuse_gate=always]", "--model", str(model),
            "--points", "512x2", "--reps", "2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    row = child_result(capsys)["points"]["512x2"]
    assert row["every_segment_hit"] and "served" not in row


def test_probe_points_record_the_hosts_speed_around_each_point(tmp_path, monkeypatch, capsys):
    """``--probe-points``: every point has the host probe before and after its prompts (here on
    the CPU), and a run without it has none."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, FakeEngine)
    for probe in (True, False):
        argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points",
                "512x2,1024x2", "--reps", "1"] + ["--probe-points"] * probe  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        ttft.main()
        points = child_result(capsys)["points"]
        for row in points.values():
            if probe:
                assert len(row["host_probe_ms"]) == 2 and all(t > 0 for t in row["host_probe_ms"])
            else:
                assert "host_probe_ms" not in row


def test_a_point_listed_again_is_measured_again_under_its_own_key(tmp_path, monkeypatch, capsys):
    """``--points 512x2,1024x2,512x2``: the repeat is measured later in the same engine, on new
    documents, as ``512x2#2`` (it used to overwrite the first)."""
    assert ttft.point_keys([(512, 2), (1024, 2), (512, 2), (512, 2)]) == [
        "512x2", "1024x2", "512x2#2", "512x2#3"
    ]  # fmt: skip
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, FakeEngine)
    argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points",
            "512x2,1024x2,512x2", "--reps", "2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    points = child_result(capsys)["points"]
    assert list(points) == ["512x2", "1024x2", "512x2#2"]
    for key in ("512x2", "512x2#2"):
        assert points[key]["length"] == 512 and len(points[key]["ttft_samples_s"]) == 2
        assert points[key]["served"] == ["reuse"] * 3  # its own documents, each stored anew


class CollectingEngine(FakeEngine):
    """A scheduler whose collector pauses 1.5 ms in every marked prompt and 0.5 ms in every
    unmarked one (registrations none), reported as a redknot server reports it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pause_ms = 0.0

    def generate(self, input_ids, sampling_params):
        if sampling_params.get("max_new_tokens") != 0:
            self.pause_ms += 1.5 if "custom_params" in sampling_params else 0.5
        return super().generate(input_ids, sampling_params)

    def get_server_info(self):
        info = super().get_server_info()
        gc = {"0": {"collections": 3, "pause_ms": self.pause_ms - 0.25}, "2": {"collections": 1,
              "pause_ms": 0.25}}  # fmt: skip
        info["internal_states"][0]["redknot_process"] = {"gc": gc}
        return info


def test_gc_prompts_give_each_timed_prompt_the_collectors_pauses(tmp_path, monkeypatch, capsys):
    """``--gc-prompts``: the scheduler's collector pauses are read after every prompt, so each
    timed prompt (marked, and its recompute) gets its own; the warm-ups are read, not kept."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, CollectingEngine)
    argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points", "512x2",
            "--reps", "3", "--own-recompute", "--gc-prompts"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    row = child_result(capsys)["points"]["512x2"]
    assert row["gc_pause_ms"] == {"marked": [1.5] * 3, "recompute": [0.5] * 3}
    summary = ttft.summarize({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                              "num_key_value_heads": 2, "intermediate_size": 16},
                             {"cacheblend": {"points": {"512x2": row}}}, reps=3)  # fmt: skip
    assert summary["cacheblend"]["512x2"]["gc_pause_ms_mean"] == {"marked": 1.5, "recompute": 0.5}


class FreezingEngine(FakeEngine):
    """Counts SGLang's ``Engine.freeze_gc`` calls and the prompts sent before each."""

    freezes: ClassVar[list] = []

    def freeze_gc(self):
        FreezingEngine.freezes.append(len(FakeEngine.prompts))


def test_freeze_gc_freezes_each_engine_once_after_its_warm_up(tmp_path, monkeypatch, capsys):
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, FreezingEngine)
    for freeze in (True, False):
        FreezingEngine.freezes, FakeEngine.prompts = [], []
        argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points", "512x2",
                "--reps", "1"] + ["--freeze-gc"] * freeze  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        ttft.main()
        child_result(capsys)
        # after the server's warm-up prompt, before any point's
        assert FreezingEngine.freezes == ([1] if freeze else [])


class TimestampingEngine(FakeEngine):
    """Answers with SGLang's request timestamps (wall clock): a marked prompt's ``prefill``
    phase takes 2 ms more than its recompute's, every other phase the same; records whether
    the engine was started with SGLang's metrics (which give these timestamps)."""

    metrics: ClassVar[list] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        TimestampingEngine.metrics.append(kwargs.get("enable_metrics", False))

    def generate(self, input_ids, sampling_params):
        import time

        answer = super().generate(input_ids, sampling_params)
        marked = "custom_params" in sampling_params
        now = time.time()
        at = {"request_received_ts": now, "api_server_dispatch_finish_ts": now + 0.001,
              "forward_entry_time": now + 0.002,
              "prefill_finished_time": now + (0.007 if marked else 0.005),
              "queue_time": 0.0004 if marked else 0.0001}  # fmt: skip
        answer["meta_info"].update(at)
        return answer


def test_phases_split_each_timed_prompt_and_pair_the_marked_with_its_recompute(
    tmp_path, monkeypatch, capsys
):
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, TimestampingEngine)
    for phases in (True, False):
        TimestampingEngine.metrics = []
        argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points", "512x2",
                "--reps", "3", "--own-recompute"] + ["--phases"] * phases  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        ttft.main()
        row = child_result(capsys)["points"]["512x2"]
        assert TimestampingEngine.metrics == [phases]
        if not phases:
            assert "phases_ms" not in row and "phases_paired_ms" not in row
            continue
        assert set(row["phases_ms"]) == {"marked", "recompute"}
        assert row["phases_ms"]["marked"]["prefill"] == pytest.approx(5.0, abs=1e-3)
        assert row["phases_ms"]["recompute"]["prefill"] == pytest.approx(3.0, abs=1e-3)
        paired = row["phases_paired_ms"]
        assert paired["prefill"] == pytest.approx(2.0, abs=1e-3)
        assert paired["to_forward"] == pytest.approx(0.0, abs=1e-3)
        # the queue's share of to_forward, where SGLang reports it
        assert paired["queue"] == pytest.approx(0.3) and paired["to_queue"] == pytest.approx(-0.3)
        assert set(paired) == set(PHASES) | {"queue", "to_queue"}
        marked = row["phase_samples_ms"]["marked"]
        assert len(marked) == 3 and marked[0]["prefill"] == pytest.approx(5.0, abs=1e-3)
        summary = ttft.summarize({"num_hidden_layers": 2, "hidden_size": 8,
                                  "num_attention_heads": 2, "num_key_value_heads": 2,
                                  "intermediate_size": 16},
                                 {"cacheblend": {"points": {"512x2": row}}}, reps=3)  # fmt: skip
        assert summary["cacheblend"]["512x2"]["phases_paired_ms"] == paired


def test_params_too_times_a_neutral_custom_params_prompt_next_to_each_pair(
    tmp_path, monkeypatch, capsys
):
    """``--params-too``: each rep also sends fresh tokens carrying a neutral ``custom_params``,
    right before the marked prompt; its phases are paired with the marked prompt's."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, TimestampingEngine)
    FakeEngine.prompts = []
    argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points", "512x2",
            "--reps", "2", "--own-recompute", "--phases", "--params-too"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    row = child_result(capsys)["points"]["512x2"]
    # after the server's warm-up: rep 0 (warm-up) and 2 marked first, rep 1 its recompute first;
    # the neutral prompt carries custom_params (counted "marked" by the fake engine)
    sent = FakeEngine.prompts[1:]
    params_first, recompute_first = ["marked", "marked", "plain"], ["plain", "marked", "marked"]
    assert sent == params_first + recompute_first + params_first
    assert len(row["params_samples_s"]) == 2 and len(row["params_paired"]) == 2
    assert set(row["phases_ms"]) == {"marked", "recompute", "params"}
    # the neutral prompt's prefill is the marked one's here (the fake engine times any
    # custom_params alike): the marked minus params phase is 0, against its recompute 2 ms
    assert row["phases_paired_params_ms"]["prefill"] == pytest.approx(0.0, abs=1e-3)
    assert row["phases_paired_ms"]["prefill"] == pytest.approx(2.0, abs=1e-3)


def test_params_too_needs_own_recompute(tmp_path, monkeypatch, capsys):
    model = model_dir(tmp_path, {"vocab_size": 1000})
    argv = ["ttft.py", "--model", str(model), "--points", "512x2", "--params-too"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        ttft.main()
    assert "--own-recompute" in capsys.readouterr().err


class GapEngine(TimestampingEngine):
    """Records, for every prompt (registrations left out), how long after the engine's last
    answer it arrived; a prompt that arrives within ``BUSY`` s of an answer reports 5 ms more
    ``to_forward`` than one that arrives later (the scheduler still working on the answer)."""

    BUSY = 0.008
    gaps: ClassVar[list] = []
    last: ClassVar[list] = []

    def generate(self, input_ids, sampling_params):
        import time

        now = time.perf_counter()
        gap = now - GapEngine.last[-1] if GapEngine.last else None
        answer = super().generate(input_ids, sampling_params)
        if sampling_params.get("max_new_tokens") != 0:
            GapEngine.gaps.append(gap)
            if gap is not None and gap < GapEngine.BUSY:
                at = answer["meta_info"]
                at["forward_entry_time"] += 0.005
                at["prefill_finished_time"] += 0.005
        GapEngine.last.append(time.perf_counter())
        return answer

    def get_server_info(self):
        import time

        info = super().get_server_info()
        GapEngine.last.append(time.perf_counter())
        return info


def test_every_timed_prompt_is_sent_settle_ms_after_the_engines_last_answer(
    tmp_path, monkeypatch, capsys
):
    """A fixed gap after each answer for the marked prompts and their recomputes alike (the
    scheduler's work after an answer would otherwise fall on whichever prompt follows at once)."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, GapEngine)
    GapEngine.gaps, GapEngine.last = [], []
    argv = ["ttft.py", "--child", "cacheblend", "--model", str(model), "--points", "512x2",
            "--reps", "3", "--own-recompute", "--params-too", "--settle-ms", "30"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    child_result(capsys)
    timed = GapEngine.gaps[1:]  # after the server's warm-up request
    assert len(timed) == 4 * 3  # reps 0-3, three prompts each
    assert all(gap >= 0.030 for gap in timed), timed


def test_back_to_back_pairs_time_the_wait_after_an_answer(tmp_path, monkeypatch, capsys):
    """``--back-to-back N``: after the reps, N pairs of fresh prompts, the first sent
    ``--settle-ms`` after an answer, the second at once; a scheduler busy for a while after
    each answer shows as the second's longer wait before the queue."""
    model = model_dir(tmp_path, {"vocab_size": 1000})
    stand_in_engine(monkeypatch, tmp_path, GapEngine)
    GapEngine.gaps, GapEngine.last = [], []
    argv = ["ttft.py", "--child", "flashinfer", "--model", str(model), "--points", "512x2",
            "--reps", "2", "--phases", "--settle-ms", "20", "--back-to-back", "3"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ttft.main()
    row = child_result(capsys)["points"]["512x2"]
    back = row["back_to_back"]
    assert back["pairs"] == 3
    # settled: 1 ms to_forward, 0.1 ms of it queued; at once: 5 ms more before the queue
    assert back["to_queue_ms"]["settled"] == pytest.approx(0.9, abs=1e-3)
    assert back["to_queue_ms"]["back_to_back"] == pytest.approx(5.9, abs=1e-3)
    pairs = GapEngine.gaps[-6:]
    assert all(gap >= 0.020 for gap in pairs[0::2]) and all(g < 0.008 for g in pairs[1::2])
    assert "extra_ms" in back and back["settled_ttft_s"] > 0 and back["back_to_back_ttft_s"] > 0
    summary = ttft.summarize({"num_hidden_layers": 2, "hidden_size": 8,
                              "num_attention_heads": 2, "num_key_value_heads": 2,
                              "intermediate_size": 16},
                             {"flashinfer": {"points": {"512x2": row}}}, reps=2)  # fmt: skip
    assert summary["flashinfer"]["512x2"]["back_to_back"] == back
