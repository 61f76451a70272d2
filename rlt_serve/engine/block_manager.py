"""The page pool: reference-counted KV pages handed out as a request's frontier grows.

Pages are never reserved for a request's whole `prompt + max_tokens` footprint; `ensure` tops a
page table up to cover the positions about to be written. With prefix caching, a full page whose
tokens finished every depth is registered under its chain hash; when its last reference goes it
stays cached (evictable, LRU) until the pool needs it. `num_free_pages == num_pages` (cached
pages count as free) is the invariant tests assert after every run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


class OutOfPages(RuntimeError):
    pass


def chain_hash(prev: bytes, token_ids: list[int], salt: bytes) -> bytes:
    """Stable across processes (PD workers must agree), unlike Python's hash()."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev)
    h.update(salt)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_pages))  # holding nothing reusable
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # refcount 0, hashed; LRU first
        self._refcount = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._cached_free)

    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        """Extra pages `page_table` needs to hold positions [0, num_tokens)."""
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def can_ensure(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(page_table, num_tokens) <= self.num_free_pages

    def ensure(self, page_table: list[int], num_tokens: int) -> None:
        """Grow `page_table` in place to cover positions [0, num_tokens)."""
        need = self.pages_needed(page_table, num_tokens)
        if need > self.num_free_pages:
            raise OutOfPages(f"need {need} pages, {self.num_free_pages} free")
        for _ in range(need):
            page_table.append(self._take())

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the least recently used cached page
            page, _ = self._cached_free.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        self._refcount[page] = 1
        return page

    def release(self, page_table: list[int]) -> None:
        """Drop one reference to every page of `page_table` and empty it."""
        for page in page_table:
            self._refcount[page] -= 1
            if self._refcount[page] < 0:
                raise AssertionError(f"page {page} released twice")
            if self._refcount[page] == 0:
                if page in self._hash_of:
                    self._cached_free[page] = None
                else:
                    self._free.append(page)
        page_table.clear()

    # -- prefix caching ---------------------------------------------------------------------
    def match_prefix(self, hashes: list[bytes], num_query_tokens: int) -> list[int]:
        """Take a reference to the longest cached run of `hashes`; returns those pages."""
        self.prefix_queries += num_query_tokens
        pages: list[int] = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            if self._refcount[page] == 0:
                del self._cached_free[page]
            self._refcount[page] += 1
            pages.append(page)
        self.prefix_hits += len(pages) * self.page_size
        return pages

    def register(self, page: int, h: bytes) -> None:
        """Publish a full page whose every plane is valid; the first page per hash wins."""
        if h in self._page_of or page in self._hash_of:
            return
        self._page_of[h] = page
        self._hash_of[page] = h

    def reset_prefix_cache(self) -> None:
        for page in list(self._cached_free):
            del self._page_of[self._hash_of.pop(page)]
            self._free.append(page)
        self._cached_free.clear()
