"""End-to-end tests against one real `vllm serve` process with the plugin on, queried with the
`openai` client as a user would: completions and chat, streaming and not, per-request adaptive
overrides in `vllm_xargs` (bad ones are HTTP 400, streaming or not, JSON booleans included, and
so are settings this engine cannot honour), and the telemetry plugins (the `vllm_adaptive:*`
Prometheus metrics and the per-request route).

The server runs a real adaptive-depth engine (budget 1.0: no exits unless a request asks for
them) with all three plugin entry points named in VLLM_PLUGINS, as README.md tells users to
deploy the route.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serving import CHAT, GREEDY, PROMPT, SERVED_NAME, START_NOISE, serving
from vllm_adaptive.telemetry_exchange import STATS_DIR_ENV

# What README.md tells users to set for the route (the endpoint group is opt-in in vLLM).
PLUGINS = "vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes"


@pytest.fixture(scope="module")
def depth_server(model_dir: Path, depth_profile: Path, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("server")
    stats, log = tmp / "stats", tmp / "vllm-serve.log"
    env = {STATS_DIR_ENV: str(stats), "VLLM_PLUGINS": PLUGINS}
    adaptive = {"depth": {"profile": str(depth_profile), "budget": 1.0, "floor": {"tokens": 4}}}
    with serving(model_dir, adaptive, log, env=env) as url:
        yield {"url": url, "log": log, "stats": stats}


@pytest.fixture(scope="module")
def server_url(depth_server: dict) -> str:
    return depth_server["url"]


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


def test_adaptive_mode_off_override(
    client: openai.OpenAI, server_url: str, greedy_text: str
) -> None:
    """The server's budget is 1.0 (no exits), so ``adaptive_mode: off`` is checked beside the
    same prompt with a budget that makes its tokens exit: that one runs shallower (its route
    record) and writes other text; the "off" one runs every layer and writes the greedy text."""

    def complete(xargs: dict) -> str:
        resp = client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, extra_body={"vllm_xargs": xargs}, **GREEDY
        )
        return resp.choices[0].text

    low = complete({"adaptive_depth_budget": 0.4, "adaptive_request_tag": "mode-low"})
    off = complete({"adaptive_mode": "off", "adaptive_request_tag": "mode-off"})
    assert off == greedy_text
    records = {tag: _records_of(client, server_url, tag) for tag in ("mode-low", "mode-off")}
    assert records["mode-off"]["mode"] == "off"
    assert set(records["mode-off"]["depths"]) == {30}
    assert records["mode-low"]["mode"] == "on" and records["mode-low"]["budget"] == 0.4
    assert records["mode-low"]["mean_depth"] < 30  # this prompt's tokens do exit when asked
    assert low != greedy_text


def _records_of(client: openai.OpenAI, url: str, tag: str) -> dict:
    """The one route record of ``tag``; a request's record is written when the engine's next
    step retires it, so a short request is sent until the record is there."""
    deadline = time.monotonic() + 30
    while True:
        status, body = _get(f"{url}/v1/adaptive/requests/{tag}")
        if status == 200 or time.monotonic() > deadline:
            break
        client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=1, temperature=0)
    assert status == 200, body
    (record,) = json.loads(body)["records"]
    return record


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


@pytest.mark.parametrize(
    ("api", "xargs", "key"),
    [
        ("completions", {"adaptive_mode": "turbo"}, "adaptive_mode"),
        ("chat", {"adaptive_depth_budget": 1.5}, "adaptive_depth_budget"),
        ("chat", {"adaptive_foo": 1}, "adaptive_foo"),
    ],
    ids=["completions-bad-mode", "chat-bad-budget", "chat-unknown-key"],
)
def test_streaming_bad_override_is_400_before_the_stream(
    depth_server: dict, client: openai.OpenAI, api: str, xargs: dict, key: str
) -> None:
    """As vLLM's own bad sampling parameters: HTTP 400 (the client raises), no 200 stream with
    an error event inside, and no traceback in the server's log."""
    body = {"model": SERVED_NAME, "stream": True, "extra_body": {"vllm_xargs": xargs}}
    with pytest.raises(openai.BadRequestError) as excinfo:
        if api == "chat":
            client.chat.completions.create(messages=CHAT, max_tokens=8, **body)
        else:
            client.completions.create(prompt="Hello, my name is", max_tokens=8, **body)
    assert excinfo.value.status_code == 400 and key in str(excinfo.value)
    log = depth_server["log"].read_text(errors="replace")
    assert "Traceback" not in log and "stream generator" not in log


