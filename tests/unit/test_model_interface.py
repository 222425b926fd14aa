"""The model interface's own logic (``models/interface.py``) on plain torch modules: the
block-recipe capability, managed linears in layer order under their fused names, and the
errors naming what is missing. What the real model classes hand out is checked through engines
(``test_identity.py``, ``test_gemma3.py``, ``test_moe_engine.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from vllm_adaptive.models.interface import (
    LINEAR_NAMES,
    LayerParts,
    ModelParts,
    model_parts,
    supports_adaptive,
)


def _layer(index: int, **extra) -> LayerParts:
    mod = nn.Identity()
    return LayerParts(
        index=index,
        block=mod,
        attention=mod,
        attn=mod,
        rotary=mod,
        q_size=4,
        kv_size=2,
        input_norm=mod,
        post_attention_norm=mod,
        linears={name: nn.Linear(2, 2) for name in LINEAR_NAMES},
        mlp=mod,
        act_fn=mod,
        **extra,
    )


def _parts(layers) -> ModelParts:
    mod = nn.Identity()
    return ModelParts(
        embed=mod,
        embedding=mod,
        layers=tuple(layers),
        final_norm=mod,
        head=mod,
        num_layers=len(layers),
        hidden_size=8,
        vocab_size=16,
    )


def test_a_layer_without_a_recipe_is_refused_naming_the_mechanism() -> None:
    with pytest.raises(ValueError, match="the Exit River runs the decoder block.*layer 3"):
        _layer(3).require_recipe("the Exit River")
    marker = object()
    assert _layer(0, recipe=marker).require_recipe("x") is marker


def test_managed_linears_in_layer_order_with_fused_names() -> None:
    layers = [_layer(0), dataclasses.replace(_layer(1), linears={"o_proj": nn.Linear(2, 2)})]
    got = _parts(layers).managed_linears(("qkv_proj", "o_proj"))
    assert [(i, name) for i, name, _ in got] == [
        (0, "layers.0.qkv_proj"),
        (0, "layers.0.o_proj"),
        (1, "layers.1.o_proj"),
    ]
    assert got[2][2] is layers[1].linears["o_proj"]


def test_split_qkv_and_missing_linear() -> None:
    layer = _layer(3)
    q, k, v = layer.split_qkv(torch.arange(8.0).reshape(1, 8))
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (4, 2, 2)
    assert torch.equal(v, torch.tensor([[6.0, 7.0]]))
    moe = dataclasses.replace(layer, linears={"qkv_proj": nn.Identity()})
    with pytest.raises(KeyError, match="layer 3 has no managed linear 'down_proj'"):
        moe.linear("down_proj")


def test_a_model_without_the_interface_is_named() -> None:
    assert not supports_adaptive(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="Linear does not implement .*SupportsAdaptive"):
        model_parts(nn.Linear(2, 2))

    class WithParts(nn.Module):
        supports_adaptive = True

        def adaptive_parts(self) -> ModelParts:
            return _parts([_layer(0)])

    assert supports_adaptive(WithParts())
    assert model_parts(WithParts()).layers[0].index == 0


class _Norm(nn.Module):
    """vLLM's RMSNorm contract: ``(x)`` or ``(x, residual)`` with the fused add."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        residual = x + residual
        return self.norm(residual), residual


class _Linear(nn.Linear):
    """vLLM's linear contract: ``(y, bias)``."""

    def forward(self, x):
        return super().forward(x), None


def _fake_llama_layer(d: int = 8, sliding_window: int | None = None) -> nn.Module:
    """The attributes ``llama_layer_parts`` reads from vLLM's ``LlamaDecoderLayer``."""
    torch.manual_seed(0)
    layer = nn.Module()
    attn = nn.Module()
    attn.qkv_proj, attn.o_proj = _Linear(d, 2 * d), _Linear(d, d)  # q d, k d/2, v d/2
    attn.q_size, attn.kv_size = d, d // 2
    attn.rotary_emb = lambda positions, q, k: (q * 2, k * 3)
    attn.attn = nn.Module()
    attn.attn.sliding_window = sliding_window
    attn.attn.forward = lambda q, k, v: q + torch.cat([k, v], -1)
    layer.self_attn = attn
    layer.input_layernorm, layer.post_attention_layernorm = _Norm(d), _Norm(d)
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = _Linear(d, 2 * d), _Linear(d, d)
    mlp.act_fn = lambda x: torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)[0]))[0]
    layer.mlp = mlp
    return layer


def test_llama_recipe_is_given_to_dense_global_layers_only_and_matches_its_parts() -> None:
    from vllm_adaptive.models.llama import LLAMA_BLOCK, llama_layer_parts

    parts = llama_layer_parts(0, _fake_llama_layer())
    assert parts.recipe is LLAMA_BLOCK
    assert llama_layer_parts(0, _fake_llama_layer(sliding_window=64)).recipe is None
    assert llama_layer_parts(0, _fake_llama_layer(), dense_mlp=False).recipe is None
    x, pos = torch.randn(3, 8), torch.arange(3)
    own = {name: (lambda t, lin=parts.linears[name]: lin(t)[0]) for name in LINEAR_NAMES}
    hidden, residual = LLAMA_BLOCK.run_with(parts, own, pos, x, None)
    # by hand: Llama's block on these parts
    h = parts.input_norm(x)
    q, k, v = parts.split_qkv(parts.linears["qkv_proj"](h)[0])
    q, k = q * 2, k * 3
    o = parts.linears["o_proj"](q + torch.cat([k, v], -1))[0]
    y, res = parts.post_attention_norm(o, x)
    torch.testing.assert_close(residual, res)
    torch.testing.assert_close(hidden, parts.mlp(y))
    k2, v2 = LLAMA_BLOCK.kv_from_state(parts, x, pos)
    torch.testing.assert_close(k2, k)
    torch.testing.assert_close(v2, v)
