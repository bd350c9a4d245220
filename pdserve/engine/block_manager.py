"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, per-sequence block tables
and reference counts (prefix caching will share blocks between sequences)."""
from collections import deque

from pdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its table covers `num_tokens` cache slots."""
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        if not self.try_allocate(seq, num_tokens):
            raise RuntimeError(f"out of KV blocks: need {self.blocks_needed(seq, num_tokens)}, "
                               f"have {len(self.free_blocks)}")

    def try_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """allocate() if there are enough free blocks (True), else change nothing (False)."""
        n = self.blocks_needed(seq, num_tokens)
        if n > len(self.free_blocks):
            return False
        for _ in range(n):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        # free in reverse so the tail blocks (least likely shared) come back first
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check_all_free(self) -> None:
        """Invariant when no request is live: every block is back on the free list."""
        used = [b for b, c in enumerate(self.ref_counts) if c]
        if used or len(self.free_blocks) != self.num_blocks:
            raise AssertionError(f"KV block leak: blocks {used[:10]} still referenced, "
                                 f"{len(self.free_blocks)}/{self.num_blocks} free")
