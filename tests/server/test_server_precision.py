"""`vllm serve` with entropy-routed precision on: per-request gears over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.serving import GREEDY, PROMPT, SERVED_NAME, serving

CONFIG = {"precision": {"policy": "gearbx", "routing": "token"}}


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("server-precision") / "vllm-serve.log"
    with serving(model_dir, CONFIG, log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=120)


def _complete(client: openai.OpenAI, xargs: dict) -> str:
    resp = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, extra_body={"vllm_xargs": xargs}, **GREEDY
    )
    return resp.choices[0].text


def test_pinned_gears_over_http(client: openai.OpenAI) -> None:
    # The high gear of gearbx is the float weight: the same computation as adaptive_mode "off".
    assert _complete(client, {"adaptive_gear": "high"}) == _complete(
        client, {"adaptive_mode": "off"}
    )
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
