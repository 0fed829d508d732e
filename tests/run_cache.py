"""How a test run compiles: one persistent compilation cache for the whole run (every xdist worker, every
engine-core and server subprocess and every notebook kernel compiles a program once, and the next reads
it from disk), and XLA's CPU backend at LLVM -O0.

The controller makes the folder (a fresh one per run, removed at its end: nothing a run compiled can
hide a change in the next) and hands it to the workers; the environment carries it to subprocesses,
whose EngineArgs default to it (`JAXINFRA_CACHE_DIR`) and whose jax reads it (`JAX_COMPILATION_CACHE_DIR`).

-O0 changes only how LLVM turns XLA's optimized HLO into machine code (the HLO passes, fusion, buffer
assignment and donation are the same; without fast-math LLVM reorders no float arithmetic): the tests'
programs are tiny, so compiling them is most of their time and running them almost none.
JAXINFRA_TEST_XLA_OPT=default keeps XLA's own level.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

WORKER_KEY = "jaxinfra_run_cache"
BACKEND_O0 = "--xla_backend_optimization_level=0"
RUN_CACHE = pytest.StashKey[str]()
# jax reads these at import, in this process and in every process started from it
# (a program that compiles faster than it is read back is not worth a file: eager ops, mostly)
JAX_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.05", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run_cache_dir(config: pytest.Config) -> str:
    """This run's compilation-cache folder (the parent of `jax-compilation-cache`, as JAXINFRA_CACHE_DIR)."""
    return config.stash[RUN_CACHE]


def configure(config: pytest.Config) -> None:
    """Point this process, and every process it starts, at the run's cache (made here in the controller)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        base = workerinput[WORKER_KEY]
    else:
        base = tempfile.mkdtemp(prefix="jaxinfra-test-run-")
        config.add_cleanup(lambda: shutil.rmtree(base, ignore_errors=True))
    config.stash[RUN_CACHE] = base
    cache = os.path.join(base, "jax-compilation-cache")
    os.makedirs(cache, exist_ok=True)
    os.environ["JAXINFRA_CACHE_DIR"] = base
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ.update(JAX_ENV)
    if os.environ.get("JAXINFRA_TEST_XLA_OPT", "O0") == "O0" and BACKEND_O0 not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {BACKEND_O0}".strip()
    import jax  # after the environment: a process that imported jax earlier still gets the settings

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(JAX_ENV["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def configure_node(node) -> None:
    """xdist: each worker gets the controller's folder."""
    node.workerinput[WORKER_KEY] = run_cache_dir(node.config)
