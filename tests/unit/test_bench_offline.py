"""The offline bench's pieces that need no engine: the ShareGPT file vLLM's throughput bench
reads, its command per configuration, output tok/s and the baseline (the bench itself runs
`vllm bench throughput`: `vllm-adaptive bench-serve --offline`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_adaptive.bench import offline, servers


def test_sharegpt_file_keeps_prompts_in_order(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    offline.write_sharegpt(["a b", "c"], path)
    rows = json.loads(path.read_text())
    assert [r["conversations"][0]["value"] for r in rows] == ["a b", "c"]
    assert all(len(r["conversations"]) == 2 for r in rows)  # vLLM drops single turns


def test_command_is_stock_without_config_and_plugin_with_it(tmp_path: Path) -> None:
    stock = servers.ServerSpec("stock", "bfloat16")
    gear = servers.ServerSpec("gear", "float32", {"precision": {"policy": "fixed"}}, ("--x",))
    args = (tmp_path, tmp_path / "d.json", 16, 64, tmp_path / "r.json", 8)
    cmd = offline.throughput_command(stock, *args)
    assert cmd[1:3] == ["bench", "throughput"] and "--additional-config" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--output-len") + 1] == "64"
    cmd = offline.throughput_command(gear, *args)
    cfg = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert cfg == {"adaptive": {"precision": {"policy": "fixed"}}} and "--x" in cmd
    # what the run's env adds
    assert servers.serve_env(stock) == {"VLLM_PLUGINS": "", "ADAPTIVE_DRAFTS": "none"}


def test_output_throughput_counts_output_tokens_only() -> None:
    res = {"num_requests": 16, "elapsed_time": 4.0, "total_num_tokens": 99999}
    assert offline.output_throughput(res, 64) == pytest.approx(256.0)


def test_baseline_is_the_faster_stock() -> None:
    def row(label: str, stock: bool, *tps: float) -> dict:
        return {"label": label, "stock": stock, "runs": [{"output_throughput": t} for t in tps]}

    rows = [row("stock bf16", True, 100, 120, 110), row("stock f32", True, 60), row("p", False, 55)]
    summ = offline.summarize(rows)
    assert summ["baseline"] == "stock bf16"
    assert summ["servers"]["p"]["x_output_throughput"] == pytest.approx(0.5)
    assert summ["servers"]["stock bf16"]["output_throughput_range"] == [100, 120]
    for r in rows:
        r["dtype"] = "x"
    md = offline.markdown(
        {"summary": summ, "servers": rows, "num_prompts": 3, "output_len": 4, "warmups": 0}
    )
    assert "| p | x | 55.0 (0.50x) |" in md
