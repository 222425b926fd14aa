"""KV-skipping attention backend: vLLM's CPU backend (CPU_ATTN) with the depth mask.

Under the ``mask`` KV strategy a token that stops after ``D`` layers writes no K/V at layers
``D ..``; attention at layer ``l`` must leave out every *cached* slot whose depth record is
``<= l`` (``docs/masked-attention.md``, the mask rule). This backend is CPU_ATTN with one change,
in :meth:`MaskedCPUAttentionImpl.forward`:

- no mask published for the step (:func:`vllm_adaptive.depth.mask_context.current_mask` is None),
  or this layer below ``mask.all_visible_below``: vLLM's fused op (the parent's ``forward``);
- otherwise (and whenever the mask carries ``query_positions``: token fusion left a request's
  queries non-contiguous, which vLLM's op cannot express) :func:`masked_paged_attention` over
  the same paged cache (its decode rows on the C++ kernel of ``kernels/native.py``, built when
  the impl is, at engine start), reading
  ``query_start_loc``, ``seq_lens`` and ``block_table`` of the step's ``CPUAttentionMetadata``.

Everything else is inherited: the metadata builder (so the depth runtime can keep slicing
``CPUAttentionMetadata`` with ``dataclasses.replace``), the KV cache shape and layout, and the
K/V write. In this vLLM the write is **not** part of ``forward``
(``CPUAttentionBackend.forward_includes_kv_cache_update`` is False): the ``Attention`` layer calls
``unified_kv_cache_update`` -> ``impl.do_kv_cache_update`` with the forward context's slot
mapping for the layer, then ``unified_attention_with_output`` -> ``impl.forward``. A request the
runtime peeled off is not in the sliced slot mapping, so it writes nothing at the layers it skips:
that is the KV skipping; this step's keys are written before the layer attends to them.

Only the causal decoder is supported on the masked path, with or without a sliding window
(Gemma 3's local layers: the kernel applies the layer's window as vLLM's op does), but no ALiBi,
soft-capping, sinks, fp8 KV cache, KV sharing, encoder or cross attention, and only the ``vec`` /
``vec16`` CPU ISAs whose K layout the torch kernel reads; anything else is refused when the impl
is built (or, for the ISA, which the metadata builder assigns later, at the first masked call).

Registration (the ``masked-attention-backend`` entry of :mod:`vllm_adaptive.engine.intrusions`, by
this module's class path, so the engine glue imports no mechanism) overrides the *class path* of
``AttentionBackendEnum.CPU_ATTN`` in vLLM's backend registry: on the CPU platform
``CpuPlatform.get_attn_backend_cls`` always answers ``AttentionBackendEnum.CPU_ATTN.get_path()`` (it
ignores any other selection), and ``get_path`` honours registry overrides. The backend keeps the
name ``CPU_ATTN`` (``Attention`` looks its name up in ``AttentionBackendEnum``; name-based checks in
vLLM and ``attention_metadata.SUPPORTED_BACKENDS`` keep working); :func:`masked_backend_active`
tells a masked layer from a stock one.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adaptive.depth.mask_context import STATS, current_mask
from vllm_adaptive.engine.vllm_api import (
    AttentionType,
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    cpu_attn_isa,
)
from vllm_adaptive.kernels.masked_paged_attention import (
    masked_paged_attention,
    split_cpu_kv_cache,
)
from vllm_adaptive.kernels.native import ensure_built as ensure_native_built

# CPU_ATTN ISAs whose K/V layout the torch masked kernel reads (K transposed per block and head)
SUPPORTED_ISAS = ("vec", "vec16")


class MaskedAttentionUnsupported(ValueError):
    """The layer's configuration cannot run the depth-masked attention path."""


def layer_index_from_name(layer_name: str) -> int:
    """Decoder layer index of an attention layer name, e.g. ``model.layers.12.self_attn.attn``
    -> 12 (vLLM's ``extract_layer_index``: the name must hold exactly one integer)."""
    from vllm_adaptive.engine.vllm_api import extract_layer_index

    if not isinstance(layer_name, str) or not layer_name:
        raise MaskedAttentionUnsupported(
            f"the masked attention backend needs the layer's name to find its layer index, "
            f"got {layer_name!r}"
        )
    try:
        return extract_layer_index(layer_name)
    except (AssertionError, ValueError) as e:
        raise MaskedAttentionUnsupported(
            f"cannot parse a layer index from attention layer name {layer_name!r} (expected one "
            f"integer, as in 'model.layers.12.self_attn.attn'): {e}"
        ) from None


