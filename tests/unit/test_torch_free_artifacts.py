"""Shared pieces the MLX backend reads without torch: the model fingerprint (the same bytes
as the torch reading it replaced), EMAD's framework-neutral rule, and the bench metrics."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from vllm_adaptive.artifacts import _canonical_config, fingerprint_matches, model_fingerprint
from vllm_adaptive.bench.metrics import free_running_agreement
from vllm_adaptive.depth.isotonic import IsotonicMap
from vllm_adaptive.depth.policies.emad_rule import EmadRule


def _torch_fingerprint(model_dir: Path, config_bytes: bytes) -> str:
    """The fingerprint as torch computed it before (safe_open "pt", rows through .float())."""
    from safetensors import safe_open

    h = hashlib.sha256()
    h.update(config_bytes)
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                sl = st.get_slice(name)
                h.update(f"{name}:{sl.get_dtype()}:{list(sl.get_shape())};".encode())
                if name in ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"):
                    t = st.get_slice(name)[:64]
                    h.update(t.float().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_numpy_fingerprint_equals_the_torch_one(tmp_path: Path, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(100, 8, generator=g).to(dt),
            "model.norm.weight": torch.randn(8, generator=g).to(dt),
            "model.layers.0.mlp.down_proj.weight": torch.randn(8, 4, generator=g).to(dt),
            "step": torch.zeros(3, dtype=torch.int64),
        },
        str(tmp_path / "model.safetensors"),
    )
    cfg = tmp_path / "config.json"
    assert model_fingerprint(tmp_path) == _torch_fingerprint(tmp_path, _canonical_config(cfg))
    # an artifact stamped with the fingerprint of config.json's bytes (before the canonical
    # hash) still matches this model
    assert fingerprint_matches(_torch_fingerprint(tmp_path, cfg.read_bytes()), tmp_path)[0]
    assert not fingerprint_matches("0" * 64, tmp_path)[0]


def test_emad_rule_lowrank_and_feature() -> None:
    rule = EmadRule("lowrank")
    got = rule.exits(np.array([0.5, 1.0, 2.0]), np.array([1.0, 1.0, 1.0]), 0)
    assert got.tolist() == [True, True, False]
    x = np.linspace(0.0, 5.0, 50)
    m = IsotonicMap.fit(x, np.sqrt(x))
    feature = EmadRule("feature", [(m.x, m.y)])
    scores = np.array([0.1, 2.0, 4.5])
    np.testing.assert_array_equal(feature.entropy(scores, 0), m(scores))
    assert feature.exits(scores, np.full(3, 1.2), 0).tolist() == (m(scores) <= 1.2).tolist()
    assert not rule.exits(np.array([0.0]), np.array([-np.inf]), 0)[0]  # budget 1.0: no exits
    with pytest.raises(ValueError, match="knots"):
        EmadRule("feature")
    with pytest.raises(ValueError, match="proxy"):
        EmadRule("bogus")


def test_free_running_agreement() -> None:
    same = free_running_agreement([[1, 2, 3]], [[1, 2, 3]])
    assert same == {"positions": 1.0, "prefix": 1.0}
    half = free_running_agreement([[1, 2, 9, 4]], [[1, 2, 3, 4]])
    assert half == {"positions": 0.75, "prefix": 0.5}
    short = free_running_agreement([[1, 2]], [[1, 2, 3, 4]])  # stopped early
    assert short == {"positions": 0.5, "prefix": 0.5}
