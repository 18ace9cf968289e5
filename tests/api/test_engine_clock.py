"""The stand-in's engine clock (``tests/api/cpu_server.py``): one step at a time, a prefill under
way continues first, and captures on miss wait while a user prompt does, as redknot's scheduler
hook makes SGLang's scheduler do (``redknot.integration.capture_order``)."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.cpu_server import EngineClock


async def _order(captures_yield: bool) -> list[str]:
    clock = EngineClock(us_per_token=10, chunk_tokens=100, captures_yield=captures_yield)
    done: list[str] = []

    async def prompt(name: str, tokens: int, capture: bool) -> None:
        await clock.prefill(tokens, capture=capture)
        done.append(name)

    first = asyncio.ensure_future(prompt("capture-a", 150, True))  # two steps: 100 + 50
    for _ in range(3):  # its first step is under way
        await asyncio.sleep(0)
    rest = [asyncio.ensure_future(prompt("capture-b", 50, True)),
            asyncio.ensure_future(prompt("user", 50, False))]  # fmt: skip
    await asyncio.gather(first, *rest)
    return done


@pytest.mark.parametrize("captures_yield", [True, False])
def test_a_user_prompt_goes_before_waiting_captures(captures_yield):
    done = asyncio.run(_order(captures_yield))
    # the capture under way finishes its prefill first either way (chunked prefill continues);
    # then the user prompt goes first with the hook, in arrival order without it
    if captures_yield:
        assert done == ["capture-a", "user", "capture-b"]
    else:
        assert done == ["capture-a", "capture-b", "user"]


def test_no_capture_joins_the_steps_of_a_user_prompt_under_way():
    """A user prompt longer than a step runs its chunks alone while captures wait (its last
    chunk leaves room that captures would otherwise take), as the scheduler hook does."""

    async def run() -> tuple[list[str], float]:
        clock = EngineClock(us_per_token=2000, chunk_tokens=100)
        done: list[str] = []
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def prompt(name: str, tokens: int, capture: bool) -> None:
            await clock.prefill(tokens, capture=capture)
            done.append(f"{name}@{round(loop.time() - start, 2)}")

        user = asyncio.ensure_future(prompt("user", 150, False))  # steps of 100 + 50 tokens
        for _ in range(3):  # its first step is under way
            await asyncio.sleep(0)
        capture = asyncio.ensure_future(prompt("capture", 50, True))
        await asyncio.gather(user, capture)
        return done

    done = asyncio.run(run())
    # user: 0.2 s + 0.1 s alone, not 0.2 + 0.2 with the capture in its last step
    assert [d.split("@")[0] for d in done] == ["user", "capture"]
    assert float(done[0].split("@")[1]) < 0.35, done


def test_the_exact_prefix_model_hits_whole_blocks_of_served_prompts_only():
    """``exact_prefix``: an earlier served prompt's whole blocks are a later prompt's prefix hit
    (at least one token left to compute); a registration takes none, as on the server."""
    import types

    from redknot.api.marks import SegmentMark, encode_marks, segment_id
    from tests.api.cpu_server import CpuScheduler

    sched = CpuScheduler(exact_prefix=True)
    block = sched.PREFIX_BLOCK
    first = list(range(1, 2 * block + 5))
    assert sched.prefix_of(first) == 0
    params = types.SimpleNamespace(custom_params=None)
    assert sched.serve("a", first, params) == 0
    assert sched.prefix_of(first + [7, 8]) == 2 * block  # the whole blocks only
    assert sched.prefix_of(first[: 2 * block]) == block  # one token left to compute
    assert sched.prefix_of([9] + first) == 0
    assert sched.serve("b", first + [7, 8], params) == 2 * block  # cached_tokens
    mark = SegmentMark(0, len(first), "default", segment_id("default", first))
    reg = types.SimpleNamespace(custom_params=encode_marks([mark], register=True))
    assert sched.serve("c", first, reg) == 0
    assert not CpuScheduler().prefix_of(first)  # off: never a hit
