"""Where device memory goes while serving: bytes of weights and of the KV pool per device, and the
rest (what `device.memory_stats()` says is in use on an accelerator; the process's resident set on
CPU, where all devices share one heap). Runs in the engine-core process, which owns the arrays."""

from __future__ import annotations

import os
from typing import Any

import jax


def process_rss_bytes() -> int:
    """This process's resident set size (Linux /proc; the peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _bytes_by_device(tree: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                key = str(shard.device)
                out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def memory_breakdown(weights: Any, kv_cache: Any) -> dict[str, Any]:
    """{"devices": [{device, weights, kv_pool, in_use, peak_in_use, other}], "process_rss": bytes}:
    `peak_in_use` (the allocator's high-water mark, steps' activations included) checks the plan
    of serve.core.kv_budget on the device. `in_use`, `peak_in_use` and `other` are None on devices
    without memory_stats (CPU): there the process RSS minus the arrays is the rest."""
    w, kv = _bytes_by_device(weights), _bytes_by_device(kv_cache)
    devices = []
    for device in jax.local_devices():
        key = str(device)
        stats = device.memory_stats() if device.platform != "cpu" else None
        in_use = int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
        peak = int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
        entry: dict[str, Any] = {"device": key, "weights": w.get(key, 0), "kv_pool": kv.get(key, 0), "in_use": in_use}
        entry["peak_in_use"] = peak
        entry["other"] = None if in_use is None else max(in_use - entry["weights"] - entry["kv_pool"], 0)
        devices.append(entry)
    rss = process_rss_bytes()
    arrays = sum(w.values()) + sum(kv.values())
    return {"devices": devices, "process_rss": rss, "process_other": max(rss - arrays, 0)}
