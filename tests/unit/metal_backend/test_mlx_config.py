"""The MLX backend's side of the shared contract, without a model: config refusals naming the
key, the checkpoint config it hands mlx-lm, request parsing of its server, the EMAD rule and the
MLX entropies against the torch path's, and that none of it imports torch or vLLM."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from vllm_adaptive.config import AdaptiveConfigError, parse_adaptive_config

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install '.[mlx]')")

from vllm_adaptive.metal_backend.loading import mlx_config_overrides  # noqa: E402
from vllm_adaptive.metal_backend.server import (  # noqa: E402
    BadRequest,
    TextStream,
    adaptive_overrides,
    adaptive_section,
    sampling_fields,
)
from vllm_adaptive.metal_backend.support import check_supported, unsupported  # noqa: E402


@pytest.mark.parametrize(
    ("adaptive", "key"),
    [
        ({"precision": {"policy": "gearbx", "group_size": None}}, "adaptive.precision.group_size"),
        ({"precision": {"policy": "gearbx", "group_size": 256}}, "adaptive.precision.group_size"),
        (
            {"precision": {"policy": "gearbx", "offload_inactive": True}},
            "adaptive.precision.offload_inactive",
        ),
        (
            {"depth": {"profile": "p", "signal": {"policy": "river"}}},
            "adaptive.depth.signal.policy",
        ),
        ({"depth": {"profile": "p", "kv_strategy": "mask"}}, "adaptive.depth.kv_strategy"),
        (
            {"depth": {"profile": "p", "refresh": {"every": 8, "raise_layers": 4}}},
            "adaptive.depth.refresh",
        ),
        ({"speculative": {"draft": "early"}}, "adaptive.speculative.draft"),
        (
            {"speculative": {"draft": "lowbit", "group_size": 16}},
            "adaptive.speculative.group_size",
        ),
    ],
)
def test_unsupported_mechanisms_are_refused_naming_the_key(adaptive: dict, key: str) -> None:
    cfg = parse_adaptive_config(adaptive)
    with pytest.raises(AdaptiveConfigError, match=key.replace(".", r"\.")):
        check_supported(cfg)
    # the engine refuses before it loads anything (no model directory needed)
    from vllm_adaptive.metal_backend.engine import MlxEngine

    with pytest.raises(AdaptiveConfigError, match=key.replace(".", r"\.")):
        MlxEngine("/nonexistent", adaptive)


@pytest.mark.parametrize(
    "adaptive",
    [
        {},
        {"mode": "off"},
        {"precision": {"policy": "gearbx"}},
        {"precision": {"policy": "quicksilver", "group_size": 64}},
        {"precision": {"policy": "fixed", "gear": "int4", "symmetric": False, "routing": "token"}},
        {"depth": {"profile": "p", "budget": 0.5, "floor": None}},
        {"speculative": {"draft": "lowbit", "precision": "int8"}},
    ],
)
def test_supported_configs_pass(adaptive: dict) -> None:
    assert unsupported(parse_adaptive_config(adaptive)) == []


def test_schema_errors_are_the_shared_schema_s() -> None:
    with pytest.raises(AdaptiveConfigError, match="adaptive.precision.policy"):
        adaptive_section('{"adaptive": {"precision": {"policy": "nope"}}}')
    with pytest.raises(AdaptiveConfigError, match="unknown keys"):
        adaptive_section('{"adaptive": {}, "turboquant": true}')
    assert adaptive_section(None) == {}
    assert adaptive_section('{"adaptive": {"mode": "off"}}') == {"mode": "off"}


def test_rope_parameters_reach_mlx_lm() -> None:
    hf = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert mlx_config_overrides(hf) == {"rope_theta": 100000.0}
    llama3 = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert mlx_config_overrides(llama3) == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    assert mlx_config_overrides({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 2}}) == {}
    assert mlx_config_overrides({}) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"vllm_xargs": {"adaptive_gear": "fast"}}, "adaptive_gear"),
        ({"adaptive_gear": "fast"}, "adaptive_gear"),
        ({"vllm_xargs": {"adaptive_bogus": 1}}, "adaptive_bogus"),
        ({"vllm_xargs": {"adaptive_depth_budget": 1.5}}, "adaptive_depth_budget"),
        ({"vllm_xargs": {"adaptive_mode": "off", "adaptive_gear": "low"}}, "adaptive_gear"),
        ({"vllm_xargs": {"adaptive_gear": "low"}, "adaptive_gear": "mid"}, "adaptive_gear"),
        ({"vllm_xargs": "adaptive_gear=low"}, "vllm_xargs"),
    ],
)
def test_bad_adaptive_keys_name_the_key(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        adaptive_overrides(body)
    assert e.value.param == param and param in str(e.value)


def test_adaptive_keys_from_vllm_xargs_or_the_top_level() -> None:
    o = adaptive_overrides({"vllm_xargs": {"adaptive_gear": "low"}, "adaptive_request_tag": "x"})
    assert (o.gear, o.request_tag) == ("low", "x")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_bad_sampling_fields_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        sampling_fields(body)
    assert e.value.param == param


def test_sampling_defaults() -> None:
    f = sampling_fields({"max_completion_tokens": 5, "top_k": -1, "stop": "\n"})
    assert f["max_tokens"] == 5 and f["top_k"] == 0 and f["stop"] == ["\n"]
    assert f["temperature"] == 1.0 and not f["stream"]


class _CharTokenizer:
    """One character per token id (ord): enough to test stop strings and held-back text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_possible_stop_strings() -> None:
    ts = TextStream(_CharTokenizer(), ["END"])
    out = "".join(ts.add(ord(c)) for c in "abcEN")
    assert out == "abc" and not ts.stopped  # "EN" is held: it may still become "END"
    assert ts.add(ord("D")) == "" and ts.stopped
    assert ts.flush() == ""
    ts = TextStream(_CharTokenizer(), ["END"])
    assert "".join(ts.add(ord(c)) for c in "xENy") + ts.flush() == "xENy"
    plain = TextStream(_CharTokenizer(), [])
    assert "".join(plain.add(ord(c)) for c in "hello") + plain.flush() == "hello"


def test_entropies_match_the_torch_path() -> None:
    torch = pytest.importorskip("torch")
    from vllm_adaptive.depth.proxies import feature_score as torch_feature
    from vllm_adaptive.metal_backend.depth import feature_score
    from vllm_adaptive.metal_backend.entropy import entropy_bits, entropy_nats
    from vllm_adaptive.precision.entropy import entropy_bits as torch_bits

    z = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32) * 3
    z[0, 5] = np.nan
    np.testing.assert_allclose(
        np.array(entropy_bits(mx.array(z))), torch_bits(torch.from_numpy(z)).numpy(), rtol=1e-5
    )
    zz = z[1:]
    np.testing.assert_allclose(
        np.array(feature_score(mx.array(zz), 1.5, 32)),
        torch_feature(torch.from_numpy(zz), 1.5, 32).numpy(),
        rtol=1e-4,
    )
    logp = zz - np.log(np.exp(zz).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        np.array(entropy_nats(mx.array(zz))), -(np.exp(logp) * logp).sum(-1), rtol=1e-4
    )
    assert math.isfinite(float(entropy_bits(mx.array(z))[0].item()))


def test_the_backend_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys\n"
        "import vllm_adaptive.metal_backend.engine, vllm_adaptive.metal_backend.server\n"
        "import vllm_adaptive.metal_backend.bench, vllm_adaptive.cli\n"
        "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'transformers') "
        "if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" not in loaded and "vllm" not in loaded, loaded
