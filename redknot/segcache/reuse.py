"""Reusing stored segments at any position: which tokens of an extend take cached local K/V.

A request whose marks (``redknot.api.marks.segments_of``) name segments that are stored and
ready reuses them: for every segment token the extend computes, each local head takes the
segment's cached K/V, re-rotated from its standalone position ``t - start`` to its position
``t`` in this prompt (RedKnot's head-aware recovery); global heads keep their fresh K/V,
recomputed under the new prefix. Tokens an exact-prefix hit already covers are not computed and
need nothing; a segment wholly inside that hit is not held at all (counted a hit, reusing
nothing), so its request's extend runs as one that reuses nothing.

| when                                 | what                                                      |
| ------------------------------------ | --------------------------------------------------------- |
| it gets a request slot (``start``)   | look each mark up (hits and misses are counted); take a reference on each hit |
| each extend (``plan_reads``)         | the segment tokens it computes: batch token, region row, offline and online position |
| it finishes or is aborted (``finish``) | drop the references                                     |

What ``start`` decided is reported to the client: ``meta_info["redknot_reuse"]`` of the answer
(SGLang's per-request ``customized_info``, carried from the scheduler to the HTTP response and
attached to the first output token, so the list holds one report) for every request that marks
segments (automatic chunks included):

| key               | meaning                                                               |
| ----------------- | --------------------------------------------------------------------- |
| ``segments_marked`` | segments the request marked                                        |
| ``segments_hit``  | of those, found stored and ready; ``null`` when not looked up (inert markup, below) |
| ``reused_tokens`` | prompt tokens computed with cached segment K/V (beyond an exact-prefix hit); 0 when not reused |
| ``segments``      | the reused ones: ``namespace``, ``start`` (prompt offset), ``tokens`` |
| ``policy``        | the recovery policy that served them, or ``null`` when nothing was reused |
| ``gate``          | the reuse gate's decision (``reuse`` / ``recompute``, predicted ms, reason); absent without a gate or without hits |
| ``samkv``         | ``--redknot-policy samkv``: the cut (``prompt_tokens``, ``served_tokens``, ``kept_blocks``, ``blocks``, ``sequence_ratio``, ``evicted``), or only the ``note`` saying why the prompt was computed in full |
| ``stored``        | the missed segments this request's own prefill stores (``namespace``, ``start``): automatic chunks due for capture under ``--redknot-auto-capture-in-place`` (``redknot.segcache.registration.store_in_place``); absent when none |

A request's marks' ids are checked against its tokens (which packs and hashes them all) only
when it reads the K/V they name: a prompt served without reuse only looks them up, counts and
reports them, and holds nothing. A prompt that no hit could make worth reusing
(``ReuseGate.hopeless``: the cheapest reusing extend's host time exceeds recomputing it, both
as this server measured them) is answered before the gate's decision. When that holds for
every prompt the model takes, by the record alone or by this server's measured recompute times
with no reuse measured (``ReuseGate.recomputes_all``), the HTTP side makes markup inert
(``SegmentApi.learn_gate``): marks carry only their number (``redknot_seg_recomputed``),
nothing is looked up or captured, and the report says ``segments_hit: null`` with the gate's
reason.

The extend that completes a reusing request's prompt also carries its sparse-FFN inputs (the
probed newest tokens and the candidate segment tokens; ``redknot.attention.ffn_schedule``).
Adaptive restore of local heads by edge mass probes the same rows
(``redknot.attention.restore``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from redknot.attention.ffn_schedule import SparseFfn
from redknot.kernels.extend import to_device
from redknot.recovery.samkv.served import ServedDoc
from redknot.segcache import registration
from redknot.segcache.entry import SegmentEntry, SegmentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentUse:
    start: int  # the segment's first token in the prompt
    entry: SegmentEntry
    prompt_len: int = 0  # tokens of the whole prompt (0: unknown, no sparse FFN)
    # SamKV (redknot.recovery.samkv.served): the document's rows in the served prompt hold
    # its anchors and kept blocks only; None: every token of the segment, in order
    doc: ServedDoc | None = None

    @property
    def num_rows(self) -> int:
        """Rows of the prompt the segment spans."""
        return self.entry.num_tokens if self.doc is None else self.doc.served_tokens

    def offsets(self, online: np.ndarray) -> np.ndarray:
        """The segment offset whose cached K/V prompt rows ``online`` start from."""
        if self.doc is None:
            return online - self.start
        return self.doc.served_offsets()[online - self.start]

    def middle(self, online: np.ndarray) -> np.ndarray:
        """Which of ``online`` are SamKV middle slots (each layer fills them with its choice)."""
        if self.doc is None:
            return np.zeros(online.shape, dtype=bool)
        rel = online - self.start
        return (rel >= self.doc.init) & (rel < self.doc.init + self.doc.slots)


@dataclass(frozen=True)
class SegmentReads:
    """One extend's reuse: batch token ``tokens_gpu[i]`` takes region row ``rows_gpu[i]``,
    rotated from ``pos_off_gpu[i]`` to ``pos_on_gpu[i]`` (int64 [R] each, on the device);
    ``sparse``: the requests whose extend ends their prompt, for the deep layers' sparse FFN."""

    tokens_gpu: torch.Tensor
    rows_gpu: torch.Tensor
    pos_off_gpu: torch.Tensor
    pos_on_gpu: torch.Tensor
    sparse: tuple[SparseFfn, ...] = ()
    tokens_cpu: torch.Tensor | None = None  # tokens_gpu on the host
    pos_off_cpu: torch.Tensor | None = None  # pos_off_gpu on the host
    middle_cpu: torch.Tensor | None = None  # [R] bool: SamKV middle slots (None: there are none)

    def select(self, index: torch.Tensor) -> SegmentReads:
        """The reads ``index`` (int64 on the device) only, without the sparse-FFN inputs or
        host copies (no host synchronisation)."""
        return SegmentReads(
            self.tokens_gpu[index], self.rows_gpu[index], self.pos_off_gpu[index],
            self.pos_on_gpu[index],
        )  # fmt: skip


