"""A free list of page ids: plain Python ints, testable without tensors."""

from __future__ import annotations


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
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(self.name, n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"pool {self.name!r}: page {page} freed twice or never allocated")
            self._used.remove(page)
            self._free.append(page)

    def check(self) -> None:
        """Every page is either free or used, never both, never lost."""
        free = set(self._free)
        assert len(free) == len(self._free), f"pool {self.name!r}: duplicate free pages"
        assert not (free & self._used), f"pool {self.name!r}: pages both free and used"
        assert len(free) + len(self._used) == self.num_pages, (
            f"pool {self.name!r}: {len(free)} free + {len(self._used)} used != {self.num_pages}"
        )
