"""Every vLLM name the package uses outside ``engine/``, in one table (:data:`NAMES`).

The mechanisms, the models and the bench get vLLM's classes and functions only from here:
``from vllm_adaptive.engine.vllm_api import LlamaForCausalLM``. A vLLM release that moves or
renames one of them then breaks this table and nothing else, and the table says who is affected
(each entry names the modules that use it; ``tests/unit/test_vllm_api.py`` keeps that list exact
and checks that every entry resolves in the installed vLLM).

Names resolve lazily (a module ``__getattr__``, PEP 562): importing this module imports nothing
of vLLM, and a name imports its vLLM module when it is first asked for. A module that imported
vLLM inside a function (so that importing it stays cheap and offline code never loads vLLM)
imports the name from here inside the same function, at the same moment. A resolved name is
kept as a global of this module, so later look-ups cost what any module attribute costs.
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> (vLLM module, attribute of it (None: the module itself), the package modules that use
#: it, relative to ``vllm_adaptive``).
NAMES: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    # -- model classes and what they are built with (models/) --
    "LlamaForCausalLM": (
        "vllm.model_executor.models.llama",
        "LlamaForCausalLM",
        ("models.dispatch", "models.llama", "models.moefied_llama"),
    ),
    "LlamaModel": (
        "vllm.model_executor.models.llama",
        "LlamaModel",
        ("models.llama", "models.moefied_llama"),
    ),
    "LlamaDecoderLayer": (
        "vllm.model_executor.models.llama",
        "LlamaDecoderLayer",
        ("models.llama", "models.moefied_llama"),
    ),
    "Eagle3LlamaForCausalLM": (
        "vllm.model_executor.models.llama_eagle3",
        "Eagle3LlamaForCausalLM",
        ("models.llama_eagle3",),
    ),
    "Gemma3ForCausalLM": (
        "vllm.model_executor.models.gemma3",
        "Gemma3ForCausalLM",
        ("models.dispatch", "models.gemma3"),
    ),
    "Gemma3Model": ("vllm.model_executor.models.gemma3", "Gemma3Model", ("models.gemma3",)),
    "VllmConfig": (
        "vllm.config",
        "VllmConfig",
        (
            "models.base",
            "models.depth_loop",
            "models.gemma3",
            "models.llama",
            "models.moefied_llama",
        ),
    ),
    "CUDAGraphMode": ("vllm.config", "CUDAGraphMode", ("models.llama",)),
    "CompilationMode": (
        "vllm.config",
        "CompilationMode",
        ("models.depth_loop", "models.gemma3", "models.llama"),
    ),
    "IntermediateTensors": (
        "vllm.sequence",
        "IntermediateTensors",
        ("models.base", "models.depth_loop", "models.llama", "models.moefied_llama"),
    ),
    "ignore_torch_compile": (
        "vllm.compilation.decorators",
        "ignore_torch_compile",
        ("models.gemma3", "models.llama", "models.moefied_llama"),
    ),
    "init_logger": ("vllm.logger", "init_logger", ("models.dispatch", "models.moefied_llama")),
    # -- distributed state --
    "get_pp_group": (
        "vllm.distributed",
        "get_pp_group",
        ("models.depth_loop", "models.precision"),
    ),
    "get_tensor_model_parallel_rank": (
        "vllm.distributed",
        "get_tensor_model_parallel_rank",
        ("models.precision",),
    ),
    # -- the CPU attention backend (attention/, the masked kernel's reference) --
    "AttentionType": ("vllm.v1.attention.backend", "AttentionType", ("attention.masked_backend",)),
    "CPUAttentionBackend": (
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackend",
        ("attention.masked_backend",),
    ),
    "CPUAttentionBackendImpl": (
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl",
        ("attention.masked_backend",),
    ),
    "cpu_attn_isa": (
        "vllm.v1.attention.backends.cpu_attn",
        "_get_attn_isa",
        ("attention.masked_backend", "attention.stock_cpu"),
    ),
    "extract_layer_index": (
        "vllm.model_executor.models.utils",
        "extract_layer_index",
        ("attention.masked_backend",),
    ),
    "get_current_vllm_config_or_none": (
        "vllm.config",
        "get_current_vllm_config_or_none",
        ("attention.masked_backend",),
    ),
    # -- vLLM's custom ops (importing the module registers torch.ops._C) and its settings --
    "custom_ops": (
        "vllm._custom_ops",
        None,
        ("attention.stock_cpu", "bench.kernels_measure"),
    ),
    "check_cpu_sgl_kernel": (
        "vllm.model_executor.layers.utils",
        "check_cpu_sgl_kernel",
        ("bench.kernels_measure",),
    ),
    "flash_attn_with_kvcache": (
        "vllm.vllm_flash_attn",
        "flash_attn_with_kvcache",
        ("bench.kernels_attention",),
    ),
    # -- linear layers (precision gears swap a linear's quant method) --
    "LinearMethodBase": (
        "vllm.model_executor.layers.linear",
        "LinearMethodBase",
        ("models.geared_linear_method",),
    ),
    # -- speculative decoding --
    "NgramProposer": (
        "vllm.v1.spec_decode.ngram_proposer",
        "NgramProposer",
        ("speculative.proposer",),
    ),
    "SuffixDecodingProposer": (
        "vllm.v1.spec_decode.suffix_decoding",
        "SuffixDecodingProposer",
        ("speculative.hybrid",),
    ),
    # -- the client side: the bench's engines and its teacher-forcing logits processor --
    "LLM": ("vllm", "LLM", ("bench.engine_run", "bench.moe", "bench.step_cost")),
    "SamplingParams": (
        "vllm",
        "SamplingParams",
        ("bench.engine_run", "bench.moe", "bench.teacher_forcing"),
    ),
    "TokensPrompt": ("vllm.inputs", "TokensPrompt", ("bench.engine_run", "bench.moe")),
    "VLLMValidationError": ("vllm.exceptions", "VLLMValidationError", ("bench.teacher_forcing",)),
    "LogitsProcessor": (
        "vllm.v1.sample.logits_processor",
        "LogitsProcessor",
        ("bench.teacher_forcing",),
    ),
    "BatchUpdate": ("vllm.v1.sample.logits_processor", "BatchUpdate", ("bench.teacher_forcing",)),
    "MoveDirectionality": (
        "vllm.v1.sample.logits_processor",
        "MoveDirectionality",
        ("bench.teacher_forcing",),
    ),
}

#: Names only some vLLM builds have (their users catch the ImportError): CUDA builds.
CUDA_ONLY = frozenset({"flash_attn_with_kvcache"})


def version() -> str:
    """The installed vLLM's ``__version__`` (ImportError without vLLM)."""
    import vllm

    return getattr(vllm, "__version__", "unknown")


def __getattr__(name: str) -> Any:
    try:
        module, attr, _ = NAMES[name]
    except KeyError:
        raise AttributeError(
            f"{__name__} has no vLLM name {name!r}: add it to NAMES, with the modules that use it"
        ) from None
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # the next look-up is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *NAMES})
