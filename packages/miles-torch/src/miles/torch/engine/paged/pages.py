"""The page pool of the KV cache: allocation, reference counts and a prefix cache over blocks.

A page holds `page_size` consecutive tokens of one sequence. A full page is named by the hash
of its tokens chained with the previous page's hash, so equal prefixes map to equal chains (the
radix idea, flattened); a request's cache_salt starts its chain, so salts never share. A page
whose last user leaves keeps its contents and its hash until it is allocated again: a later
request with the same prefix (the next turn of a conversation, another sample of the same prompt)
takes it back instead of computing it again. Pages in use by several sequences are shared
read-only; a sequence never writes into a page it shares, because only full pages are shared and
a sequence's last token is always computed into a page of its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from miles.torch.engine.paged.sequence import Sequence

# Page 0 is never handed out: padded rows of a CUDA-graph batch write their K/V there.
SCRATCH_PAGE = 0


def block_hash(tokens: list[int], previous: int | None) -> int:
    # Python's hash of ints and tuples is not salted: stable within and across processes.
    return hash((previous, tuple(tokens)))


def chain_start(seq: Sequence) -> int | None:
    """The hash a sequence's chain of pages starts from: its request's cache_salt, so prefixes
    of differently salted requests never meet (a stable digest: str hashes vary by process)."""
    salt = seq.request.cache_salt
    if salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


class PagePool:
    """Page ids 1 .. num_pages-1, their reference counts and the prefix cache."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        # Free pages, least recently freed first; cached ones keep their hash until reused.
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._hash_of: dict[int, int] = {}  # page -> hash of its (full) contents
        self._page_of: dict[int, int] = {}  # hash -> page
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # page -> its tokens (a hash can collide)
        self.lookups = 0  # prompt tokens looked up, and found, since the last reset
        self.hits = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slots(self, seq: Sequence, upto: int) -> list[int]:
        """The cache slots (page x page_size + offset) of `seq`'s first `upto` tokens."""
        size = self.page_size
        return [seq.pages[p // size] * size + p % size for p in range(upto)]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def clear_cache(self) -> None:
        """Forget every cached prefix (after a weight update, cached K/V are stale)."""
        self._hash_of.clear()
        self._page_of.clear()
        self._tokens_of.clear()

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the prefix cache that hold `seq`'s leading full pages, stopping so that at
        least its last token is left to compute; none for a sequence that still needs its prompt
        logprobs (every prompt position's logits, which the cache does not keep)."""
        tokens, size = seq.tokens, self.page_size
        pages: list[int] = []
        if seq.needs_prompt_logprobs:
            return pages
        previous = chain_start(seq)
        for start in range(0, len(tokens) - 1 - size + 1, size):
            previous = block_hash(tokens[start : start + size], previous)
            page = self._page_of.get(previous)
            if page is None or self._tokens_of[page] != tuple(tokens[start : start + size]):
                break
            pages.append(page)
        return pages

    def can_admit(self, seq: Sequence) -> bool:
        cached = self.cached_prefix(seq)
        reusable_free = sum(1 for p in cached if self._refs[p] == 0)
        needed = self.pages_for(len(seq)) - len(cached)
        return needed + reusable_free <= self.num_free

    def admit(self, seq: Sequence) -> None:
        """Give `seq` pages for all its tokens: cached prefix pages first, then fresh ones."""
        cached = self.cached_prefix(seq)
        for page in cached:
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1
        seq.pages = list(cached)
        seq.num_computed = len(cached) * self.page_size
        if not seq.response:  # first admission: count the prompt's hit
            self.lookups += len(seq.request.prompt_ids)
            self.hits += seq.num_computed
            seq.cached_tokens = seq.num_computed
        self.grow(seq, len(seq))

    def register(self, seq: Sequence, upto: int) -> None:
        """Name `seq`'s full pages among its first `upto` tokens in the prefix cache.

        Called when a step is planned, for the tokens that step computes: a request admitted
        later in the same step (another sample of the group) shares them at once. That is safe
        because every layer writes the step's K/V before any of the step's attention reads them.
        """
        tokens, size = seq.tokens, self.page_size
        previous = chain_start(seq)
        for i in range(min(len(seq.pages), upto // size)):
            previous = block_hash(tokens[i * size : (i + 1) * size], previous)
            page = seq.pages[i]
            if self._hash_of.get(page) == previous:
                continue
            if previous in self._page_of:  # the same contents already cached in another page
                continue
            self._drop_hash(page)
            self._hash_of[page], self._page_of[previous] = previous, page
            self._tokens_of[page] = tuple(tokens[i * size : (i + 1) * size])

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room in `seq`'s pages for `num_tokens` tokens; the caller checked `num_free`."""
        missing = self.pages_for(num_tokens) - len(seq.pages)
        if missing > self.num_free:
            raise RuntimeError(f"{missing} pages needed, {self.num_free} free")
        for _ in range(missing):
            page, _ = self._free.popitem(last=False)
            self._drop_hash(page)
            self._refs[page] = 1
            seq.pages.append(page)

    def release(self, seq: Sequence) -> None:
        """Return `seq`'s pages; cached ones stay findable until they are reused."""
        for page in reversed(seq.pages):  # the tail is freed first, so it is reused first
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None
                if page not in self._hash_of:  # nothing to find in it: reuse it first
                    self._free.move_to_end(page, last=False)
        seq.pages = []
        seq.num_computed = 0

    def _drop_hash(self, page: int) -> None:
        h = self._hash_of.pop(page, None)
        self._tokens_of.pop(page, None)
        if h is not None and self._page_of.get(h) == page:
            del self._page_of[h]
