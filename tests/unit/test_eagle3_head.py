"""EAGLE-3 heads in vLLM's format: vocabulary maps, shape checks, the target fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_adaptive.speculative import eagle3_head as e3

TARGET = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
    "rms_norm_eps": 1e-5,
}


def _target(tmp_path: Path, name: str = "target", **cfg) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TARGET, **cfg}))
    save_file({"model.embed_tokens.weight": torch.ones(32, 8)}, str(d / "model.safetensors"))
    return d


def test_vocab_maps_round_trip() -> None:
    ids = torch.tensor([0, 3, 4, 9])
    d2t, t2d = e3.vocab_maps(ids, 10)
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()  # vLLM: target = draft + d2t[draft]
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    with pytest.raises(ValueError, match="increasing"):
        e3.vocab_maps(torch.tensor([3, 1]), 10)
    with pytest.raises(ValueError, match="outside"):
        e3.vocab_maps(torch.tensor([1, 10]), 10)


def test_random_head_in_vllms_format(tmp_path: Path) -> None:
    target = _target(tmp_path)
    head = e3.random_head(tmp_path / "head", target, draft_vocab_size=6)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 6
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (8, 24)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape == (8, 16)
        assert f.get_tensor("d2t").dtype == torch.int64
    assert {"d2t", "t2d", "lm_head.weight", "norm.weight"} <= names
    e3.check_head_for_target(head, target)  # made for it: accepted


def test_head_refused_for_another_target(tmp_path: Path) -> None:
    head = e3.random_head(tmp_path / "head", _target(tmp_path), draft_vocab_size=6)
    other = _target(tmp_path, "other", rope_theta=1.0)
    with pytest.raises(e3.Eagle3HeadError, match="made for another model"):
        e3.check_head_for_target(head, other)
    wider = _target(tmp_path, "wider", hidden_size=16)
    with pytest.raises(e3.Eagle3HeadError, match="hidden_size"):
        e3.check_head_for_target(head, wider)


def test_head_survives_another_transformers_version(tmp_path: Path) -> None:
    """The same weights converted under another transformers version (its config.json stamps
    its own version, and may order keys differently) are the same target; a head stamped
    before the canonical config hash (config.json's bytes) is still accepted by its target."""
    from vllm_adaptive.artifacts import _fingerprint

    target = _target(tmp_path, transformers_version="5.17.0")
    head = e3.random_head(tmp_path / "head", target, draft_vocab_size=6)
    cfg = json.loads((target / "config.json").read_text())
    legacy = _fingerprint(target, legacy=True)
    cfg["transformers_version"] = "5.19.0"
    (target / "config.json").write_text(json.dumps(dict(reversed(cfg.items())), indent=2))
    e3.check_head_for_target(head, target)
    marker = head / e3.MARKER
    doc = json.loads(marker.read_text())
    doc["target_fingerprint"] = _fingerprint(target, legacy=True)  # stamped on this config
    marker.write_text(json.dumps(doc))
    e3.check_head_for_target(head, target)
    doc["target_fingerprint"] = legacy  # bytes of a config this target no longer has
    marker.write_text(json.dumps(doc))
    with pytest.raises(e3.Eagle3HeadError, match="made for another model"):
        e3.check_head_for_target(head, target)


def test_save_head_checks_shapes(tmp_path: Path) -> None:
    target = _target(tmp_path)
    cfg = e3.head_config(TARGET, 6)
    weights = {n: torch.zeros(s) for n, s in e3.head_shapes(cfg).items()}
    weights["fc.weight"] = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="fc.weight"):
        e3.save_head(tmp_path / "h", target, weights, torch.arange(6))
    del weights["fc.weight"]
    with pytest.raises(ValueError, match="missing"):
        e3.save_head(tmp_path / "h", target, weights, torch.arange(6))
