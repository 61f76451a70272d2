"""The page pool: reference-counted KV pages handed out as a request's frontier grows.

Pages are never reserved for a request's whole `prompt + max_tokens` footprint; `ensure`
tops a page table up to cover the positions about to be written. Every page comes back through
`release`, and `num_free_pages == num_pages` is the invariant tests assert after every run.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        """Extra pages `page_table` needs to hold positions [0, num_tokens)."""
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def can_ensure(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(page_table, num_tokens) <= len(self._free)

    def ensure(self, page_table: list[int], num_tokens: int) -> None:
        """Grow `page_table` in place to cover positions [0, num_tokens)."""
        need = self.pages_needed(page_table, num_tokens)
        if need > len(self._free):
            raise OutOfPages(f"need {need} pages, {len(self._free)} free")
        for _ in range(need):
            page = self._free.popleft()
            self._refcount[page] = 1
            page_table.append(page)

    def release(self, page_table: list[int]) -> None:
        """Drop one reference to every page of `page_table` and empty it."""
        for page in page_table:
            self._refcount[page] -= 1
            if self._refcount[page] < 0:
                raise AssertionError(f"page {page} released twice")
            if self._refcount[page] == 0:
                self._free.append(page)
        page_table.clear()
