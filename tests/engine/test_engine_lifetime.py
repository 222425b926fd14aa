"""When the process that started a vLLM engine is killed outright (SIGKILL: no handler runs),
none of the engine's processes outlives it (the plugin's orphan watch,
``vllm_adaptive/engine/lifetime.py``). Negative control: with the watch off, stock vLLM's engine
core and worker go on running, holding the dead parent's pipes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = r"""
import json, os, signal, sys

def descendants(root):
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out

def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
    llm.generate(["The lighthouse"], SamplingParams(max_tokens=2), use_tqdm=False)
    print("DESCENDANTS " + json.dumps(descendants(os.getpid())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    main()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a dead child nobody reaped is gone for our purpose


def _kill_parent_and_watch(model_dir: Path, tmp_path: Path, watch: str, wait_s: float) -> list:
    script = tmp_path / "engine_then_sigkill.py"
    script.write_text(CHILD)
    env = dict(os.environ, ADAPTIVE_ORPHAN_WATCH=watch, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,  # one process group to clean up whatever happens
    )
    pids: list[int] = []
    try:
        for line in proc.stdout:
            if line.startswith("DESCENDANTS "):
                pids = json.loads(line.split(" ", 1)[1])
                break
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        assert pids, "the engine started no processes"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.5)
        return [p for p in pids if _alive(p)]
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.kill()


def test_engine_processes_end_with_their_parent(model_dir: Path, tmp_path: Path) -> None:
    left = _kill_parent_and_watch(model_dir, tmp_path, "on", wait_s=30)
    assert left == [], f"engine processes outlived their parent: {left}"


@pytest.mark.slow  # the full suite: another engine start (about a minute)
def test_without_the_watch_they_outlive_it(model_dir: Path, tmp_path: Path) -> None:
    """Negative control: stock vLLM's engine core and worker are orphaned."""
    left = _kill_parent_and_watch(model_dir, tmp_path, "off", wait_s=10)
    assert left, "without the watch the engine's processes should have outlived the parent"
