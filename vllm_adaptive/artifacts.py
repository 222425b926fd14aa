"""The file format offline code writes and engines read: `tensors.safetensors` + `profile.json`.

Depth profiles (`vllm-adaptive calibrate`) and W8A8 smoothing profiles (`calibrate
--smoothing`) are written and checked here; M2R2 adapters (`m2r2/adapters.py`, their own
`adapter.json`) check their base model with the same `model_fingerprint`. Offline code and the
engine meet through this module. No pickle, no vLLM.

The JSON holds every scalar and list (probe layers, rank, temperature, q, alpha, budget,
thresholds, margins, figures) plus a model fingerprint and the sha256 of the tensor file.
`load_profile` refuses, with a `ProfileError` naming the problem, a profile made for another
model, a missing or corrupt file, or another format version.

The fingerprint hashes config.json as sorted JSON without the keys that name its writer
(transformers stamps its own version), so the same weights converted under another
transformers version keep it; :func:`fingerprint_matches` also accepts the fingerprint of
config.json's bytes that artifacts carried before.

Reading needs no torch: the fingerprint reads the safetensors header and converts the few
hashed rows with numpy (bf16 / f16 to float32 is exact, so the bytes equal torch's), and
``load_profile(..., framework="numpy")`` returns numpy arrays (the MLX backend's path).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_VERSION = 1
JSON_NAME = "profile.json"
TENSORS_NAME = "tensors.safetensors"
#: tensors hashed into the fingerprint (first rows only for the big ones)
_FINGERPRINT_TENSORS = ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight")
_FINGERPRINT_ROWS = 64
#: config.json keys that record who wrote the file, not the model: transformers stamps its own
#: version, so the same weights converted under another version must keep their fingerprint
_WRITER_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")


class ProfileError(Exception):
    """A profile cannot be used: wrong model, missing/corrupt file or wrong format version."""


@dataclass
class Profile:
    meta: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)  # torch tensors or numpy arrays


#: safetensors dtypes the fingerprint can widen to float32 (exactly, as torch's ``.float()``)
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def _header(f: BinaryIO) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def _rows_as_float32(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    return np.frombuffer(raw, dtype="<f4" if dtype == "F32" else "<f8").astype(np.float32)


def _canonical_config(cfg: Path) -> bytes:
    """config.json as sorted, compact JSON without the writer's keys (``_WRITER_KEYS``)."""
    try:
        doc = json.loads(cfg.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{cfg} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ProfileError(f"{cfg} is not a JSON object")
    for key in _WRITER_KEYS:
        doc.pop(key, None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json (canonical, without the writer's version), every tensor's
    name/dtype/shape and a few weights' leading rows."""
    return _fingerprint(Path(model_dir), legacy=False)


def fingerprint_matches(stored: Any, model_dir: str | Path) -> tuple[bool, str]:
    """Whether an artifact's stored fingerprint names ``model_dir``; returns (match, the model's
    fingerprint). Artifacts written before the canonical config hash (which hashed config.json's
    bytes as written) still match the model they were made for."""
    model_dir = Path(model_dir)
    mine = model_fingerprint(model_dir)
    if stored == mine:
        return True, mine
    return stored == _fingerprint(model_dir, legacy=True), mine


def _fingerprint(model_dir: Path, legacy: bool) -> str:
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise ProfileError(f"model directory {model_dir} has no config.json")
    h.update(cfg.read_bytes() if legacy else _canonical_config(cfg))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ProfileError(f"model directory {model_dir} has no *.safetensors weights")
    for path in files:
        with open(path, "rb") as f:
            header = _header(f)
            base = f.tell()
            for name in sorted(k for k in header if k != "__metadata__"):
                info = header[name]
                dtype, shape = info["dtype"], list(info["shape"])
                h.update(f"{name}:{dtype}:{shape};".encode())
                if name in _FINGERPRINT_TENSORS:
                    if dtype not in _ST_ITEMSIZE:
                        raise ProfileError(f"{path}: cannot fingerprint {name} of dtype {dtype}")
                    row = int(np.prod(shape[1:], dtype=np.int64)) * _ST_ITEMSIZE[dtype]
                    nbytes = min(shape[0], _FINGERPRINT_ROWS) * row if shape else 0
                    f.seek(base + info["data_offsets"][0])
                    h.update(_rows_as_float32(f.read(nbytes), dtype).tobytes())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_profile(profile: Profile, out_dir: str | Path, model_dir: str | Path) -> Path:
    from safetensors.torch import save_file

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


def load_profile(profile_dir: str | Path, model_dir: str | Path, framework: str = "pt") -> Profile:
    """Check and load a profile; tensors as torch tensors (``"pt"``) or numpy arrays."""
    if framework == "pt":
        from safetensors.torch import load_file
    elif framework == "numpy":
        from safetensors.numpy import load_file
    else:
        raise ValueError(f'framework must be "pt" or "numpy", not {framework!r}')
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
    ok, want = fingerprint_matches(meta.get("model_fingerprint"), model_dir)
    if not ok:
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
