"""A second `scripts/serve.sh` start with the same settings finds the first one's compiled model.

Two compiled (not `--enforce-eager`) starts of the README's GEARBX server in one fresh
`VLLM_CACHE_ROOT`. vLLM 0.32's AOT compile cache cannot load on CPU (`'function' object has no
attribute 'finalize_loading'`, stock vLLM alike), so `scripts/serve.sh` turns it off
(`VLLM_USE_AOT_COMPILE=0`) and keeps Inductor's own cache under the vLLM cache root
(`torch_compile_cache/inductor`). The first start writes the compiled graphs there; the second
must find every graph it needs there (it adds none) and answer the same. Nothing the plugin puts
in the environment per run (the telemetry directory, `ADAPTIVE_STATS_DIR`) may change a graph.
Several minutes: the full suite.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import openai

from tests.support.serving import PROMPT, SERVED_NAME, serving

CONFIG = {"precision": {"policy": "gearbx"}}
AOT_LINES = re.compile(r"saved AOT compiled function|Compiling model again|load AOT compilation")
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def _start(model_dir: Path, log: Path, cache: Path) -> tuple[float, str]:
    """Seconds from launch to a served completion, and the answer."""
    t0 = time.monotonic()
    # "" is unset for serve.sh: this test process may have exported vLLM's AOT Inductor dir
    env = {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": ""}
    with serving(model_dir, CONFIG, log, env=env, serve_sh="ADAPTIVE_CONFIG", eager=False) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=300)
        out = client.completions.create(
            model=SERVED_NAME, prompt=PROMPT, temperature=0, max_tokens=8
        )
        return time.monotonic() - t0, out.choices[0].text


def _graphs(inductor: Path) -> set[str]:
    """The compiled graphs in Inductor's cache (``fxgraph/<xx>/<key>/<entry>``)."""
    root = inductor / "fxgraph"
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_second_start_finds_the_first_starts_compiled_model(
    model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    inductor = cache / "torch_compile_cache" / "inductor"
    first_s, first = _start(model_dir, tmp_path / "first.log", cache)
    after_first = _graphs(inductor)
    second_s, second = _start(model_dir, tmp_path / "second.log", cache)
    after_second = _graphs(inductor)
    log1 = (tmp_path / "first.log").read_text(errors="replace")
    log2 = (tmp_path / "second.log").read_text(errors="replace")
    inits = [m.group(1) for m in (INIT.search(log1), INIT.search(log2)) if m]
    print(
        f"\nserve.sh start to first completion: {first_s:.1f} s, then {second_s:.1f} s; "
        f"engine init {' s, then '.join(inits)} s; {len(after_first)} compiled graphs"
    )
    assert AOT_LINES.search(log1 + log2) is None, "vLLM's AOT cache ran: serve.sh turns it off"
    assert after_first, f"no compiled graph under {inductor}: {log1[-3000:]}"
    assert after_second == after_first, f"the second start compiled {after_second - after_first}"
    assert second == first
