"""Host bookkeeping of the paged KV cache: which pages are free, who holds which, and the prefix cache.

A page holds `page_size` consecutive tokens of one row (see `kv_cache.KVCache`). Pages are
reference-counted: a full page of prompt tokens is published under the hash of the whole prefix
that ends with it, so a later row whose prompt starts the same way takes the same page instead of
recomputing it. A published page that no row holds stays cached (idle) until a new page is needed
and nothing is free; then the least recently used idle page is evicted.

The pages of a row that failed may hold NaN (a diverged adapter's keys and values). They leave the
prefix cache, and once no row holds them they are zeroed before anyone takes them again (`recycle`):
attention weighs what it reads past a row's length by zero, and zero times NaN is NaN.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

PAD_PAGE = 0  # written by padding, never given to a row


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PagePool:
    """Pages 1..n_pages-1 of the cache (page 0 is padding's), and the prefix cache over them."""

    def __init__(self, n_pages: int, page_size: int, prefix_caching: bool = True):
        self.n_pages, self.page_size, self.prefix_caching = n_pages, page_size, prefix_caching
        self.lookups = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found cached
        self.reset()

    def reset(self) -> None:
        """Every page free and nothing cached, for a fresh pool on the device (the counts stay)."""
        self.free = list(range(self.n_pages - 1, PAD_PAGE, -1))  # popped from the end: low pages first
        self.refs = [0] * self.n_pages
        self.by_prefix: dict[tuple, int] = {}  # prefix key -> page
        self.prefix_of: dict[int, tuple] = {}  # page -> prefix key
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages no row holds, oldest first
        self.scores: dict[int, Any] = {}  # page -> its tokens' scores (logprobs), when a scoring row computed them
        self.spoiled: set[int] = set()  # pages a failed row held: zeroed once no row holds them
        self.to_zero: list[int] = []  # spoiled pages no row holds, waiting for `recycle`

    @property
    def capacity(self) -> int:
        """Pages a row can ever be given."""
        return self.n_pages - 1

    @property
    def available(self) -> int:
        """Pages that can be handed out now: free ones and idle cached ones (evicted on demand)."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Pages held by rows."""
        return self.capacity - self.available

    def allocate(self, n: int) -> list[int]:
        if n > self.available:
            raise RuntimeError(f"{n} KV pages asked for, {self.available} available")  # the engine reserves first
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.by_prefix[self.prefix_of.pop(page)]
                self.scores.pop(page, None)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int], failed: bool = False) -> None:
        """A row gives its pages back; `failed`: the row failed, so they are spoiled (see the module's doc)."""
        for page in pages:
            if failed:
                self.spoiled.add(page)
                if page in self.prefix_of:
                    del self.by_prefix[self.prefix_of.pop(page)]
                    self.scores.pop(page, None)
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.spoiled:
                    self.to_zero.append(page)
                elif page in self.prefix_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def recycle(self, zero: Callable[[list[int]], None]) -> None:
        """Free the spoiled pages no row holds once `zero(pages)` has zeroed them on the device."""
        if self.to_zero:
            zero(self.to_zero)
            self.spoiled.difference_update(self.to_zero)
            self.free += self.to_zero
            self.to_zero = []

    def keys(self, tokens: Sequence[int], n_pages: int, salt: int = 0) -> list[tuple]:
        """The prefix key of each of the first `n_pages` full pages: the previous key and the page's tokens.
        The first page's previous key is the `salt`: what else the keys and values depend on (the
        adapter the row runs), so rows that compute different ones never share pages."""
        keys, key = [], (salt,)
        for i in range(n_pages):
            key = (hash(key), tuple(tokens[i * self.page_size : (i + 1) * self.page_size]))
            keys.append(key)
        return keys

    def matchable(self, tokens: Sequence[int]) -> int:
        """Full pages of `tokens` a match can take: all but the one holding the last token, which must run."""
        return (len(tokens) - 1) // self.page_size if self.prefix_caching else 0

    def match(self, tokens: Sequence[int], scored: bool = False, salt: int = 0) -> list[int]:
        """Take the cached pages that hold the longest full-page prefix of `tokens`, leaving at least one
        token to run (its logits choose the first new token); with `scored`, only pages whose tokens'
        scores are cached too."""
        pages = []
        for key in self.keys(tokens, self.matchable(tokens), salt):
            page = self.by_prefix.get(key)
            if page is None or (scored and page not in self.scores):
                break
            pages.append(page)
        for page in pages:
            if self.refs[page] == 0:
                del self.idle[page]
            self.refs[page] += 1
        return pages

    def record(self, prompt_tokens: int, pages_found: int) -> None:
        """Count an admitted prompt's lookup (for the hit rate)."""
        self.lookups += prompt_tokens
        self.hits += pages_found * self.page_size

    def publish(
        self, tokens: Sequence[int], pages: Sequence[int], scores: Sequence[Any] | None = None, salt: int = 0
    ) -> None:
        """Offer the full pages of a prompt that has just been written to later rows, with the scores of
        their tokens (one entry per page) when the row was scored; `salt` as in `keys`."""
        if not self.prefix_caching:
            return
        keys = self.keys(tokens, len(tokens) // self.page_size, salt)
        for i, (key, page) in enumerate(zip(keys, pages, strict=False)):
            if key not in self.by_prefix and page not in self.prefix_of:
                self.by_prefix[key] = page
                self.prefix_of[page] = key
            if scores is not None:  # a function of the prefix alone: they serve whichever page holds it
                self.scores.setdefault(self.by_prefix[key], scores[i])

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0
