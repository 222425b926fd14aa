"""Stream bandwidth, weight bytes per decode step, bandwidth share (bench/bandwidth.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_adaptive.bench.bandwidth import (
    bandwidth_share,
    checkpoint_weight_bytes,
    safetensors_header,
    stream_bandwidth,
)


def test_stream_bandwidth_is_positive() -> None:
    threads = torch.get_num_threads()
    bw = stream_bandwidth(array_mib=8, repeats=2)
    for key in ("copy_gbs", "triad_gbs", "read_gbs"):
        assert 0.1 < bw[key] < 10_000.0, bw  # GB/s: anything real lies far inside this
    assert bw["best_gbs"] == max(bw["copy_gbs"], bw["triad_gbs"], bw["read_gbs"])
    assert bw["threads"] == 1 and bw["array_mib"] == 8
    assert torch.get_num_threads() == threads  # restored


def _checkpoint(d: Path, tied: bool, int8: bool) -> None:
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16),
    }
    if int8:
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(16, 8, dtype=torch.int8)
        t["model.layers.0.mlp.up_proj.weight_scale"] = torch.zeros(16, 1, dtype=torch.float32)
    else:
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(16, 8, dtype=torch.bfloat16)
    if not tied:
        t["lm_head.weight"] = torch.zeros(100, 8, dtype=torch.bfloat16)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))


def test_checkpoint_weight_bytes(tmp_path: Path) -> None:
    _checkpoint(tmp_path, tied=True, int8=False)
    assert set(safetensors_header(tmp_path / "model.safetensors")) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    wb = checkpoint_weight_bytes(tmp_path, dtype_bytes=4)  # bf16 stored, run in float32
    assert wb["lm_head_bytes"] == 100 * 8 * 4  # tied: the embedding is read whole as LM head
    assert wb["decoder_bytes"] == (8 + 16 * 8) * 4
    assert wb["weight_bytes_per_step"] == wb["lm_head_bytes"] + wb["decoder_bytes"]

    q = tmp_path / "int8"
    q.mkdir()
    _checkpoint(q, tied=False, int8=True)
    wb = checkpoint_weight_bytes(q, dtype_bytes=2)
    assert wb["lm_head_bytes"] == 100 * 8 * 2 and not wb["tied_lm_head"]
    # int8 weights as stored, float32 scales as stored, the norm at the engine dtype; the
    # untied input embedding is a lookup, not counted
    assert wb["decoder_bytes"] == 16 * 8 * 1 + 16 * 4 + 8 * 2


def test_bandwidth_share() -> None:
    assert bandwidth_share(1e9, 0.1, 20.0) == pytest.approx(0.5)  # 10 GB/s of 20
    assert bandwidth_share(1e9, 0.0, 20.0) is None
    assert bandwidth_share(1e9, 0.1, 0.0) is None


def test_reference_is_the_best_of_the_readings() -> None:
    from vllm_adaptive.bench.harness import best_stream

    start = {"copy_gbs": 11.0, "triad_gbs": 11.8, "read_gbs": 6.0, "best_gbs": 11.8}
    end = {"copy_gbs": 18.6, "triad_gbs": 11.4, "read_gbs": 15.8, "best_gbs": 18.6}
    ref = best_stream(start, end)
    assert (ref["copy_gbs"], ref["triad_gbs"], ref["read_gbs"]) == (18.6, 11.8, 15.8)
    assert ref["best_gbs"] == 18.6 and ref["readings"] == [start, end]
