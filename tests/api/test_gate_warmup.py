"""The reuse gate's startup calibration on the HTTP side (``redknot.api.gate_warmup``): added
to SGLang's custom warmups, it sends the gate's plan one prompt at a time through the
tokenizer manager, and the scheduler's gate then decides with what it measured."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest

from redknot.api import control, gate_warmup
from redknot.costmodel.measured import TimedForward
from redknot.costmodel.model import PromptWork
from tests.costmodel.test_calibration import SMOLLM2, timed_gate


class CalibratedServer:
    """A tokenizer manager whose scheduler holds a real reuse gate (SmolLM2's EPIC on the H200
    record) and runs each prompt as one recompute forward timed at ``ratio`` of the record,
    as redknot's forward hook times it; records every request and how many ran at once."""

    def __init__(
        self,
        ratio: float,
        context_len: int = 8192,
        chunk: int = 8192,
        max_req_input_len: int | None = None,
    ):
        self.gate, self.clock = timed_gate(SMOLLM2, "epic", "NVIDIA H200", chunk)
        self.ratio = ratio
        self.model_config = types.SimpleNamespace(vocab_size=49152)
        self.server_args = types.SimpleNamespace(dp_size=1)
        cache = types.SimpleNamespace(
            segments=types.SimpleNamespace(enabled=True),
            pool=types.SimpleNamespace(reuse_gate=self.gate),
        )
        scheduler = types.SimpleNamespace(
            tree_cache=cache,
            model_config=types.SimpleNamespace(context_len=context_len),
            server_args=types.SimpleNamespace(chunked_prefill_size=chunk),
        )
        # SGLang's scheduler refuses prompts of max_req_input_len tokens and more
        self.refuses_from = max_req_input_len or context_len
        if max_req_input_len is not None:
            scheduler.max_req_input_len = self.max_req_input_len = max_req_input_len
        self.received, self.running, self.most_at_once = [], 0, 0

        async def communicator(req):
            return [control.handle(scheduler, req)]

        self.redknot_segments_communicator = communicator

    async def generate_request(self, obj, request=None):
        self.received.append(obj)
        if len(obj.input_ids) >= self.refuses_from:  # as SGLang's validate_input_length
            raise ValueError(
                f"Input length ({len(obj.input_ids)} tokens) exceeds the maximum allowed "
                f"length ({self.refuses_from} tokens)."
            )
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        await asyncio.sleep(0)  # another request could start here if the caller let it
        n = len(obj.input_ids)
        forward = TimedForward("recompute", (PromptWork(n, 0),), n)
        begin = self.gate.timer.start()
        self.clock.now += self.ratio * self.gate.predict(forward)
        self.gate.timer.finish(begin, forward)
        self.clock.reach_all()
        self.gate.timer.harvest(warm=True)  # as after a prefill batch's answers
        self.running -= 1
        yield {"meta_info": {"id": "x"}}


def test_the_calibration_sends_the_plan_and_the_gate_then_recomputes(caplog):
    """SmolLM2's 512 x 4 prompt on the H200 record: reused before, recomputed after the
    startup calibration measured recomputing at 10.5 / 22.4 of the record; the prompts are the
    plan's, one at a time, random ids within the vocabulary, one output token, no markup, the
    same at every start; the log says what was measured."""
    server = CalibratedServer(ratio=10.5 / 22.4)
    work = PromptWork(577, 0, tuple((1 + i * 128, 128) for i in range(4)))
    assert server.gate.decide(work).reuse
    plan = server.gate.calibration_plan(8191)
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", server))
    assert [len(r.input_ids) for r in server.received] == [n for n, k in plan for _ in range(k)]
    assert server.most_at_once == 1
    for r in server.received:
        assert all(0 <= t < 49152 for t in r.input_ids)
        assert r.sampling_params == {"max_new_tokens": 1, "temperature": 0.0}
        assert not getattr(r, "custom_params", None) and r.text is None
    assert not server.gate.decide(work).reuse
    assert "reuse gate calibrated" in caplog.text and "x0.47-x0.47" in caplog.text
    # at 0.47 of the record no hit can pay at any length: the log says markup will be inert
    assert "segment markup will be inert" in caplog.text
    caplog.clear()
    again = CalibratedServer(ratio=1.0)
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", again))
    assert [r.input_ids for r in again.received] == [r.input_ids for r in server.received]
    assert "reuse gate calibrated" in caplog.text and "inert" not in caplog.text


