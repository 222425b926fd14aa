"""Reference forward of a MoEfied Llama: a transformers ``LlamaForCausalLM`` whose MLPs are
replaced by :class:`MoefiedMLP` (plain torch, no vLLM).

The on-disk format (docs/moe.md, "The MoEfied model"): a Llama checkpoint whose MLP neurons are
permuted so that expert ``e`` of layer ``i`` is the contiguous block of rows
``e*m:(e+1)*m`` of ``gate_proj``/``up_proj`` and of columns of ``down_proj`` (``m =
moe_intermediate_size = intermediate_size / num_local_experts``), plus one bias-free router
``model.layers.{i}.mlp.router.weight`` [num_local_experts, hidden_size] per layer.

Routing: the router's logits on the MLP input (after ``post_attention_layernorm``) pick the
``top_k`` largest; the MLP output is the plain sum of the selected experts' outputs,
``sum_e down_e(act(gate_e(x)) * up_e(x))``, without gate weights (the dense model has none, and
with every expert selected the sum is the dense MLP). The selection is ``torch.topk``'s (exact
ties of float logits are not specified).

Modes of :class:`MoefiedMLP` (for the quality evaluation):
- ``router``: the trained router picks the experts (the shipped model);
- ``oracle``: the experts with the largest output contribution (L2 norm of ``down_e(...)``) on
  this very token, a reference no runtime can have;
- ``neuron_oracle``: no experts at all: the ``top_k * moe_intermediate_size`` neurons with the
  largest ``|a_i| * ||down[:, i]||`` on this token (the same number of neurons as k experts),
  a bound on what any split into experts can reach with this activation sparsity;
- with ``top_k == num_experts`` all are the dense MLP (the permutation aside).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ARCHITECTURE = "MoefiedLlamaForCausalLM"
ROUTER_SUFFIX = "mlp.router.weight"


def router_key(layer: int) -> str:
    return f"model.layers.{layer}.{ROUTER_SUFFIX}"


def mlp_intermediate(mlp, x: torch.Tensor) -> torch.Tensor:
    """``act(gate(x)) * up(x)`` of a Llama MLP (the neurons the experts split)."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def expert_contributions(down_weight: torch.Tensor, a: torch.Tensor, experts: int) -> torch.Tensor:
    """[..., E]: L2 norm of each expert's share of the MLP output, ``down_e(a_e)``, for
    intermediate activations ``a`` [..., I] in permuted (expert-contiguous) order."""
    m = a.shape[-1] // experts
    lead = a.shape[:-1]
    a_e = a.reshape(-1, experts, m)  # [N, E, m]
    w_e = down_weight.reshape(down_weight.shape[0], experts, m)  # [d, E, m]
    y = torch.einsum("nem,dem->ned", a_e, w_e.to(a.dtype))
    return y.norm(dim=-1).reshape(*lead, experts)


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [..., E]: the ``k`` largest scores of each row."""
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


@dataclass
class RoutingStats:
    """Recall of the oracle top-k by the router, accumulated over calls (router mode only)."""

    tokens: int = 0
    hits: float = 0.0  # sum over tokens of |router top-k & oracle top-k| / k
    expert_counts: list[int] = field(default_factory=list)

    @property
    def recall(self) -> float:
        return self.hits / max(self.tokens, 1)


class MoefiedMLP(nn.Module):
    """A Llama MLP split into ``num_experts`` contiguous neuron blocks with a top-k router."""

    def __init__(
        self, mlp, num_experts: int, top_k: int, router_weight: torch.Tensor | None = None
    ):
        super().__init__()
        inter = mlp.gate_proj.out_features
        if inter % num_experts:
            raise ValueError(f"intermediate size {inter} is not divisible by {num_experts} experts")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self.num_experts = num_experts
        self.expert_size = inter // num_experts
        hidden = mlp.gate_proj.in_features
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.router.to(dtype=mlp.gate_proj.weight.dtype)
        if router_weight is not None:
            with torch.no_grad():
                self.router.weight.copy_(router_weight)
        self.top_k = top_k
        self.mode = "router"
        self.track = False
        # False: route (and track) but compute every expert, so the recall is measured on the
        # dense model's own residual stream
        self.apply = True
        self.stats = RoutingStats(expert_counts=[0] * num_experts)

    def selection(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
        """Bool [..., E] of the selected experts (None: all of them)."""
        if self.top_k >= self.num_experts:
            return None
        if self.mode == "neuron_oracle":
            return None  # forward() masks neurons itself
        if self.mode == "oracle":
            return topk_mask(
                expert_contributions(self.down_proj.weight, a, self.num_experts), self.top_k
            )
        if self.mode != "router":
            raise ValueError(
                f"mode must be 'router', 'oracle' or 'neuron_oracle', got {self.mode!r}"
            )
        chosen = topk_mask(self.router(x), self.top_k)
        if self.track:
            oracle = topk_mask(
                expert_contributions(self.down_proj.weight, a, self.num_experts), self.top_k
            )
            flat = chosen.reshape(-1, self.num_experts)
            self.stats.tokens += flat.shape[0]
            self.stats.hits += float((flat & oracle.reshape_as(flat)).sum()) / self.top_k
            for e, c in enumerate(flat.sum(0).tolist()):
                self.stats.expert_counts[e] += int(c)
        return chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = mlp_intermediate(self, x)
        if self.mode == "neuron_oracle" and self.top_k < self.num_experts:
            importance = a.abs() * self.down_proj.weight.norm(dim=0).to(a.dtype)
            return self.down_proj(a * topk_mask(importance, self.top_k * self.expert_size))
        chosen = self.selection(x, a)
        if chosen is not None and self.apply:
            # zeroing the unselected experts' neurons = summing the selected experts' outputs
            a = a * chosen.repeat_interleave(self.expert_size, dim=-1).to(a.dtype)
        return self.down_proj(a)


def moefy_modules(model, num_experts: int, top_k: int, routers: list[torch.Tensor] | None = None):
    """Replace every layer's MLP of a (permuted) transformers Llama by a :class:`MoefiedMLP`, in
    place; ``routers[i]`` is layer i's router weight. Returns the model."""
    for i, layer in enumerate(model.model.layers):
        w = None if routers is None else routers[i]
        layer.mlp = MoefiedMLP(layer.mlp, num_experts, top_k, w)
    return model


