"""A bad adaptive config stops a real engine at start, with a message naming the keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_bad_config_fails_engine_start(model_dir: Path, tmp_path: Path) -> None:
    """A real engine refuses to start and the log names both bad keys; in the same process
    (one vLLM import for both), adaptive.depth.fusion with a KV strategy it cannot compose with
    is refused with a message saying why."""
    fusion = {
        "profile": str(tmp_path),
        "kv_strategy": "monotone",
        "fusion": {"profile": str(tmp_path)},
    }
    code = (
        "from vllm import LLM\n"
        "def start(adaptive):\n"
        "    try:\n"
        f"        LLM(model={str(model_dir)!r}, enforce_eager=True, max_model_len=512,\n"
        "            additional_config={'adaptive': adaptive})\n"
        "    except Exception as e:\n"
        "        print('REFUSED', e, flush=True)\n"
        "        return\n"
        "    raise SystemExit('STARTED')\n"
        "if __name__ == '__main__':\n"
        "    start({'mode': 'fast', 'bogus': 1})\n"
        f"    start({{'depth': {fusion!r}}})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("REFUSED") == 2
    assert "adaptive.bogus: unknown key" in out
    assert "adaptive.mode: Input should be 'on' or 'off'" in out
    assert 'adaptive.depth: Value error, "fusion" needs kv_strategy "mask"' in out
