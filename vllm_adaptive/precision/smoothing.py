"""SmoothQuant-style smoothing for the W8A8 gear: activation statistics measured offline.

W8A8 with one activation scale per token loses where a few input channels carry outliers: the
token's scale is set by them and every other channel is rounded coarsely. SmoothQuant (Xiao et
al. 2023, section 4) divides each input channel ``j`` by ``s_j = max|X_j|^a / max|W_j|^(1-a)``
and multiplies the weight's column by it, which leaves the product unchanged and balances the
two ranges. ``max|X_j|`` comes from calibration text: :func:`calibrate_smoothing` runs the model
(transformers, float32, no vLLM) over the calibration part of the corpora and records the
per-channel absolute maximum of the input of every managed linear, keyed by vLLM's fused module
names (``layers.{i}.qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, and ``lm_head``).
The engine turns them into factors at load time with the configured ``alpha``
(:func:`load_smoothing`, then ``factors_for`` in ``models/precision.py``), so one calibration
serves every alpha.

Written as a profile (``profile.json`` + ``tensors.safetensors``, the model's fingerprint
inside): ``vllm-adaptive calibrate --smoothing --model DIR --corpus FILE... --out DIR``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_adaptive.artifacts import Profile, ProfileError, load_profile, save_profile

KIND = "smoothing"
#: HF Llama module (input observed) -> vLLM fused module it feeds
_HF_TO_FUSED = {
    "self_attn.q_proj": "qkv_proj",
    "self_attn.o_proj": "o_proj",
    "mlp.gate_proj": "gate_up_proj",
    "mlp.down_proj": "down_proj",
}


@torch.no_grad()
def activation_absmax(model, windows: list[list[int]], progress: bool = True) -> dict:
    """Per-channel max |input| of every managed linear (and the LM head) over ``windows``."""
    from tqdm import tqdm

    stats: dict[str, torch.Tensor] = {}
    hooks = []

    def observe(name: str):
        def hook(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
            stats[name] = x if name not in stats else torch.maximum(stats[name], x)

        return hook

    for i, layer in enumerate(model.model.layers):
        for hf_name, fused in _HF_TO_FUSED.items():
            module = layer.get_submodule(hf_name)
            hooks.append(module.register_forward_pre_hook(observe(f"layers.{i}.{fused}")))
    hooks.append(model.lm_head.register_forward_pre_hook(observe("lm_head")))
    try:
        for w in tqdm(windows, desc="activation statistics", unit="window", disable=not progress):
            model(torch.tensor([w]))
    finally:
        for h in hooks:
            h.remove()
    return stats


def calibrate_smoothing(
    model_dir: str | Path,
    corpora: list[str | Path],
    out: str | Path,
    tokens: int = 256 * 32,
    window: int = 256,
    progress: bool = True,
) -> Path:
    """Measure activation maxima on the calibration part of ``corpora``; write the profile."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import read_corpus, token_windows_with_next

    t0 = time.perf_counter()
    files = [read_corpus(c) for c in corpora]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    windows, _ = token_windows_with_next(
        tok, [f.calibration_text for f in files], window, max(1, tokens // window)
    )
    stats = activation_absmax(model, windows, progress=progress)
    meta = {
        "kind": KIND,
        "statistic": "per-channel max |x| of each linear's input",
        "tokens": len(windows) * window,
        "window": window,
        "corpora": [{"path": str(f.path), "sha256": f.sha256} for f in files],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return save_profile(Profile(meta=meta, tensors=stats), out, model_dir)


def load_smoothing(profile_dir: str | Path, model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The activation maxima of a smoothing profile made for this model (``ProfileError``
    naming the problem otherwise)."""
    prof = load_profile(profile_dir, model_dir)
    if prof.meta.get("kind") != KIND:
        raise ProfileError(
            f"profile {profile_dir} is a {prof.meta.get('kind', 'depth')!r} profile, not a "
            "smoothing profile (make one with `vllm-adaptive calibrate --smoothing`)"
        )
    return prof.tensors
