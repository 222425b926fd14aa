"""`vllm serve` with the telemetry plugins: vllm_adaptive metrics and the per-request route.

One server start. A real adaptive-depth engine (budget 1.0, one request at
0.4) writes the stats and request records; the test reads them back over HTTP as a user
deploys it, and checks that a bad per-request budget is an HTTP 400.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import GREEDY, PROMPT, SERVED_NAME, serving
from vllm_adaptive.telemetry_exchange import (
    STATS_DIR_ENV,
)

pytestmark = pytest.mark.server

# What README.md tells users to set for the route (the endpoint group is opt-in in vLLM).
PLUGINS = "vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_depth_metrics_request_route_and_400(
    model_dir: Path, depth_profile: Path, tmp_path: Path
) -> None:
    stats = tmp_path / "stats"
    log = tmp_path / "vllm-serve.log"
    env = {STATS_DIR_ENV: str(stats), "VLLM_PLUGINS": PLUGINS}
    adaptive = {"depth": {"profile": str(depth_profile), "budget": 1.0, "floor": {"tokens": 4}}}
    with serving(model_dir, adaptive, log, env=env) as url:
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