def moefied_mlps(model) -> list[MoefiedMLP]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoefiedMLP)]


def set_routing(
    model,
    top_k: int | None = None,
    mode: str | None = None,
    track: bool | None = None,
    apply: bool | None = None,
):
    """Set top-k / mode / recall tracking / whether routing is applied (False: every expert
    computed, routing only tracked) on every MoEfied MLP, and reset the stats."""
    for mlp in moefied_mlps(model):
        if top_k is not None:
            if not 1 <= top_k <= mlp.num_experts:
                raise ValueError(f"top_k must be in 1..{mlp.num_experts}, got {top_k}")
            mlp.top_k = top_k
        if mode is not None:
            mlp.mode = mode
        if track is not None:
            mlp.track = track
        if apply is not None:
            mlp.apply = apply
        mlp.stats = RoutingStats(expert_counts=[0] * mlp.num_experts)


@dataclass(frozen=True)
class MoeFields:
    """The MoE fields of a MoEfied config.json."""

    num_local_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int

    @classmethod
    def read(cls, config: dict) -> MoeFields:
        fields = cls(
            int(config["num_local_experts"]),
            int(config["num_experts_per_tok"]),
            int(config["moe_intermediate_size"]),
        )
        if fields.num_local_experts * fields.moe_intermediate_size != config["intermediate_size"]:
            raise ValueError("num_local_experts * moe_intermediate_size != intermediate_size")
        if not 1 <= fields.num_experts_per_tok <= fields.num_local_experts:
            raise ValueError("num_experts_per_tok must be in 1..num_local_experts")
        return fields


def load_moefied(path: str | Path, dtype: torch.dtype = torch.float32, top_k: int | None = None):
    """The MoEfied checkpoint in ``path`` as a transformers Llama with :class:`MoefiedMLP`s
    (weights cast to ``dtype``; ``top_k`` defaults to the config's ``num_experts_per_tok``)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    moe = MoeFields.read(raw)
    config = LlamaConfig.from_pretrained(str(path))
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    routers = [state.pop(router_key(i)) for i in range(config.num_hidden_layers)]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: state dict mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype)
    moefy_modules(
        model,
        moe.num_local_experts,
        top_k or moe.num_experts_per_tok,
        [r.to(dtype) for r in routers],
    )
    return model.eval()
