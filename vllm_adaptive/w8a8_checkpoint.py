"""A W8A8 int8 checkpoint of a prepared model, in the compressed-tensors format, so that vLLM's
own int8 path can be measured beside the plugin (the bench's peer row).

The scheme is the one vLLM 0.32 maps to `CompressedTensorsW8A8Int8` with dynamic activations
(`compressed_tensors.py::_is_dynamic_token_w8a8`): int8 weights, symmetric, one scale per output
channel (`weight_scale`, shape [N, 1], float32); int8 activations quantized per token at run time
(no activation scales in the checkpoint). On CPU vLLM runs it through oneDNN
(`vllm/model_executor/kernels/linear/scaled_mm/cpu.py`), or its AMX kernel where the CPU has AMX.
Only the decoder's linears are quantized; the embedding (tied LM head) and the norms stay as
they were. llm-compressor is not needed: round-to-nearest absmax per channel is what its
`W8A8` preset does without SmoothQuant or GPTQ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

#: Linear weights of a Llama-architecture decoder layer (vLLM fuses q/k/v and gate/up itself).
LINEAR_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)

_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}

#: `quantization_config` of config.json, as llm-compressor writes it for its W8A8 preset.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**_INT8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**_INT8, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "global_compression_ratio": None,
}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 with one float32 scale per output row (absmax / 127)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float32)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def is_quantized_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(LINEAR_SUFFIXES)


def write_w8a8(src: Path, out: Path) -> dict[str, Any]:
    """Write the W8A8 checkpoint of the checkpoint in ``src`` into ``out`` (an empty directory):
    model.safetensors, config.json with `quantization_config`, and every other file of ``src``
    (tokenizer, generation config) copied. Returns a summary (tensors quantized, bytes, the
    worst relative reconstruction error of a row)."""
    from safetensors.torch import load_file, save_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    out_state: dict[str, torch.Tensor] = {}
    quantized, worst = 0, 0.0
    for name, tensor in state.items():
        if not is_quantized_linear(name):
            out_state[name] = tensor.contiguous()
            continue
        q, scale = quantize_per_channel(tensor)
        err = (dequantize(q, scale) - tensor.float()).norm(dim=1) / tensor.float().norm(
            dim=1
        ).clamp(min=1e-12)
        worst = max(worst, float(err.max()))
        out_state[name] = q.contiguous()
        out_state[name.removesuffix(".weight") + ".weight_scale"] = scale.contiguous()
        quantized += 1
    if quantized == 0:
        raise ValueError(f"{src}: no decoder linear weights found (not a Llama-style checkpoint?)")
    save_file(out_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            if not f.name.startswith("vllm_adaptive_manifest"):
                shutil.copy2(f, out / f.name)
    return {
        "quantized_tensors": quantized,
        "bytes": sum(t.numel() * t.element_size() for t in out_state.values()),
        "worst_row_relative_error": worst,
    }
