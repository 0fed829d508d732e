"""Blocks a prefill engine offers to decode engines, until they are pulled or expire.

A decode engine that never comes (it died, the client went away) must not hold the prefill
engine's blocks forever: every offer carries a deadline, and `expire` hands back the offers past it
so the caller frees their blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Offer:
    """One request's offered blocks and whatever its transport needs to release them."""

    request_id: str
    block_ids: tuple[int, ...]
    deadline: float
    payload: Any = None


class OfferTable:
    """Offers by request id, with the counts vLLM-style metrics report (blocks offered/pulled/expired)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"kv offer timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.clock = clock
        self.offers: dict[str, Offer] = {}
        self.blocks_offered = 0
        self.blocks_pulled = 0
        self.blocks_expired = 0

    def __len__(self) -> int:
        return len(self.offers)

    def offer(self, request_id: str, block_ids: list[int], payload: Any = None) -> Offer:
        """Hold `block_ids` for `request_id` until pulled or `timeout_s` from now."""
        if request_id in self.offers:
            raise ValueError(f"request {request_id!r} already has offered blocks")
        offer = Offer(request_id, tuple(block_ids), self.clock() + self.timeout_s, payload)
        self.offers[request_id] = offer
        self.blocks_offered += len(block_ids)
        return offer

    def pulled(self, request_id: str) -> Offer | None:
        """The offer a decode engine has just pulled (None if it already expired): free its blocks."""
        offer = self.offers.pop(request_id, None)
        if offer is not None:
            self.blocks_pulled += len(offer.block_ids)
        return offer

    def expire(self) -> list[Offer]:
        """The offers past their deadline, removed: free their blocks."""
        now = self.clock()
        gone = [o for o in self.offers.values() if o.deadline <= now]
        for o in gone:
            del self.offers[o.request_id]
            self.blocks_expired += len(o.block_ids)
        return gone

    def expire_all(self) -> list[Offer]:
        """Every offer, removed and counted as expired (the engine is going away)."""
        gone = list(self.offers.values())
        self.offers.clear()
        self.blocks_expired += sum(len(o.block_ids) for o in gone)
        return gone

    @property
    def num_held_blocks(self) -> int:
        return sum(len(o.block_ids) for o in self.offers.values())
