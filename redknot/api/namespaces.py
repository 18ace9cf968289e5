"""Which namespaces a request may name.

Without ``--redknot-namespaces`` the set is open: a namespace is created on first use, by a
request that marks a segment in it or by a registration (``POST /redknot/segments``); any valid
name is accepted. With ``--redknot-namespaces`` the set is closed (``default`` and the declared
names): naming any other namespace is a 400 that says so, and neither requests nor
registrations create new ones, which keeps tenants from inventing their own. The set lives in
the HTTP server process and starts afresh with the server (so does the cache); an open set lists
at most ``MAX_LISTED`` created names (later ones are served, not listed).
"""

from __future__ import annotations

import threading

from redknot.api.marks import SegmentMarkError
from redknot.api.options import DEFAULT_NAMESPACE, check_namespace_name, parse_namespaces

MAX_LISTED = 1024  # created namespaces remembered for listing (names come from clients)


class NamespaceRegistry:
    def __init__(self, declared: tuple[str, ...] | None = None):
        self.closed = declared is not None
        self._known = set(declared or ()) | {DEFAULT_NAMESPACE}
        self._lock = threading.Lock()

    @classmethod
    def from_option(cls, value: str | None) -> NamespaceRegistry:
        return cls(parse_namespaces(value))

    def known(self) -> list[str]:
        with self._lock:
            return sorted(self._known)

    def require(self, name: object, *, where: str = "namespace") -> str:
        """``name`` if requests may use it (created on first use when the set is open), else a
        400 saying what is allowed."""
        if isinstance(name, str) and name in self._known:  # checked when it became known
            return name  # (a set's membership test needs no lock; every marked span asks)
        try:
            check_namespace_name(name, where=where)
        except ValueError as e:
            raise SegmentMarkError(str(e)) from None
        with self._lock:
            if name in self._known:
                return name
        if not self.closed:
            self.create(name)
            return name
        raise SegmentMarkError(
            f"{where} {name!r} is unknown: this server's namespaces are fixed by "
            f"--redknot-namespaces; known namespaces: {self.known()}"
        )

    def check(self, name: object, *, where: str = "namespace") -> str:
        """Like :meth:`require`, without creating anything (for reads: listings, statistics)."""
        if self.closed:
            return self.require(name, where=where)
        try:
            return check_namespace_name(name, where=where)
        except ValueError as e:
            raise SegmentMarkError(str(e)) from None

    def is_known(self, name: object) -> bool:
        """Whether ``name`` is in the set now (no namespace is created)."""
        with self._lock:
            return name in self._known

    def admit_registration(self, name: object) -> str:
        """``name`` for a registration: known, or creatable when the set is open."""
        if self.closed:
            return self.require(name)
        try:
            return check_namespace_name(name, where="namespace")
        except ValueError as e:
            raise SegmentMarkError(str(e)) from None

    def create(self, name: str) -> None:
        with self._lock:
            if len(self._known) < MAX_LISTED or self.closed:
                self._known.add(name)
