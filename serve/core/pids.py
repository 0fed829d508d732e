"""Whether a process id is alive, whether a file named after its creator's pid has outlived it (what the
sweeps of files left by killed processes ask), and a child's watch that ends it with its parent."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    """True unless no process has this id (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def creator_gone(name: str, prefix: str) -> bool:
    """A file named `<prefix><pid>-...` whose creating process (pid) no longer exists."""
    pid = name[len(prefix) :].split("-")[0] if name.startswith(prefix) else ""
    return pid.isdigit() and not pid_alive(int(pid))


PARENT_WATCH_S = 0.2  # how often a child started by serve checks that its parent is alive


def exit_with_parent(parent: int, cleanup: Callable[[], None] = lambda: None) -> None:
    """End this process within PARENT_WATCH_S once `parent` (the pid that started it, passed in since it
    may have died before we got here) is no longer its parent, whatever the main thread is doing
    (loading weights, compiling, stepping): a daemon thread watches, runs `cleanup` and exits. Not
    PR_SET_PDEATHSIG, which fires when the parent's *thread* that started us ends."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        with contextlib.suppress(Exception):
            cleanup()
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
