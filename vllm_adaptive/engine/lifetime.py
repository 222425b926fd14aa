"""vLLM's engine processes end with the process that started them.

vLLM's engine core and its workers are multiprocessing children. When their parent is killed
(SIGKILL, ``os._exit``, the kernel's OOM killer) nothing tells them: they go on holding memory,
cores and the parent's output pipes (a bench waiting on those pipes never ends). In every
multiprocessing child where the plugin registers (only vLLM's own processes load vLLM plugins),
a daemon thread checks once a second that the parent is still the process that started it; when
it is gone, the child sends itself SIGTERM (vLLM's handlers shut its own children down), then
SIGKILL if it is still there after a grace period. Its children, watching it the same way, follow.

A thread that polls ``getppid`` rather than Linux's parent-death signal: that signal fires when
the parent *thread* that spawned the child ends, which need not be the parent process's end.
``ADAPTIVE_ORPHAN_WATCH=off`` turns the watch off (the negative control of its test).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

ENV = "ADAPTIVE_ORPHAN_WATCH"
POLL_S = 1.0
GRACE_S = 5.0
_started = False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> bool:
    """Start the watch in this process if it is a multiprocessing child; returns whether it runs.
    Idempotent (vLLM may register plugins more than once per process)."""
    global _started
    if _started:
        return True
    if os.environ.get(ENV, "on").lower() in ("0", "off", "false", "no"):
        return False
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None or os.name != "posix":
        return False
    threading.Thread(
        target=_watch, args=(parent.pid,), name="adaptive-orphan-watch", daemon=True
    ).start()
    _started = True
    return True
