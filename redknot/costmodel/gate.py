"""The per-request decision to serve a prompt with or without segment reuse.

When a marked request gets its slot (``redknot.segcache.reuse.start``), the scheduler knows its
prompt length, its exact-prefix hit and where its stored segments lie. The gate asks the cost
model (:class:`redknot.costmodel.model.ReuseCostModel`, constants from the device's record,
:mod:`redknot.costmodel.record`) for the predicted extend time with and without reuse; reuse is
served only when it is predicted at most ``1 - margin`` of recomputing. Otherwise the request
drops its segment hits and is computed as the same prompt without reuse: the exact dense
answer, never slower than recomputing by construction. The decision and its reason are logged
per request and counted (``served_without_reuse`` in the segment counters' log line).

The break-even (:meth:`ReuseGate.min_segment_tokens`, :meth:`ReuseGate.break_even_prompt_tokens`)
is what an automatic chunker reads as the shortest chunk worth storing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from redknot.costmodel.host_probe import host_scale
from redknot.costmodel.measured import (
    MIN_SAMPLES,
    NEAR,
    RATIO_RANGE,
    SPAN,
    ForwardTimer,
    MeasuredCorrection,
    TimedForward,
    cuda_marker,
)
from redknot.costmodel.model import ModelCosts, PromptWork, Recovery, ReuseCostModel
from redknot.costmodel.record import record_for

logger = logging.getLogger(__name__)

# Startup calibration (ReuseGate.calibration_plan): prompts of these sizes are recomputed once
# the server is up, before it listens, so that the correction holds this server's recompute
# time where a decision could turn on it. The largest size bounds the startup cost (~2 s for an
# 8B model on an H100); longer prompts are corrected from the forwards they serve.
CALIBRATION_TOKENS = (256, 8192)
CALIBRATION_QUESTION = 64  # tokens of the best-case reusing prompt that are not reused


@dataclass(frozen=True)
class Decision:
    reuse: bool
    reuse_ms: float  # predicted extend time with reuse
    plain_ms: float  # predicted extend time without reuse
    reason: str


class ReuseGate:
    """Decides, per request, whether its segment hits are served (see the module docstring)."""

    def __init__(self, model: ReuseCostModel, source: str = "") -> None:
        self.model, self.source = model, source
        self.served_without_reuse = 0
        self.served_with_reuse = 0
        self.served_inert = 0  # marked requests of an inert server (none looked up)
        self.host_scale = 1.0  # the factor on the record's host constants (host_probe)
        # --redknot-reuse-gate auto: the server's own forward times (redknot.costmodel.measured)
        self.timer: ForwardTimer | None = None

    @classmethod
    def build(
        cls,
        config: Any,
        hf_config: Any,
        layout: Any,
        device_name: str,
        tp_size: int = 1,
        chunk: int | None = None,
        host_probe: Callable[[], float] | None = None,
        clock: Callable[[], Any] | None = None,
    ) -> ReuseGate:
        """From the served ``RedknotConfig``, the model's HF config and the rank's layout; the
        record is ``config.cost_record`` if given, else the device's shipped one, else the
        fallback record (said in the startup log). ``host_probe`` measures this machine's
        :func:`redknot.costmodel.host_probe.probe_ms` (the largest over the ranks); it is
        called only for a record that carries its own probe, whose host constants it then
        scales (:func:`~redknot.costmodel.host_probe.host_scale`). None: not measured, the
        constants as recorded. Under ``--redknot-reuse-gate auto`` (the default) with one
        tensor-parallel rank, ``clock`` (default :func:`~redknot.costmodel.measured.cuda_marker`
        on a GPU; none, nothing timed, without one) times the forwards whose ratios to the
        record correct it (:mod:`redknot.costmodel.measured`)."""
        record, why = record_for(device_name, getattr(config, "cost_record", None))
        factor = 1.0
        if host_probe is not None:
            measured = host_probe() if record.host_probe_ms else None
            factor, said = host_scale(measured, record.host_probe_ms)
            record, why = record.scaled(factor), f"{why}; {said}"
        costs = ModelCosts.of(hf_config, layout, tp_size=tp_size)
        model = ReuseCostModel(costs, Recovery.of(config, layout.num_layers), record, chunk)
        gate = cls(model, why)
        gate.host_scale = factor
        if clock is None and torch.cuda.is_available():
            clock = cuda_marker
        if getattr(config, "reuse_gate", "auto") != "auto":
            why += "; by the record alone (--redknot-reuse-gate record)"
        elif tp_size > 1:
            why += (
                f"; by the record alone under tensor parallelism ({tp_size} ranks would each "
                "measure their own forward times and could decide a request apart)"
            )
        elif clock is None:
            why += "; by the record alone (no GPU to time forwards on)"
        else:
            gate.timer = ForwardTimer(MeasuredCorrection(), gate.predict, clock)
            why += "; corrected by this server's measured forward times"
        gate.source = why
        shortest = gate.min_segment_tokens(8192)
        pays = (
            f"segments of {shortest}+ tokens pay in an 8K prompt"
            if shortest is not None
            else "no segment length pays in an 8K prompt on this model and device, so marked "
            "prompts up to 8K are recomputed"
        )
        logger.info(
            "redknot: reuse gate on (%s; %s): a marked request reuses its segments only when "
            "predicted at most %.0f%% of recomputing; %s",
            model.recovery.describe(), why, 100 * (1 - record.margin), pays,
        )  # fmt: skip
        return gate

    def decide(self, work: PromptWork) -> Decision:
        """Whether the request described by ``work`` is served with its segment hits."""
        if work.reused == 0:
            return Decision(False, 0.0, 0.0, "no stored segment in the computed tokens")
        # one request: model.choose([work]) reduces to this comparison (two predictions)
        reuse_ms = self._reuse_ms(work)
        plain_ms = self._plain_ms(work.computed, work.prefix)  # hits change nothing without reuse
        if self.timer is not None:
            self.timer.harvest()
        r_reuse, r_plain, said = self._factors(work.computed, work.prefix)
        reuse_ms, plain_ms = reuse_ms * r_reuse, plain_ms * r_plain
        said = f"; {said}" if said else ""
        told = (
            f"reuse predicted {reuse_ms:.1f} ms vs {plain_ms:.1f} ms recomputing "
            f"({work.reused} reused of {work.computed} computed tokens, {len(work.segments)} "
            f"segments{said})"
        )
        if reuse_ms <= (1 - self.model.record.margin) * plain_ms:
            self.served_with_reuse += 1
            return Decision(True, reuse_ms, plain_ms, told)
        self.served_without_reuse += 1
        return Decision(False, reuse_ms, plain_ms, told + ": recomputed")

    def hopeless(
        self, prompt_len: int, prefix_len: int = 0, *, measured: bool = True
    ) -> Decision | None:
        """The recompute decision for any request of ``prompt_len`` tokens after an exact-prefix
        hit of ``prefix_len``, when no segment hit can change it: even the cheapest reusing
        extend (:meth:`ReuseCostModel.reuse_floor_ms`) is predicted over ``1 - margin`` of
        recomputing. None when hits might pay (then :meth:`decide` on the request's hits).
        Found without looking a segment up, so a request it answers reads no K/V and its
        marks' ids need no checking. Not counted: the caller counts a request that had hits
        (:meth:`count_recomputed`).

        ``measured`` (with a timer): both sides scaled by the factors :meth:`decide` puts on
        its predictions at this size (the measured correction), so that a size where this
        server measured recomputing faster than the record (its startup calibration, say) is
        answered here as :meth:`decide` would answer any of its hit sets; the floor stays a
        lower bound of every reusing prediction, both scaled alike. Without it, by the record
        alone: :meth:`recomputed_up_to` needs an answer that only grows with the size."""
        computed = prompt_len - prefix_len
        if computed <= 0:
            return None
        floor = self.model.reuse_floor_ms()
        plain_ms = self._plain_ms(computed, prefix_len)
        said = ""
        if measured:
            r_reuse, r_plain, said = self._factors(computed, prefix_len)
            floor, plain_ms = floor * r_reuse, plain_ms * r_plain
            said = f", {said}" if said else ""
        if floor <= (1 - self.model.record.margin) * plain_ms:
            return None
        return Decision(
            False, floor, plain_ms,
            f"reuse takes at least {floor:.1f} ms (its host path alone{said}) vs "
            f"{plain_ms:.1f} ms recomputing {computed} tokens, whatever it hits: recomputed",
        )  # fmt: skip

    def _factors(self, computed: int, prefix: int = 0) -> tuple[float, float, str]:
        """The measured correction's ``(reuse, recompute)`` factors on the record's predictions
        for a prompt computing ``computed`` tokens after an exact-prefix hit of ``prefix``, and
        how a reason says them ("" when there are none: no timer, or nothing measured near that
        size). Where recomputing was not measured near that size, a longer prompt's measured
        recompute time (:meth:`MeasuredCorrection.caps`) bounds it: a server whose startup
        calibration measured recomputing 256 tokens at half the record's time is not taken to
        recompute 100 tokens slower than that."""
        if self.timer is None:
            return 1.0, 1.0, ""
        correction = self.timer.correction
        r_reuse, r_plain = correction.ratios(computed)
        caps = correction.caps(computed, computed + prefix)
        if caps:
            plain = self._plain_ms(computed, prefix)
            cap = min(r * self._plain_ms(n, 0) for n, r in caps)
            if plain > 0 and cap < r_plain * plain:
                r_plain = cap / plain
        if (r_reuse, r_plain) == (1.0, 1.0):
            return 1.0, 1.0, ""
        return r_reuse, r_plain, f"the record's x{r_reuse:.2f} and x{r_plain:.2f} as measured here"

    def recomputed_up_to(self, limit: int) -> int:
        """The longest prompt, at most ``limit`` tokens, that :meth:`hopeless` recomputes from
        scratch by the record alone (0: none); every shorter prompt is recomputed too, whatever
        its exact-prefix hit (recomputing fewer tokens after a prefix costs no more than the
        whole prompt). The measured factors differ by size, so with them no shorter prompt
        would be sure to follow: what is built on this (markup made inert for a server's life,
        the calibration's first size) keeps to the record."""
        lo, hi = 0, limit  # hopeless(lo) holds (or lo == 0); find the last n that holds
        if self.hopeless(hi, measured=False) is not None:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.hopeless(mid, measured=False) is not None else (lo, mid)
        return lo

    def recomputes_all(self, limit: int) -> str | None:
        """Why no request of up to ``limit`` tokens is served faster by reusing what it hits
        than by recomputing it (the ground for making markup inert for the server's life:
        ``SegmentApi.learn_gate``), or None when some hit set might be.

        By the record alone when :meth:`recomputed_up_to` reaches ``limit``. Otherwise by this
        server's measured forwards (its startup calibration), only while no reuse was measured
        anywhere (an unmeasured reuse is taken as slow as the record's floor or slower) and
        :meth:`hopeless` holds, measured, for a prompt of every length up to ``limit`` from
        scratch. A request after an exact-prefix hit recomputes no more than its whole prompt
        from scratch, so the same floor is over its recompute too. The lengths are checked at
        finitely many points: the factors on the record change with the length only at the
        edges of the measured forwards' windows (``NEAR``, ``SPAN``) and at the measured sizes
        (:meth:`MeasuredCorrection.caps`); between two edges the floor is one constant and the
        corrected recompute time does not fall as the length grows, so the last length before
        each edge is the hardest."""
        if limit <= 0:
            return None
        if self.recomputed_up_to(limit) >= limit:
            return (
                f"the reuse gate recomputes every prompt this model takes (up to {limit} tokens) "
                "whatever it hits, on this device"
            )
        if self.timer is None:
            return None
        self.timer.harvest()
        correction = self.timer.correction
        sizes = correction.sizes("recompute")
        if not sizes or correction.counts()["reuse"]:
            return None
        edges = {limit}
        for s in sizes:  # the last length inside each window, the last before it, the size
            for e in (
                s,
                *(int(s * w) for w in (NEAR, SPAN)),
                *(-(-s // w) - 1 for w in (NEAR, SPAN)),
            ):
                edges.update((int(e) - 1, int(e), int(e) + 1))
        for n in sorted(e for e in edges if 0 < e <= limit):
            if self.hopeless(n, measured=True) is None:
                return None
        return (
            f"no segment hit can make a prompt of up to {limit} tokens faster to serve than "
            f"recomputing it, by this server's measured recompute times ({len(sizes)} sizes) "
            "against the cheapest reuse"
        )

    def calibration_plan(self, limit: int) -> list[tuple[int, int]]:
        """``(prompt tokens, how many)`` prompts to recompute at startup (no stored segment, no
        prefix) so that the measured correction holds this server's recompute time before the
        first marked request: none without a timer (``--redknot-reuse-gate record``, tensor
        parallelism, no GPU). The sizes step by ``NEAR ** 2`` from the shortest prompt a hit
        could make worth reusing up to ``min(limit, CALIBRATION_TOKENS[1])`` (the last step
        shorter), so that every prompt between them is within ``NEAR`` of one (its ratio then
        comes from those forwards, not from wider ones). A size is kept only where a measured
        recompute could turn a decision: where the best-case reuse (all but a short question
        reused, in one segment), at that size or at ``size / NEAR``, would be recomputed if
        recomputing measured the lowest ratio the correction keeps (``RATIO_RANGE[0]`` of the
        record). Each size gets ``MIN_SAMPLES`` forwards, one more where it opens a size class
        (whose first forward the correction drops).

        Why: the record can be far off for a model it was not fitted on. On SmolLM2's shape the
        H200 record predicts recomputing 577 tokens in 22.4 ms where a server on SGLang's
        prefill graph took 10.5, and the gate reused such prompts at 1.75-1.9x their recompute
        until served recomputes corrected it (docs/performance.md)."""
        if self.timer is None:
            return []
        lo, hi = CALIBRATION_TOKENS
        hi = min(limit, hi)
        n = max(lo, self.recomputed_up_to(hi) + 1)
        fastest = (1 - self.model.record.margin) * RATIO_RANGE[0]  # of the record's recompute
        plan, classes = [], set()

        def turns(m: int) -> bool:
            best = self._reuse_ms(work_of(m, 0, [(0, m - CALIBRATION_QUESTION)]))
            return best > fastest * self._plain_ms(m, 0)

        while n <= hi:
            # a size measures the prompts within NEAR of it: kept if its lower edge may turn
            if turns(n) or turns(max(lo, int(n / NEAR))):
                opens = n.bit_length() not in classes
                classes.add(n.bit_length())
                plan.append((n, MIN_SAMPLES + opens))
            if n == hi:
                break
            n = min(hi, max(n + 1, int(n * NEAR * NEAR)))  # the last step ends at hi
        return plan

    def count_recomputed(self) -> None:
        """A request with segment hits that :meth:`hopeless` answered."""
        self.served_without_reuse += 1

    def count_ignored(self) -> None:
        """A request :meth:`decide` reused, served without reuse after all (its marks turned
        out invalid)."""
        self.served_with_reuse -= 1
        self.served_without_reuse += 1

    def count_inert(self) -> None:
        """A marked request of a server whose markup is inert (its marks not looked up)."""
        self.served_inert += 1

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one gate per scheduler, kept for its life)
    def predict(self, forward: TimedForward) -> float:
        """The record's time for a timed forward (:mod:`redknot.costmodel.measured`; ~0.3 ms
        of host each, so repeated shapes are remembered)."""
        works = list(forward.works)
        return self.model.batch_ms(works, [forward.path == "reuse"] * len(works))

    def describe(self, forward_batch: Any, pool: Any) -> TimedForward | None:
        """What an extend forward computes, for timing it: ``reuse`` when every request reuses
        its hits and the forward ends every prompt, ``recompute`` when none reads a segment;
        None for any other forward (decode, mixed batches, a reusing prompt in chunks, a
        forward that also captures a segment), which is not timed."""
        if forward_batch.forward_mode.name != "EXTEND":
            return None
        slots = getattr(forward_batch, "redknot_req_slots", None)
        prefix, lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        if slots is None or prefix is None or lens is None or len(slots) != len(lens):
            return None
        works, reused = [], 0
        for rpi, p, e in zip(slots, prefix, lens):
            if pool.capture_jobs.get(rpi) is not None:
                return None
            uses = pool.segment_reads.get(rpi)
            if not uses:
                works.append(PromptWork(int(e), int(p)))
                continue
            if uses[0].prompt_len != p + e:
                return None  # a chunk of a reusing prompt: the model predicts whole prompts
            reused += 1
            hits = [(u.start, u.entry.num_tokens) for u in uses]
            works.append(work_of(int(p) + int(e), int(p), hits))
        if 0 < reused < len(works):
            return None
        path = "reuse" if reused else "recompute"
        return TimedForward(path, tuple(works), sum(w.computed for w in works))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one gate per scheduler, kept for its life)
    def _plain_ms(self, computed: int, prefix_len: int) -> float:
        return self.model.batch_ms([PromptWork(computed, prefix_len)], [False])

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (prompts of one layout decide alike)
    def _reuse_ms(self, work: PromptWork) -> float:
        return self.model.batch_ms([work], [True])

    def min_segment_tokens(self, prompt_tokens: int = 8192, question: int = 64) -> int | None:
        """The shortest segment worth storing for prompts of ``prompt_tokens`` made of such
        segments and a ``question``; None when no segment length pays at that size."""
        return self.model.min_segment_tokens(prompt_tokens, question)

    def break_even_prompt_tokens(self, segment_tokens: int, question: int = 64) -> int | None:
        """The smallest prompt of ``segment_tokens`` segments (all hits) served with reuse."""
        return self.model.break_even_prompt_tokens(segment_tokens, question)


def work_of(prompt_len: int, prefix_len: int, starts_and_lengths) -> PromptWork:
    """A request's :class:`PromptWork`: ``prompt_len`` tokens, ``prefix_len`` of them an
    exact-prefix hit, segment hits ``(start in the prompt, tokens)``; the parts of the hits
    that the prefix covers are not computed and do not count."""
    segs = []
    for start, n in starts_and_lengths:
        lo, hi = max(start, prefix_len), min(start + n, prompt_len)
        if lo < hi:
            segs.append((lo - prefix_len, hi - lo))
    return PromptWork(prompt_len - prefix_len, prefix_len, tuple(segs))
