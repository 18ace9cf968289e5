"""Chat messages as segments: ``--redknot-chat-segments``, and automatic segments of unmarked
chat requests under ``--redknot-auto-segments cdc``.

SGLang renders a chat request with the model's Jinja template and encodes the rendered string
in ``OpenAIServingChat._apply_jinja_template``. redknot wraps that method (an AROUND hook):

1. each selected content (a message's string content, or one text part of a list content) is
   replaced by a sentinel (a private-use character pair around its index) in a copy of the
   request;
2. SGLang's own method runs on that copy with a tokenizer stand-in: ``apply_chat_template``
   renders the sentinel messages, and also the real ones for comparison; ``encode`` cuts the
   rendered string at the sentinels and encodes the template text between them on its own and
   each content standalone (``tokenize.py``), so the template never changes a content's tokens
   and the tokens around a content are the template's own;
3. if the template rewrote a content (trimmed it, say), the sentinel rendering with contents
   put back differs from the real one: the request is served exactly as SGLang would (real
   rendering, no segments) and a warning is logged once;
4. each content's token span is marked, whole or cut, as the server's options say
   (:class:`Scheme`):

- ``--redknot-chat-segments messages`` (``min-tokens:N``): every content (of N tokens or more)
  is one segment, in namespace ``custom_params.redknot_namespace``, else ``default``;
- chat segments off and ``--redknot-auto-segments cdc``: every content's
  ``AutoSegments.message_spans`` (the whole content up to the chunker's maximum, its
  content-defined chunks beyond; none shorter than the shortest stored chunk), in namespace
  ``auto``.

Chat segments, when on, decide alone (a server's explicit choice is not mixed with automatic
chunks, as a ``/generate`` request's own marks are not). ``custom_params`` of a request:
``redknot_capture: false`` keeps its segments from being captured on a miss (``capture.py``);
``redknot_auto_segments: false`` serves it without automatic segments. Chat requests on models
with a Python chat encoder, multimodal models, or a named ``--chat-template`` (conversation
templates) are served without segments, and so are requests whose messages, tools or template
arguments hold a sentinel character themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redknot.api.auto import AUTO_FIELD
from redknot.api.capture import CAPTURE_FIELD, check_flag, note
from redknot.api.marks import SegmentMarkError, reserved_keys
from redknot.api.options import AUTO_NAMESPACE, DEFAULT_NAMESPACE

logger = logging.getLogger(__name__)

NAMESPACE_KEY = "redknot_namespace"
S_OPEN, S_CLOSE = "\U000f0010", "\U000f0011"
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("redknot chat segments: %s", message)


class _Forward:
    """Forwards every attribute it does not hold itself to ``target``."""

    def __init__(self, target: Any, **own: Any):
        self.__dict__["_target"] = target
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


class SegmentingTokenizer(_Forward):
    """The tokenizer stand-in of step 2; ``spans`` holds the token spans of the last encode and
    ``keys`` the sentinel of each (``None`` when it fell back to the real rendering)."""

    def __init__(self, real: Any, piecewise: Any, contents: dict[str, list[int]], texts: dict):
        super().__init__(real, piecewise=piecewise, contents=contents, texts=texts)
        self.__dict__.update(expected=None, spans=None, keys=None, fell_back=False)

    def _restore(self, text: str) -> tuple[str, list[tuple[str, bool]]]:
        pieces, pos = [], 0
        while (i := text.find(S_OPEN, pos)) >= 0:
            j = text.find(S_CLOSE, i)
            key = text[i : j + 1]
            if j < 0 or key not in self.texts:
                break
            pieces += [(text[pos:i], False), (key, True)]
            pos = j + 1
        pieces.append((text[pos:], False))
        return "".join(self.texts[p] if s else p for p, s in pieces), pieces

    def _put_back(self, value: Any) -> Any:
        """``value`` (a message as the template gets it) with every sentinel replaced by its
        content: a string content, or text parts kept as a list or joined by SGLang."""
        if isinstance(value, str):
            return self._restore(value)[0]
        if isinstance(value, list):
            return [self._put_back(v) for v in value]
        if isinstance(value, dict):
            return {k: self._put_back(v) for k, v in value.items()}
        return value

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        rendered = self._target.apply_chat_template(messages, *args, **kwargs)
        if isinstance(rendered, str):
            real = self._put_back(messages)
            self.__dict__["expected"] = self._target.apply_chat_template(real, *args, **kwargs)
        return rendered

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        restored, pieces = self._restore(text)
        if args or not any(s for _, s in pieces) or restored != self.expected:
            # Not the rendering made with sentinels, or the template rewrote a content: encode
            # what SGLang would have encoded (the real rendering), without segments.
            fell_back = any(s for _, s in pieces)
            self.__dict__.update(spans=None, keys=None, fell_back=fell_back)
            real = self.expected if fell_back and self.expected is not None else restored
            return self._target.encode(real, *args, **kwargs)
        before, after = self.piecewise.specials(kwargs.get("add_special_tokens", True))
        ids, spans, keys = list(before), [], []
        for piece, is_segment in pieces:
            if is_segment:
                seg = self.contents[piece]
                spans.append((len(ids), len(ids) + len(seg)))
                keys.append(piece)
                ids += seg
            elif piece:
                ids += self.piecewise.segment_tokens(piece)
        self.__dict__.update(spans=spans, keys=keys)
        return ids + list(after)


@dataclass(frozen=True)
class Scheme:
    """Which contents of a chat request become segments, cut how, in which namespace."""

    namespace: str
    cut: Callable[[list[int]], list[tuple[int, int]]]  # a content's tokens -> segment ranges
    auto: bool  # automatic segments (counted as such); else --redknot-chat-segments


def _scheme(api: Any, namespace: str, auto: bool) -> Scheme | None:
    """The request's scheme (module docstring), or ``None``: served as SGLang serves it."""
    if api.chat.enabled:

        def whole(ids: list[int]) -> list[tuple[int, int]]:
            return [(0, len(ids))] if api.chat.selects(len(ids)) else []

        return Scheme(namespace, whole, auto=False)
    if auto and api.auto.usable(api.namespaces):
        return Scheme(AUTO_NAMESPACE, api.auto.message_spans, auto=True)
    return None