def test_a_calibration_that_fails_or_keeps_nothing_says_so_and_the_server_comes_up(caplog):
    failing = CalibratedServer(ratio=1.0)
    failing.redknot_segments_communicator = None  # no control path
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", failing))
    assert "startup calibration failed" in caplog.text and not failing.received
    caplog.clear()
    stalls = CalibratedServer(ratio=100.0)  # every forward out of range: none kept
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", stalls))
    assert stalls.received and "no recompute ratio was kept" in caplog.text
    assert stalls.gate.decide(PromptWork(577, 0, ((1, 512),))).reuse  # the record decides


def test_the_warmup_is_added_to_sglangs_and_runs_through_it(sglang_plugins, model_dir, http_app):
    """Set up through SGLang's own HTTP server setup (the session's app), the server's
    ``--warmups`` name it once and SGLang's registry runs it; ``--skip-server-warmup``, several
    data-parallel ranks or a disaggregated server leave it out, and say why."""
    from sglang.srt.entrypoints import warmup

    from tests.api.cpu_server import make_server_args

    assert warmup._warmup_registry[gate_warmup.WARMUP_NAME] is gate_warmup.calibrate
    args = make_server_args(model_dir)
    gate_warmup.install(args)
    gate_warmup.install(args)
    assert args.warmups == gate_warmup.WARMUP_NAME
    server = CalibratedServer(ratio=0.5)
    asyncio.run(warmup.execute_warmups("null", args.warmups.split(","), server))
    assert server.received and server.most_at_once == 1
    for attr, value, said in (
        ("skip_server_warmup", True, "--skip-server-warmup"),
        ("dp_size", 2, "--dp-size 2"),
        ("disaggregation_mode", "prefill", "disaggregated"),
    ):
        ns = types.SimpleNamespace(skip_server_warmup=False, disaggregation_mode="null")
        setattr(ns, attr, value)
        assert said in gate_warmup.skip_reason(ns)


@pytest.mark.parametrize("given", [None, "voice_chat"])
def test_a_users_own_warmups_are_kept(sglang_plugins, model_dir, given, caplog):
    from tests.api.cpu_server import make_server_args

    args = make_server_args(model_dir)
    if given:
        args.override("test", warmups=given)
    gate_warmup.install(args)
    expected = [given] if given else []
    assert args.warmups.split(",") == [*expected, gate_warmup.WARMUP_NAME]
    skip = make_server_args(model_dir)
    skip.override("test", skip_server_warmup=True)
    logging.getLogger().addHandler(caplog.handler)  # SGLang's argument setup resets the root's
    with caplog.at_level(logging.INFO):
        gate_warmup.install(skip)
    assert (
        skip.warmups is None and "not calibrated at startup (--skip-server-warmup)" in caplog.text
    )


def test_the_calibration_stays_below_the_longest_prompt_sglang_takes(caplog):
    """SGLang refuses prompts of ``max_req_input_len`` tokens and more, a few below the context
    (2170 of 2176 on an H200 run, where the plan's last size, 2175 tokens, was refused and the
    calibration was said to have failed): the plan stops below it, and a refused prompt costs
    only its own size."""
    server = CalibratedServer(ratio=0.5, context_len=2176, max_req_input_len=2170)
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", server))
    sizes = {len(r.input_ids) for r in server.received}
    assert max(sizes) == 2169 and "refused" not in caplog.text
    assert "reuse gate calibrated" in caplog.text
    # a scheduler that does not say its limit: the plan reaches the context, SGLang refuses
    # the longest, and the rest is measured
    blind = CalibratedServer(ratio=0.5, context_len=2176)
    blind.refuses_from = 2170
    caplog.clear()
    with caplog.at_level(logging.INFO):
        asyncio.run(gate_warmup.calibrate("null", blind))
    assert "prompts refused (first: 2175 tokens" in caplog.text
    assert "reuse gate calibrated" in caplog.text and "failed" not in caplog.text