@pytest.mark.parametrize(
    ("xargs", "key"),
    [
        ({"adaptive_depth_budget": True}, "adaptive_depth_budget"),
        ({"adaptive_gear": True}, "adaptive_gear"),
    ],
    ids=["budget", "gear"],
)
def test_json_booleans_are_refused_naming_what_was_sent(
    client: openai.OpenAI, xargs: dict, key: str
) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, extra_body={"vllm_xargs": xargs}, **GREEDY
        )
    message = str(excinfo.value)
    assert key in message and "got true (a boolean)" in message and "got 1" not in message


def test_gear_on_a_depth_engine_is_400_naming_why(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=CHAT,
            stream=True,
            extra_body={"vllm_xargs": {"adaptive_gear": "low"}},
            **GREEDY,
        )
    message = str(excinfo.value)
    assert "adaptive_gear='low' cannot be honoured" in message
    assert "no adaptive.precision section" in message and "it runs: depth" in message


def test_start_log_has_no_noise(depth_server: dict) -> None:
    log = depth_server["log"].read_text(errors="replace")
    for noise in START_NOISE:
        assert noise not in log


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_depth_metrics_request_route_and_400(depth_server: dict) -> None:
    url, log, stats = depth_server["url"], depth_server["log"], depth_server["stats"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=120)
    xargs = {"adaptive_depth_budget": 0.4, "adaptive_request_tag": "e2e-depth"}
    out = client.completions.create(
        model=SERVED_NAME,
        prompt="def parse_config(path):\n    ",
        max_tokens=64,
        temperature=0.0,
        extra_body={"vllm_xargs": xargs},
    )
    assert out.usage.completion_tokens == 64
    with pytest.raises(openai.BadRequestError, match="adaptive_depth_budget"):
        client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            extra_body={"vllm_xargs": {"adaptive_depth_budget": 0}},
            **GREEDY,
        )
    time.sleep(1.2)  # past the collector's one-second throttle
    assert client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY).choices

    status, body = _get(f"{url}/v1/adaptive/requests/e2e-depth")
    assert status == 200
    (record,) = json.loads(body)["records"]
    assert record["generated_tokens"] == 64 and record["budget"] == 0.4
    assert record["mean_depth"] < 30
    assert sum(record["exit_histogram"].values()) == 64

    status, body = _get(f"{url}/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    decode = samples["vllm_adaptive:decode_tokens_total", ()]
    exits = {
        int(dict(labels)["depth"]): value
        for (name, labels), value in samples.items()
        if name == "vllm_adaptive:exit_tokens_total"
    }
    assert decode >= 63 and sum(exits.values()) == decode
    assert any(d < 30 and n > 0 for d, n in exits.items())  # the 0.4 request exited
    layers = samples["vllm_adaptive:layers_executed_total", ()]
    assert layers == sum(d * n for d, n in exits.items())
    assert samples["vllm_adaptive:mean_decode_depth", ()] == pytest.approx(layers / decode)
    assert samples["vllm_adaptive:forward_seconds_total", ()] > 0
    # vLLM's own Prometheus logger is still there beside ours.
    assert any(name == "vllm:generation_tokens_total" for name, _ in samples)

    status, body = _get(f"{url}/v1/adaptive/requests/no-such-tag")
    assert status == 404
    error = json.loads(body)
    assert error["tag"] == "no-such-tag" and "no-such-tag" in error["error"]["message"]
    assert f"adaptive telemetry: engine stats exchanged in {stats}" in log.read_text()