def _options(request: Any, api: Any) -> tuple[str, bool, bool]:
    """The request's namespace, whether its segments may be captured, and whether it wants
    automatic segments; redknot's keys are removed from its ``custom_params``."""
    params = dict(request.custom_params or {})
    ns = params.pop(NAMESPACE_KEY, DEFAULT_NAMESPACE)
    capture = check_flag(params.pop(CAPTURE_FIELD, True), f"custom_params.{CAPTURE_FIELD}")
    auto = check_flag(params.pop(AUTO_FIELD, True), f"custom_params.{AUTO_FIELD}")
    bad = reserved_keys(params)
    if bad:
        raise SegmentMarkError(
            f"custom_params keys {bad} are reserved for redknot; a chat request may only set "
            f"'{NAMESPACE_KEY}', '{CAPTURE_FIELD}' and '{AUTO_FIELD}'"
        )
    if NAMESPACE_KEY in (request.custom_params or {}) and not api.chat.enabled:
        raise SegmentMarkError(
            f"custom_params.{NAMESPACE_KEY} needs chat segments: start the server with "
            "--redknot-chat-segments messages (or min-tokens:N)"
        )
    api.namespaces.require(ns, where=f"custom_params.{NAMESPACE_KEY}")
    request.custom_params = params or None
    return ns, capture, auto


