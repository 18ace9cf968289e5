"""Page allocator of the segment region: which pages are free, and which segment owns each.

Every page is either on the free list or owned by exactly one segment (its registration
serial). ``free`` checks ownership, so a page can never be freed twice or by a segment that
does not own it; ``check`` verifies the whole invariant (the tests call it after every step).
"""

from __future__ import annotations

FREE = -1


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 0, num_pages
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._owner: list[int] = [FREE] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int, owner: int) -> tuple[int, ...]:
        """``n`` free pages for ``owner`` (a registration serial, >= 0)."""
        assert owner >= 0 and n >= 0, (owner, n)
        if n > len(self._free):
            raise RuntimeError(f"segment pages: {n} asked, {len(self._free)} free")
        pages = tuple(self._free.pop() for _ in range(n))
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages: tuple[int, ...], owner: int) -> None:
        for p in pages:
            if self._owner[p] != owner:
                state = "free" if self._owner[p] == FREE else f"owned by {self._owner[p]}"
                raise RuntimeError(f"segment page {p} freed by {owner} but it is {state}")
        for p in pages:
            self._owner[p] = FREE
            self._free.append(p)

    def owner_of(self, page: int) -> int:
        return self._owner[page]

    def check(self, owned: dict[int, tuple[int, ...]]) -> None:
        """Assert that ``owned`` (serial -> pages) plus the free list cover every page once."""
        seen = sorted(self._free) + sorted(p for pages in owned.values() for p in pages)
        assert sorted(seen) == list(range(self.num_pages)), "a page is lost or held twice"
        assert all(self._owner[p] == FREE for p in self._free)
        for serial, pages in owned.items():
            assert all(self._owner[p] == serial for p in pages), serial