def start(cache: Any, req: Any) -> None:
    """``req`` got its request slot: find its stored segments and hold them while it runs."""
    from redknot.api.marks import (
        SegmentMarkError,
        check_ids,
        recomputed_marks,
        registration_of,
        segments_of,
        stored_marks,
    )

    if getattr(req, "sampling_params", None) is None:
        return
    plan = getattr(req, SAMKV_ATTR, None)
    if plan is not None:
        _start_samkv(cache, req, plan)
        return
    gate = getattr(cache.pool, "reuse_gate", None)
    prompt_len, prefix = len(req.origin_input_ids), _prefix_len(req)
    inert = recomputed_marks(req)
    if inert:  # marked on a server whose gate recomputes every prompt: nothing to look up
        if gate is not None:  # why, for the answer (no log line: the server said it once)
            # the whole prompt's recompute bounds one after a prefix (ReuseGate.recomputes_all)
            req.redknot_reuse = gate.hopeless(prompt_len, prefix) or gate.hopeless(prompt_len)
            gate.count_inert()
        _report(req, cache.pool, inert, None, [])
        return
    try:
        if registration_of(req) is not None:
            return
        hopeless = None if gate is None else gate.hopeless(prompt_len, prefix)
        # the marks' ids are checked against the prompt's tokens (which packs and hashes them
        # all) only where this request reads the K/V they name: a prompt served without reuse
        # (no hit could make it pay, or the gate recomputes it) only counts and reports them
        marks = segments_of(req, verify=False)
        due = stored_marks(req, marks)
    except SegmentMarkError as e:  # validated by the API; never fail the scheduler on it
        logger.warning("redknot: segment marks of request %s ignored: %s", req.rid, e)
        return
    if not marks:  # reported too: SGLang would give it a null report beside one that has one
        _report(req, cache.pool, 0, 0, [])
        return
    store = cache.segments
    try:  # each hit's serial: its entry is made only if the request reads it
        found = list(zip(marks, store.find_ids(
            [(mark.namespace, mark.segment_id, mark.num_tokens) for mark in marks]
        )))  # fmt: skip
    except SegmentError as e:  # a namespace the store refuses (marks set past the API)
        logger.warning("redknot: segment marks of request %s ignored: %s", req.rid, e)
        return
    hits = sum(1 for _, serial in found if serial is not None)
    # a hit inside the exact-prefix hit reads nothing (SGLang's prefix cache serves those
    # tokens): not held, and the extend stays off the reuse kernels (a hit is as long as its
    # mark: the lookup matched the length)
    held = [(mark, serial) for mark, serial in found if serial is not None and mark.end > prefix]
    uses: list[SegmentUse] = []
    if hopeless is not None:
        if held:
            gate.count_recomputed()
            _recomputed(req, hopeless)
    elif held and getattr(cache.pool, "reuse_policy", None) == "samkv":
        _samkv_declined(req)  # served as a shorter prompt, or not reused at all
    elif held and _pays(cache, req, [(mark.start, mark.num_tokens) for mark, _ in held]):
        try:  # this request reads their K/V: the ids must name its tokens
            check_ids(req.origin_input_ids, marks)
        except SegmentMarkError as e:
            logger.warning("redknot: segment marks of request %s ignored: %s", req.rid, e)
            if gate is not None:  # decided to reuse, served without
                gate.count_ignored()
            req.redknot_reuse = None
            return
        uses = [SegmentUse(mark.start, store.entry_of(serial), prompt_len) for mark, serial in held]
        for use in uses:
            store.acquire(use.entry)
        cache.pool.segment_reads[req.req_pool_idx] = uses
    stored = []
    if due:  # after the reads are held: making room for these never evicts them
        missed = {mark.start for mark, serial in found if serial is None}
        due = [mark for mark in due if mark.start in missed]
        stored = registration.store_in_place(cache, req, due, prefix)
    _report(req, cache.pool, len(marks), hits, uses, stored)


