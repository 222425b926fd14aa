"""Token fusion test inputs and worker-side instruments (run through ``LLM.apply_model``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def write_fusion_profile(
    out: Path,
    model_dir: Path,
    taus: dict[int, float],
    *,
    split_repeats: bool = True,
    vocab_size: int = 49152,
) -> Path:
    """A fusion profile with the given taus (no calibration): SmolLM2's special tokens and the
    default anchors exempt, no rare-token exemption (every count above the minimum)."""
    from transformers import AutoTokenizer

    from vllm_adaptive.artifacts import Profile, save_profile
    from vllm_adaptive.depth.calibration.fusion import DEFAULT_ANCHORS, KIND
    from vllm_adaptive.depth.policies.fusion import anchor_sequences

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    layers = sorted(taus)
    anchors = anchor_sequences(lambda s: tok(s, add_special_tokens=False)["input_ids"],
                               DEFAULT_ANCHORS)  # fmt: skip
    meta = {
        "kind": KIND,
        "layers": layers,
        "tau_fuse": {str(k): v for k, v in taus.items()},
        "weighting": "uniform",
        "tau_attn": None,
        "max_group": None,
        "split_repeats": split_repeats,
        "anchors": list(DEFAULT_ANCHORS),
        "anchor_ids": [list(a) for a in anchors],
        "special_ids": sorted(int(i) for i in tok.all_special_ids),
        "rare_min_count": 3,
        "note": "test profile: taus set by hand, not calibrated",
    }
    tensors = {
        "fusion_layers": torch.tensor(layers, dtype=torch.int32),
        "fusion_tau": torch.tensor([taus[x] for x in layers], dtype=torch.float32),
        "fusion_token_counts": torch.full((vocab_size,), 1000, dtype=torch.int32),
    }
    save_profile(Profile(meta=meta, tensors=tensors), out, model_dir)
    return out


_SAVED: dict[str, Any] = {}


def _runtime(model: Any) -> Any:
    return model.depth


def set_fusion_taus(model: Any, taus: dict[int, float]) -> None:
    """Change the engine's tau_fuse per layer (a test knob: one engine, two thresholds)."""
    import dataclasses

    fusion = _runtime(model).fusion
    fusion.rules = {
        int(k): dataclasses.replace(fusion.rules[int(k)], tau_fuse=float(v))
        for k, v in taus.items()
    }


def fusion_telemetry(model: Any) -> dict[str, Any]:
    rt = _runtime(model)
    return {"stats": rt.fusion.stats(), "events": rt.fusion.recent_events()}


def reset_fusion_events(model: Any) -> None:
    _runtime(model).fusion.events.clear()


def stop_masking_fused_slots(model: Any) -> None:
    """Negative control: after fusion, attention gets the query positions but a record that
    says every slot was written at every layer, so fused members' slots are read."""
    from vllm_adaptive.depth import runtime as rt_mod
    from vllm_adaptive.depth.mask_context import StepMask, current_mask, replace_mask

    cls = rt_mod.DepthRuntime
    _SAVED.setdefault("publish_positions", cls.__dict__["_publish_positions"])  # staticmethod

    def publish(pos: torch.Tensor) -> None:
        mask = current_mask()
        full = torch.full_like(mask.record, 32000)
        replace_mask(StepMask(full, mask.all_visible_below, pos))

    cls._publish_positions = staticmethod(publish)


def restore_masking_fused_slots(model: Any) -> None:
    from vllm_adaptive.depth import runtime as rt_mod

    cls = rt_mod.DepthRuntime
    cls._publish_positions = _SAVED.pop("publish_positions")
