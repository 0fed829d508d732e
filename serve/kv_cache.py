"""KV block manager: a fixed pool of blocks, reference counts, LRU free queue, automatic prefix caching."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from serve.sequence import Sequence


def block_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """A full block's key: chained from its parent's key, so equal keys mean equal prefixes."""
    return hash((parent, tokens, salt))


class BlockManager:
    """Every block is free (ref 0, in the LRU free queue, maybe still holding a cached prefix) or owned
    (ref > 0). Full blocks are keyed by chained hashes; a new sequence reuses the longest cached chain."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.block_to_hash: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0     # tokens found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by live sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix; returns cached tokens.

        At least the last token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return 0
        bs = self.block_size
        self.prefix_queries += seq.num_tokens
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            h = block_hash(parent, tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.cache_salt)
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_ids.append(block)
            seq.block_hashes.append(h)
            parent = h
        cached = len(seq.block_ids) * bs
        self.prefix_hits += cached
        return cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make sure the sequence owns blocks for its next `num_new_tokens`; False if the pool is short."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_ids)
        if needed > len(self.free_queue):
            return False
        for _ in range(max(needed, 0)):
            block, _ = self.free_queue.popitem(last=False)  # least recently freed first
            old = self.block_to_hash.pop(block, None)
            if old is not None:
                del self.hash_to_block[old]
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks that computing has filled, so later sequences can share them."""
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.cache_salt)
            seq.block_hashes.append(h)
            block = seq.block_ids[i]
            if self.enable_prefix_caching and h not in self.hash_to_block and block not in self.block_to_hash:
                self.hash_to_block[h] = block
                self.block_to_hash[block] = h

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (tail first, so tails are evicted before shared prefixes)."""
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the live sequences' block lists."""
        owners = collections.Counter()
        holders: dict[int, set[int]] = collections.defaultdict(set)
        for seq in live:
            assert len(set(seq.block_ids)) == len(seq.block_ids), f"seq {seq.seq_id} holds a block twice"
            for b in seq.block_ids:
                owners[b] += 1
                holders[b].add(seq.seq_id)
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == owners[b], f"block {b}: ref {self.ref_counts[b]} != owners {owners[b]}"
            assert (b in self.free_queue) == (owners[b] == 0), f"block {b}: free-queue membership is wrong"
            if len(holders[b]) > 1:
                assert b in self.block_to_hash, f"block {b} is shared by {holders[b]} but holds no cached prefix"
        assert len(self.hash_to_block) == len(self.block_to_hash)
        for h, b in self.hash_to_block.items():
            assert self.block_to_hash[b] == h, f"block {b}: hash maps disagree"
