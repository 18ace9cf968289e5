"""Captures yield to user requests in SGLang's prefill scheduling.

A capture (``redknot.api.capture``) is a registration the server sends itself, after the
request that missed has its answer: a standalone prefill of the missed segments, stored for
later requests. SGLang schedules it like any prompt, first come first served, so a user request
that arrives while captures wait queued behind them: up to two capture batches of 8,192 tokens,
about 0.45 s of prefill on the 8B shape (H100), in front of a prompt that may take 30 ms.

The rule, applied each time the scheduler builds a prefill batch
(``Scheduler.get_new_batch_prefill``; hook in ``redknot.integration.plugin``):

| waiting                          | what the batch may take                                  |
| -------------------------------- | -------------------------------------------------------- |
| no capture                       | as SGLang decides (unchanged)                            |
| captures only                    | the first of them up to one step of prompt tokens (at least one) |
| user requests and captures       | the user requests only; the captures keep their places at the end of the queue, for a later batch |
| captures, a user prompt in flight | nothing from the queue: the next chunk of the user's prompt runs alone; the captures keep their places |

A user prompt longer than SGLang's chunk size (``--chunked-prefill-size``) is prefilled over
several batches; between them it is SGLang's ``chunked_req``, not in the waiting queue. Without
the last row above, captures would fill the rest of its chunks' batches (SGLang adds waiting
requests after the chunk, up to the chunk size) and delay the user's first token by that much
(the replayed RAG prompts of ``benchmarks/trace_replay.py`` are 9-25K tokens, SGLang's chunks
8,192 on the H100 and H200).

So a user request that arrives while captures run waits for one step of captures instead of
every capture queued before it. The step is a fraction (``--redknot-capture-step-fraction``,
default 0.1) of the shortest of the last 8 user prompts, at least 256 tokens and at most
``--redknot-capture-step-tokens`` (default 2,048): a step costs about its tokens' prefill, so
the wait stays a small part of the users' own prefill whatever their length (a 2K-token step,
57 ms on the 8B shape, H200, ``ttft_all_sizes.json``, is most of a 2K chat prompt's first
token, a ninth of a 16K RAG prompt's). Measured on that shape with a fixed step, the captures
of one replayed request delayed the next one's first token 12.7% at 2,048 and 7.3% at 1,024
(``trace_replay_capture_step_h200.json``, docs/reuse.md). What it does not do: a capture already running is not stopped (SGLang
continues a chunked prompt first, and a forward step under way is not interrupted), so a
capture longer than the step still takes steps of SGLang's chunk size; and under load that
never leaves the queue empty, captures wait (they hold no memory while queued; the HTTP side
bounds how many are pending, ``redknot.api.capture.MAX_PENDING``). Every rank of a
tensor-parallel server sees the same queue and takes the same decision. Client registrations
(``POST /redknot/segments``) are user requests here: the client asked for them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redknot import envs
from redknot.api.marks import KEY_CAPTURE, KEY_REGISTER
from redknot.config import RedknotConfig

T = TypeVar("T")

CAPTURE_STEP_TOKENS: int = RedknotConfig.__dataclass_fields__["capture_step_tokens"].default
CAPTURE_STEP_FRACTION: float = RedknotConfig.__dataclass_fields__["capture_step_fraction"].default
MIN_STEP_TOKENS = 256  # about one automatic chunk: a smaller step would cost more than it saves
RECENT_USERS = 8  # the step follows the shortest of this many latest user prompts


@dataclasses.dataclass
class OrderStats:
    """What the rule did in this scheduler, reported by ``GET /redknot/stats`` under
    ``"capture_order"``."""

    batches_for_users: int = 0  # prefill batches built from user requests, captures held back
    capture_steps_cut: int = 0  # prefill batches of captures only, cut at the step's tokens
    captures_held: int = 0  # captures left waiting by those batches (summed over batches)
    chunks_alone: int = 0  # of batches_for_users: a user prompt's next chunk, captures held
    step_tokens: int = CAPTURE_STEP_TOKENS  # the step the latest captures-only batch was cut at

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


STATS = OrderStats()  # one per scheduler process


class StepRule:
    """How many prompt tokens of captures may start in one batch: ``fraction`` of the shortest
    of the last :data:`RECENT_USERS` user prompts, at least :data:`MIN_STEP_TOKENS`, at most
    ``max_tokens`` (``max_tokens`` alone while no user prompt was seen, or with ``fraction``
    0)."""

    def __init__(self, max_tokens: int, fraction: float):
        self.max_tokens, self.fraction = max_tokens, fraction
        self._recent: collections.OrderedDict[Any, int] = collections.OrderedDict()

    def saw_user(self, key: Any, tokens: int) -> None:
        """A user prompt of ``tokens`` tokens (``key`` identifies it: seen again, it counts
        once)."""
        self._recent[key] = tokens
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT_USERS:
            self._recent.popitem(last=False)

    def tokens(self) -> int:
        if not self.fraction or not self._recent:
            return self.max_tokens
        scaled = round(self.fraction * min(self._recent.values()))
        return max(min(self.max_tokens, MIN_STEP_TOKENS), min(self.max_tokens, scaled))


def step_rule() -> StepRule:
    """This scheduler's :class:`StepRule`, from ``--redknot-capture-step-tokens`` and
    ``--redknot-capture-step-fraction`` (their defaults where no configuration was resolved)."""
    return _rule_of(envs.REDKNOT_RESOLVED_CONFIG.get())


@functools.cache
def _rule_of(text: str | None) -> StepRule:
    if text is None:
        return StepRule(CAPTURE_STEP_TOKENS, CAPTURE_STEP_FRACTION)
    config = RedknotConfig.from_json(text)
    return StepRule(config.capture_step_tokens, config.capture_step_fraction)


def is_capture(req: Any) -> bool:
    """Whether a scheduler ``Req`` is a capture on miss (not a user request)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return (
        isinstance(params, dict)
        and bool(params.get(KEY_REGISTER))
        and bool(params.get(KEY_CAPTURE))
    )


