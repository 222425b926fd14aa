"""`vllm serve` with entropy-routed precision on, started as the README tells users: through
`scripts/serve.sh`, with GEARBX's paper settings (`{"precision": {"policy": "gearbx",
"symmetric": true}}`: absmax tiers, so it routes between gears on every machine).

Per-request gears over HTTP, the first tokens of greedy answers against stock vLLM, per-request
records and gear metrics, settings this engine cannot honour (400 before a stream starts), and
a quiet start log.
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

from tests.support.serving import GREEDY, PROMPT, SERVED_NAME, START_NOISE, serving
from tests.support.workloads import PROMPTS

# The paper's GEARBX: absmax int4 tiers, step routing, cold start. (As typed, without
# "symmetric", GEARBX takes the default model's 4-bit grid and, where the plugin's kernels run
# bf16 rows, int4 at every level with no routing: tests/engine/test_precision_one_gear.py.)
CONFIG = {"precision": {"policy": "gearbx", "symmetric": True}}


def _default_high_gear() -> str:
    """The high gear GEARBX's defaults give a bf16 engine on this machine (the server's)."""
    from vllm_adaptive.config import parse_adaptive_config
    from vllm_adaptive.kernels import native
    from vllm_adaptive.kernels.float_linear import amx_int8_available, cpu_has_int8_dot

    cfg = parse_adaptive_config(CONFIG).precision.for_dtype(
        "bfloat16",
        amx_int8=amx_int8_available(),
        int8_dot=cpu_has_int8_dot(),
        native_bf16_dot=native.bf16_dot_available(),
    )
    return cfg.level_gears[2]


# The config goes in serve.sh's old variable name: the deprecated path must keep working
# without vLLM warning about an unknown VLLM_* variable.
CONFIG_ENV = "VLLM_ADAPTIVE_CONFIG"


@pytest.fixture(scope="module")
def precision_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    log = tmp_path_factory.mktemp("server-precision") / "vllm-serve.log"
    with serving(model_dir, CONFIG, log, serve_sh=CONFIG_ENV) as url:
        yield {"url": url, "log": log}


@pytest.fixture(scope="module")
def client(precision_server: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{precision_server['url']}/v1", api_key="EMPTY", timeout=120)


def _complete(client: openai.OpenAI, xargs: dict) -> str:
    resp = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, extra_body={"vllm_xargs": xargs}, **GREEDY
    )
    return resp.choices[0].text


def _first_token(client: openai.OpenAI, prompt: str, xargs: dict) -> int:
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        temperature=0,
        max_tokens=1,
        extra_body={"vllm_xargs": xargs, "return_token_ids": True},
    )
    (token,) = resp.choices[0].model_extra["token_ids"]
    return token


def test_first_tokens_match_stock(client: openai.OpenAI, stock_bf16: dict) -> None:
    """GEARBX with default settings at temperature 0 keeps the first token of every answer
    where the full gear gives stock vLLM's (the prompt's prefill, which makes it, runs at the
    high gear; before, a short prompt's cold-start low gear changed it: "The capital of France
    is" -> " located" instead of " Paris")."""
    stock = [ids[0] for ids in stock_bf16["identity"]["alone"]]  # greedy, each prompt alone
    geared = [_first_token(client, p, {}) for p in PROMPTS]  # first: nothing cached yet
    full = [_first_token(client, p, {"adaptive_gear": "high"}) for p in PROMPTS]
    comparable = [i for i, (f, s) in enumerate(zip(full, stock, strict=True)) if f == s]
    assert len(comparable) >= 8, (full, stock)  # bf16 kernels: like shapes give like tokens
    assert [geared[i] for i in comparable] == [stock[i] for i in comparable], (geared, stock)


def test_pinned_gears_over_http(client: openai.OpenAI) -> None:
    high = _complete(client, {"adaptive_gear": "high"})
    if _default_high_gear() == "full":  # the same computation as adaptive_mode "off"
        assert high == _complete(client, {"adaptive_mode": "off"})
    else:  # int8 (CPUs whose kernels run the bf16 dot product): mid is int8 as well
        assert _default_high_gear() == "int8"
        assert high == _complete(client, {"adaptive_gear": "mid"})
    low = _complete(client, {"adaptive_gear": "low", "adaptive_request_tag": "http-low"})
    assert low.strip()  # int4 weights still produce text
    plain = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi."}], **GREEDY
    )
    assert plain.choices[0].message.content


