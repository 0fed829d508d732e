"""Compiles step shapes on a pool of daemon threads: tracing holds the GIL, but lowering's MLIR passes
and XLA's compilation release it, so shapes compile side by side, and beside the step loop once the
engine serves. Daemon threads: a core that exits does not wait for its last shapes."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from tqdm import tqdm

from serve.core.runner.ready_shapes import ReadyShapes, Shape

MAX_THREADS = 8  # XLA's GPU compiler runs threads of its own: more than this gained nothing


def default_threads() -> int:
    """One compile thread per core this process may use, up to MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class CompilePool:
    """Runs jobs (a shape and the call that compiles it) in the order given, `threads` at a time; a
    job's shape joins `ready` once it compiled. `wait()` blocks until every job given so far is done
    and raises the first failure."""

    def __init__(self, ready: ReadyShapes, threads: int, total: int) -> None:
        self.ready = ready
        self.total = total
        self.threads = threads
        self._jobs: queue.Queue[tuple[Shape, Callable[[], object]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._bar = tqdm(total=total, desc="compiling step shapes", unit="shape", leave=False)
        for i in range(threads):
            threading.Thread(target=self._work, name=f"compile-{i}", daemon=True).start()

    def submit(self, jobs: list[tuple[Shape, Callable[[], object]]]) -> None:
        """Queue jobs behind those given before."""
        for job in jobs:
            self._jobs.put(job)

    def finish(self) -> None:
        """No more jobs: each thread ends once those queued are done."""
        for _ in range(self.threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            shape, compile_shape = job
            try:
                if self._error is None:
                    compile_shape()
                    self.ready.add(shape)
                    self._bar.update()
                    if len(self.ready) >= self.total:  # batches take their own shapes from now on
                        self.ready.complete = True
                        self._bar.close()
            except BaseException as e:  # reported by wait(); the shape stays unready, so no batch picks it
                self._error = self._error or e
            finally:
                self._jobs.task_done()

    @property
    def done(self) -> bool:
        """Every job given so far has finished."""
        return self._jobs.unfinished_tasks == 0

    def wait(self) -> None:
        """Block until every job given so far has finished; raise the first failure."""
        self._jobs.join()
        if self._error is not None:
            raise RuntimeError(f"compiling a step shape failed: {self._error!r}") from self._error