def _holds_sentinel(value: Any) -> bool:
    """Whether a value the template renders (messages, tools, template arguments) holds a
    sentinel character anywhere."""
    if isinstance(value, str):
        return S_OPEN in value or S_CLOSE in value
    if isinstance(value, (list, tuple)):
        return any(_holds_sentinel(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_sentinel(k) or _holds_sentinel(v) for k, v in value.items())
    if hasattr(value, "model_dump"):
        return _holds_sentinel(value.model_dump())
    return False


def _is_text_part(part: Any) -> bool:
    return getattr(part, "type", None) == "text" and isinstance(getattr(part, "text", None), str)


class _Selection:
    """The selected contents of one request, by sentinel: tokens, text and segment ranges."""

    def __init__(self, scheme: Scheme, piecewise: Any):
        self.scheme, self.piecewise = scheme, piecewise
        self.contents: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.cuts: dict[str, list[tuple[int, int]]] = {}

    def take(self, label: str, text: str) -> str | None:
        """The sentinel standing for ``text`` when it has segments, else ``None``."""
        if not text:
            return None
        ids = self.piecewise.segment_tokens(text)
        cuts = self.scheme.cut(ids)
        if not cuts:
            return None
        key = f"{S_OPEN}{label}{S_CLOSE}"
        self.contents[key], self.texts[key], self.cuts[key] = ids, text, cuts
        return key

    def message(self, i: int, msg: Any) -> Any:
        """``msg`` (the request's ``i``-th) with its selected contents replaced by sentinels."""
        content = getattr(msg, "content", None)
        if isinstance(content, str):
            key = self.take(str(i), content)
            return msg if key is None else msg.model_copy(update={"content": key})
        if not isinstance(content, list):
            return msg
        parts, changed = [], False
        for j, part in enumerate(content):
            key = self.take(f"{i}.{j}", part.text) if _is_text_part(part) else None
            parts.append(part if key is None else part.model_copy(update={"text": key}))
            changed = changed or key is not None
        return msg.model_copy(update={"content": parts}) if changed else msg


def around_apply_jinja_template(
    original: Any, self: Any, request: Any, tools: Any, is_multimodal: bool
) -> Any:
    from redknot.api.server import current_api

    api = current_api()
    if api is None:
        return original(self, request, tools, is_multimodal)
    try:
        namespace, capture, auto = _options(request, api)
    except SegmentMarkError:
        api.counters.add(rejected=1)
        raise
    scheme = _scheme(api, namespace, auto)
    if scheme is None:
        return original(self, request, tools, is_multimodal)
    if is_multimodal or getattr(self, "chat_encoding_spec", None) is not None:
        _warn_once("model", "this model's chat encoding is not a plain Jinja template")
        return original(self, request, tools, is_multimodal)
    if _holds_sentinel([request.messages, tools, request.chat_template_kwargs]):
        # A sentinel written by the client could pass for a content's sentinel and be swapped
        # for that content's text: serve such a request as SGLang would.
        _warn_once("sentinel", "a request holds U+F0010/U+F0011; served unsegmented")
        return original(self, request, tools, is_multimodal)

    selection = _Selection(scheme, api.tokenizer)
    last = len(request.messages) - 1
    messages = [
        (
            msg  # the prefix the answer continues: its end is the prompt's
            if i == last and msg.role == "assistant" and request.continue_final_message
            else selection.message(i, msg)
        )
        for i, msg in enumerate(request.messages)
    ]
    if not selection.contents:
        return original(self, request, tools, is_multimodal)

    tokenizer = SegmentingTokenizer(
        self.tokenizer_manager.tokenizer, selection.piecewise, selection.contents, selection.texts
    )
    proxy = _Forward(self, tokenizer_manager=_Forward(self.tokenizer_manager, tokenizer=tokenizer))
    result = original(proxy, request.model_copy(update={"messages": messages}), tools, False)
    if tokenizer.spans is None:
        if tokenizer.fell_back:
            _warn_once(
                "template", "the chat template rewrites message contents; served unsegmented"
            )
        return result
    ids = result.prompt_ids
    if scheme.auto and api.context_len is not None and len(ids) >= api.context_len:
        return result  # SGLang refuses it; a mark must not answer first
    spans = [
        (start + a, start + b)
        for (start, _), key in zip(tokenizer.spans, tokenizer.keys, strict=True)
        for a, b in selection.cuts[key]
    ]
    marks = api.marks(ids, spans, [scheme.namespace] * len(spans), where="chat")
    store = []  # automatic segments this request stores itself if it misses them
    if scheme.auto and capture and api.inert is None:
        store = api.capture.stored_here(marks, ids, chunks=False)
    request.custom_params = {**(request.custom_params or {}), **api.encode(marks, store)}
    if scheme.auto:
        api.counters.add(auto_requests=1, auto_chunks_marked=len(marks))
    else:
        api.counters.add(requests_with_segments=1, segments_marked=len(marks))
    if capture and api.inert is None:
        auto = scheme.auto
        note(
            [(m.namespace, ids[m.start : m.end]) for m in marks],
            contexts=api.auto.contexts(ids, marks) if auto else None,
            starts=api.auto.starts(marks) if auto else None,
        )
    return result
