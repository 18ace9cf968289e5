"""Server options of the request API, parsed and validated (pure Python, no SGLang imports).

``--redknot-chat-segments`` says which messages of an OpenAI chat request become segments;
``--redknot-namespaces`` declares the namespaces requests may use (see ``namespaces.py``);
``--redknot-auto-segments`` / ``--redknot-auto-chunk-tokens`` cut unmarked ``/generate`` prompts
into content-defined chunks and make unmarked chat messages segments (see ``auto.py``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

CHAT_MODES = ("off", "messages", "min-tokens:N")
AUTO_MODES = ("off", "cdc", "cdc-edges", "cdc-docs")
AUTO_NAMESPACE = "auto"  # the namespace of automatic chunks
MIN_AUTO_CHUNK_TOKENS = 16  # smallest --redknot-auto-chunk-tokens (chunks of 4+ tokens)
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}")  # the whole name
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class ChatSegments:
    """Which chat messages are segments: none, all, or those of ``min_tokens`` tokens or more."""

    enabled: bool
    min_tokens: int = 1

    @classmethod
    def parse(cls, value: str) -> ChatSegments:
        """``off`` | ``messages`` | ``min-tokens:N`` (N >= 1); ValueError otherwise."""
        text = str(value).strip().lower()
        if text == "off":
            return cls(enabled=False)
        if text == "messages":
            return cls(enabled=True)
        if text.startswith("min-tokens:"):
            number = text.split(":", 1)[1]
            if number.isdigit() and int(number) >= 1:
                return cls(enabled=True, min_tokens=int(number))
        raise ValueError(
            f"--redknot-chat-segments {value!r} is not one of {', '.join(CHAT_MODES)} "
            "(N an integer >= 1)"
        )

    def selects(self, num_tokens: int) -> bool:
        return self.enabled and num_tokens >= self.min_tokens


@dataclass(frozen=True)
class AutoSegmentsOption:
    """Whether unmarked prompts get automatic segments, and the chunks' average length."""

    enabled: bool
    chunk_tokens: int = 256
    capture_after: int = 2  # an automatic segment is captured at its N-th miss
    capture_context: int = 64  # ... after the tokens that preceded it (kept: 0 .. this many)
    edges: bool = False  # cdc-edges: documents' edges learned from repeats (redknot.api.edges)
    documents: bool = False  # cdc-docs: and a document between two learned edges one segment

    @classmethod
    def parse(
        cls, mode: str, chunk_tokens: int, capture_after: int = 2, capture_context: int = 64
    ) -> AutoSegmentsOption:
        """``mode``: one of :data:`AUTO_MODES`; ``chunk_tokens``: an integer >= 16; ``capture_after``:
        an integer >= 1; ``capture_context``: an integer >= 0. ValueError else."""
        if mode not in AUTO_MODES:
            raise ValueError(
                f"--redknot-auto-segments {mode!r} is not one of {', '.join(AUTO_MODES)}"
            )
        if (
            isinstance(chunk_tokens, bool)
            or not isinstance(chunk_tokens, int)
            or chunk_tokens < MIN_AUTO_CHUNK_TOKENS
        ):
            raise ValueError(
                f"--redknot-auto-chunk-tokens must be an integer >= {MIN_AUTO_CHUNK_TOKENS}, "
                f"got {chunk_tokens!r}"
            )
        if (
            isinstance(capture_after, bool)
            or not isinstance(capture_after, int)
            or capture_after < 1
        ):
            raise ValueError(
                f"--redknot-auto-capture-after must be an integer >= 1, got {capture_after!r}"
            )
        if (
            isinstance(capture_context, bool)
            or not isinstance(capture_context, int)
            or capture_context < 0
        ):
            raise ValueError(
                "--redknot-auto-capture-context must be an integer >= 0, got "
                f"{capture_context!r}"
            )
        return cls(
            enabled=mode != "off",
            chunk_tokens=chunk_tokens,
            capture_after=capture_after,
            capture_context=capture_context,
            edges=mode in ("cdc-edges", "cdc-docs"),
            documents=mode == "cdc-docs",
        )


@functools.lru_cache(maxsize=1024)
def valid_namespace_name(name: str) -> bool:
    """Whether the string ``name`` is a valid namespace name (remembered: every marked span
    names one, and a server sees few)."""
    return NAMESPACE_PATTERN.fullmatch(name) is not None


def check_namespace_name(name: object, *, where: str = "namespace") -> str:
    """``name`` if it is a valid namespace name, else ValueError saying what is allowed."""
    if not (isinstance(name, str) and valid_namespace_name(name)):
        raise ValueError(
            f"{where} {name!r} is not a valid namespace name: use a string of 1 to 64 "
            "characters from letters, digits and _ . : / -, starting with a letter or digit"
        )
    return name


def parse_namespaces(value: str | None) -> tuple[str, ...] | None:
    """The comma-separated ``--redknot-namespaces`` list (``None`` when not given)."""
    if value is None:
        return None
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if not names:
        raise ValueError("--redknot-namespaces is empty: give comma-separated names or omit it")
    for name in names:
        check_namespace_name(name, where="--redknot-namespaces entry")
    return tuple(dict.fromkeys([DEFAULT_NAMESPACE, *names]))
