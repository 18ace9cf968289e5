"""``benchmarks/ttft_side_by_side.py`` against small HTTP servers that answer like SGLang's
``/generate``: servers take turns, registrations go to redknot servers only, a server that
refuses registrations is measured unmarked, and the figures are the servers' own."""

from __future__ import annotations

import json
import sys
import threading
import time
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ttft_side_by_side as sbs

from redknot.api.generate import reject_reserved
from redknot.api.marks import SegmentMarkError


class FakeServer:
    """Answers ``/generate`` after ``delay`` seconds, and registrations at ``/redknot/segments``
    when it ``stores`` them (else 400, as a server without a segment region); ``reuse``: whether
    a marked prompt reports reused tokens. Like redknot's server, it refuses (400) a request
    that sets redknot's reserved ``custom_params`` keys itself."""

    def __init__(self, delay: float, stores: bool, reuse: bool, log: list):
        self.delay, self.stores, self.reuse, self.log = delay, stores, reuse, log
        self.marked_extra = 0.0  # seconds more for a marked prompt
        self.stacks: list = []  # with_stack of each /start_profile
        self.gaps: list = []  # per prompt: seconds since this server's last answer (None: first)
        self.answered: float | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # only a server that reuses has a gate to report
                if self.path != "/server_info" or fake.reuse:
                    return self.answer(404, b"")
                state = {"redknot_reuse_gate": {"served_without_reuse": len(fake.gaps)}}
                self.answer(200, json.dumps({"internal_states": [state]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                try:
                    reject_reserved(body)
                except SegmentMarkError as e:
                    fake.log.append((fake, "refused", False))
                    return self.answer(400, str(e).encode())
                if self.path in ("/start_profile", "/stop_profile"):
                    fake.log.append((fake, self.path, body.get("output_dir")))
                    if self.path == "/start_profile":
                        fake.stacks.append(body.get("with_stack"))
                    return self.answer(200, b"ok")
                if self.path == "/redknot/segments":
                    fake.log.append((fake, "register", True))
                    if not fake.stores:
                        return self.answer(400, b"no segment region")
                    return self.answer(200, json.dumps({"state": "ready"}).encode())
                marked = bool(body.get("redknot_segments"))
                params = (body.get("sampling_params") or {}).get("custom_params")
                fake.log.append((fake, "prompt", "params" if params else marked))
                now = time.perf_counter()
                fake.gaps.append(None if fake.answered is None else now - fake.answered)
                received = time.time()  # SGLang's --enable-metrics timestamps, as it names them
                time.sleep(fake.delay + (fake.marked_extra if marked else 0.0))
                meta = {
                    "request_received_ts": received,
                    "api_server_dispatch_finish_ts": received + 0.001,
                    "forward_entry_time": received + 0.002,
                    "prefill_finished_time": time.time(),
                }
                if marked:
                    reused = 10 if fake.reuse else 0
                    gate = None if fake.reuse else {"decision": "recompute", "reason": "slower"}
                    meta["redknot_reuse"] = [{"reused_tokens": reused, "gate": gate}]
                self.send_response(200)
                self.end_headers()
                chunk = {"output_ids": [1], "meta_info": meta}
                if body.get("stream"):
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.wfile.write(json.dumps(chunk).encode())
                self.wfile.flush()
                fake.answered = time.perf_counter()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def servers():
    log: list = []
    made = {
        "flashinfer": FakeServer(0.04, stores=False, reuse=False, log=log),
        "cacheblend": FakeServer(0.01, stores=True, reuse=False, log=log),
        "epic": FakeServer(0.02, stores=True, reuse=True, log=log),
        "plain": FakeServer(0.02, stores=False, reuse=False, log=log),
    }
    yield made, log
    for server in made.values():
        server.httpd.shutdown()


def test_servers_take_turns_and_are_compared_round_by_round(servers):
    made, log = servers
    urls = {name: s.url for name, s in made.items()}
    args = Namespace(points="64x2", rounds=4, question=4)
    rows = sbs.measure(urls, args, vocab=1000)["64x2"]
    names = {s: n for n, s in made.items()}
    registered = [names[s] for s, what, _ in log if what == "register"]
    assert "flashinfer" not in registered and registered.count("cacheblend") == 2
    assert registered.count("plain") == 1  # refused once, then measured unmarked
    prompts = [(names[s], marked) for s, what, marked in log if what == "prompt"]
    assert len(prompts) == 4 * 5  # every server, the warm-up round and 4 measured ones
    assert not [x for x in log if x[1] == "refused"]  # the public API only
    firsts = [prompts[4 * r][0] for r in range(5)]
    assert firsts == ["flashinfer", "cacheblend", "epic", "plain", "flashinfer"]  # rotating
    assert all(marked == (n in ("cacheblend", "epic")) for n, marked in prompts)
    assert "registration refused" in rows["plain"]["unmarked"]
    assert rows["cacheblend"]["gate"] == {"recompute": 4}
    assert rows["cacheblend"]["gate_reasons"] == ["slower"] * 4  # each sample's, as reported
    assert "gate_reasons" not in rows["epic"]
    # each marked server's gate as /server_info says it after the point (none: not answered)
    assert rows["cacheblend"]["gate_state"] == {"served_without_reuse": 5}
    assert rows["epic"]["gate_state"] is None and "gate_state" not in rows["flashinfer"]
    assert rows["epic"]["gate"] == {"reuse": 4} and rows["flashinfer"]["gate"] == {"none": 4}
    assert len(rows["epic"]["samples"]) == 4
    assert rows["flashinfer"]["paired_speedup"] == 1.0
    assert 2.0 < rows["cacheblend"]["paired_speedup"] < 5.0  # 40 ms against 10 ms
    assert 1.2 < rows["epic"]["speedup_vs_flashinfer"] < 2.5


def test_unmarked_rows_and_profiled_prompts(servers, tmp_path):
    made, log = servers
    made["cacheblend"].marked_extra = 0.01  # a marked prompt twice as long as unmarked
    urls = {name: made[name].url for name in ("flashinfer", "cacheblend", "plain")}
    args = Namespace(
        points="32x2,64x2", rounds=2, question=2, unmarked_too=True, params_too=True,
        profile_dir=str(tmp_path), profile_points="64x2", profile_requests=2,
    )  # fmt: skip
    out = sbs.measure(urls, args, vocab=1000)
    names = {s: n for n, s in made.items()}
    # a server that refused registrations has no marked row, so no unmarked one either
    assert sorted(out["32x2"]) == [
        "cacheblend", "cacheblend-params", "cacheblend-unmarked", "flashinfer", "plain"
    ]  # fmt: skip
    row = out["32x2"]["cacheblend-unmarked"]
    assert row["gate"] == {"none": 2} and len(row["samples"]) == 2
    # the marked row against its own server unmarked, round by round: 10 ms against 20 ms
    assert 0.35 < out["32x2"]["cacheblend"]["over_unmarked"] < 0.7
    assert "over_unmarked" not in row and "over_unmarked" not in out["32x2"]["flashinfer"]
    assert out["32x2"]["cacheblend"]["gate"] == {"recompute": 2}
    assert len(out["32x2"]["cacheblend-params"]["samples"]) == 2
    # the same server answers the three rows: a prompt each a round per point over 3 rounds,
    # then 2 per row of the profiled point under the profiler, and one unmarked prompt under
    # the profiler before those (the server's first profile, discarded)
    prompts = [marked for s, what, marked in log if what == "prompt" and names[s] == "cacheblend"]
    assert prompts.count(True) == 3 + 3 + 2 and prompts.count(False) == 3 + 3 + 2 + 1
    assert prompts.count("params") == 3 + 3 + 2
    profiles = [(names[s], what, where) for s, what, where in log if what.endswith("_profile")]
    starts = [where for _, what, where in profiles if what == "/start_profile"]
    warmups = [str(Path(f"{tmp_path}-warmup", s)) for s in ("flashinfer", "cacheblend", "plain")]
    assert starts[:3] == warmups  # each server's first profile, before any row's
    assert sorted(starts[3:]) == [str(tmp_path / f"{row}-64x2") for row in (
        "cacheblend", "cacheblend-params", "cacheblend-unmarked", "flashinfer", "plain"
    )]  # fmt: skip
    assert [what for _, what, _ in profiles].count("/stop_profile") == 3 + 5
    assert len(out["64x2"]["cacheblend-unmarked"]["profiled_ttft_s"]) == 2
    assert "profiled_ttft_s" not in out["32x2"]["flashinfer"]
    # each row's phases: the server's own timestamps between the client's send and first byte
    for name, delay in (("flashinfer", 0.04), ("cacheblend", 0.01)):
        row = out["32x2"][name]
        phases = row["phases_ms"]
        assert list(phases) == list(sbs.PHASES)
        assert phases["api_dispatch"] == pytest.approx(1.0, abs=0.01)
        assert phases["to_forward"] == pytest.approx(1.0, abs=0.01)
        assert 1e3 * delay - 3 < phases["prefill"] < 1e3 * delay + 15
        assert 0 <= phases["http_in"] < 30 and 0 <= phases["out"] < 30
        assert sum(phases.values()) == pytest.approx(1e3 * row["ttft_s"], abs=15)


def test_phases_need_every_timestamp():
    meta = {"request_received_ts": 1.0, "api_server_dispatch_finish_ts": 1.5}
    assert sbs.phases_of(meta, sent=0.5, ttft=2.0) is None
    meta |= {"forward_entry_time": 2.0, "prefill_finished_time": 2.25}
    assert sbs.phases_of(meta, sent=0.5, ttft=2.0) == {
        "http_in": 0.5, "api_dispatch": 0.5, "to_forward": 0.5, "prefill": 0.25, "out": 0.25,
    }  # fmt: skip


def test_the_baseline_must_be_one_of_the_servers():
    assert sbs.parse_servers("flashinfer=--attention-backend flashinfer;x=--a b") == {
        "flashinfer": ["--attention-backend", "flashinfer"],
        "x": ["--a", "b"],
    }
    with pytest.raises(SystemExit, match="flashinfer"):
        sbs.parse_servers("x=--attention-backend redknot")
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        sbs.parse_servers("flashinfer=--a;nothing")


def test_each_finished_point_is_handed_over_at_once(servers):
    made, _ = servers
    urls = {name: made[name].url for name in ("flashinfer", "cacheblend")}
    seen = []
    args = Namespace(points="32x2,64x2", rounds=1, question=2)
    out = sbs.measure(urls, args, vocab=1000, on_point=lambda r: seen.append(sorted(r)))
    assert seen == [["32x2"], ["32x2", "64x2"]] and sorted(out) == ["32x2", "64x2"]


def test_cores_are_split_into_disjoint_equal_shares():
    client, shares = sbs.split_cores(list(range(15, -1, -1)), 3)
    assert client == [0, 1] and shares == [[2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13]]
    assert sbs.split_cores(list(range(7)), 3) is None  # fewer than two cores a server
    assert sbs.split_cores(list(range(8)), 3)[1] == [[2, 3], [4, 5], [6, 7]]


def test_a_pinned_server_command_runs_on_its_cores_only():
    import os
    import subprocess

    import gpu_machine as gm

    core = min(os.sched_getaffinity(0))
    show = ["-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    out = subprocess.run(
        [sys.executable, "-c", gm.PINNED, str(core), *show],
        check=False,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == f"[{core}]"


@pytest.mark.parametrize("stack", [False, True])
def test_profile_stack_asks_every_profile_for_python_stacks(servers, tmp_path, stack):
    made, _ = servers
    urls = {name: made[name].url for name in ("flashinfer", "cacheblend")}
    args = Namespace(
        points="32x2", rounds=1, question=2, profile_dir=str(tmp_path), profile_points="32x2",
        profile_requests=1, profile_stack=stack,
    )  # fmt: skip
    sbs.measure(urls, args, vocab=1000)
    for name in urls:  # the discarded first profile and the row's
        assert made[name].stacks == [stack, stack]


def test_a_prompt_leaves_settle_ms_after_its_servers_last_answer(servers):
    """Rows of one server that follow each other in a round (marked, then unmarked) are sent
    ``--settle-ms`` apart, not at once: a server still working after its answer would
    otherwise make the second wait."""
    made, _ = servers
    urls = {name: made[name].url for name in ("flashinfer", "cacheblend")}
    args = Namespace(points="32x2", rounds=3, question=2, unmarked_too=True, settle_ms=40)
    sbs.measure(urls, args, vocab=1000)
    gaps = [g for g in made["cacheblend"].gaps if g is not None]
    assert len(gaps) == 2 * 4 - 1  # marked and unmarked, warm-up round and 3 measured
    # the server's own answer is a little later than the client's read of it: 35 of 40 ms
    assert all(g >= 0.035 for g in gaps), gaps


def test_without_a_flashinfer_server_each_server_is_compared_with_itself(servers):
    """With ``--unmarked-too`` a run needs no flashinfer server: every server is marked, and
    its marked row is compared with its own unmarked prompts (``over_unmarked``), which the
    host speed of another server process does not move; without it, a flashinfer server is
    still required."""
    made, _ = servers
    made["cacheblend"].marked_extra = 0.01
    with pytest.raises(SystemExit, match="--unmarked-too"):
        sbs.parse_servers("cacheblend=--attention-backend redknot")
    assert sbs.parse_servers("cacheblend=-x", own_recompute=True) == {"cacheblend": ["-x"]}
    args = Namespace(points="32x2", rounds=3, question=2, unmarked_too=True)
    rows = sbs.measure({"cacheblend": made["cacheblend"].url}, args, vocab=1000)["32x2"]
    assert sorted(rows) == ["cacheblend", "cacheblend-unmarked"]
    assert rows["cacheblend"]["gate"] == {"recompute": 3}  # marked: registered and reported
    assert 0.35 < rows["cacheblend"]["over_unmarked"] < 0.7  # 20 ms marked, 10 ms unmarked
    assert "paired_speedup" not in rows["cacheblend"]
