"""The W8A8 checkpoint writer (vllm_adaptive/w8a8_checkpoint.py): the quantizer, and a config
that vLLM's own compressed-tensors parser maps to its dynamic per-token W8A8 int8 scheme."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_adaptive.w8a8_checkpoint import (
    QUANTIZATION_CONFIG,
    dequantize,
    is_quantized_linear,
    quantize_per_channel,
    write_w8a8,
)


def test_quantize_per_channel_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[3] *= 100.0  # one row with a large range: its own scale, the others unaffected
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64, 1) and s.dtype == torch.float32
    assert int(q.abs().max()) == 127
    err = (dequantize(q, s) - w).abs()
    assert bool((err <= s / 2 + 1e-6).all())  # round to nearest: at most half a step
    assert torch.allclose(s[3], w[3].abs().max() / 127.0)
    assert float(err[0].max()) < 0.02


def test_write_w8a8_and_vllm_reads_the_scheme(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 16).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(16, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 24).to(torch.bfloat16),
    }
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
    (src / "tokenizer.json").write_text("{}")
    summary = write_w8a8(src, out)
    assert summary["quantized_tensors"] == 2 and summary["worst_row_relative_error"] < 0.02

    written = load_file(out / "model.safetensors")
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert written["model.layers.0.self_attn.q_proj.weight_scale"].shape == (16, 1)
    assert torch.equal(written["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert (out / "tokenizer.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == QUANTIZATION_CONFIG and cfg["vocab_size"] == 32
    assert is_quantized_linear("model.layers.3.mlp.gate_proj.weight")
    assert not is_quantized_linear("lm_head.weight")

    # vLLM's own parser: the Linear group is int8 channel weights with dynamic per-token
    # activations, the combination it runs as CompressedTensorsW8A8Int8 (dynamic input scales)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    ct = CompressedTensorsConfig.from_config(json.loads(json.dumps(cfg["quantization_config"])))
    scheme = ct.target_scheme_map["Linear"]
    assert CompressedTensorsConfig._is_dynamic_token_w8a8(
        scheme["weights"], scheme["input_activations"]
    )
    assert ct.ignore == ["lm_head"] and ct.quant_format == "int-quantized"
