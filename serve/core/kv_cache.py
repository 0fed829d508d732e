"""KV block manager: a fixed pool of blocks, reference counts, LRU free queue, automatic prefix caching.

A full block is keyed by sha256(parent key, its token ids, cache salt, LoRA adapter id), so equal keys
mean equal prefixes computed by the same weights; a hit is still checked against the block's own
tokens, salt, adapter and parent, so not even a hash collision can hand one prompt (or tenant, or
adapter) another's KV.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from collections.abc import Iterable

import numpy as np

from serve.core.sequence import Sequence

NO_CHAIN = -1  # a prefix that resolves to no cached block: nothing after it is cached


def block_hash(parent: bytes | None, tokens: tuple[int, ...], salt: str | None, adapter: int = 0) -> bytes:
    """A full block's key: sha256 chained from its parent's key (vLLM's scheme); `adapter`: the
    lora_int_id whose weights computed it (0: the base model's, keyed as before adapters existed)."""
    h = hashlib.sha256(parent or b"\x00")
    h.update(np.asarray(tokens, np.int64).tobytes())
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass"))
    if adapter:
        h.update(b"\x02" + adapter.to_bytes(8, "little", signed=True))
    return h.digest()


@dataclasses.dataclass(frozen=True)
class CachedBlock:
    """What a cached block holds: checked on every hit. `uid` changes each time a block is cached,
    so children of an evicted block can never chain onto its successor."""

    key: bytes
    tokens: tuple[int, ...]
    salt: str | None
    adapter: int  # lora_int_id (0: none)
    parent_uid: int | None
    uid: int


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
        self.hash_to_block: dict[bytes, int] = {}
        self.cached: dict[int, CachedBlock] = {}
        self._uids = itertools.count()
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

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

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.tokens[i * self.block_size : (i + 1) * self.block_size])

    def _lookup(self, key: bytes, tokens: tuple[int, ...], seq: Sequence, parent_uid: int | None) -> int | None:
        """The cached block holding exactly this content of `seq` (its salt and adapter) after this parent, or None."""
        block = self.hash_to_block.get(key)
        if block is None:
            return None
        c = self.cached[block]
        same = c.tokens == tokens and c.salt == seq.cache_salt and c.adapter == seq.lora_id
        return block if same and c.parent_uid == parent_uid else None

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix; returns cached tokens.

        At least the last token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return 0
        self.prefix_queries += seq.num_tokens
        parent_key, parent_uid = None, None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, i)
            key = block_hash(parent_key, tokens, seq.cache_salt, seq.lora_id)
            block = self._lookup(key, tokens, seq, parent_uid)
            if block is None:
                break
            self._take(block)
            seq.block_ids.append(block)
            seq.block_hashes.append(key)
            parent_key, parent_uid = key, self.cached[block].uid
            seq.chain_uids.append(parent_uid)
        cached = len(seq.block_ids) * self.block_size
        self.prefix_hits += cached
        return cached

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make sure the sequence owns blocks for its next `num_new_tokens`; False if the pool is short."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_ids)
        if needed > len(self.free_queue):
            return False
        for _ in range(max(needed, 0)):
            block, _ = self.free_queue.popitem(last=False)  # least recently freed first
            old = self.cached.pop(block, None)
            if old is not None and self.hash_to_block.get(old.key) == block:
                del self.hash_to_block[old.key]
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks whose tokens are all known and computed, so later sequences can share them."""
        full = min(seq.num_computed_tokens, len(seq.tokens)) // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent_key = seq.block_hashes[-1] if seq.block_hashes else None
            parent_uid = seq.chain_uids[-1] if seq.chain_uids else None
            tokens = self._block_tokens(seq, i)
            key = block_hash(parent_key, tokens, seq.cache_salt, seq.lora_id)
            seq.block_hashes.append(key)
            uid = NO_CHAIN
            if self.enable_prefix_caching and parent_uid != NO_CHAIN:
                existing = self._lookup(key, tokens, seq, parent_uid)
                block = seq.block_ids[i]
                if existing is not None:
                    uid = self.cached[existing].uid
                elif key not in self.hash_to_block and block not in self.cached:
                    uid = next(self._uids)
                    self.cached[block] = CachedBlock(key, tokens, seq.cache_salt, seq.lora_id, parent_uid, uid)
                    self.hash_to_block[key] = block
            seq.chain_uids.append(uid)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (tail first, so tails are evicted before shared prefixes)."""
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_ids = []
        seq.block_hashes = []
        seq.chain_uids = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self.hash_to_block.clear()
        self.cached.clear()

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError if any bookkeeping disagrees with the live sequences' block lists."""
        owners: collections.Counter[int] = collections.Counter()
        holders: dict[int, set[int]] = collections.defaultdict(set)
        for seq in live:
            assert len(set(seq.block_ids)) == len(seq.block_ids), f"seq {seq.seq_id} holds a block twice"
            assert len(seq.block_hashes) == len(seq.chain_uids) <= len(seq.block_ids), f"seq {seq.seq_id} keys"
            for b in seq.block_ids:
                owners[b] += 1
                holders[b].add(seq.seq_id)
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == owners[b], f"block {b}: ref {self.ref_counts[b]} != owners {owners[b]}"
            assert (b in self.free_queue) == (owners[b] == 0), f"block {b}: free-queue membership is wrong"
            if len(holders[b]) > 1:
                assert b in self.cached, f"block {b} is shared by {holders[b]} but holds no cached prefix"
        for key, b in self.hash_to_block.items():
            assert self.cached[b].key == key, f"block {b}: hash maps disagree"
        assert len({c.uid for c in self.cached.values()}) == len(self.cached), "cached uids repeat"
