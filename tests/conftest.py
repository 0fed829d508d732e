"""Shared fixtures. jax runs on CPU with float32 matmuls at full precision; nothing reaches the network."""

import os
import socket

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
