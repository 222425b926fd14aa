"""End-to-end tests against a real `vllm serve` process with the plugin on.

One server is started for the whole module (about a minute on 2 CPU cores)
and queried with the `openai` client: completions and chat, streaming and
not, and per-request adaptive overrides carried in `vllm_xargs`.
"""

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

import openai
import pytest

pytestmark = pytest.mark.server

SERVED_NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 16}
STARTUP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 30


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
    model_dir: Path, adaptive: dict, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """A real `vllm serve` (the venv's console script, as a user runs it) until the block ends.

    `env` adds to (or overrides) this process's environment for the server.
    """
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--additional-config",
        json.dumps({"adaptive": adaptive}),
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--dtype",
        "bfloat16",
    ]
    server_env = {**os.environ, **(env or {})}
    server_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
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


@pytest.fixture(scope="module")
def server_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    with serving(model_dir, {}, log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="EMPTY", timeout=120)


@pytest.fixture(scope="module")
def greedy_text(client: openai.OpenAI) -> str:
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
    return resp.choices[0].text


def test_models_lists_served_name(server_url: str) -> None:
    with urllib.request.urlopen(f"{server_url}/v1/models", timeout=10) as resp:
        models = json.load(resp)
    assert SERVED_NAME in [m["id"] for m in models["data"]]


def test_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
    choice = resp.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("length", "stop")


def test_completion_streaming_matches(client: openai.OpenAI, greedy_text: str) -> None:
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, stream=True, **GREEDY)
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(chunks) > 1
    text = "".join(chunks)
    assert text.strip()
    assert text == greedy_text


def test_chat(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, **GREEDY)
    content = resp.choices[0].message.content
    assert content and content.strip()
    assert resp.choices[0].finish_reason in ("length", "stop")

    stream = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, stream=True, **GREEDY)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == content


def test_adaptive_mode_off_override(client: openai.OpenAI, greedy_text: str) -> None:
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        extra_body={"vllm_xargs": {"adaptive_mode": "off"}},
        **GREEDY,
    )
    assert resp.choices[0].text == greedy_text


@pytest.mark.parametrize(
    ("xargs", "key"),
    [
        ({"adaptive_mode": "turbo"}, "adaptive_mode"),
        ({"adaptive_bogus": 1}, "adaptive_bogus"),
    ],
    ids=["bad-value", "unknown-key"],
)
def test_bad_override_is_400(
    client: openai.OpenAI, greedy_text: str, xargs: dict, key: str
) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, extra_body={"vllm_xargs": xargs}, **GREEDY
        )
    assert excinfo.value.status_code == 400
    assert key in str(excinfo.value)

    # The server keeps serving after the rejection.
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY)
    assert resp.choices[0].text == greedy_text
