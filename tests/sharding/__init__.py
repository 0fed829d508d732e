"""Test package: helpers import as `tests.…`, so no installed distribution can shadow them."""
