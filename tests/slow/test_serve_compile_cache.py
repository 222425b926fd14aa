"""A second `scripts/serve.sh` start with the same settings reuses vLLM's torch.compile cache.

Two compiled (not `--enforce-eager`) starts of the README's GEARBX server in one fresh
`VLLM_CACHE_ROOT`: the first compiles and stores its graphs, the second loads them. Nothing
the plugin puts in the environment (the per-run telemetry directory, `ADAPTIVE_STATS_DIR`) may
enter vLLM's cache key. Several minutes on 2 cores: the full suite only.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import openai

from tests.support.serving import PROMPT, SERVED_NAME, serving

CONFIG = {"precision": {"policy": "gearbx"}}
LOADED = "Directly load the compiled graph(s)"
COMPILED = "Compiling a graph for compile range"


def _start(model_dir: Path, log: Path, cache: Path) -> tuple[float, str]:
    """Seconds from launch to a served completion, and the answer."""
    t0 = time.monotonic()
    env = {"VLLM_CACHE_ROOT": str(cache)}
    with serving(model_dir, CONFIG, log, env=env, serve_sh="ADAPTIVE_CONFIG", eager=False) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=300)
        out = client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, temperature=0, max_tokens=8
        )
        return time.monotonic() - t0, out.choices[0].text


def test_second_start_reuses_the_compile_cache(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "vllm-cache"
    first_s, first = _start(model_dir, tmp_path / "first.log", cache)
    second_s, second = _start(model_dir, tmp_path / "second.log", cache)
    log1 = (tmp_path / "first.log").read_text(errors="replace")
    log2 = (tmp_path / "second.log").read_text(errors="replace")
    dirs = {re.search(r"Using cache directory: (\S+)", t).group(1) for t in (log1, log2)}
    assert len(dirs) == 1, dirs  # the same cache key
    assert COMPILED in log1 and LOADED not in log1
    assert LOADED in log2 and COMPILED not in log2
    assert second == first
    print(f"\nserve.sh start to first completion: {first_s:.1f} s, then {second_s:.1f} s")
    assert second_s < first_s, (first_s, second_s)
