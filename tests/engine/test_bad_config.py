"""A bad adaptive config stops a real engine at start, with a message naming the keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_bad_config_fails_engine_start(model_dir: Path) -> None:
    """A real engine refuses to start and the log names both bad keys."""
    code = (
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM(model={str(model_dir)!r}, enforce_eager=True, max_model_len=512,\n"
        "        additional_config={'adaptive': {'mode': 'fast', 'bogus': 1}})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "adaptive.bogus: unknown key" in out
    assert "adaptive.mode: Input should be 'on' or 'off'" in out
