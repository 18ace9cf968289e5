"""The reuse gate's correction by the forward times its own server measures.

A device record (:mod:`redknot.costmodel.record`) holds for the machine it was fitted on. On
other machines of the same GPU, and between engines on one machine, the host-bound extends of
prompts of a few thousand tokens move by 30-70%
(``benchmarks/results/archive/ttft_own_recompute_h100_1a80c47.json``: SparseX's reuse of a 2K x 8
prompt took 40.9, 53.2 and 70.3 ms in three engines on H100s), and the host probe taken at
startup does not follow these moves. Near the break-even the gate then reuses where this
server recomputes faster.

Under ``--redknot-reuse-gate auto`` (the default) the server times every extend forward it runs
(CUDA events read back when reached, never waited for: from the allocation of the request's
slot, where its segments are looked up, for a request's first extend, else from the forward's
start, to the forward's end; ``redknot.integration.plugin``; read back after each prefill
batch's answers are out, and at the next forward or decision) and keeps, per path, the ratio of
the measured time to the record's prediction for that forward:
``reuse`` (every request of the batch reused its hits) and ``recompute`` (none had any). A
decision for a prompt computing ``n`` tokens scales each path's prediction by the median ratio
of that path's recent forwards of ``n / 1.25`` to ``1.25 n`` tokens (:data:`NEAR`), once there
are :data:`MIN_SAMPLES` of them; without those, forwards of ``n / 2`` to ``2 n`` tokens
(:data:`SPAN`) stand in only where they make the path look slower (reuse) or faster
(recompute) than the record, because the ratio moves with size: on an H200, CacheBlend's reuse
measured 0.77 of the record at 2K x 8 made the gate reuse 1K x 8 prompts, which then took 1.2x
their recompute (``ttft_phases_queue_h200.json``). A path without such forwards errs towards
recomputing: an unmeasured reuse is taken as slow as the record or as the measured recompute,
whichever is slower, and an unmeasured recompute as fast as the record or as the measured
reuse, whichever is faster. With neither the record is used as it is. The ratios stay
local in size because the record's errors are not the same at every size. The first forward of
each path in each power-of-two size class is not kept (first-use costs of a new shape).

Each path learns only from forwards it served: a gate that stops reusing at some size gets no
more reuse samples there, so it recomputes where reuse was measured slower, which is the safe
side. Tensor-parallel ranks would each measure their own times and could decide one request
differently, so the correction runs with one rank only (:meth:`ReuseGate.build` says so).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PATHS = ("reuse", "recompute")
WINDOW = 64  # forwards kept per path (the newest)
MIN_SAMPLES = 3  # forwards of similar size before a path's ratio is used
NEAR = 1.25  # a sample measures decisions within this factor of its computed tokens, ...
SPAN = 2.0  # ... and, where there are none, stands in within this one on the safe side only
RATIO_RANGE = (0.25, 8.0)  # ratios outside are dropped (a compile, a stall)
MAX_PENDING = 64  # forwards timed and not yet read back (more: the oldest are dropped)


@dataclass(frozen=True)
class Sample:
    tokens: int  # tokens the forward computed
    ratio: float  # measured / predicted


class MeasuredCorrection:
    """Per path, the recent forwards' measured-to-predicted ratios; thread-safe (the forward may
    run on another thread than the scheduler's decisions)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples = {path: deque(maxlen=window) for path in PATHS}
        self._seen: set[tuple[str, int]] = set()  # (path, size class) with a forward before
        self._lock = threading.Lock()
        self.dropped = 0  # first forwards of a size class, and ratios outside RATIO_RANGE
        # ratios(tokens) since the last sample kept: a decision is on the marked request's way
        # to its prefill, where filtering both windows took ~35 us of host (ForwardTimer.harvest
        # fills this for the sizes it reads back, off that way)
        self._memo: dict[int, tuple[float, float]] = {}
        self._caps: dict[tuple[int, int], tuple[tuple[int, float], ...]] = {}  # caps(), alike

    def add(self, path: str, tokens: int, measured_ms: float, predicted_ms: float) -> None:
        """One forward's time. The first of each path in each size class (a power of two of
        tokens) is dropped: the first forward of a new shape pays first-use costs (kernel
        compiles and plans, the allocator growing) that would otherwise hold a size at
        recomputing for good, since a recomputed size gets no more reuse samples."""
        if predicted_ms <= 0 or tokens <= 0:
            return
        ratio = measured_ms / predicted_ms
        lo, hi = RATIO_RANGE
        size_class = (path, tokens.bit_length())
        with self._lock:
            if size_class not in self._seen or not lo <= ratio <= hi:
                self._seen.add(size_class)
                self.dropped += 1
                return
            self._samples[path].append(Sample(tokens, ratio))
            self._memo.clear()
            self._caps.clear()

    def _ratio(self, path: str, tokens: int) -> float | None:
        """The path's ratio at ``tokens``: the median of its forwards within :data:`NEAR` of
        that size; failing those, of its forwards within :data:`SPAN`, taken only on the side
        that recomputes more (a reuse no faster, a recompute no slower than the record): the
        ratio moves with size (a reuse's fixed host cost weighs more in a smaller prompt), so
        a reuse measured fast at 2K must not make a 1K prompt reuse."""
        samples = self._samples[path]
        near = [s.ratio for s in samples if tokens / NEAR <= s.tokens <= tokens * NEAR]
        if len(near) >= MIN_SAMPLES:
            return statistics.median(near)
        wide = [s.ratio for s in samples if tokens / SPAN <= s.tokens <= tokens * SPAN]
        if len(wide) < MIN_SAMPLES:
            return None
        ratio = statistics.median(wide)
        return max(ratio, 1.0) if path == "reuse" else min(ratio, 1.0)

    def ratios(self, tokens: int) -> tuple[float, float]:
        """``(reuse, recompute)`` factors on the record's predictions for a prompt computing
        ``tokens`` tokens (1.0 each while nothing of that size was measured)."""
        with self._lock:
            known = self._memo.get(tokens)
            if known is None:
                known = self._memo[tokens] = self._ratios(tokens)
        return known

    def _ratios(self, tokens: int) -> tuple[float, float]:
        reuse, plain = self._ratio("reuse", tokens), self._ratio("recompute", tokens)
        if reuse is None and plain is None:
            return 1.0, 1.0
        # a way not measured at this size errs towards recomputing: reuse at least as slow as
        # the record or as recomputing was measured, recomputing no slower than either
        if plain is None:
            return reuse, min(reuse, 1.0)
        if reuse is None:
            return max(plain, 1.0), plain
        return reuse, plain

    def measured(self, path: str, tokens: int) -> float | None:
        """The path's own ratio at ``tokens`` (as :meth:`ratios` finds it before the other
        path stands in), None while too few of its forwards are near that size."""
        with self._lock:
            return self._ratio(path, tokens)

    def caps(self, tokens: int, prompt: int) -> tuple[tuple[int, float], ...]:
        """Where recomputing ``tokens`` has no ratio of its own (:meth:`measured`): each larger
        recompute size measured, at least ``prompt`` tokens (the whole prompt those tokens end,
        a prefix included), with its ratio. Recomputing a prompt takes no longer than
        recomputing a longer one from scratch, so each bounds this size's recompute time from
        above (:meth:`redknot.costmodel.gate.ReuseGate._factors`). Empty where the size has a
        ratio of its own, or no larger size has one."""
        with self._lock:
            key = (tokens, prompt)
            known = self._caps.get(key)
            if known is None:
                known = ()
                if self._ratio("recompute", tokens) is None:
                    sizes = self._sizes("recompute")
                    ratios = ((n, self._ratio("recompute", n)) for n in sizes if n >= prompt)
                    known = tuple((n, r) for n, r in ratios if r is not None)
                self._caps[key] = known
        return known

    def sizes(self, path: str) -> list[int]:
        """The distinct sizes (computed tokens) of the path's kept forwards, ascending: where
        its ratio can change with the size (the edges of their :data:`NEAR` and :data:`SPAN`
        windows)."""
        with self._lock:
            return self._sizes(path)

    def _sizes(self, path: str) -> list[int]:
        return sorted({s.tokens for s in self._samples[path]})

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {path: len(s) for path, s in self._samples.items()}


