"""CPU seconds of a process from /proc/<pid>/stat, read from a real child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from vllm_adaptive.bench.cputime import (
    cpu_delta,
    cpu_snapshot,
    parent_pid,
    read_cpu_seconds,
)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

# The child renames itself to a command name with spaces and parentheses (the field that makes
# naive parsing of /proc/<pid>/stat go wrong), burns about 0.5 CPU seconds, then sleeps.
CHILD = """
import sys, time
open('/proc/self/comm', 'w').write('x) (y z')
print('ready', flush=True)
sys.stdin.readline()
t = time.process_time()
while time.process_time() - t < 0.5:
    pass
print('burnt', flush=True)
time.sleep(30)
"""


def test_cpu_seconds_of_a_child_that_burns_cpu() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with open(f"/proc/{child.pid}/stat") as f:
            assert "(x) (y z)" in f.read()  # the awkward name is really there
        pids = {"worker": child.pid, "frontend": os.getpid()}
        before = cpu_snapshot(pids)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "burnt"
        after = cpu_snapshot(pids)
        used = cpu_delta(before, after)
        assert 0.4 <= used["worker"] <= 2.0, used
        assert used["frontend"] >= 0.0
        assert parent_pid(child.pid) == os.getpid()
        time.sleep(0.2)  # sleeping costs no CPU time
        assert read_cpu_seconds(child.pid) - after["worker"] < 0.05
    finally:
        child.kill()
        child.wait()
    assert read_cpu_seconds(child.pid) is None  # gone (reaped)
    assert cpu_delta({"worker": 1.0}, {"worker": None}) == {"worker": None}


def test_own_cpu_seconds_grow() -> None:
    t0 = read_cpu_seconds()
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert read_cpu_seconds() - t0 >= 0.15