REPORT_KEY = "redknot_reuse"  # meta_info key of the report (module docstring)
SAMKV_ATTR = "redknot_samkv"  # on a request served as SamKV's shorter prompt: its ServedPlan
SAMKV_NOTE = "redknot_samkv_note"  # on a request SamKV could not serve so: why


def _start_samkv(cache: Any, req: Any, plan: Any) -> None:
    """A request served as SamKV's shorter prompt (``redknot.segcache.samkv``) got its slot:
    hold its documents. One evicted since the prompt was cut is served from the rows the
    prompt holds, computed afresh (its anchors and first kept blocks), and said so."""
    store = cache.segments
    uses, gone = [], []
    for doc in plan.docs:
        entry = store.lookup_id(doc.namespace, doc.segment_id, doc.num_tokens)
        if entry is None:
            gone.append(doc.source)
            continue
        store.acquire(entry)
        uses.append(SegmentUse(doc.start, entry, plan.served_tokens, doc=doc))
    if gone:
        logger.warning(
            "redknot samkv: request %s: document(s) at %s evicted while the request waited; "
            "their kept rows are computed without the cache", req.rid, gone,
        )  # fmt: skip
    if uses:
        cache.pool.segment_reads[req.req_pool_idx] = uses
    _report(req, cache.pool, len(plan.docs), len(uses), uses)
    report = req.customized_info[REPORT_KEY][0]
    report["samkv"] = {**plan.report(), "evicted": gone}


def _samkv_declined(req: Any) -> None:
    """A samkv server's request with hits that was not cut (``SAMKV_NOTE`` says why): its
    prompt is computed in full, without the cache (exact)."""
    note = getattr(req, SAMKV_NOTE, None) or "not cut by the samkv policy"
    logger.info("redknot samkv: request %s served without segment reuse: %s", req.rid, note)


def _report(
    req: Any,
    pool: Any,
    marked: int,
    hits: int | None,
    uses: list[SegmentUse],
    stored: Sequence[Any] = (),
) -> None:
    """Attach what ``start`` decided to ``req`` for its answer's ``meta_info`` (``hits`` None:
    the marks were not looked up; ``stored``: the marks its own prefill stores)."""
    prefix = _prefix_len(req)
    report: dict[str, Any] = {
        "segments_marked": marked,
        "segments_hit": hits,
        "reused_tokens": sum(max(0, u.start + u.num_rows - max(u.start, prefix)) for u in uses),
        "segments": [
            {
                "namespace": u.entry.namespace,
                "start": u.start if u.doc is None else u.doc.source,  # in the client's prompt
                "tokens": u.entry.num_tokens,
            }
            for u in uses
        ],
        "policy": getattr(pool, "reuse_policy", None) if uses else None,
    }
    if stored:
        report["stored"] = [{"namespace": m.namespace, "start": m.start} for m in stored]
    note = getattr(req, SAMKV_NOTE, None)
    if note is not None:
        report["samkv"] = {"note": note}
    decision = getattr(req, "redknot_reuse", None)
    if decision is not None:
        report["gate"] = {
            "decision": "reuse" if decision.reuse else "recompute",
            "reuse_ms": round(decision.reuse_ms, 3),
            "recompute_ms": round(decision.plain_ms, 3),
            "reason": decision.reason,
        }
    info = getattr(req, "customized_info", None)
    info = dict(info) if isinstance(info, dict) else {}
    info[REPORT_KEY] = [report]  # one value per output token: the first one's
    req.customized_info = info


