"""The fuzzer's machinery, shared by ``benchmarks/fuzz_api.py`` (which generates the cases)
and ``tests/api/test_fuzz.py``: what a case is, the oracle of what must reach the tokenizer
manager, the checks of 200 answers against the segment store, and the classification of every
answer (see :func:`run_case`).
"""

from __future__ import annotations

import json
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redknot.api.marks import decode_marks, segment_id

REDKNOT_DIR = str(Path(__file__).resolve().parents[2] / "redknot")
NO_BODY = object()


@dataclass
class Case:
    """One request and what it must get. ``expect``: ``"4xx"``, a status, or a function of the
    server giving the status (called just before sending). ``names``: a 4xx message must name
    one of these. ``check(server, response)``: for a 200, what is wrong with it (or None)."""

    category: str
    method: str
    path: str
    body: Any = NO_BODY
    raw: bytes | None = None
    headers: dict | None = None
    params: Any = None
    expect: Any = "4xx"
    names: tuple[str, ...] = ()
    check: Callable | None = None
    before: Callable | None = None


class Oracle:
    """What a prompt with segments must become, restated from ``redknot.api.tokenize``'s
    documented rule: the text cut at segment edges, each piece encoded on its own without
    special tokens, between the special tokens the tokenizer adds around a whole text."""

    def __init__(self, tok: Any):
        self.tok = tok
        plain = tok.encode("probe text", add_special_tokens=False)
        full = tok.encode("probe text")
        i = next(i for i in range(len(full)) if full[i : i + len(plain)] == plain)
        self.before, self.after = full[:i], full[i + len(plain) :]

    def enc(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, text: str, spans: list[tuple[int, int, str]]) -> tuple[list[int], list]:
        """``(input_ids, [(start, end, namespace, id)])`` of ``text`` with character spans."""
        ids, marks, pos = list(self.before), [], 0
        for s, e, ns in sorted(spans):
            ids += self.enc(text[pos:s]) if s > pos else []
            seg = self.enc(text[s:e])
            marks.append((len(ids), len(ids) + len(seg), ns, segment_id(ns, seg)))
            ids, pos = ids + seg, e
        ids += self.enc(text[pos:]) if pos < len(text) else []
        return ids + self.after, marks


def received_marks(server: Any) -> tuple[list[int], list]:
    """``(input_ids, [(start, end, namespace, id)])`` of the last request that reached the
    tokenizer manager (its marks validated against its tokens)."""
    obj = server.tm.last
    sp = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
    custom = sp.get("custom_params") or {}
    marks = decode_marks(custom, obj.input_ids)
    return obj.input_ids, [(m.start, m.end, m.namespace, m.segment_id) for m in marks]


def check_prompt(ids: list[int], marks: list, cached: int | None = None) -> Callable:
    """Exactly ``ids`` and ``marks`` reached the tokenizer manager; with ``cached``, that many
    prompt tokens read segment K/V from the store (hits)."""

    def check(server, r):
        got = received_marks(server)
        if got != (ids, marks):
            return f"reached the tokenizer manager: {got}, want {(ids, marks)}"
        meta = r.json().get("meta_info", {})
        if cached is not None and meta.get("standin_read_tokens") != cached:
            return f"read {meta.get('standin_read_tokens')} tokens, want {cached} (store hits)"
        return None

    return check


def check_registered(ns: str, ids: list[int], pin: bool) -> Callable:
    """The registration answer (200), its carrier request, and the store: the segment is ready
    with this pin."""

    def check(server, r):
        sid = segment_id(ns, ids)
        want = {
            "segment_id": sid,
            "namespace": ns,
            "num_tokens": len(ids),
            "pinned": pin,
            "cached_tokens": 0,
            "state": "ready",
        }
        if r.json() != want:
            return f"answer {r.json()}, want {want}"
        obj = server.tm.last
        if obj.input_ids != ids or obj.sampling_params.get("max_new_tokens") != 0:
            return f"carrier {obj.input_ids} {obj.sampling_params}"
        entry = server.store.get(ns, sid)
        if not entry.ready or entry.pinned != pin:
            return f"store entry {entry}"
        return None

    return check


