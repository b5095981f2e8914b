"""Paged KV-cache bookkeeping: which physical blocks hold a sequence's tokens, shared prefixes, LRU eviction.

A sequence's KV lives in fixed-size blocks listed in its block table. A *full* block is identified by a chained
hash of everything up to and including it, so two sequences with the same prefix can share those blocks.
Image placeholders are one repeated token id whatever the picture, so the hash of a block also covers the
content hash of every image whose placeholders overlap it: the same text with another image of the same size
never shares a block from the image on. Blocks nobody references stay cached (findable by hash) until the free
list hands them out again, least recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from fovea.core.request import MMSpan


def block_hashes(
    token_ids: Sequence[int], block_size: int, mm_spans: Sequence[MMSpan] = (), salt: bytes = b""
) -> list[bytes]:
    """One chained digest per full block of `token_ids` (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, block_size, mm_spans, salt)


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, mm_spans: Sequence[MMSpan] = (), salt: bytes = b""
) -> list[bytes]:
    """Appends to `hashes` the digests of the full blocks of `token_ids` it does not cover yet (a sequence
    grows one token at a time; its earlier digests never change). `salt` starts the chain: a LoRA adapter's
    requests compute other KV for the same tokens, so their blocks are found only by requests of that adapter.

    blake2b rather than hash(): stable across processes (str hashes are salted per process) and wide enough
    that a crafted prompt cannot collide into another user's cached blocks.
    """
    parent = hashes[-1] if hashes else salt
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(struct.pack(f"<{block_size}q", *token_ids[start:end]))
        for span in mm_spans:
            if span.start < end and span.start + span.length > start:
                digest.update(b"\x00image:" + span.content_hash.encode())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix. The block holding the last token is never taken from the
        cache: that token must be computed again so the model yields logits for it."""
        if not self.enable_prefix_caching:
            return []
        prefix = []
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            prefix.append(block)
        return prefix

    def adopt_cached(
        self, table: list[int], hashes: list[bytes], first: int, num_tokens: int, keep_free: int = 0
    ) -> int:
        """A running prefill's blocks from index `first` on, replaced by cached blocks of the same hashes while
        there are any (computed by another sequence since this one was admitted; the block of the last token is
        never taken, as in cached_prefix), and while `keep_free` blocks stay free (a cached block no sequence
        holds sits in the free list: taking it leaves one fewer). Its own blocks there hold nothing registered
        and go back to the free list first in line. Returns how many blocks were taken."""
        if not self.enable_prefix_caching:
            return 0
        taken = 0
        for index in range(first, min(len(hashes), (num_tokens - 1) // self.block_size)):
            block = self.cached.get(hashes[index])
            if block is None:
                break
            freed = index < len(table) and self.ref_counts[table[index]] == 1  # its own block there goes back
            if len(self.free) - (self.ref_counts[block] == 0) + freed < keep_free:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            if index < len(table):
                own = table[index]
                self.ref_counts[own] -= 1
                if self.ref_counts[own] == 0:
                    self.free[own] = None
                    self.free.move_to_end(own, last=False)  # nothing cached in it: the first to hand out
                table[index] = block
            else:
                table.append(block)
            taken += 1
        return taken

    def can_allocate(self, prefix: list[int], num_tokens: int, extra_blocks: int = 0) -> bool:
        """Whether a table starting with the cached `prefix` can grow to `num_tokens` tokens (plus
        `extra_blocks` spare ones)."""
        reused_free = sum(1 for b in prefix if self.ref_counts[b] == 0)  # cached but sitting in the free list
        needed = self.blocks_needed(num_tokens) - len(prefix) + extra_blocks
        return needed <= self.num_free_blocks - reused_free

    def allocate(self, prefix: list[int], num_tokens: int) -> list[int]:
        """Block table for a new sequence: the cached `prefix` blocks, then fresh ones up to `num_tokens`."""
        if not self.can_allocate(prefix, num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {num_tokens} tokens")
        table = list(prefix)
        for block in table:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        self.append_slots(table, num_tokens)
        return table

    def can_append(self, table: list[int], num_tokens: int, extra_blocks: int = 0) -> bool:
        return self.blocks_needed(num_tokens) - len(table) + extra_blocks <= self.num_free_blocks

    def append_slots(self, table: list[int], num_tokens: int) -> None:
        """Grows `table` so it can hold `num_tokens` tokens (one new block when a decode step crosses a border)."""
        while len(table) < self.blocks_needed(num_tokens):
            if not self.free:
                raise RuntimeError("no free KV block left to grow a sequence")
            table.append(self._take_free_block())

    def fork(self, table: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """A second table over the same `num_tokens` tokens: full blocks are shared, a partially filled last
        block is copied (both sequences will write different tokens into it). Returns the table and the
        (source, destination) block copy the model runner must do, if any."""
        full = num_tokens // self.block_size
        if full < len(table) and not self.free:  # checked first: a failure leaves no reference count raised
            raise RuntimeError("no free KV block left for a fork's copy of its parent's last block")
        shared = table[:full]
        for block in shared:
            self.ref_counts[block] += 1
        child = list(shared)
        if full == len(table):
            return child, None
        child.append(self._take_free_block())
        return child, (table[full], child[-1])

    def mark_computed(
        self, table: list[int], hashes: list[bytes], num_computed_tokens: int, num_registered: int = 0
    ) -> int:
        """Makes the full blocks whose KV is now written findable by later sequences, from block
        `num_registered` on; returns how many blocks are registered now. Only after the model has run over
        their tokens: a block registered at allocation could be "hit" before its KV exists."""
        upto = min(num_computed_tokens // self.block_size, len(hashes))
        for index in range(num_registered, upto):
            block = table[index]
            if self.block_hash[block] is None:
                self.block_hash[block] = hashes[index]
                if self.enable_prefix_caching:
                    self.cached.setdefault(hashes[index], block)
        return max(upto, num_registered)

    def release(self, table: list[int]) -> None:
        # Tail first: when the cache fills up, a prompt's last blocks are evicted before its shared beginning.
        for block in reversed(table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                self.free[block] = None
        table.clear()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, so later prompts compute all their KV again (vLLM's reset_prefix_cache);
        False, forgetting nothing, while a sequence holds blocks."""
        if any(self.ref_counts):
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]  # evicted: its contents are about to be overwritten
        self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
