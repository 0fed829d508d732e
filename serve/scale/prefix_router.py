"""Prefix-cache-aware routing across replicas (llm-d's scorer, beyond power-of-two-choices): each
replica is scored by how many of the prompt's leading blocks it probably holds (the block hash chain
the engines key their prefix caches by, remembered per replica as an LRU of chains it was sent)
against how many requests it has in flight; the best score wins.

    router = PrefixAwareRouter(num_replicas=2, block_size=16)
    r = router.choose(prompt_ids, salt)       # also counts the request in on replica r
    ...
    router.finished(r)
"""

from __future__ import annotations

import collections

from serve.core.kv_cache import block_hash


def prompt_block_hashes(token_ids: list[int], block_size: int, salt: str | None, limit: int) -> list[bytes]:
    """The chained keys of the prompt's first `limit` full blocks (the engine's prefix-cache keys)."""
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        parent = block_hash(parent, tuple(token_ids[start : start + block_size]), salt)
        out.append(parent)
    return out


class RoundRobinRouter:
    """The baseline: replicas in turn, whatever the prompt."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas
        self._next = 0

    def choose(self, token_ids: list[int], salt: str | None = None) -> int:
        r = self._next
        self._next = (r + 1) % self.num_replicas
        self.in_flight[r] += 1
        return r

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1


class PrefixAwareRouter(RoundRobinRouter):
    """score = prefix_weight * (leading blocks the replica holds / prompt blocks)
    - queue_weight * (replica's in-flight requests / (max_num_seqs)); ties go to the less loaded
    replica. `max_blocks` full blocks of a prompt are hashed at most, `remember` chains per replica."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        max_num_seqs: int = 256,
        prefix_weight: float = 1.0,
        queue_weight: float = 1.0,
        max_blocks: int = 64,
        remember: int = 100_000,
    ) -> None:
        super().__init__(num_replicas)
        self.block_size, self.max_num_seqs, self.max_blocks, self.remember = (
            block_size,
            max_num_seqs,
            max_blocks,
            remember,
        )
        self.prefix_weight, self.queue_weight = prefix_weight, queue_weight
        self.cached: list[collections.OrderedDict[bytes, None]] = [
            collections.OrderedDict() for _ in range(num_replicas)
        ]

    def matched_blocks(self, replica: int, hashes: list[bytes]) -> int:
        cache, n = self.cached[replica], 0
        while n < len(hashes) and hashes[n] in cache:
            n += 1
        return n

    def add_replica(self) -> int:
        """A new replica's slot (replicas that come and go keep their slots' numbers)."""
        self.in_flight.append(0)
        self.cached.append(collections.OrderedDict())
        self.num_replicas += 1
        return self.num_replicas - 1

    def forget(self, replica: int) -> None:
        """The replica is gone: what it cached is too."""
        self.cached[replica].clear()

    def choose(self, token_ids: list[int], salt: str | None = None, among: list[int] | None = None) -> int:
        """The best replica of `among` (default: all)."""
        hashes = prompt_block_hashes(token_ids, self.block_size, salt, self.max_blocks)

        def score(r: int) -> tuple[float, int, int]:
            prefix = self.matched_blocks(r, hashes) / len(hashes) if hashes else 0.0
            load = self.in_flight[r] / self.max_num_seqs
            return (self.prefix_weight * prefix - self.queue_weight * load, -self.in_flight[r], -r)

        best = max(range(self.num_replicas) if among is None else among, key=score)
        cache = self.cached[best]
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.remember:
            cache.popitem(last=False)
        self.in_flight[best] += 1
        return best
