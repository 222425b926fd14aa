"""A `vllm-adaptive` command killed with SIGTERM stops what it started (no orphaned servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# The parent: the CLI's handlers, then a child in its own session (as bench-serve starts
# `vllm serve`), stopped by the same `finally` that stops a benched server.
PARENT = """
import signal, subprocess, sys, time
from vllm_adaptive.cli import exit_on_termination
from vllm_adaptive.bench.servers import start_group, stop_group
if sys.argv[1] in ("handlers", "blocked"):
    exit_on_termination()
if sys.argv[1] == "blocked":  # as a thread that blocked SIGINT hands its mask to what it starts
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
child = start_group(["sleep", "300"])
try:
    print(child.pid, flush=True)  # inside the try: a signal right after it still cleans up
    time.sleep(300)
finally:
    stop_group(child)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waiting for init to reap it is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def _terminate_parent(mode: str, settle_s: float) -> tuple[int, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)
    rc = parent.wait(timeout=30)
    deadline = time.monotonic() + settle_s
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rc, child


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sigterm_stops_the_commands_children() -> None:
    rc, child = _terminate_parent("handlers", settle_s=10)
    assert rc == 128 + signal.SIGTERM
    assert not _alive(child)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_child_started_with_sigint_blocked_still_stops_at_once() -> None:
    """A blocked SIGINT is inherited across exec; the child gets it unblocked before exec, so
    the group's SIGINT stops it at once (blocked, it waited 30 s for SIGKILL: a CI failure)."""
    start = time.monotonic()
    rc, child = _terminate_parent("blocked", settle_s=10)
    assert rc == 128 + signal.SIGTERM
    assert not _alive(child)
    assert time.monotonic() - start < 20


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_without_the_handlers_the_child_is_orphaned() -> None:
    """Negative control: Python's default SIGTERM skips the cleanup and leaves the child."""
    rc, child = _terminate_parent("default", settle_s=1)
    try:
        assert rc == -signal.SIGTERM
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)
