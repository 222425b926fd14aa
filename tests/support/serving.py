"""A real `vllm serve` process for server tests: started as a user starts it (the venv's
console script, or `scripts/serve.sh`), waited for on /health, stopped with SIGINT (then
harder)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from vllm_adaptive.telemetry_exchange import STATS_DIR_ENV

SERVED_NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 16}
STARTUP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 30
REPO = Path(__file__).resolve().parents[2]
#: What vLLM logs at start for settings a user should not have to see (scripts/serve.sh).
START_NOISE = ("Unknown vLLM environment variable", "but VLLM_PLUGINS is not set")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, lines: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no server log: {e}>"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(timeout=10)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.kill()
    proc.wait(timeout=10)


@contextlib.contextmanager
def serving(
    model_dir: Path,
    adaptive: dict,
    log: Path,
    env: Mapping[str, str] | None = None,
    serve_sh: str | None = None,
    eager: bool = True,
) -> Iterator[str]:
    """A real `vllm serve` (the venv's console script, as a user runs it) until the block ends.

    `env` adds to (or overrides) this process's environment for the server. `serve_sh`: start
    it through `scripts/serve.sh` instead (the repository's `.venv`, the default model), with
    the config in the environment variable of that name. `eager=False`: vLLM's default
    compilation instead of `--enforce-eager`.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    config = json.dumps({"adaptive": adaptive})
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    common += ["--dtype", "bfloat16", *(["--enforce-eager"] if eager else [])]
    if serve_sh:
        cmd = ["bash", str(REPO / "scripts" / "serve.sh"), *common]
        env = {**(env or {}), serve_sh: config}
    else:
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir)]
        cmd += ["--served-model-name", SERVED_NAME, "--additional-config", config, *common]
    server_env = {**os.environ, **(env or {})}
    server_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # A server of its own telemetry exchange, as a user's fresh shell gives it: this test
    # process may have exported one already (an in-process engine), whose stats files from
    # earlier engines would otherwise be summed into this server's /metrics.
    if not (env or {}).get(STATS_DIR_ENV):
        server_env[STATS_DIR_ENV] = str(log.parent / "adaptive-stats")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                pytest.fail(
                    f"vllm serve exited with code {proc.returncode} before becoming healthy; "
                    f"log {log}:\n{_log_tail(log)}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve not healthy after {STARTUP_TIMEOUT_S}s; "
                    f"log {log}:\n{_log_tail(log)}"
                )
            time.sleep(1)
        yield url
    finally:
        _stop(proc)