def check_listing(ns: str) -> Callable:
    """``GET /redknot/segments`` lists exactly the store's segments of ``ns``, in order."""

    def check(server, r):
        want = [e.id for e in server.store.list(ns)]
        got = [s["id"] for s in r.json()["segments"]]
        return None if got == want else f"listed {got}, store holds {want}"

    return check


def registration_status(ns: str, sid: str, *, held: bool = False) -> Callable:
    """The status a valid registration must get, from the store just before it is sent: 200
    when the segment is stored and ready, or will be by this registration; 202 when a
    registration still writes it (an earlier one, or this one when the scheduler ``held`` it)."""

    def status(server):
        listed = [e for e in server.store.list(ns) if e.id == sid]
        if listed:
            return 200 if listed[0].ready else 202
        return 202 if held else 200

    return status


def check_in_flight(ns: str, sid: str) -> Callable:
    """A registration answered while its K/V is being written (202, state ``writing``, listed),
    or of a segment already stored (200, ready)."""

    def check(server, r):
        want = "writing" if r.status_code == 202 else "ready"
        if r.json().get("segment_id") != sid or r.json().get("state") != want:
            return f"answer {r.status_code} {r.json()}"
        listed = [e.id for e in server.store.list(ns)]
        return None if sid in listed else f"{sid} is not listed while being written"

    return check


def delete_status(ns: Any, sid: str) -> Callable:
    """The status a delete must get: 200 when the store lists ``sid`` in ``ns``, else 404."""
    return lambda server: 200 if any(e.id == sid for e in server.store.list(ns)) else 404


def stats_match(ns: str | None) -> Callable:
    """``GET /redknot/stats`` reports the store's own statistics of ``ns`` (or all)."""

    def check(server, r):
        got, want = r.json()["store"], server.store.stats(ns)
        return None if got == want else f"stats {got}, store says {want}"

    return check


def check_batch(prompts: list[tuple[list[int], list]]) -> Callable:
    """Every prompt of a batch reached the tokenizer manager as ``(input_ids, marks)``."""

    def check(server, r):
        obj = server.tm.last
        got = []
        for i, ids in enumerate(obj.input_ids):
            custom = obj.sampling_params[i].get("custom_params") or {}
            marks = decode_marks(custom, ids)
            got.append((ids, [(m.start, m.end, m.namespace, m.segment_id) for m in marks]))
        return None if got == [(ids, marks) for ids, marks in prompts] else f"batch {got}"

    return check


# ---- running and classifying ------------------------------------------------------------


def _message(r) -> str:
    """The error message of a 4xx/5xx answer, in any of the shapes redknot, SGLang and FastAPI
    use (``{"error": {"message"}}``, ``{"message"}``, ``{"detail"}``); "" when there is none."""
    try:
        body = r.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    err = body.get("error")
    msg = err.get("message") if isinstance(err, dict) else body.get("message", body.get("detail"))
    return msg if isinstance(msg, str) else json.dumps(msg) if msg else ""