@pytest.mark.parametrize(
    "xargs",
    [{"adaptive_gear": "turbo"}, {"adaptive_gear": "low", "adaptive_mode": "off"}],
    ids=["unknown-gear", "contradiction"],
)
def test_bad_gear_is_400_and_server_keeps_serving(client: openai.OpenAI, xargs: dict) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        _complete(client, xargs)
    assert excinfo.value.status_code == 400
    assert "adaptive_gear" in str(excinfo.value)
    assert _complete(client, {}).strip()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_depth_budget_on_a_precision_engine_is_400(client: openai.OpenAI, stream: bool) -> None:
    """A setting this engine cannot honour is refused naming why, before a stream starts."""
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            stream=stream,
            extra_body={"vllm_xargs": {"adaptive_depth_budget": 0.5}},
            **GREEDY,
        )
    message = str(excinfo.value)
    assert "adaptive_depth_budget=0.5 cannot be honoured" in message
    assert "no adaptive.depth section" in message


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_tagged_requests_leave_records_and_gear_metrics_count(precision_server: dict) -> None:
    url = precision_server["url"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=120)
    n = 24

    def tagged(xargs: dict) -> None:
        out = client.completions.create(
            model=SERVED_NAME,
            prompt="Once upon a time, in a small village by the sea,",
            temperature=0,
            max_tokens=n,
            extra_body={"vllm_xargs": xargs, "ignore_eos": True},
        )
        assert out.usage.completion_tokens == n

    tagged({"adaptive_request_tag": "e2e-gears"})
    tagged({"adaptive_request_tag": "e2e-low", "adaptive_gear": "low"})
    time.sleep(1.2)  # past the metrics collector's one-second throttle
    # vLLM tells the worker a request left the batch at the next step: this one's
    assert _complete(client, {}).strip()

    status, body = _get(f"{url}/v1/adaptive/requests/e2e-gears")
    assert status == 200, body
    (record,) = json.loads(body)["records"]
    assert record["mechanism"] == "precision" and record["generated_tokens"] == n
    assert sum(record["gear_tokens"].values()) == n and len(record["entropy_bits"]) == n
    assert record["prefill_gear"] == "high" and record["gears"][0] == "high"
    status, body = _get(f"{url}/v1/adaptive/requests/e2e-low")
    (low,) = json.loads(body)["records"]
    assert low["gear_tokens"]["low"] == n and low["pinned"] == "low" and low["shifts"] == 0

    status, body = _get(f"{url}/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    decode = samples["vllm_adaptive:decode_tokens_total", ()]
    gears = {
        dict(labels)["gear"]: value
        for (name, labels), value in samples.items()
        if name == "vllm_adaptive:gear_tokens_total"
    }
    assert decode >= 2 * (n - 1)  # at least the two tagged requests' decode tokens
    assert sum(gears.values()) == decode and gears["low"] >= n - 1
    assert samples["vllm_adaptive:exit_tokens_total", (("depth", "30"),)] == decode
    assert samples["vllm_adaptive:layers_executed_total", ()] == 30 * decode
    assert samples["vllm_adaptive:mean_decode_depth", ()] == 30
    assert samples["vllm_adaptive:gear_shifts_total", ()] >= 0
    assert samples["vllm_adaptive:forward_seconds_total", ()] > 0
    assert samples["vllm_adaptive:decision_seconds_total", ()] > 0


def test_start_log_is_quiet(precision_server: dict) -> None:
    """serve.sh takes the old variable name with a deprecation note, hides it from vLLM, and
    allowlists the plugin's entry points (the route loads, vLLM does not warn)."""
    text = precision_server["log"].read_text(errors="replace")
    assert "VLLM_ADAPTIVE_CONFIG is deprecated: name it ADAPTIVE_CONFIG" in text
    assert "Loaded endpoint plugin vllm_adaptive_routes" in text
    for noise in START_NOISE:
        assert noise not in text
    assert "Traceback" not in text
