"""M2R2 adapters, ARLA and the plain-torch reference forward (training runs:
tests/slow/test_m2r2_training.py).

No vLLM engine: the real default model through transformers (float32, CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_adaptive.m2r2.adapters import AdapterConfig, AdapterError, M2R2Adapters
from vllm_adaptive.m2r2.arla import ARLA
from vllm_adaptive.m2r2.reference import (
    accelerated_layer,
    accelerated_stream,
    apply_rope,
    draft_logits,
    readout,
    slow_forward,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))


def _spec_config(model, k: int = 4, rank: int = 8) -> AdapterConfig:
    return AdapterConfig.from_model_config(model.config, mode="spec", k=k, rank=rank)


def _randomise(adapters: M2R2Adapters, seed: int = 1, scale: float = 0.05) -> M2R2Adapters:
    """Non-zero deltas (all six matrices random)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return adapters


# -- reference forward -----------------------------------------------------------------------
def test_slow_stream_is_hf_forward(hf_model, ids):
    n = hf_model.config.num_hidden_layers
    with torch.no_grad():
        out = hf_model(ids, output_hidden_states=True)
    slow = slow_forward(hf_model, ids)
    assert len(slow.hidden) == n + 1 and len(slow.keys) == n
    for j in range(n):  # HF's last hidden state is after the final norm
        torch.testing.assert_close(slow.hidden[j], out.hidden_states[j], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        hf_model.model.norm(slow.hidden[n]), out.hidden_states[n], rtol=1e-5, atol=1e-4
    )
    assert torch.equal(slow.greedy, out.logits.argmax(-1))
    assert slow.keys[0].shape == (2, 3, ids.shape[1], 64)


def test_zero_adapters_are_the_early_exit_stream(hf_model, ids):
    """With zero deltas p_t attends over h_<t (+) p_t with p == h at the layer input, which is
    the base layer itself: by induction p_i == h_i at every layer and position."""
    cfg = _spec_config(hf_model, k=4)
    adapters = M2R2Adapters.zeros(cfg, seed=3)
    slow = slow_forward(hf_model, ids, kv_layers=4)
    with torch.no_grad():
        ps = accelerated_stream(hf_model, adapters, slow, 0, 4)
        assert len(ps) == 4
        for i, p in enumerate(ps, start=1):
            torch.testing.assert_close(p, slow.hidden[i], rtol=1e-5, atol=2e-4)
        # one-token sequence: no context at all, the accelerated stream is h_k itself
        one = slow_forward(hf_model, ids[:, :1], kv_layers=4)
        p1 = accelerated_stream(hf_model, adapters, one, 0, 4)[-1]
        torch.testing.assert_close(p1, one.hidden[4], rtol=1e-5, atol=2e-4)
        # the draft of zero adapters is the early exit at depth k
        early = readout(hf_model, slow.hidden[4]).argmax(-1)
        assert torch.equal(readout(hf_model, ps[-1]).argmax(-1), early)
        assert torch.equal(draft_logits(hf_model, adapters, ids).argmax(-1), early)


def _naive_accelerated_layer(layer, adapters, i, p, k_slow, v_slow, cos, sin):
    """Position by position: q_t attends over [k_slow[<t]] + [own k_t], no vectorised masks."""
    attn = layer.self_attn
    b, t, _ = p.shape
    hd = attn.head_dim
    x = layer.input_layernorm(p)
    q = (attn.q_proj(x) + adapters.delta_q(i, x.reshape(b * t, -1)).view(b, t, -1)).view(
        b, t, -1, hd
    )
    k = attn.k_proj(x).view(b, t, -1, hd)
    v = attn.v_proj(x).view(b, t, -1, hd)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    g = q.shape[1] // k.shape[1]
    rows = []
    for pos in range(t):
        keys = torch.cat([k_slow[:, :, :pos], k[:, :, pos : pos + 1]], dim=2)
        vals = torch.cat([v_slow[:, :, :pos], v[:, :, pos : pos + 1]], dim=2)
        keys = keys.repeat_interleave(g, dim=1)
        vals = vals.repeat_interleave(g, dim=1)
        s = (q[:, :, pos : pos + 1] @ keys.transpose(-1, -2)) * attn.scaling
        rows.append(torch.softmax(s, -1) @ vals)  # [B, H, 1, hd]
    att = torch.cat(rows, dim=2).transpose(1, 2).reshape(b * t, -1)
    o = attn.o_proj(att) + adapters.delta_o(i, att)
    p = p + o.view(b, t, -1)
    y = layer.post_attention_layernorm(p).reshape(b * t, -1)
    return p + (layer.mlp(y) + adapters.delta_mlp(i, y)).view(b, t, -1)


