"""The MoEfied Llama in a real engine against an independent reference: the all-resident engine
(no ``adaptive`` section) at float32 against ``vllm_adaptive/moe/reference.py`` (a transformers
``LlamaForCausalLM`` with plain-torch top-k MLPs, no vLLM) on the same checkpoint, the
**mechanics fixture** of ``tests/support/moefied.py`` (its text means nothing).
``tests/slow/test_moe_engine.py`` compares the tiered engine with the resident one; this module
checks that the resident one computes the model the checkpoint describes.

Float32 on both sides (the bf16 weights upcast exactly): the two differ by kernel summation
order only, about 1e-5, which can still flip a top-k routing choice or an argmax where two
logits are that close. Hence the tolerances: teacher-forced top-1 agreement at least 0.99, the
forced tokens' log-probabilities within ``TOL`` at 95% of the positions (a flipped routing
choice moves a few positions by more), and greedy tokens identical for ``GREEDY_SAME`` tokens.
Measured on an AMX Xeon (2026-11-27): 766/766 top-1, |d logprob| median 2.3e-5, max 2.4e-4,
every greedy token identical; a reference with one layer's router rows of two experts swapped
agrees on 376/766 and diverges at greedy token 6.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.support.engines import make_llm, shutdown
from tests.support.moefied import build_mechanics_moefied
from tests.support.workloads import PROMPTS

TOL = 2e-3  # float32 log-probabilities, vLLM's CPU kernels against transformers (ARLA's too)
FORCED_TOKENS = 384  # per text, over two 256-token prefill chunks
GREEDY_TOKENS = 24
GREEDY_SAME = 16  # leading greedy tokens that must be identical in every prompt


@pytest.fixture(scope="module")
def moefied_dir(model_dir: Path, tmp_path_factory) -> Path:
    return build_mechanics_moefied(model_dir, tmp_path_factory.mktemp("moefied") / "model")


@pytest.fixture(scope="module")
def texts(moefied_dir: Path) -> list[list[int]]:
    """Teacher-forced token ids: Python source and English prose."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(moefied_dir))
    code = Path(argparse.__file__).read_text()[20000:40000]
    prose = " ".join(PROMPTS) + " " + Path(argparse.__file__).read_text()[:3000]
    return [tok(t)["input_ids"][:FORCED_TOKENS] for t in (code, prose)]


@pytest.fixture(scope="module")
def engine_out(moefied_dir: Path, texts: list[list[int]]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(moefied_dir, {}, dtype="float32")  # every expert resident
    try:
        forced = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in texts],
            SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False),
            use_tqdm=False,
        )
        greedy = llm.generate(
            PROMPTS[:4],
            SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        shutdown(llm)
    return {
        "forced": [o.prompt_logprobs for o in forced],
        "greedy": [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in greedy],
    }


@pytest.fixture(scope="module")
def reference(moefied_dir: Path):
    from vllm_adaptive.moe.reference import load_moefied

    return load_moefied(moefied_dir, dtype=torch.float32)


def test_teacher_forced_logprobs_match_the_reference(engine_out, reference, texts) -> None:
    agree, positions, diffs = 0, 0, []
    for ids, lps in zip(texts, engine_out["forced"], strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
        for t in range(1, len(ids)):
            step = lps[t]
            top = next(tok for tok, lp in step.items() if lp.rank == 1)
            agree += top == int(ref[t - 1].argmax())
            positions += 1
            diffs.append(abs(step[ids[t]].logprob - float(ref[t - 1, ids[t]])))
    diffs_t = torch.tensor(diffs)
    print(
        f"top-1 agreement {agree}/{positions}, |dlogprob| median {diffs_t.median():.2e} "
        f"p99 {diffs_t.quantile(0.99):.2e} max {diffs_t.max():.2e}"
    )
    assert agree / positions >= 0.99
    assert float(diffs_t.quantile(0.95)) < TOL


def test_greedy_tokens_match_the_reference(engine_out, reference) -> None:
    """The reference's greedy continuation, read off one forward pass over the prompt and the
    engine's tokens: up to the first position where its argmax is not the engine's token the
    two greedy sequences are the same."""
    for i, (prompt_ids, got) in enumerate(engine_out["greedy"]):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt_ids + got])).logits[0]
        want = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        first = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        print(f"prompt {i}: first difference at {first}")
        assert first is None or first >= GREEDY_SAME, f"prompt {i}: diverges at token {first}"