def _origin(exc: BaseException) -> str:
    """``redknot`` when redknot's package is on the traceback, else ``sglang/harness``."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        "redknot" if any(f.filename.startswith(REDKNOT_DIR) for f in frames) else "sglang/harness"
    )


def _send(client: Any, case: Case) -> Any:
    headers = case.headers
    if headers is None and case.raw is not None:
        headers = {"content-type": "application/json"}
    kw: dict[str, Any] = {"params": case.params, "headers": headers}
    if case.raw is not None:
        kw["content"] = case.raw
    elif case.body is None:  # httpx sends no body for json=None
        kw["content"], kw["headers"] = b"null", {"content-type": "application/json"}
    elif case.body is not NO_BODY:
        kw["json"] = case.body
    return client.request(case.method, case.path, **kw)


def run_case(server: Any, client: Any, case: Case) -> tuple[str, str]:
    """``(outcome, detail)``; outcomes: ``ok`` (the 200 expected, checked), ``4xx`` (a clear
    4xx), ``4xx_unclear`` (empty message, or not naming the field), ``accepted`` (2xx where a
    4xx was due), ``wrong`` (another status than predicted, or a failed check), ``5xx``,
    ``crash`` (an exception out of the app) and ``store`` (a broken store invariant)."""
    try:
        if case.before is not None:
            case.before(server)
        expect = case.expect(server) if callable(case.expect) else case.expect
        r = _send(client, case)
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        return "crash", f"{_origin(e)}: {type(e).__name__}: {e}"[:500]
    try:
        server.store.check()
    except AssertionError as e:
        return "store", f"store invariant broken: {e}"
    status, msg = r.status_code, _message(r)
    if status >= 500:
        return "5xx", f"{status}: {msg or r.text}"[:500]
    if expect == "4xx" or (isinstance(expect, int) and 400 <= expect < 500):
        if status < 400:
            return "accepted", f"{status}: {r.text}"[:500]
        if isinstance(expect, int) and status != expect:
            return "wrong", f"{status}, want {expect}: {msg}"[:500]
        low = msg.lower()
        if not msg.strip() or (case.names and not any(n.lower() in low for n in case.names)):
            return "4xx_unclear", f"{status}: {msg!r} does not name {case.names}"[:500]
        return "4xx", ""
    if status != expect:
        return "wrong", f"{status}, want {expect}: {msg or r.text}"[:500]
    try:
        problem = case.check(server, r) if case.check is not None else None
    except Exception as e:  # noqa: BLE001 - an answer the check could not read
        problem = f"the check raised {type(e).__name__}: {e} on {r.text[:200]}"
    return ("wrong", problem[:500]) if problem else ("ok", "")


def _describe(case: Case) -> dict:
    body = case.raw.decode("utf-8", "replace") if case.raw is not None else case.body
    text = json.dumps(None if body is NO_BODY else body, ensure_ascii=True, default=str)
    return {
        "category": case.category,
        "request": f"{case.method} {case.path}",
        "params": case.params,
        "body": text[:300],
    }


def run(server: Any, client: Any, plan: list[Case]) -> dict:
    """Send ``plan`` in order; the counts of every outcome, overall and per category, and the
    first examples of every outcome other than ``ok`` and ``4xx``. Cases of category ``good``
    are the well-formed requests and are counted apart."""
    import logging

    per_cat: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, list] = defaultdict(list)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL)  # refused requests log errors by design
    started = time.perf_counter()
    try:
        for case in plan:
            outcome, detail = run_case(server, client, case)
            per_cat[case.category][outcome] += 1
            if outcome not in ("ok", "4xx") and len(examples[outcome]) < 8:
                examples[outcome].append({**_describe(case), "answer": detail})
    finally:
        root.setLevel(level)
        server.scheduler.finish_running()
    total: Counter = Counter()
    for cat, counts in per_cat.items():
        if cat != "good":
            total.update(counts)
    good = per_cat["good"]
    return {
        "cases": sum(total.values()),
        "count_4xx": total["4xx"] + total["4xx_unclear"],
        "count_4xx_unclear": total["4xx_unclear"],
        "count_5xx": total["5xx"] + good["5xx"],
        "crashes": total["crash"] + good["crash"],
        "accepted_bad": total["accepted"],
        "wrong_answers": total["wrong"],
        "store_invariant_failures": total["store"] + good["store"],
        "adversarial_valid_ok": total["ok"],
        "good_requests_ok": good["ok"],
        "good_requests_sent": sum(good.values()),
        "seconds": round(time.perf_counter() - started, 1),
        "store_after": server.store.stats(),
        "per_category": {cat: dict(sorted(c.items())) for cat, c in sorted(per_cat.items())},
        "examples": dict(examples),
    }
