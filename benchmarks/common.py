"""Timing helpers shared by the benchmark scripts: wall-clock medians and measured device ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def time_fn(fn: Callable[..., Any], *args: Any, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds per call of an already-jitted function (compilation excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def device_seconds(fn: Callable[..., Any], *args: Any, iters: int = 20) -> float:
    """Seconds per call measured on the device: `iters` calls chained inside one jitted loop (each
    call's first argument perturbed by the previous result, so none is hoisted), minus a one-call
    loop; dispatch and launch overhead cancel out."""

    def looped(n: int) -> Callable[..., Any]:
        def run(first: jax.Array, *rest: Any) -> jax.Array:
            def body(_: int, acc: jax.Array) -> jax.Array:
                out = fn((first + (acc * 0).astype(first.dtype)), *rest)
                return acc + jnp.sum(out.astype(jnp.float32)) * 1e-30

            return jax.lax.fori_loop(0, n, body, jnp.zeros((), jnp.float32))

        return jax.jit(run)

    one, many = looped(1), looped(iters)
    return max((time_fn(many, *args, iters=5) - time_fn(one, *args, iters=5)) / (iters - 1), 1e-9)


def matmul_peak_tflops(n: int = 8192, dtype: jnp.dtype = jnp.bfloat16, iters: int = 10) -> float:
    """Measured dense matmul rate (TFLOP/s) on random data: the ceiling MFU and kernels are compared to."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), dtype)
    b = jax.random.normal(k2, (n, n), dtype)
    seconds = time_fn(jax.jit(jnp.matmul), a, b, iters=iters)
    return 2 * n**3 / seconds / 1e12


def copy_bandwidth_gbs(nbytes: int = 2**31, iters: int = 10) -> float:
    """Measured device-to-device copy bandwidth (GB/s, bytes read + written)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    seconds = time_fn(jax.jit(lambda x: x + 1), x, iters=iters)
    return 2 * nbytes / seconds / 1e9