def _predicted_isa(head_size: int, kv_cache_dtype: str) -> str | None:
    """The ISA vLLM's CPU metadata builder will pick for this layer, from the current config
    (the builder computes it from the model dtype, block size, head size and cache dtype)."""
    from vllm_adaptive.engine.vllm_api import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    model_config = getattr(cfg, "model_config", None)
    dtype = getattr(model_config, "dtype", None) or torch.get_default_dtype()
    block_size = getattr(getattr(cfg, "cache_config", None), "block_size", None) or 32
    try:
        return cpu_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except NotImplementedError:
        return None


def _isa_error(isa: Any) -> MaskedAttentionUnsupported:
    return MaskedAttentionUnsupported(
        f"the KV mask (kv_strategy 'mask') needs vLLM's CPU attention ISA 'vec' or 'vec16', but "
        f"this layer uses ISA {isa!r}: its K cache packing ('amx': bfloat16 on CPUs with AMX; "
        f"'neon': ARM) is not the layout the torch masked-attention kernel reads. Run in float32 "
        f"or float16 on an AMX CPU, or use another kv_strategy."
    )


class MaskedCPUAttentionImpl(CPUAttentionBackendImpl):
    """CPU_ATTN impl whose ``forward`` applies the published depth mask (see the module doc)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        refused = []
        if attn_type != AttentionType.DECODER:
            refused.append(f"attention type {attn_type!r} (only decoder self-attention)")
        if self.alibi_slopes is not None:
            refused.append("ALiBi")
        if self.logits_soft_cap:
            refused.append(f"logits soft-capping {self.logits_soft_cap}")
        if self.sinks is not None:
            refused.append("attention sinks")
        if self.is_fp8_kv_cache:
            refused.append(f"quantized KV cache {kv_cache_dtype!r}")
        if kv_sharing_target_layer_name is not None:
            refused.append(f"KV sharing with {kv_sharing_target_layer_name!r}")
        if refused:
            raise MaskedAttentionUnsupported(
                "the KV mask (kv_strategy 'mask') supports causal decoder attention only; "
                "this layer has " + ", ".join(refused)
            )
        isa = _predicted_isa(head_size, kv_cache_dtype)
        if isa is not None and isa not in SUPPORTED_ISAS:
            raise _isa_error(isa)
        # the C++ decode kernel is built here, at engine start (once per machine), never inside
        # a request; where it cannot be, the torch path runs (logged once)
        ensure_native_built()
        self._layer_index: int | None = None
        self._masked_checked = False

    def layer_index(self, layer: Any) -> int:
        """The layer's decoder index, parsed from ``layer.layer_name`` once (one impl per layer)."""
        if self._layer_index is None:
            self._layer_index = layer_index_from_name(getattr(layer, "layer_name", None))
        return self._layer_index

    def _check_masked_call(self, layer: Any, md: Any) -> None:
        isa = getattr(layer, "isa", None)
        if isa not in SUPPORTED_ISAS:
            raise _isa_error(isa)
        if md.causal is not True or md.dynamic_causal is not None or md.encoder_cache is not None:
            raise MaskedAttentionUnsupported(
                "the masked attention path handles causal decoder metadata only (got causal="
                f"{md.causal!r}, dynamic_causal set: {md.dynamic_causal is not None})"
            )

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        mask = current_mask()
        layer_index = None if mask is None else self.layer_index(layer)
        plain = mask is None or (
            layer_index < mask.all_visible_below and mask.query_positions is None
        )
        if attn_metadata is None or plain:
            if attn_metadata is not None:
                if mask is None:
                    STATS.unmasked += 1
                else:
                    STATS.fused += 1
            return super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by MaskedCPUAttentionImpl"
            )
        if not self._masked_checked:
            self._check_masked_call(layer, attn_metadata)
            self._masked_checked = True
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = split_cpu_kv_cache(kv_cache)
        masked_paged_attention(
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            self.scale,
            depth_record=mask.record,
            layer=layer_index,
            layout="cpu",
            out=output[:n],
            mask_step_tokens=mask.query_positions is not None,
            query_positions=mask.query_positions,
            sliding_window=self.sliding_window,
        )
        STATS.masked += 1
        return output


class MaskedCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with :class:`MaskedCPUAttentionImpl`; builder, metadata and cache inherited."""

    @staticmethod
    def get_name() -> str:
        # Must name an AttentionBackendEnum member (Attention.__init__ looks it up); keeping
        # CPU_ATTN keeps vLLM's and the depth runtime's name-based checks working.
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[MaskedCPUAttentionImpl]:
        return MaskedCPUAttentionImpl


def masked_backend_active(attn_layer: Any) -> bool:
    """Whether the attention layer (vLLM ``Attention``) really runs the masked impl."""
    return isinstance(getattr(attn_layer, "impl", None), MaskedCPUAttentionImpl)


__all__ = [
    "SUPPORTED_ISAS",
    "MaskedAttentionUnsupported",
    "MaskedCPUAttentionBackend",
    "MaskedCPUAttentionImpl",
    "layer_index_from_name",
    "masked_backend_active",
]
