"""The layer loop's view of an mlx-lm model: embed, blocks, final norm, LM head, linears.

Adaptive depth runs the blocks one by one and the gears swap linears by name, so both need to
know an architecture's layout. mlx-lm's Llama family (``mlx_lm.models.llama``: SmolLM2 and
every ``LlamaForCausalLM`` checkpoint) is the one the project supports
(``vllm_adaptive/models``); another model type is refused by `LlamaLayout.of`.
"""

from __future__ import annotations

from typing import Any

#: config module names (the vLLM path's fused names) -> mlx-lm attribute paths in a block
MODULE_PATHS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}

SUPPORTED_MODEL_TYPES = ("llama",)


class UnsupportedArchitecture(ValueError):
    """The model's layout is not one this backend can run layer by layer."""


class LlamaLayout:
    """mlx-lm ``llama.Model``: ``model.model.{embed_tokens, layers, norm}``, tied or own head."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        self.tied = bool(getattr(model.args, "tie_word_embeddings", True))
        self.eps = float(self.inner.norm.eps)
        self.vocab_size = int(model.args.vocab_size)
        if any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise UnsupportedArchitecture("sliding-window layers are not supported")

    @classmethod
    def of(cls, model: Any) -> LlamaLayout:
        kind = getattr(model, "model_type", None)
        if kind not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type {kind!r}: the MLX backend's adaptive mechanisms support "
                f"{list(SUPPORTED_MODEL_TYPES)} (LlamaForCausalLM)"
            )
        return cls(model)

    def embed(self, ids: Any) -> Any:
        return self.inner.embed_tokens(ids)

    def mask(self, h: Any, cache: list[Any]) -> Any:
        from mlx_lm.models.base import create_attention_mask

        return create_attention_mask(h, cache[0])

    def norm(self, h: Any) -> Any:
        return self.inner.norm(h)

    def head(self, h: Any) -> Any:
        """Logits of (normed) hidden states."""
        if self.tied:
            return self.inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)

    def head_weight(self) -> Any:
        """The [V, d] unembedding."""
        return self.inner.embed_tokens.weight if self.tied else self.model.lm_head.weight

    def linears(self, layer: int, module: str) -> list[tuple[Any, str]]:
        """(parent module, attribute) of each mlx-lm linear behind a config module name."""
        out = []
        for path in MODULE_PATHS[module]:
            parent = self.layers[layer]
            *parents, attr = path.split(".")
            for name in parents:
                parent = getattr(parent, name)
            out.append((parent, attr))
        return out
