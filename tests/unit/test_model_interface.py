"""The model interface's own logic (``models/interface.py``) on plain torch modules: which
layouts count as Llama's block, managed linears in layer order under their fused names, and the
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


def test_only_llamas_layout_is_a_llama_block() -> None:
    assert _layer(0).llama_block
    for field in ("pre_feedforward_norm", "post_feedforward_norm", "q_norm", "k_norm", "experts"):
        assert not _layer(0, **{field: nn.Identity()}).llama_block, field
    assert not _layer(0, sliding_window=512).llama_block
    assert not dataclasses.replace(_layer(0), act_fn=None).llama_block
    moe = dataclasses.replace(_layer(0), linears={"qkv_proj": nn.Identity()})
    assert not moe.llama_block


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
