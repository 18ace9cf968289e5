"""Chat messages as segments: ``--redknot-chat-segments messages | min-tokens:N``.

SGLang renders a chat request with the model's Jinja template and encodes the rendered string
in ``OpenAIServingChat._apply_jinja_template``. redknot wraps that method (an AROUND hook):

1. each selected message's content is replaced by a sentinel (a private-use character pair
   around its index) in a copy of the request;
2. SGLang's own method runs on that copy with a tokenizer stand-in: ``apply_chat_template``
   renders the sentinel messages, and also the real ones for comparison; ``encode`` cuts the
   rendered string at the sentinels and encodes the template text between them on its own and
   each content standalone (``tokenize.py``), so the template never changes a segment's tokens
   and the tokens around a segment are the template's own;
3. if the template rewrote a content (trimmed it, say), the sentinel rendering with contents
   put back differs from the real one: the request is served exactly as SGLang would (real
   rendering, no segments) and a warning is logged once.

The messages' namespace is ``custom_params["redknot_namespace"]`` of the request, else
``default``; ``custom_params["redknot_capture"] = false`` keeps its messages from being captured
on a miss (``capture.py``). Chat requests on models with a Python chat encoder, multimodal models, or a named
``--chat-template`` (conversation templates) are served without segments, and so are requests
whose messages hold a sentinel character themselves.
"""

from __future__ import annotations

import logging
from typing import Any

from redknot.api.capture import CAPTURE_FIELD, check_flag, note
from redknot.api.marks import SegmentMarkError, encode_marks, reserved_keys
from redknot.api.options import DEFAULT_NAMESPACE

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
    """The tokenizer stand-in of step 2; ``spans`` holds the token spans of the last encode
    (``None`` when it fell back to the real rendering)."""

    def __init__(self, real: Any, piecewise: Any, contents: dict[str, list[int]], texts: dict):
        super().__init__(real, piecewise=piecewise, contents=contents, texts=texts)
        self.__dict__.update(expected=None, spans=None, fell_back=False)

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

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        rendered = self._target.apply_chat_template(messages, *args, **kwargs)
        if isinstance(rendered, str):
            real = [
                (
                    {**m, "content": self.texts[m["content"]]}
                    if isinstance(m, dict) and m.get("content") in self.texts
                    else m
                )
                for m in messages
            ]
            self.__dict__["expected"] = self._target.apply_chat_template(real, *args, **kwargs)
        return rendered

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        restored, pieces = self._restore(text)
        if args or not any(s for _, s in pieces) or restored != self.expected:
            # Not the rendering made with sentinels, or the template rewrote a content: encode
            # what SGLang would have encoded (the real rendering), without segments.
            fell_back = any(s for _, s in pieces)
            self.__dict__.update(spans=None, fell_back=fell_back)
            real = self.expected if fell_back and self.expected is not None else restored
            return self._target.encode(real, *args, **kwargs)
        before, after = self.piecewise.specials(kwargs.get("add_special_tokens", True))
        ids, spans = list(before), []
        for piece, is_segment in pieces:
            if is_segment:
                seg = self.contents[piece]
                spans.append((len(ids), len(ids) + len(seg)))
                ids += seg
            elif piece:
                ids += self.piecewise.segment_tokens(piece)
        self.__dict__["spans"] = spans
        return ids + list(after)


def _namespace(request: Any, api: Any) -> tuple[str, bool]:
    """The request's namespace and whether its messages may be captured."""
    params = dict(request.custom_params or {})
    ns = params.pop(NAMESPACE_KEY, DEFAULT_NAMESPACE)
    capture = check_flag(params.pop(CAPTURE_FIELD, True), f"custom_params.{CAPTURE_FIELD}")
    bad = reserved_keys(params)
    if bad:
        raise SegmentMarkError(
            f"custom_params keys {bad} are reserved for redknot; a chat request may only set "
            f"'{NAMESPACE_KEY}' and '{CAPTURE_FIELD}'"
        )
    if NAMESPACE_KEY in (request.custom_params or {}) and not api.chat.enabled:
        raise SegmentMarkError(
            f"custom_params.{NAMESPACE_KEY} needs chat segments: start the server with "
            "--redknot-chat-segments messages (or min-tokens:N)"
        )
    api.namespaces.require(ns, where=f"custom_params.{NAMESPACE_KEY}")
    request.custom_params = params or None
    return ns, capture


def _holds_sentinel(content: Any) -> bool:
    """Whether a message content (a string or a list of parts) holds a sentinel character."""
    if isinstance(content, str):
        return S_OPEN in content or S_CLOSE in content
    if isinstance(content, list):
        return any(
            _holds_sentinel(
                part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
            )
            for part in content
        )
    return False


def around_apply_jinja_template(
    original: Any, self: Any, request: Any, tools: Any, is_multimodal: bool
) -> Any:
    from redknot.api.server import current_api

    api = current_api()
    if api is None:
        return original(self, request, tools, is_multimodal)
    try:
        namespace, capture = _namespace(request, api)
    except SegmentMarkError:
        api.counters.add(rejected=1)
        raise
    if not api.chat.enabled:
        return original(self, request, tools, is_multimodal)
    if is_multimodal or getattr(self, "chat_encoding_spec", None) is not None:
        _warn_once("model", "this model's chat encoding is not a plain Jinja template")
        return original(self, request, tools, is_multimodal)
    if any(_holds_sentinel(getattr(m, "content", None)) for m in request.messages):
        # A content holding the sentinels could pass for another message's sentinel and be
        # swapped for that message's text: serve such a request as SGLang would.
        _warn_once("sentinel", "a message holds U+F0010/U+F0011; served unsegmented")
        return original(self, request, tools, is_multimodal)

    piecewise = api.tokenizer
    last = len(request.messages) - 1
    contents: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    messages = []
    for i, msg in enumerate(request.messages):
        content = getattr(msg, "content", None)
        keep = (
            isinstance(content, str)
            and content
            and not (i == last and msg.role == "assistant" and request.continue_final_message)
        )
        if keep:
            ids = piecewise.segment_tokens(content)
            if api.chat.selects(len(ids)):
                key = f"{S_OPEN}{i}{S_CLOSE}"
                contents[key], texts[key] = ids, content
                msg = msg.model_copy(update={"content": key})
        messages.append(msg)
    if not contents:
        return original(self, request, tools, is_multimodal)

    tokenizer = SegmentingTokenizer(self.tokenizer_manager.tokenizer, piecewise, contents, texts)
    proxy = _Forward(self, tokenizer_manager=_Forward(self.tokenizer_manager, tokenizer=tokenizer))
    result = original(proxy, request.model_copy(update={"messages": messages}), tools, False)
    if tokenizer.spans is None:
        if tokenizer.fell_back:
            _warn_once(
                "template", "the chat template rewrites message contents; served unsegmented"
            )
        return result
    marks = api.marks(
        result.prompt_ids, tokenizer.spans, [namespace] * len(tokenizer.spans), where="chat"
    )
    request.custom_params = {**(request.custom_params or {}), **encode_marks(marks)}
    api.counters.add(requests_with_segments=1, segments_marked=len(marks))
    if capture:
        note([(m.namespace, result.prompt_ids[m.start : m.end]) for m in marks])
    return result
