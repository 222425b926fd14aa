"""Calibration profile on disk: `tensors.safetensors` + `profile.json` (no pickle).

The JSON holds every scalar and list (probe layers, rank, temperature, q, alpha, budget,
thresholds, margins, figures) plus a model fingerprint and the sha256 of the tensor file.
`load_profile` refuses, with a `ProfileError` naming the problem, a profile made for another
model, a missing or corrupt file, or another format version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
JSON_NAME = "profile.json"
TENSORS_NAME = "tensors.safetensors"
#: tensors hashed into the fingerprint (first rows only for the big ones)
_FINGERPRINT_TENSORS = ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight")
_FINGERPRINT_ROWS = 64


class ProfileError(Exception):
    """A profile cannot be used: wrong model, missing/corrupt file or wrong format version."""


@dataclass
class Profile:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json, every tensor's name/dtype/shape and a few weights' leading rows."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise ProfileError(f"model directory {model_dir} has no config.json")
    h.update(cfg.read_bytes())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ProfileError(f"model directory {model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                sl = st.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{list(sl.get_shape())};".encode())
                if name in _FINGERPRINT_TENSORS:
                    t = st.get_slice(name)[:_FINGERPRINT_ROWS]
                    h.update(t.float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_profile(profile: Profile, out_dir: str | Path, model_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in profile.tensors.items()}
    save_file(tensors, str(out / TENSORS_NAME))
    meta = dict(profile.meta)
    meta["format_version"] = FORMAT_VERSION
    meta["model_fingerprint"] = model_fingerprint(model_dir)
    meta["tensors_sha256"] = _sha256_file(out / TENSORS_NAME)
    meta["tensor_names"] = sorted(tensors)
    (out / JSON_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def load_profile(profile_dir: str | Path, model_dir: str | Path) -> Profile:
    d = Path(profile_dir)
    jpath, tpath = d / JSON_NAME, d / TENSORS_NAME
    if not jpath.is_file():
        raise ProfileError(f"profile {d}: missing {JSON_NAME}")
    try:
        meta = json.loads(jpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile {d}: {JSON_NAME} is corrupt ({e})") from None
    if not isinstance(meta, dict):
        raise ProfileError(f"profile {d}: {JSON_NAME} is corrupt (not a JSON object)")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ProfileError(
            f"profile {d}: format version {version!r}, this code reads {FORMAT_VERSION}; "
            "recalibrate"
        )
    want = model_fingerprint(model_dir)
    if meta.get("model_fingerprint") != want:
        raise ProfileError(
            f"profile {d} was made for a different model (fingerprint "
            f"{str(meta.get('model_fingerprint'))[:12]}..., {model_dir} is {want[:12]}...)"
        )
    if not tpath.is_file():
        raise ProfileError(f"profile {d}: missing {TENSORS_NAME}")
    if _sha256_file(tpath) != meta.get("tensors_sha256"):
        raise ProfileError(f"profile {d}: {TENSORS_NAME} is corrupt (sha256 mismatch)")
    try:
        tensors = load_file(str(tpath))
    except Exception as e:  # safetensors raises its own error types
        raise ProfileError(f"profile {d}: {TENSORS_NAME} unreadable ({e})") from None
    if sorted(tensors) != meta.get("tensor_names"):
        raise ProfileError(f"profile {d}: tensor names differ from {JSON_NAME}")
    return Profile(meta=meta, tensors=tensors)
