"""Shared fixtures. jax runs on CPU with float32 matmuls at full precision; nothing reaches the network;
one compilation cache serves the whole run; the run's slowest files are reported against CI's budget."""

import os
import socket

import pytest

from tests import run_cache, run_report

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    run_cache.configure(config)
    run_report.register(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    run_cache.configure_node(node)


_LOCAL = ("127.", "::1", "localhost", "0.0.0.0")
_connect = socket.socket.connect


def _guarded_connect(self: socket.socket, address) -> None:
    """Loopback and local sockets only: a test that reaches for the network fails at once."""
    if self.family in (socket.AF_INET, socket.AF_INET6) and not str(address[0]).startswith(_LOCAL):
        raise OSError(f"tests may not use the network (connect to {address[0]!r})")
    return _connect(self, address)


@pytest.fixture(autouse=True, scope="session")
def _no_network():
    socket.socket.connect = _guarded_connect
    yield
    socket.socket.connect = _connect


# Files that take a minute or more on a 2-core machine: scheduled first (pytest-randomly still shuffles
# the rest and every file's tests), so that no xdist worker ends the run alone on one of them while the
# other idles (with --dist loadfile a file runs whole on one worker; --no-loadscope-reorder, in the
# Makefile, keeps xdist from putting the files with the most tests first instead).
FIRST = (
    "tests/test_sharding.py",
    "tests/test_gpu_check.py",
    "tests/test_ray_serve.py",
    "tests/test_benchmarks.py",
    "tests/test_api_server.py",
    "tests/test_context_parallel.py",
    "tests/test_serve_engine.py",
    "tests/test_long_context.py",
    "tests/test_pipeline.py",
    "tests/test_structured_outputs.py",
    "tests/test_context_parallel_serve.py",
    "notebooks/train_to_serve.ipynb",
    "notebooks/grpo.ipynb",
    "notebooks/flash_attention.ipynb",
    "notebooks/kv_cache_memory.ipynb",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(FIRST)))
