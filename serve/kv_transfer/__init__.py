"""Prefill/decode disaggregation: KV blocks computed by one engine, pulled by another.

base.py              KVConnectorBase: vLLM V1's connector shape (scheduler side + worker side)
blocks.py            gather / scatter whole blocks of a PagedKVCache (every layer, scales included)
offers.py            OfferTable: blocks offered to a decode engine, freed when pulled or when they expire
shm_transport.py     between engine processes of one host: blocks in POSIX shared memory, msgspec control
shm_connector.py     KVConnectorBase over shm_transport: prefill saves and offers, decode loads (or recomputes)
device_transport.py  between meshes of one JAX process: jitted gather, device_put, jitted scatter
balancer.py          LeastOutstanding: the proxy's choice among several engine URLs
proxy.py             `jaxinfra serve --role proxy`: one OpenAI endpoint over prefill and decode engines
"""
