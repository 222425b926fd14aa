"""An engine process the harness keeps alive and asks for one measurement at a time.

`EngineProcess` starts ``python -m vllm_adaptive.bench.engine_run --serve SPEC FD``, waits for
its engine, then sends JSON commands on its stdin and reads one JSON reply per command from a
pipe of its own (the engine's stdout carries vLLM's log). The engine's log goes to the
harness's own stdout/stderr, so its progress stays visible.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def pss_bytes(pid: int) -> int | None:
    """Pss of a process from /proc/<pid>/smaps_rollup (None if unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class EngineFailed(RuntimeError):
    pass


class EngineProcess:
    """One live engine (see the module docstring)."""

    def __init__(self, name: str, spec: dict[str, Any], env_overrides: dict[str, str]) -> None:
        self.name = name
        self._tmp = Path(tempfile.mkdtemp(prefix="vllm-adaptive-bench-"))
        spec_path = self._tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.update(env_overrides)
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_adaptive.bench.engine_run",
                    "--serve",
                    str(spec_path),
                    str(write_fd),
                ],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(write_fd,),
                text=True,
            )
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        ready = self._read()
        self.engine_start_s: float = ready["engine_start_s"]
        self.pids: dict[str, int] = ready["pids"]

    def footprint_bytes(self) -> int:
        """Proportional set size (Pss) of the engine's processes now: its share of memory,
        shared libraries split between the processes that map them."""
        return sum(pss_bytes(pid) or 0 for pid in set(self.pids.values()))

    def _read(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            code = self.proc.wait(timeout=60)
            raise EngineFailed(f"engine for {self.name} exited ({code}); see its log above")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineFailed(f"engine for {self.name}: {reply['error']}")
        return reply

    def ask(self, cmd: str, **fields: Any) -> dict[str, Any]:
        """Send one command and wait for its reply."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise EngineFailed(f"engine for {self.name} is gone") from e
        return self._read()

    def stop(self) -> None:
        """Stop the engine (politely, then by force) and remove its files."""
        try:
            if self.proc.poll() is None:
                try:
                    self.ask("stop")
                except (EngineFailed, OSError, ValueError):
                    pass
                try:
                    self.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=30)
        finally:
            self._replies.close()
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
