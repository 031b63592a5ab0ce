"""The page allocator of the GPU adapter pool: a free list of fixed-size page ids.

Plain Python, no torch: the pool tensor itself and the byte layout inside a page
belong to `kernels.paged`; this only decides which page ids an adapter owns.
"""
from __future__ import annotations

from collections import deque


class PageAllocator:
    """Hands out page ids `[0, num_pages)` all-or-nothing and takes them back."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the adapter pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        """Takes `n` pages at once; never a partial grant (two half-granted loads could wait on each other)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Returns pages; freeing a page that is not in use is a book-keeping bug and raises."""
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed but not in use")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)
