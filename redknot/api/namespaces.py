"""Which namespaces a request may name.

A namespace is *known* when it is ``default``, declared by ``--redknot-namespaces``, or (only
when that option is not given) created by registering a segment in it (``POST
/redknot/segments``). Naming any other namespace in a request is an unknown namespace: a 400
that says how to declare or create it. With ``--redknot-namespaces`` the set is closed: a
registration cannot create new namespaces, which keeps tenants from inventing their own.
The set lives in the HTTP server process and starts afresh with the server (so does the cache).
"""

from __future__ import annotations

import threading

from redknot.api.marks import SegmentMarkError
from redknot.api.options import DEFAULT_NAMESPACE, check_namespace_name, parse_namespaces


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
        """``name`` if requests may use it, else a 400 saying how to make it known."""
        try:
            check_namespace_name(name, where=where)
        except ValueError as e:
            raise SegmentMarkError(str(e)) from None
        with self._lock:
            if name in self._known:
                return name
        how = (
            "this server's namespaces are fixed by --redknot-namespaces"
            if self.closed
            else "register a segment in it first (POST /redknot/segments) to create it"
        )
        raise SegmentMarkError(
            f"{where} {name!r} is unknown: {how}; known namespaces: {self.known()}"
        )

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
            self._known.add(name)