def _prefix_len(req: Any) -> int:
    """Tokens of ``req``'s exact-prefix hit (``prefix_indices``: a tensor in the scheduler)."""
    indices = getattr(req, "prefix_indices", None)
    return 0 if indices is None else len(indices)


def _pays(cache: Any, req: Any, hits: list[tuple[int, int]]) -> bool:
    """The reuse gate's decision for ``req`` with its segment ``hits`` (start in the prompt,
    tokens) (``redknot.costmodel.gate``; no gate: reuse). A request served without reuse is
    logged with the reason and marked ``redknot_reuse``."""
    gate = getattr(cache.pool, "reuse_gate", None)
    if gate is None:
        return True
    from redknot.costmodel.gate import work_of

    prompt_len = len(req.origin_input_ids)
    decision = gate.decide(work_of(prompt_len, len(req.prefix_indices), hits))
    if not decision.reuse:
        _recomputed(req, decision)
    else:
        req.redknot_reuse = decision
    return decision.reuse


def _recomputed(req: Any, decision: Any) -> None:
    """``req`` has segment hits and is served without them: say why (log, answer)."""
    req.redknot_reuse = decision
    logger.debug("redknot: request %s served without segment reuse: %s", req.rid, decision.reason)


def plan_reads(
    pool: Any, req_pool_indices: list[int], prefix_cpu, lens_cpu, device, recent_n: int = 128
) -> SegmentReads | None:
    """The segment tokens one extend batch computes, with where their cached K/V lies, and the
    sparse-FFN inputs of the requests whose prompt this extend completes."""
    # built in NumPy and handed to torch once (per-segment torch ops cost ~0.6 ms a request
    # of 8 segments on the scheduler's host; benchmarks/marked_host_cost.py)
    parts: list[tuple[np.ndarray, ...]] = []
    sparse: list[SparseFfn] = []
    offset = 0
    for b, (rpi, p, e) in enumerate(zip(req_pool_indices, list(prefix_cpu), list(lens_cpu))):
        p, e = int(p), int(e)
        uses = pool.segment_reads.get(rpi, ())
        positions = []
        for use in uses:
            lo = max(use.start, p)
            hi = min(use.start + use.num_rows, p + e)
            if lo < hi:
                online = np.arange(lo, hi, dtype=np.int64)
                offline = use.offsets(online)
                parts.append((offset + online - p, use.entry.rows_of(offline), offline, online,
                              use.middle(online)))  # fmt: skip
                positions.append(online)
        if positions and uses[0].prompt_len == p + e:
            question = max(u.start + u.num_rows for u in uses)
            probe = max(min(question, p + e - recent_n), p)
            cand = np.concatenate(positions)
            cand = to_device(torch.from_numpy(cand[cand < probe]), device)
            sparse.append(SparseFfn(rpi, offset, p, e, probe, cand, index=b))
        offset += e
    if not parts:
        return None
    tokens, rows, pos_off, pos_on, middle = (
        torch.from_numpy(np.concatenate(column)) for column in zip(*parts)
    )
    on_device = (to_device(x, device) for x in (tokens, rows, pos_off, pos_on))
    return SegmentReads(
        *on_device, sparse=tuple(sparse), tokens_cpu=tokens, pos_off_cpu=pos_off,
        middle_cpu=middle if bool(middle.any()) else None,
    )  # fmt: skip


def finish(cache: Any, req_pool_idx: int | None) -> None:
    """A request left its slot: release the segments it read."""
    if req_pool_idx is None:
        return
    for use in cache.pool.segment_reads.pop(req_pool_idx, ()):
        cache.segments.release(use.entry)