@dataclass(frozen=True)
class TimedForward:
    """What one timed forward computed: enough to predict it once its time is read back."""

    path: str
    works: tuple  # PromptWork per request
    tokens: int


class ForwardTimer:
    """Times forwards with a pair of markers each and feeds :class:`MeasuredCorrection` when a
    forward's end has been reached. ``clock``: a callable returning a started marker with
    ``query() -> bool`` (reached) and ``elapsed_ms(end)`` (CUDA events on a GPU,
    :func:`cuda_marker`); ``predict(forward) -> ms``: the record's prediction."""

    def __init__(
        self,
        correction: MeasuredCorrection,
        predict: Callable[[TimedForward], float],
        clock: Callable[[], Any],
    ) -> None:
        self.correction, self.predict, self.clock = correction, predict, clock
        self._pending: deque = deque()
        self._harvesting = threading.Lock()  # the forward's thread and the scheduler's both read

    def start(self) -> Any:
        return self.clock()

    def finish(self, begin: Any, forward: TimedForward) -> None:
        self._pending.append((begin, self.clock(), forward))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def harvest(self, *, warm: bool = False) -> int:
        """Read back every finished forward, oldest first; the number read (0 also while another
        thread reads them). ``warm``: then work out the correction's ratios at each read
        forward's size, so that a decision for a prompt of that size finds them (called so
        after a batch's answers are out: ``redknot.integration.plugin``)."""
        if not self._harvesting.acquire(blocking=False):
            return 0
        read = []
        try:
            while self._pending:
                begin, end, forward = self._pending[0]
                if not end.query():
                    break
                self._pending.popleft()
                ms = begin.elapsed_ms(end)
                self.correction.add(forward.path, forward.tokens, ms, self.predict(forward))
                read.append(forward.tokens)
        finally:
            self._harvesting.release()
        if warm:
            for tokens in set(read):
                self.correction.ratios(tokens)
        return len(read)


class _CudaMarker:
    __slots__ = ("event",)

    def __init__(self) -> None:
        import torch

        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def query(self) -> bool:
        return self.event.query()

    def elapsed_ms(self, end: _CudaMarker) -> float:
        return self.event.elapsed_time(end.event)


def cuda_marker() -> _CudaMarker:
    """A CUDA event recorded on the current stream now."""
    return _CudaMarker()
