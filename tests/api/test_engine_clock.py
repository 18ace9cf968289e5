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
