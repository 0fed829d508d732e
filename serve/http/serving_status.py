"""/status (JSON: what the server is doing now and over the last minute) and /dashboard (one
self-contained HTML page that draws /status every second; no external scripts)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from serve.engine.core_client import EngineDeadError
from serve.http.serving_base import OpenAIServing

DASHBOARD_HTML = resources.files("serve.http").joinpath("dashboard.html").read_text()


class ServingStatus(OpenAIServing):
    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/status", self.status, methods=["GET"])
        r.add_api_route("/dashboard", self.dashboard, methods=["GET"], response_class=HTMLResponse)
        return r

    async def status(self, request: Request) -> dict[str, Any]:
        """The server's state; a tenant that is not an operator sees only its own rows of the tenant
        table and of the slowest requests."""
        state, engine = self.state, self.engine
        memory, stats = None, None
        if engine.healthy:
            with contextlib.suppress(EngineDeadError):
                memory, stats = await engine.call("memory"), await engine.call("stats")
        live = state.metrics.live.snapshot(stats=stats)
        tenants = state.quotas.snapshot(state.keys.tenants() if state.keys else ())
        viewer = getattr(request.state, "tenant", None)
        if viewer is not None and not viewer.operator:
            tenants = {name: row for name, row in tenants.items() if name == viewer.name}
            live["slowest_requests"] = [r for r in live["slowest_requests"] if r["tenant"] == viewer.name]
        return {
            "model": state.model_name,
            "uptime_s": round(time.time() - state.created, 1),
            "healthy": engine.healthy,
            "draining": state.drain.draining,
            "in_flight_sequences": state.in_flight,
            "capacity_sequences": state.capacity,
            "num_blocks": engine.num_blocks,
            "engine_args": dataclasses.asdict(engine.args),
            **live,
            "memory": memory,
            "tenants": tenants,
        }

    async def dashboard(self) -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)
