"""`vllm serve` with the telemetry plugins: vllm_adaptive metrics and the per-request route.

One server start. The test plays the depth runtime's part (it writes an engine
stats file and a request record into the server's stats directory), so it
checks the frontend half of the exchange as a user deploys it.
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
    append_request_record,
    write_engine_stats,
)

pytestmark = pytest.mark.server

# What README.md tells users to set for the route (the endpoint group is opt-in in vLLM).
PLUGINS = "vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes"
ENGINE_STATS = {
    "mechanism": "depth",
    "num_layers": 30,
    "decode_tokens": 120,
    "prefill_tokens": 50,
    "layers_executed": 2880,
    "exit_tokens": {"12": 40, "24": 20, "30": 60},
    "requests_finished": 4,
    "decision_seconds": 0.75,
    "forward_seconds": 6.5,
}
RECORD = {"tag": "e2e-depth", "mean_depth": 21.5, "exit_tokens": {"12": 3, "30": 5}}


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_metrics_and_request_route(model_dir: Path, tmp_path: Path) -> None:
    stats = tmp_path / "stats"
    log = tmp_path / "vllm-serve.log"
    env = {STATS_DIR_ENV: str(stats), "VLLM_PLUGINS": PLUGINS}
    with serving(model_dir, {}, log, env=env) as url:
        write_engine_stats(ENGINE_STATS, stats)
        append_request_record(RECORD, stats)
        time.sleep(1.2)  # past the collector's one-second throttle
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=120)
        assert client.completions.create(model=SERVED_NAME, prompt=PROMPT, **GREEDY).choices

        status, body = _get(f"{url}/metrics")
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        assert samples["vllm_adaptive:decode_tokens_total", ()] == 120
        assert samples["vllm_adaptive:layers_executed_total", ()] == 2880
        assert samples["vllm_adaptive:mean_decode_depth", ()] == 24.0
        assert samples["vllm_adaptive:decision_seconds_total", ()] == 0.75
        assert samples["vllm_adaptive:forward_seconds_total", ()] == 6.5
        exits = {
            dict(labels)["depth"]: value
            for (name, labels), value in samples.items()
            if name == "vllm_adaptive:exit_tokens_total"
        }
        assert exits == {"12": 40, "24": 20, "30": 60}
        # vLLM's own Prometheus logger is still there beside ours.
        assert any(name == "vllm:generation_tokens_total" for name, _ in samples)

        status, body = _get(f"{url}/v1/adaptive/requests/e2e-depth")
        assert status == 200
        assert json.loads(body) == {"tag": "e2e-depth", "records": [RECORD]}

        status, body = _get(f"{url}/v1/adaptive/requests/no-such-tag")
        assert status == 404
        error = json.loads(body)
        assert error["tag"] == "no-such-tag" and "no-such-tag" in error["error"]["message"]
    assert f"adaptive telemetry: engine stats exchanged in {stats}" in log.read_text()
