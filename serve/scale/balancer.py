"""The proxy's choice among several engines of one role: least outstanding requests (vLLM's router)."""

from __future__ import annotations

import itertools


class LeastOutstanding:
    """Engine URLs with their in-flight request counts; ties go round-robin."""

    def __init__(self, urls: list[str], role: str) -> None:
        if not urls:
            raise ValueError(f"--{role} needs at least one URL")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self.outstanding = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def ranked(self) -> list[str]:
        """Every URL, least loaded first (the next to try when one is unreachable)."""
        start = next(self._turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        return sorted(rotated, key=lambda u: self.outstanding[u])

    def acquire(self, url: str) -> None:
        """One more request outstanding on `url`."""
        self.outstanding[url] += 1

    def release(self, url: str) -> None:
        """One request on `url` is over."""
        self.outstanding[url] -= 1
