"""The paged KV cache's bookkeeping: fixed-size blocks, a free queue, per-sequence block tables,
reference counts, and the prefix cache (as vLLM v1 does it).

Prefix cache: once a block is full and its K/V computed, it is registered under a chained hash of
its parent's hash and its tokens (the first block's parent is the cache namespace, e.g. the
model's dtype, and the request's cache_salt). Admission walks a prompt block by block and stops at
the first miss; a candidate found by hash is a hit only if its stored key, (parent registration,
tokens), equals the prompt's, so a hash collision can only cost a miss, never return another
prefix's K/V. Parents are named by registration, not by hash: a child whose parent was evicted
and whose parent hash was taken again by other content can never match. Hit blocks are shared
read-only (new tokens always go to blocks of their own: hits are whole blocks) and counted by
reference. A freed block keeps its content: registered ones go to the back of the free queue,
unregistered ones to the front, and blocks are handed out from the front, so cached content is
evicted last, least recently freed first, and only when a block is needed."""
import itertools
from collections import OrderedDict

from pdserve.engine.sequence import Sequence


def hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The chained hash of one full block. Only picks candidates: hits compare keys."""
    return hash((parent_hash, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, namespace: tuple = ()):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace   # what else changes a block's K/V: the model's dtype, quantization
        self.ref_counts = [0] * num_blocks
        # the free queue, front first: an OrderedDict, so a cached block hit while free leaves it in O(1)
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}                       # chained hash -> registered block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple | None] = [None] * num_blocks   # (parent registration, tokens)
        self.block_entry: list[int] = [0] * num_blocks         # id of the block's current registration
        self._entries = itertools.count(1)
        # prompt tokens looked up and found, at every admission (vLLM's prefix_cache_queries / _hits)
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its table covers `num_tokens` cache slots."""
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether `seq`, taking the cached blocks `hits` first, fits `num_tokens` slots."""
        evictable = sum(1 for b in hits if self.ref_counts[b] == 0)   # free now, not once shared
        return self.blocks_needed(seq, num_tokens) - len(hits) + evictable <= len(self.free_blocks)

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
            block = self.free_blocks.popitem(last=False)[0]
            assert self.ref_counts[block] == 0
            if self.block_hash[block] is not None:
                self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def admit(self, seq: Sequence, num_tokens: int, hits: list[int]) -> None:
        """Give a waiting `seq` the cached blocks `hits` (from find_cached), then new blocks up to
        `num_tokens` slots; the caller checked can_allocate."""
        assert not seq.block_table
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
        seq.prefix.num_cached_blocks = len(hits)
        seq.prefix.parent = self.block_entry[hits[-1]] if hits else self._root(seq)
        if self.enable_caching:
            self.num_queries += seq.num_tokens
            self.num_hits += len(hits) * self.block_size
        self.allocate(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        # in reverse, so a sequence's tail blocks (least likely shared) are evicted first
        caching = self.enable_caching
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if caching and self.block_hash[block] is None:   # nothing to keep: hand it out first
                    self.free_blocks.move_to_end(block, last=False)
        seq.block_table = []
        seq.prefix.num_cached_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks of seq's table beyond `num_tokens` slots (a speculation's rejected
        drafts). They were never full of computed tokens, so never cached: back to the front."""
        keep = (num_tokens + self.block_size - 1) // self.block_size
        table = seq.block_table
        while len(table) > keep:
            block = table.pop()
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] == 0 and self.block_hash[block] is None
            self.free_blocks[block] = None
            self.free_blocks.move_to_end(block, last=False)

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- the prefix cache

    def _root(self, seq: Sequence) -> tuple:
        """The parent of a sequence's first block: what every block of it depends on besides tokens."""
        return (self.namespace, seq.params.cache_salt)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq's chained hashes of its first `num_blocks` full blocks (kept on seq: tokens only grow)."""
        hashes, bs, tokens = seq.prefix.hashes, self.block_size, seq.token_ids
        if len(hashes) < num_blocks:
            h = hashes[-1] if hashes else hash(self._root(seq))
            for i in range(len(hashes), num_blocks):
                h = hash_block(h, tuple(tokens[i * bs:(i + 1) * bs]))
                hashes.append(h)
        return hashes

    def find_cached(self, seq: Sequence) -> list[int]:
        """The cached blocks holding seq's longest cached prefix, in whole blocks and short of its
        last token (which must be computed for its logits)."""
        if not self.enable_caching:
            return []
        bs, tokens = self.block_size, seq.token_ids
        n = (seq.num_tokens - 1) // bs
        hashes = self._block_hashes(seq, n)
        parent, hits = self._root(seq), []
        for i in range(n):
            b = self.cached.get(hashes[i])
            if b is None:
                break
            key = self.block_key[b]
            if key[0] != parent or key[1] != tuple(tokens[i * bs:(i + 1) * bs]):   # a hash collision
                break
            hits.append(b)
            parent = self.block_entry[b]
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full and computed (num_computed_tokens) but not yet cached."""
        bs, tokens = self.block_size, seq.token_ids
        full = seq.num_computed_tokens // bs
        parent = seq.prefix.parent
        if parent is not None:
            hashes = self._block_hashes(seq, full)
            for i in range(seq.prefix.num_cached_blocks, full):
                b, h = seq.block_table[i], hashes[i]
                key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
                other = self.cached.get(h)
                if other is None:
                    self.cached[h] = b
                    self.block_hash[b], self.block_key[b] = h, key
                    self.block_entry[b] = parent = next(self._entries)
                elif self.block_key[other] == key:   # the same content, computed twice: chain on from it
                    parent = self.block_entry[other]
                else:                                # a hash collision: cache no more of this sequence
                    parent = None
                    break
        seq.prefix.num_cached_blocks = full
        seq.prefix.parent = parent

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = self.block_key[block] = None

    def reset_prefix_cache(self) -> dict:
        """Forget every cached block no sequence holds (they move to the front of the free queue).
        Blocks held by running sequences stay cached: they are in use, and their content is valid."""
        reset = [b for b in self.free_blocks if self.block_hash[b] is not None]
        for b in reset:
            self._evict(b)
            self.free_blocks.move_to_end(b, last=False)
        return {"reset_blocks": len(reset), "cached_blocks_in_use": len(self.cached)}

    def check_all_free(self) -> None:
        """Invariant when no request is live: every block is back on the free list."""
        used = [b for b, c in enumerate(self.ref_counts) if c]
        if used or len(self.free_blocks) != self.num_blocks:
            raise AssertionError(f"KV block leak: blocks {used[:10]} still referenced, "
                                 f"{len(self.free_blocks)}/{self.num_blocks} free")