def prompt_tokens(req: Any) -> int:
    return len(getattr(req, "origin_input_ids", ()) or ())


def split_queue(
    queue: Sequence[T],
    capture: Callable[[T], bool],
    size: Callable[[T], int],
    step_tokens: int,
    user_in_flight: bool = False,
) -> tuple[list[T], list[T]]:
    """``(schedulable now, held back)``, both in queue order: with a user request waiting or a
    user prompt's chunks in flight (``user_in_flight``), the captures are held back; with
    captures only, those after the first ``step_tokens`` tokens (the first capture always
    goes)."""
    users = [item for item in queue if not capture(item)]
    if len(users) == len(queue):
        return list(queue), []
    if users or user_in_flight:
        return users, [item for item in queue if capture(item)]
    now, total = [], 0
    for item in queue:
        if now and total + size(item) > step_tokens:
            break
        now.append(item)
        total += size(item)
    return now, list(queue[len(now) :])


def around_get_new_batch_prefill(original, self, *args, **kwargs):
    """SGLang's ``Scheduler.get_new_batch_prefill`` over the queue :func:`split_queue` leaves;
    the held captures are appended back to what the batch left waiting."""
    queue = getattr(self, "waiting_queue", None)
    if not queue:
        return original(self, *args, **kwargs)
    chunked = getattr(self, "chunked_req", None)
    in_flight = chunked is not None and not is_capture(chunked)
    rule = step_rule()
    step = rule.tokens()  # only a batch without users takes it: users of this pass change nothing
    now, held = split_queue(queue, is_capture, prompt_tokens, step, in_flight)
    if now and not is_capture(now[0]):  # the user requests (split_queue never mixes the two)
        for req in now:
            rule.saw_user(getattr(req, "rid", None) or id(req), prompt_tokens(req))
    if not held:
        return original(self, *args, **kwargs)
    self.waiting_queue = now
    try:
        batch = original(self, *args, **kwargs)
    finally:
        self.waiting_queue = list(self.waiting_queue) + held
    if batch is not None:  # SGLang built a batch (None: nothing could be scheduled now)
        if now and is_capture(now[0]):
            STATS.capture_steps_cut += 1
            STATS.step_tokens = step
        else:
            STATS.batches_for_users += 1
            if not now:
                STATS.chunks_alone += 1
        STATS.captures_held += len(held)
    return batch
