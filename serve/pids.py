"""Whether a process id is alive, and whether a file named after its creator's pid has outlived it:
what the sweeps of files left by killed processes ask."""

from __future__ import annotations

import os


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
