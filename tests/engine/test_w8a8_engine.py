"""vLLM's own int8 CPU path on the W8A8 checkpoint (`models prepare
smollm2-135m-instruct-w8a8`): it loads in a real engine, every decoder linear runs vLLM's
compressed-tensors W8A8 int8 kernel (not a silent dequantization), greedy text is sane, and its
perplexity stays close to the float32 model's (transformers reference)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

TEXT = (
    "The Debian project is an association of individuals who have made common cause to "
    "create a free operating system. The operating system is called Debian. It comes with "
    "thousands of packages, precompiled software bundled up in a nice format for easy "
    "installation on your machine. Most of the software is free and can be changed and "
    "redistributed by anyone who follows the licence."
)


@pytest.fixture(scope="module")
def w8a8_dir(model_dir: Path) -> Path:
    from vllm_adaptive.model_zoo import prepare

    return prepare("smollm2-135m-instruct-w8a8", quiet=True)


@pytest.fixture(scope="module")
def w8a8_llm(w8a8_dir: Path):
    from vllm import LLM

    from vllm_adaptive.kernels.float_linear import amx_int8_available

    # On CPUs with AMX vLLM 0.32 runs W8A8 through its AMX kernel, which takes bf16 / fp16
    # activations only (a float32 engine dies at its first step: "int8_scaled_mm_with_quant:
    # expect A to be bfloat16 or half"); elsewhere oneDNN's kernel, in float32 here.
    dtype = "bfloat16" if amx_int8_available() else "float32"
    llm = LLM(model=str(w8a8_dir), dtype=dtype, enforce_eager=True, seed=0, max_model_len=512)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_every_linear_runs_vllm_int8_kernel(w8a8_llm) -> None:
    from vllm_adaptive.bench.dispatch import linear_methods

    methods = w8a8_llm.apply_model(linear_methods)[0]
    int8 = {k: n for k, n in methods.items() if "CompressedTensorsW8A8Int8" in k}
    # 30 layers x (qkv, o, gate_up, down): all through the int8 scaled-mm kernel (oneDNN, or
    # the AMX kernel on CPUs that have AMX)
    assert sum(int8.values()) == 120, methods
    assert all("CPUInt8ScaledMMLinearKernel" in k for k in int8), methods
    assert "UnquantizedLinearMethod" not in methods


def test_greedy_text_is_sane(w8a8_llm) -> None:
    from vllm import SamplingParams

    from vllm_adaptive.kernels.float_linear import cpu_has_int8_dot

    if not cpu_has_int8_dot():
        pytest.skip(
            "vLLM 0.32's oneDNN int8 GEMM saturates without VNNI/AMX (an output element 4% of "
            "the range off, tests/unit/test_float_linear.py), so its W8A8 text degrades on this "
            "AVX2 CPU ('def fibonacci(n):' -> an input() loop); the plugin avoids that kernel here"
        )

    outs = w8a8_llm.generate(
        ["The capital of France is", "def fibonacci(n):"],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    paris, code = (o.outputs[0].text for o in outs)
    assert "Paris" in paris, paris
    assert "return" in code, code


def test_perplexity_close_to_float32(w8a8_llm, model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    out = w8a8_llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    ppl_int8 = math.exp(-sum(lps) / len(lps))

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    ppl_f32 = math.exp(float(nll))
    # W8A8 round-to-nearest with per-token activations: a few percent worse (the bench
    # measures it on held-out text), never a broken model
    assert ppl_f32 * 0.9 < ppl_int8 < ppl_f32 * 1.25, (ppl_int8, ppl_f32)
