"""The ingress's engine replicas on Ray: start, route, drain, replace, and scale them on the SLO.

Replicas are plain Ray actors the ingress owns (so it, not Ray Serve, sets their number), each a
slot of a `PrefixAwareRouter`. Every `metrics_interval_s` the control loop asks the ready replicas
for their recent TTFT/ITL samples and queue, feeds one deployment-wide `MetricsSample` to the
`SloAutoscaler`, and reconciles: new replicas join the router once their engine is up; a replica
to remove first leaves the router, then finishes its in-flight requests (up to `drain_timeout_s`)
before its engine stops; a replica that dies is dropped and, the desired count unchanged, replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from serve.scale.autoscale import MetricsSample, SloAutoscaler
from serve.scale.autoscale_args import PoolConfig
from serve.scale.prefix_router import PrefixAwareRouter

log = logging.getLogger(__name__)


def p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def merge_samples(now: float, reports: list[dict[str, Any]]) -> MetricsSample:
    """One deployment-wide sample from the replicas' `metrics()` reports: P95s over all their
    latencies, the queues summed, KV usage averaged."""
    ttft = [v for r in reports for v in r["ttft"]]
    itl = [v for r in reports for v in r["itl"]]
    waiting = sum(r["num_waiting"] for r in reports)
    kv = sum(r["kv_usage"] for r in reports) / len(reports) if reports else 0.0
    return MetricsSample(now, p95(ttft), p95(itl), float(waiting), kv)


class ReplicaPool:
    """The live replicas, their router slots, and the control loop that sizes them."""

    def __init__(
        self,
        make_actor: Callable[[str], ActorHandle],
        config: PoolConfig,
        initial: int,
        block_size: int,
        max_num_seqs: int,
    ) -> None:
        self.make_actor, self.config = make_actor, config
        self.autoscaler = SloAutoscaler(config.autoscale)
        self.desired = min(max(initial, config.autoscale.min_replicas), config.autoscale.max_replicas)
        self.router = PrefixAwareRouter(0, block_size, max_num_seqs=max_num_seqs)
        self.actors: dict[int, ActorHandle] = {}  # router slot -> ready replica taking requests
        self.names: dict[int, str] = {}
        self.starting = 0
        self.draining: set[int] = set()
        self.retried = 0  # requests moved to another replica because theirs died before answering
        self.ready = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """Starts the desired replicas (returns once they are up) and the control loop."""
        self.reconcile()
        await self.ready.wait()
        self._spawn(self.control_loop())

    def choose(self, token_ids: list[int], salt: str | None) -> tuple[int, ActorHandle]:
        """The slot and actor for a request (counted in flight until `finished`)."""
        if not self.actors:
            raise RuntimeError("no engine replica is ready")
        r = self.router.choose(token_ids, salt, among=list(self.actors))
        return r, self.actors[r]

    def finished(self, slot: int) -> None:
        self.router.finished(slot)

    def lost(self, slot: int) -> None:
        """The replica in `slot` died: it takes no more requests; the loop replaces it."""
        actor = self.actors.pop(slot, None)
        if actor is not None:
            log.warning("engine replica %s died", self.names[slot])
            self.router.forget(slot)
            with contextlib.suppress(Exception):
                ray.kill(actor)
            self.reconcile()

    def reconcile(self) -> None:
        """Starts replicas until the ready and starting ones make `desired`; drains the least busy
        ready ones past it (a replica still starting is drained once it is up)."""
        for _ in range(self.desired - len(self.actors) - self.starting):
            self.starting += 1
            self._spawn(self._add())
        by_load = sorted(self.actors, key=lambda s: self.router.in_flight[s])
        for slot in by_load[: max(len(self.actors) - self.desired, 0)]:
            self._spawn(self._drain(slot))

    async def _add(self) -> None:
        name = f"jaxinfra-engine-{uuid.uuid4().hex[:8]}"
        actor = self.make_actor(name)
        try:
            await actor.ready.remote()
        except ray.exceptions.RayError:
            log.exception("engine replica %s failed to start", name)
            with contextlib.suppress(Exception):
                ray.kill(actor)
            self.starting -= 1
            return
        self.starting -= 1
        slot = self.router.add_replica()
        self.actors[slot], self.names[slot] = actor, name
        log.info("engine replica %s ready (%d ready)", name, len(self.actors))
        if len(self.actors) >= self.desired:
            self.ready.set()

    async def _drain(self, slot: int) -> None:
        """Out of the router now; stopped once its requests finish or the drain timeout passes."""
        actor = self.actors.pop(slot)
        self.draining.add(slot)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.router.in_flight[slot] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.stop.remote(), self.config.poll_timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        self.router.forget(slot)
        self.draining.discard(slot)
        log.info("engine replica %s removed (%d ready)", self.names[slot], len(self.actors))

    async def sample(self) -> MetricsSample:
        """Polls the ready replicas; one that does not answer is lost."""
        slots = list(self.actors)
        reports = await asyncio.gather(
            *(
                asyncio.wait_for(
                    self.actors[s].metrics.remote(self.config.look_back_period_s), self.config.poll_timeout_s
                )
                for s in slots
            ),
            return_exceptions=True,
        )
        ok: list[dict[str, Any]] = []
        for slot, report in zip(slots, reports, strict=True):
            if isinstance(report, BaseException):
                self.lost(slot)
            else:
                ok.append(report)
        return merge_samples(time.monotonic(), ok)

    async def step(self) -> None:
        """One poll of the control loop: sample, decide, reconcile."""
        self.autoscaler.observe(await self.sample())
        target = self.autoscaler.decide(self.desired)
        if target != self.desired:
            log.info("autoscaling %d -> %d replicas", self.desired, target)
            self.desired = target
        self.reconcile()

    async def control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                await self.step()
            except Exception:
                log.exception("autoscaling step failed")

    def status(self) -> dict[str, Any]:
        return {
            "desired": self.desired,
            "ready": [{"name": self.names[s], "in_flight": self.router.in_flight[s]} for s in sorted(self.actors)],
            "starting": self.starting,
            "draining": len(self.draining),
            "retried": self.retried,
            "min_replicas": self.config.autoscale.min_replicas,
            "max_replicas": self.config.autoscale.max_replicas,
        }