def test_vectorised_attention_matches_per_position_loop(hf_model, ids):
    cfg = _spec_config(hf_model, k=2)
    adapters = _randomise(M2R2Adapters.zeros(cfg))
    slow = slow_forward(hf_model, ids, kv_layers=2)
    layer = hf_model.model.layers[1]
    p = slow.hidden[1] + 0.5 * torch.randn(slow.hidden[1].shape, generator=torch.Generator())
    with torch.no_grad():
        fast = accelerated_layer(
            layer, adapters, 1, p, slow.keys[1], slow.values[1], slow.cos, slow.sin
        )
        naive = _naive_accelerated_layer(
            layer, adapters, 1, p, slow.keys[1], slow.values[1], slow.cos, slow.sin
        )
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-4)
    # and it is really different from the adapter-free layer
    with torch.no_grad():
        plain = accelerated_layer(
            layer, None, 1, p, slow.keys[1], slow.values[1], slow.cos, slow.sin
        )
    assert (fast - plain).abs().max() > 1e-2


# -- the adapter module ----------------------------------------------------------------------
def test_deltas_on_2d_tokens(hf_model):
    cfg = _spec_config(hf_model, k=3, rank=4)
    zero = M2R2Adapters.zeros(cfg)
    x = torch.randn(5, 576)
    att = torch.randn(5, 9 * 64)
    assert zero.delta_q(2, x).shape == (5, 576) and not zero.delta_q(2, x).any()
    assert zero.delta_o(0, att).shape == (5, 576) and not zero.delta_o(0, att).any()
    assert not zero.delta_mlp(1, x).any()
    ad = _randomise(M2R2Adapters.zeros(cfg))
    a = ad.layers[2]
    torch.testing.assert_close(ad.delta_q(2, x), x @ a.q_A.T @ a.q_B.T)
    torch.testing.assert_close(ad.delta_o(2, att), att @ a.o_A.T @ a.o_B.T)
    torch.testing.assert_close(
        ad.delta_mlp(2, x), torch.nn.functional.silu(x @ a.mlp_D.T) @ a.mlp_U.T
    )
    assert ad.delta_q(2, x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert len(ad.layers) == 3 and len(ad.routers) == 0


def test_exit_mode_layout():
    cfg = AdapterConfig(
        mode="exit",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rank=8,
        gates=[6, 12, 18, 24],
    )
    assert cfg.intervals == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert [cfg.rate(a, b) for a, b in cfg.intervals] == [5.0, 4.0, 3.0, 2.0]
    t = cfg.distill_targets()
    assert [t[g] for g in (6, 12, 18, 24)] == [30, 30, 30, 30]
    assert t[1] == 5 and t[7] == 10 and t[19] == 20
    spec = AdapterConfig(**{**cfg.__dict__, "mode": "spec", "k": 4, "gates": None})
    assert spec.distill_targets() == {1: 8, 2: 15, 3: 23, 4: 30}  # R = 7.5, half up
    ad = M2R2Adapters.zeros(cfg)
    assert len(ad.layers) == 24 and len(ad.routers) == 4
    with pytest.raises(AdapterError):
        AdapterConfig(**{**cfg.__dict__, "gates": [6, 30]})


def test_arla_exit_probability():
    router = ARLA(576, 64)
    router.reset_parameters(torch.Generator().manual_seed(0))
    states = torch.randn(7, 5, 576) * 100
    prob = router.exit_probability(states)
    assert prob.shape == (7,) and bool(((prob >= 0) & (prob <= 1)).all())
    torch.testing.assert_close(router.exit_probability(list(states.unbind(1))), prob)
    assert sum(p.numel() for p in router.parameters()) < 150_000


def test_exit_mode_losses_and_gradients(hf_model, ids):
    from vllm_adaptive.m2r2.args import TrainOptions
    from vllm_adaptive.m2r2.objective import m2r2_losses

    cfg = AdapterConfig.from_model_config(hf_model.config, mode="exit", gates=[2, 4], rank=4)
    adapters = M2R2Adapters.zeros(cfg)
    slow = slow_forward(hf_model, ids, kv_layers=cfg.adapted_layers)
    opts = TrainOptions(model="", corpus=[], out="")
    out = m2r2_losses(hf_model, adapters, slow, slow.greedy, opts)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and "bce" in out and len(out["agree_per_gate"]) == 2
    assert adapters.layers[3].mlp_U.grad.abs().sum() > 0  # interval 2's adapters train
    assert adapters.routers[1].q.weight.grad.abs().sum() > 0


def test_save_load_round_trip_and_refusals(hf_model, model_dir, tmp_path):
    from vllm_adaptive.artifacts import model_fingerprint

    cfg = AdapterConfig.from_model_config(hf_model.config, mode="exit", gates=[3, 6], rank=4)
    ad = _randomise(M2R2Adapters.zeros(cfg))
    meta = {"model_fingerprint": model_fingerprint(model_dir), "step": 7, "training_args": {}}
    ad.save(tmp_path / "a", meta)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter.json",
        "adapter.safetensors",
    ]
    back, m = M2R2Adapters.load(tmp_path / "a", model_dir=model_dir)
    assert back.config == cfg and m["step"] == 7 and m["gates"] == [3, 6] and m["rank"] == 4
    for (n1, t1), (n2, t2) in zip(ad.state_dict().items(), back.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2)

    # another model's fingerprint
    doc = json.loads((tmp_path / "a" / "adapter.json").read_text())
    doc["model_fingerprint"] = "0" * 64
    (tmp_path / "a" / "adapter.json").write_text(json.dumps(doc))
    with pytest.raises(AdapterError, match="fingerprint"):
        M2R2Adapters.load(tmp_path / "a", model_dir=model_dir)
    M2R2Adapters.load(tmp_path / "a")  # without a model to check against it loads

    # another model's shapes
    other = tmp_path / "other-model"
    other.mkdir()
    mcfg = json.loads((Path(model_dir) / "config.json").read_text())
    mcfg["hidden_size"] = 960
    (other / "config.json").write_text(json.dumps(mcfg))
    ad.save(tmp_path / "b", meta)
    with pytest.raises(AdapterError, match="hidden_size"):
        M2R2Adapters.load(tmp_path / "b", model_dir=other)

    # a tampered tensor file
    raw = bytearray((tmp_path / "b" / "adapter.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "b" / "adapter.safetensors").write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="sha256"):
        M2R2Adapters.load(tmp_path / "b")


def _greedy_folder(tmp_path: Path, fingerprint: str = "abc", seq_len: int = 16) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    spec = {"data_source": "greedy", "target_fingerprint": fingerprint, "seq_len": seq_len,
            "corpus_sha256": ["s1", "s2"]}  # fmt: skip
    (folder / "spec.json").write_text(json.dumps(spec))
    for i in range(2):
        tokens = torch.arange(3 * seq_len).view(3, seq_len) + 100 * i
        torch.save(
            {"tokens": tokens, "aux": torch.zeros(3, seq_len, 4)}, folder / f"train-{i:05d}.pt"
        )
    torch.save({"tokens": torch.ones(2, 12, dtype=torch.long)}, folder / "eval.pt")
    return folder


def test_greedy_data_is_the_heads_windows(tmp_path):
    """M2R2 trained with --greedy-data sees the EAGLE-3 head's own windows and held-out
    prompts, cut to seq_len + 1; data made for another model, or too short, is refused."""
    from vllm_adaptive.m2r2.train import load_greedy_data

    folder = _greedy_folder(tmp_path)
    data, shas = load_greedy_data(folder, 9, "abc")
    assert data.train.shape == (6, 10) and data.train.dtype == torch.long
    assert data.train[3, 0] == 100 and data.train[0, 9] == 9  # shards in order, cut to 10
    assert data.val.shape == (2, 12) and shas == ["s1", "s2"]
    with pytest.raises(AdapterError, match="another model"):
        load_greedy_data(folder, 9, "xyz")
    with pytest.raises(AdapterError, match="--seq-len 16 needs 17"):
        load_greedy_data(folder, 16, "abc")
    with pytest.raises(AdapterError, match="no spec.json"):
        load_greedy_data(tmp_path, 9, "abc")
