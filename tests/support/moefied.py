"""A MoEfied checkpoint for mechanics tests, derived from the default dense model.

**Mechanics fixture, not a model**: the identity permutation (expert e is simply neurons
``e*m:(e+1)*m`` of the dense MLP, with no clustering) and a seeded random router. It has the
on-disk format of docs/moe.md ("The MoEfied model") and exercises the runtime (routing, expert
tiers, prefetch) on the real architecture, but its text and its expert choices mean nothing: no
quality, hit-rate or speed claim may be made on it. The real model is built offline by
``vllm_adaptive/moe/moefy.py`` (``vllm-adaptive models prepare smollm2-135m-moefied``), which a
fresh CI machine does not have prepared; this fixture needs only the dense model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LABEL = "mechanics fixture: identity permutation, random router (not a quality model)"


def build_mechanics_moefied(
    dense_dir: Path, out_dir: Path, experts: int = 8, top_k: int = 4, seed: int = 0
) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((dense_dir / "config.json").read_text())
    inter, hidden = config["intermediate_size"], config["hidden_size"]
    if inter % experts:
        raise ValueError(f"intermediate size {inter} is not divisible by {experts} experts")
    config.update(
        architectures=["MoefiedLlamaForCausalLM"],
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter // experts,
    )
    tensors = load_file(str(dense_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    dtype = tensors["model.layers.0.mlp.gate_proj.weight"].dtype
    for i in range(config["num_hidden_layers"]):
        router = torch.randn(experts, hidden, generator=g) / hidden**0.5
        tensors[f"model.layers.{i}.mlp.router.weight"] = router.to(dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (dense_dir / name).exists():
            shutil.copy(dense_dir / name, out_dir / name)
    (out_dir / "MECHANICS_FIXTURE.txt").write_text(LABEL + "\n")
    return out_dir


def train_fixture_adapters(moefied_dir: Path, tmp: Path) -> Path:
    """Stream adapters for the fixture (seconds of training: mechanics, not a predictor)."""
    import torch

    from vllm_adaptive.corpora import default_code_corpus
    from vllm_adaptive.moe.m2r2 import train_stream_adapters

    tmp.mkdir(parents=True, exist_ok=True)
    corpus = default_code_corpus(tmp / "code.txt", max_chars=200_000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_stream_adapters(
            moefied_dir,
            [corpus],
            tmp / "adapters",
            distances=2,
            rank=4,
            steps=10,
            batch=128,
            windows_per_corpus=2,
            window=64,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    return tmp / "adapters"
