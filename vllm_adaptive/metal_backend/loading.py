"""Load a checkpoint directory (``vllm-adaptive models prepare``) into mlx-lm's model class.

mlx-lm 0.32 reads RoPE settings from top-level ``rope_theta`` / ``rope_scaling`` only, while
checkpoints saved by transformers 5 nest them in ``rope_parameters``: loaded as is, SmolLM2
silently gets mlx-lm's default theta (10000 instead of 100000) and drifts from the model after
a few hundred tokens (measured: 80% argmax agreement with transformers at 400 tokens, 100% with
the setting passed). `mlx_config_overrides` passes the checkpoint's own values to
``mlx_lm.load(model_config=...)``; the stock baseline of the bench and the identity tests load
through the same function, so "stock mlx-lm" means mlx-lm's code on the correct config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: ``--dtype`` choices: "auto" keeps the checkpoint's (bfloat16 for the default model)
DTYPES = ("auto", "bfloat16", "float16", "float32")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (a checkpoint directory?)")
    return json.loads(path.read_text())


def mlx_config_overrides(hf: dict[str, Any]) -> dict[str, Any]:
    """Top-level ``rope_theta`` / ``rope_scaling`` from transformers 5's ``rope_parameters``,
    where the checkpoint does not give them itself."""
    rope = hf.get("rope_parameters")
    if not isinstance(rope, dict) or isinstance(rope.get("rope_theta"), dict):
        return {}  # absent, or per-layer-type (an architecture that reads it itself)
    out: dict[str, Any] = {}
    if "rope_theta" in rope and "rope_theta" not in hf:
        out["rope_theta"] = float(rope["rope_theta"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default") and hf.get("rope_scaling") is None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def load_mlx(model_dir: str | Path, dtype: str = "auto") -> tuple[Any, Any]:
    """(mlx-lm model, mlx-lm tokenizer wrapper) for a checkpoint directory, in ``dtype``."""
    import mlx.core as mx
    import mlx_lm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    hf = read_hf_config(model_dir)
    model, tokenizer = mlx_lm.load(str(model_dir), model_config=mlx_config_overrides(hf))
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, tokenizer


def model_dtype_name(model: Any) -> str:
    """The floating dtype of the model's weights, as a name ("bfloat16", "float32", ...)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        name = str(p.dtype).rsplit(".", 1)[-1]
        if name.startswith(("float", "bfloat")):
            return name
    return "unknown"
