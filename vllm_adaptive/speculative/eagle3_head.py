"""EAGLE-3 draft heads in the format vLLM's EAGLE-3 loader reads (``llama_eagle3.py``).

A head is one decoder layer over ``fc([h_low, h_mid, h_high])`` (three of the target's hidden
states) and the token embedding, with a truncated draft vocabulary mapped back to the target's
by ``d2t`` (``target_id = draft_id + d2t[draft_id]``). The directory holds ``config.json``
(architecture ``LlamaForCausalLMEagle3``), ``model.safetensors`` with the names EAGLE-3
checkpoints use (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and
``vllm_adaptive.json`` with the fingerprint of the target it was made for, so that a head made
for another model is refused (:func:`check_head_for_target`). No vLLM here: the engine glue and
the training recipe both use it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive.artifacts import fingerprint_matches, model_fingerprint

ARCHITECTURE = "LlamaForCausalLMEagle3"
MARKER = "vllm_adaptive.json"


class Eagle3HeadError(ValueError):
    """A head that cannot serve this target: says what does not match."""


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 layers for a Llama target (``SupportsEagle3.
    get_eagle3_default_aux_hidden_state_layers``): the residual stream after 2, L // 2 and
    L - 3 layers (transformers' ``output_hidden_states[i]``)."""
    return (2, num_layers // 2, num_layers - 3)


def target_rope_theta(target_config: dict[str, Any]) -> float:
    """The target's rotary base: ``rope_theta``, or transformers 5's ``rope_parameters``."""
    if target_config.get("rope_theta") is not None:
        return float(target_config["rope_theta"])
    params = target_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def head_config(
    target_config: dict[str, Any],
    draft_vocab_size: int,
    aux_layers: Sequence[int] | None = None,
    num_layers: int = 1,
) -> dict[str, Any]:
    """The head's config.json: the target's shapes, ``num_layers`` decoder layers (vLLM's
    EAGLE-3 model: the first reads [embedding, fc(h)], later ones the stream), the truncated
    vocabulary.
    ``aux_layers`` (the target layers the head reads) is written where vLLM looks for it
    (``eagle_aux_hidden_state_layer_ids``, top level and in ``eagle_config``); without it vLLM
    uses :func:`default_aux_layers`."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    extra: dict[str, Any] = {}
    if aux_layers is not None:
        layers = [int(i) for i in aux_layers]
        extra = {
            "eagle_aux_hidden_state_layer_ids": layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim", hidden // heads),
        "num_hidden_layers": int(num_layers),
        "hidden_act": target_config.get("hidden_act", "silu"),
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-5),
        "rope_theta": target_rope_theta(target_config),
        "rope_scaling": target_config.get("rope_scaling"),
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **extra,
    }


def head_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head and its shape (the first layer's attention reads [embedding,
    fc(h)]; layers 1.. read the stream, as ``layers.{i}.*``, and carry vLLM's unused
    ``hidden_norm`` so that its loader finds every parameter it built)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    later: dict[str, tuple[int, ...]] = {}
    for i in range(1, int(cfg.get("num_hidden_layers", 1))):
        p = f"layers.{i}."
        later.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "hidden_norm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return {
        "fc.weight": (h, 3 * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        **later,
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
    }


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` (offsets, int64) and ``t2d`` (membership, bool) for sorted target ids."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long)
    if ids.ndim != 1 or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary: want strictly increasing target ids")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary: ids outside the target's vocabulary 0..{vocab_size}")
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def save_head(
    out_dir: str | Path,
    target_dir: str | Path,
    weights: dict[str, torch.Tensor],
    draft_ids: torch.Tensor,
    meta: dict[str, Any] | None = None,
    aux_layers: Sequence[int] | None = None,
    num_layers: int = 1,
) -> Path:
    """Write a head for the target in ``target_dir``; checks every tensor's shape.
    ``aux_layers``, ``num_layers``: see :func:`head_config`."""
    from safetensors.torch import save_file

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = head_config(target_cfg, len(draft_ids), aux_layers, num_layers)
    shapes = head_shapes(cfg)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise ValueError(f"EAGLE-3 head: missing tensors {missing}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"EAGLE-3 head: {name} is {tuple(weights[name].shape)}, want {shape}")
    d2t, t2d = vocab_maps(draft_ids, cfg["vocab_size"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: weights[n].detach().float().contiguous() for n in shapes}
    save_file({**tensors, "d2t": d2t, "t2d": t2d}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    marker = {"target_fingerprint": model_fingerprint(target_dir), **(meta or {})}
    (out / MARKER).write_text(json.dumps(marker, indent=1))
    return out


def load_head(head_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor]:
    """A saved head's config, its weights (``d2t`` / ``t2d`` removed) and its draft vocabulary
    as target ids (vLLM: target id = draft id + ``d2t[draft id]``)."""
    from safetensors.torch import load_file

    head = Path(head_dir)
    cfg = json.loads((head / "config.json").read_text())
    weights = load_file(str(head / "model.safetensors"))
    d2t = weights.pop("d2t")
    weights.pop("t2d", None)
    shapes = head_shapes(cfg)
    if {n: tuple(t.shape) for n, t in weights.items()} != shapes:
        raise ValueError(f"EAGLE-3 head {head}: tensors do not match its config.json")
    return cfg, weights, torch.arange(len(d2t)) + d2t.long()


def head_aux_layers(cfg: dict[str, Any]) -> list[int] | None:
    """The target layers a head's config names (None: vLLM's default)."""
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return [int(i) for i in layers] if layers else None


def random_head(
    out_dir: str | Path, target_dir: str | Path, draft_vocab_size: int = 4096, seed: int = 0
) -> Path:
    """An untrained head (small random weights, the first ids as the draft vocabulary): runs
    through vLLM's proposer and is almost never accepted; for capability tests."""
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = head_config(target_cfg, draft_vocab_size)
    gen = torch.Generator().manual_seed(seed)
    weights = {
        n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02)
        for n, s in head_shapes(cfg).items()
    }
    return save_head(
        out_dir, target_dir, weights, torch.arange(draft_vocab_size), {"trained": False}
    )


def check_head_for_target(head_dir: str | Path, target_dir: str | Path) -> None:
    """Refuse a head made for another model (fingerprint) or with other shapes."""
    head = Path(head_dir)
    cfg_path = head / "config.json"
    if not cfg_path.is_file():
        raise Eagle3HeadError(f"EAGLE-3 head {head}: no config.json")
    cfg = json.loads(cfg_path.read_text())
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != target_cfg.get(key):
            raise Eagle3HeadError(
                f"EAGLE-3 head {head}: {key} {cfg.get(key)} does not match the target's "
                f"{target_cfg.get(key)} ({target_dir})"
            )
    marker = head / MARKER
    if marker.is_file():
        want = json.loads(marker.read_text()).get("target_fingerprint")
        ok, got = fingerprint_matches(want, target_dir) if want else (True, "")
        if not ok:
            raise Eagle3HeadError(
                f"EAGLE-3 head {head} was made for another model (fingerprint {want[:12]}, "
                f"this target {got[:12]}: {target_dir})"
            )
