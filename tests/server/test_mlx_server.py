"""`vllm-adaptive serve --backend mlx` end to end: a real server process (the venv's console
script, as a user runs it) on the default checkpoint with GEARBX gears, queried with the
`openai` client: completions and chat, streaming and not, per-request knobs (400 naming the key,
streaming requests too), the per-request telemetry route, and the per-request kill switch
against stock mlx-lm's greedy output."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install '.[mlx]')")

SERVED_NAME = "smollm2-mlx"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}
STARTUP_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("mlx-server") / "serve.log"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(Path(sys.executable).parent / "vllm-adaptive"),
        "serve",
        "--backend",
        "mlx",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--additional-config",
        json.dumps({"adaptive": {"precision": {"policy": "gearbx"}}}),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if _get(f"{url}/health")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server not healthy (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="EMPTY", timeout=120)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_completion_streaming_and_not_agree(client: openai.OpenAI, model_dir: Path) -> None:
    off = {"vllm_xargs": {"adaptive_mode": "off"}}
    full = client.completions.create(model=SERVED_NAME, prompt=PROMPT, extra_body=off, **GREEDY)
    text = full.choices[0].text
    assert full.choices[0].finish_reason in ("length", "stop") and text
    assert full.usage.completion_tokens <= GREEDY["max_tokens"]
    chunks = list(
        client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=off,
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # adaptive_mode off is stock mlx-lm's greedy output
    from mlx_lm.generate import generate_step

    from vllm_adaptive.metal_backend.loading import load_mlx

    model, tok = load_mlx(model_dir, "float32")
    ids = [t for t, _ in generate_step(mx.array(tok.encode(PROMPT)), model, max_tokens=8)]
    eos = set(tok.eos_token_ids)
    ids = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]
    assert text == tok.decode(ids, skip_special_tokens=True)


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=SERVED_NAME, messages=msgs, **GREEDY)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model=SERVED_NAME, messages=msgs, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("xargs", "param"),
    [
        ({"adaptive_gear": "turbo"}, "adaptive_gear"),
        ({"adaptive_gaer": "low"}, "adaptive_gaer"),
        ({"adaptive_depth_budget": 0}, "adaptive_depth_budget"),
        ({"adaptive_mode": "off", "adaptive_gear": "low"}, "adaptive_gear"),
        ({"adaptive_depth_budget": True}, "adaptive_depth_budget"),  # a JSON boolean
        # a setting this (precision-only) server cannot honour: 400 naming why, as on vLLM
        ({"adaptive_depth_budget": 0.5}, "adaptive_depth_budget"),
    ],
)
def test_bad_knobs_are_400_naming_the_key(
    client: openai.OpenAI, xargs: dict, param: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            stream=stream,
            extra_body={"vllm_xargs": xargs},
            **GREEDY,
        )
    assert e.value.status_code == 400
    err = e.value.body if isinstance(e.value.body, dict) else {}
    err = err.get("error", err)
    assert err.get("param") == param and param in err.get("message", ""), e.value.body
    if xargs == {"adaptive_depth_budget": 0.5}:
        assert "cannot be honoured: this engine has no adaptive.depth section" in err["message"]


def test_gear_knobs_and_telemetry_by_tag(client: openai.OpenAI, server_url: str) -> None:
    client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        extra_body={"vllm_xargs": {"adaptive_gear": "mid", "adaptive_request_tag": "pinned"}},
        **GREEDY,
    )
    code, body = _get(f"{server_url}/v1/adaptive/requests/pinned")
    assert code == 200
    (rec,) = body["records"]
    assert rec["mechanism"] == "precision" and rec["pinned"] == "mid"
    assert set(rec["gears"]) == {"mid"} and len(rec["entropy_bits"]) == rec["generated_tokens"]
    # top-level keys (as an mlx-lm client would send them) work the same
    client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, extra_body={"adaptive_request_tag": "free"}, **GREEDY
    )
    code, body = _get(f"{server_url}/v1/adaptive/requests/free")
    assert code == 200 and body["records"][0]["pinned"] is None
    code, body = _get(f"{server_url}/v1/adaptive/requests/nope")
    assert code == 404 and body["error"]["param"] == "tag"
    code, eng = _get(f"{server_url}/v1/adaptive/engine")
    assert code == 200 and eng["mechanism"] == "precision" and eng["backend"] == "mlx"
