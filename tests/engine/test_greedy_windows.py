"""Training windows written by vLLM's engine (`train draft --generator vllm`, the default on a
CPU where vLLM is installed): the prompt is kept, every generated token is the target's greedy
choice given what precedes it (checked against transformers' teacher-forced argmax in float32),
and the engine's processes are gone after ``close``."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from vllm_adaptive.engine.greedy_windows import VllmWindows


def _engine_children() -> list[str]:
    return [
        p.name() for p in psutil.Process().children(recursive=True) if "VLLM" in p.name().upper()
    ]


def test_vllm_windows_are_the_targets_greedy_continuations(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = (
        "The river rose through the night, and by morning the lower fields were under water. "
        "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip()\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompts = torch.tensor([ids[i : i + 16] for i in (0, 5, 11, 19)])
    windows = VllmWindows(model_dir, torch.float32, max_len=64)
    # 30 layers x (k, v) x 3 heads x 64 x 4 bytes a token, 256 windows of 64, a quarter spare
    assert windows.kv_cache_bytes() == int(1.25 * 30 * 2 * 3 * 64 * 4 * 256 * 64)
    try:
        got = windows(prompts, 48)
        assert _engine_children(), "the engine runs in processes of its own"
    finally:
        windows.close()
    assert not _engine_children(), "close() left engine processes behind"
    assert got.shape == (4, 48) and torch.equal(got[:, :16], prompts)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        argmax = model(got).logits.argmax(-1)
    agree = (got[:, 16:] == argmax[:, 15:-1]).float().mean().item()
    # float32 on both sides: sums in another order may flip a near-tie, rarely
    assert agree >= 0.97, agree
    assert torch.equal(got[:, 16], argmax[:, 15])  # the first token has no earlier flip
