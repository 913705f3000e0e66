"""A free list of page ids with reference counts: plain Python ints, testable without tensors.

A page is used while anything holds a reference to it: the request that allocated it, and (prefix
caching, backend/memory/prefix_cache.py) every cache entry and every other request that shares it.
`allocate` hands out pages with one reference, `retain` adds one, `free` drops one; a page returns to
the free list only when its last reference goes, so a page in use is never freed.
"""

from __future__ import annotations

from collections import Counter


class OutOfPages(RuntimeError):
    """A pool has fewer free pages than an allocation needs; nothing was allocated."""

    def __init__(self, pool: str, needed: int, free: int):
        super().__init__(f"pool {pool!r}: needed {needed} pages, {free} free")
        self.pool = pool
        self.needed = needed
        self.free = free


class PageAllocator:
    """Hands out page ids in [0, num_pages); all-or-nothing allocation."""

    def __init__(self, name: str, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"pool {name!r} needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs: Counter[int] = Counter()  # used page -> references

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(self.name, n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._refs.update(dict.fromkeys(pages, 1))
        return pages

    def retain(self, pages: list[int]) -> None:
        """One more reference to each of these used pages (a sharer). A prefix-cache entry retains all of a request's
        compressed pages, so this runs in C-level loops (the check too)."""
        if not self._refs.keys() >= set(pages):
            unused = sorted(set(pages) - self._refs.keys())
            raise ValueError(f"pool {self.name!r}: page {unused[0]} retained but not in use")
        self._refs.update(pages)

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page without references is free again."""
        refs = self._refs
        if len(set(pages)) != len(pages) or not refs.keys() >= set(pages):
            self._free_one_by_one(pages)
            return
        refs.subtract(pages)
        released = [page for page in pages if not refs[page]]
        for page in released:
            del refs[page]
        self._free.extend(released)

    def _free_one_by_one(self, pages: list[int]) -> None:
        """free() of a list with repeats, or with a page not in use (which it names)."""
        for page in pages:
            if page not in self._refs:
                raise ValueError(f"pool {self.name!r}: page {page} freed twice or never allocated")
            self._refs[page] -= 1
            if not self._refs[page]:
                del self._refs[page]
                self._free.append(page)

    def check(self) -> None:
        """Every page is either free or used, never both, never lost."""
        free = set(self._free)
        assert len(free) == len(self._free), f"pool {self.name!r}: duplicate free pages"
        assert not (free & set(self._refs)), f"pool {self.name!r}: pages both free and used"
        assert all(count > 0 for count in self._refs.values()), f"pool {self.name!r}: a used page without references"
        assert len(free) + len(self._refs) == self.num_pages, (
            f"pool {self.name!r}: {len(free)} free + {len(self._refs)} used != {self.num_pages}"
        )
