"""Serving: KV block manager, scheduler, jitted runner, sampler, offline API and HTTP server."""
