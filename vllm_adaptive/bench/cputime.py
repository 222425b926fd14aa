"""CPU seconds of the processes that run an engine, read from /proc/<pid>/stat.

Wall time on a shared machine counts every moment the engine waited for a core; the CPU time
its processes consumed does not, so CPU seconds per generated token is a far steadier measure
of the work a config costs. With vLLM V1 on CPU the model runs in a worker process (the
multiprocessing executor's `VLLM::Worker`), a child of the engine core (`VLLM::EngineCore`), a
child of the process that built `LLM` (the frontend). `engine_pids` finds all three: the
worker's pid comes from inside it (`LLM.apply_model`, the same route as the memory readings),
the engine core is its parent.
"""

from __future__ import annotations

import os
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_cpu_seconds(pid: int | str = "self") -> float | None:
    """utime + stime of every thread of ``pid`` (seconds), None if the process is gone.

    Fields 14 and 15 of /proc/<pid>/stat; the command name (field 2) may contain spaces and
    parentheses, so the fields are counted from the last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime is field 14 -> index 11, stime 15 -> 12
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def worker_pid(model: Any) -> int:
    """The pid of the process running ``model`` (call through ``LLM.apply_model``)."""
    return os.getpid()


def engine_pids(llm: Any) -> dict[str, int]:
    """{"worker": pid, "engine_core": pid, "frontend": pid} of an engine; roles that are the same
    process (no multiprocessing) are left out, the worker is always there."""
    frontend = os.getpid()
    workers = sorted(set(llm.apply_model(worker_pid)))
    pids = {"worker": workers[0]}
    if len(workers) > 1:
        pids.update({f"worker{i}": p for i, p in enumerate(workers[1:], 1)})
    core = parent_pid(workers[0])
    if core is not None and core not in (frontend, workers[0]) and workers[0] != frontend:
        pids["engine_core"] = core
    if frontend not in pids.values():
        pids["frontend"] = frontend
    return pids


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float | None]:
    return {role: read_cpu_seconds(pid) for role, pid in pids.items()}


def cpu_delta(
    before: dict[str, float | None], after: dict[str, float | None]
) -> dict[str, float | None]:
    """CPU seconds each role consumed between two snapshots (None if unreadable)."""
    out: dict[str, float | None] = {}
    for role, b in before.items():
        a = after.get(role)
        out[role] = a - b if a is not None and b is not None else None
    return out
