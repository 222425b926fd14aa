"""MoEfy mechanics on tiny random-weight Llama configs (labelled: mechanics only, never a quality
claim): the permutation is the identity at k = E, experts are equal, the router has its shapes,
top-k is the sum of the selected experts, and the checkpoint round-trips through config.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_adaptive.moe.collect import collect_mlp_inputs, collect_residuals  # noqa: E402
from vllm_adaptive.moe.moefy import (  # noqa: E402
    MoefyOptions,
    balanced_assign,
    balanced_kmeans,
    expert_permutation,
    ks_for,
    moefied_config,
    moefy_model,
    neuron_profiles,
    write_from_windows,
)
from vllm_adaptive.moe.reference import (  # noqa: E402
    ARCHITECTURE,
    MoefiedMLP,
    MoeFields,
    load_moefied,
    mlp_intermediate,
    moefied_mlps,
    moefy_modules,
    router_key,
    set_routing,
)

HIDDEN, INTER, LAYERS, VOCAB = 32, 64, 2, 128


def tiny_config():
    return transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def tiny_model(dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_config()).to(dtype).eval()


def windows(n: int = 6, length: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g).tolist()


def small_opts(experts: int = 8, top_k: int = 4) -> MoefyOptions:
    return MoefyOptions(
        experts=experts,
        top_k=top_k,
        profile_tokens=64,
        kmeans_iters=10,
        router_steps=20,
        router_batch=32,
    )


def test_balanced_kmeans_gives_equal_experts_deterministically() -> None:
    g = torch.Generator().manual_seed(1)
    prof = neuron_profiles(torch.randn(50, INTER, generator=g))
    a = balanced_kmeans(prof, 8, 20, seed=3)
    assert np.bincount(a, minlength=8).tolist() == [INTER // 8] * 8
    assert np.array_equal(a, balanced_kmeans(prof, 8, 20, seed=3))
    with pytest.raises(ValueError):
        balanced_kmeans(prof, 7, 5, seed=0)


def test_balanced_assign_fills_every_column_to_capacity() -> None:
    sim = np.zeros((6, 3))
    sim[:, 0] = 1.0  # everyone prefers column 0; only two fit
    labels = balanced_assign(sim, 2)
    assert np.bincount(labels).tolist() == [2, 2, 2]


def test_permutation_groups_experts_contiguously() -> None:
    labels = np.array([2, 0, 1, 0, 2, 1])
    perm = expert_permutation(labels)
    assert labels[perm.numpy()].tolist() == [0, 0, 1, 1, 2, 2]


def test_all_experts_active_is_the_dense_model() -> None:
    dense = tiny_model(torch.float64)
    moe = tiny_model(torch.float64)
    ids = torch.tensor(windows(2))
    inputs = collect_mlp_inputs(moe, windows(), progress=False)
    built = moefy_model(moe, [x.double() for x in inputs], small_opts(), progress=False)
    moefy_modules(moe, 8, 8, [r.double() for r in built["routers"]])
    with torch.no_grad():
        ref, got = dense(ids).logits, moe(ids).logits
    # only the order of the down projection's sum changed
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    for layer_d, layer_m, perm in zip(
        dense.model.layers, moe.model.layers, built["permutations"], strict=True
    ):
        inv = torch.argsort(perm)
        assert torch.equal(layer_m.mlp.gate_proj.weight[inv], layer_d.mlp.gate_proj.weight)
        assert torch.equal(layer_m.mlp.up_proj.weight[inv], layer_d.mlp.up_proj.weight)
        assert torch.equal(layer_m.mlp.down_proj.weight[:, inv], layer_d.mlp.down_proj.weight)
    set_routing(moe, top_k=4)
    with torch.no_grad():
        assert not torch.allclose(moe(ids).logits, ref)


@pytest.mark.parametrize("mode", ["router", "oracle"])
def test_top_k_is_the_sum_of_the_selected_experts(mode: str) -> None:
    model = tiny_model(torch.float64)
    g = torch.Generator().manual_seed(0)
    router = torch.randn(8, HIDDEN, generator=g, dtype=torch.float64)
    mlp = MoefiedMLP(model.model.layers[0].mlp, 8, 3, router)
    mlp.mode = mode
    x = torch.randn(5, HIDDEN, generator=g, dtype=torch.float64)
    with torch.no_grad():
        got = mlp(x)
        a = mlp_intermediate(mlp, x)
        chosen = mlp.selection(x, a)
        m = INTER // 8
        for t in range(x.shape[0]):
            experts = chosen[t].nonzero().flatten().tolist()
            assert len(experts) == 3
            want = sum(
                mlp.down_proj.weight[:, e * m : (e + 1) * m]
                @ (
                    torch.nn.functional.silu(mlp.gate_proj.weight[e * m : (e + 1) * m] @ x[t])
                    * (mlp.up_proj.weight[e * m : (e + 1) * m] @ x[t])
                )
                for e in experts
            )
            torch.testing.assert_close(got[t], want, rtol=1e-12, atol=1e-12)


def test_one_collector_serves_mlp_inputs_and_residuals() -> None:
    """The MLP input is post_attention_layernorm of the residual after attention: both come
    from the same hook collector (moe/collect.py), for every token of every window, in order."""
    model = tiny_model(torch.float64)
    bos = 0
    inputs = collect_mlp_inputs(model, windows(), bos, progress=False)
    residuals = collect_residuals(model, windows(), bos)
    assert residuals.shape == (LAYERS, 6 * 16, HIDDEN)
    for layer, x, h in zip(model.model.layers, inputs, residuals, strict=True):
        with torch.no_grad():
            want = layer.post_attention_layernorm(h.double()).float()
        torch.testing.assert_close(x, want)
    assert not torch.equal(residuals[0], residuals[1])


def test_router_shapes_and_recall_stats() -> None:
    model = tiny_model()
    inputs = collect_mlp_inputs(model, windows(), progress=False)
    assert [x.shape for x in inputs] == [(6 * 16, HIDDEN)] * LAYERS
    built = moefy_model(model, inputs, small_opts(), progress=False)
    assert [r.shape for r in built["routers"]] == [(8, HIDDEN)] * LAYERS
    for layer in built["layers"]:
        assert set(layer["router_recall"]) == {"1", "2", "4"}
        assert all(0.0 <= v <= 1.0 for v in layer["router_recall"].values())
    assert ks_for(16) == [2, 4, 8, 16] and ks_for(4) == [1, 2, 4]


def test_config_fields_are_checked() -> None:
    base = tiny_config().to_dict()
    cfg = moefied_config(base, 8, 2)
    assert cfg["architectures"] == [ARCHITECTURE]
    assert MoeFields.read(cfg) == MoeFields(8, 2, INTER // 8)
    with pytest.raises(ValueError):
        moefied_config(base, 5, 2)
    with pytest.raises(ValueError):
        moefied_config(base, 8, 9)
    with pytest.raises(ValueError):
        MoeFields.read({**cfg, "moe_intermediate_size": 4})


def test_checkpoint_round_trip_and_determinism(tmp_path: Path) -> None:
    src = tmp_path / "dense"
    dense = tiny_model()
    dense.save_pretrained(src, safe_serialization=True)
    outs = []
    for run in range(2):
        out = tmp_path / f"moe{run}"
        out.mkdir()
        write_from_windows(src, out, windows(), small_opts(top_k=2), progress=False)
        outs.append(out)
    for name in ("model.safetensors", "config.json", "moefy.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name

    from safetensors.torch import load_file

    config = json.loads((outs[0] / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert (
        config["num_local_experts"],
        config["num_experts_per_tok"],
        config["moe_intermediate_size"],
    ) == (8, 2, INTER // 8)
    state = load_file(outs[0] / "model.safetensors")
    for i in range(LAYERS):
        assert state[router_key(i)].shape == (8, HIDDEN)
    dense_state = load_file(src / "model.safetensors")
    assert set(state) == set(dense_state) | {router_key(i) for i in range(LAYERS)}
    sidecar = json.loads((outs[0] / "moefy.json").read_text())
    assert len(sidecar["permutations"]) == LAYERS
    assert sorted(sidecar["permutations"][0]) == list(range(INTER))

    moe = load_moefied(outs[0])
    assert {m.top_k for m in moefied_mlps(moe)} == {2}
    ids = torch.tensor(windows(1))
    set_routing(moe, top_k=8)
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


def test_cli_and_zoo_know_the_moefied_model() -> None:
    from vllm_adaptive.cli import build_parser
    from vllm_adaptive.model_zoo import DERIVED

    args = build_parser().parse_args(["moe", "quality", "--corpus", "a.txt", "--k", "2,16"])
    assert args.model == ["smollm2-135m-moefied"] and args.k == "2,16"
    args = build_parser().parse_args(["moe", "build", "--corpus", "a.txt", "--out", "d"])
    assert args.experts is None and args.base == "smollm2-135m-instruct"
    entry = DERIVED["smollm2-135m-moefied"]
    assert entry.kind == "moefy" and entry.base == "smollm2-135m-instruct"
    assert "NOT a trained MoE" in entry.description
