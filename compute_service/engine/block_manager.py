"""Paged KV-cache book-keeping: a free list of fixed-size blocks and per-sequence block tables.

Plain Python; the KV tensors themselves live in `kv_cache.py`. A sequence's
token at position p lives in block `block_table[p // block_size]`, offset
`p % block_size`.
"""
from __future__ import annotations

from collections import deque

from compute_service.engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks to sequences and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Appends blocks to `seq.block_table` until `num_tokens` tokens fit; False, with nothing changed,
        when too few blocks are free (one call per sequence per step: the check and the growth together)."""
        missing = -(-num_tokens // self.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        free = self._free
        if missing > len(free):
            return False
        table = seq.block_table
        for _ in range(missing):
            table.append(free.popleft())
        return True

    def free(self, seq: Sequence) -> None:
        """Returns every block of `seq` to the free list."""
        self._free.extend(seq.block_table)
        seq.block_table = []
