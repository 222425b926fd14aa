"""Token fusion's reference forward (depth/calibration/fusion_reference.py) against
transformers' own blocks on a tiny random Llama: no fusion is the model itself, and one fused
pair is the HF forward of the kept rows at their own positions from the fusion layer on."""

from __future__ import annotations

import pytest
import torch

from vllm_adaptive.depth.calibration.fusion_reference import fused_forward, prefix_state
from vllm_adaptive.depth.policies.fusion import FusionRule

IDS = [3, 7, 9, 11, 2, 5, 5, 5, 8, 30, 12, 4]
PROMPT = 8


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def _nll(logits: torch.Tensor) -> torch.Tensor:
    target = torch.tensor(IDS[PROMPT:])
    lp = torch.log_softmax(logits[PROMPT - 1 : -1].float(), dim=-1)
    return -lp.gather(1, target[:, None])[:, 0]


def test_no_fusion_is_the_model(model) -> None:
    run = fused_forward(model, IDS, PROMPT, {})
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0]
    assert torch.allclose(run.nll, _nll(logits), atol=1e-5)
    assert run.removed_fraction == 0.0
    assert run.active_prompt_rows == [PROMPT] * 4


def test_one_fused_pair_is_hf_on_the_kept_rows(model) -> None:
    layer = 2
    with torch.no_grad():
        h = model(torch.tensor([IDS]), output_hidden_states=True).hidden_states[layer][0]
    d = (h[1:] - h[:-1]).norm(dim=-1)[: PROMPT - 2]  # fusable pairs: rows 0..PROMPT-2
    a = int(d.argmin())
    tau = float(d[a]) * 1.0001
    assert (d < tau).sum() == 1  # exactly one pair (a, a+1) passes
    run = fused_forward(model, IDS, PROMPT, {layer: FusionRule(tau_fuse=tau)})
    assert [(e.layer, e.first_token, e.last_token) for e in run.events] == [(layer, a, a + 1)]
    # HF's own blocks from the fusion layer on: the kept rows at their positions, the
    # super-token (uniform mean) in row a+1, causal over the kept rows only (the mask strategy)
    keep = [i for i in range(len(IDS)) if i != a]
    x = h.clone()
    x[a + 1] = (h[a] + h[a + 1]) / 2
    x = x[keep][None]
    pos = torch.tensor([keep])
    with torch.no_grad():
        pe = model.model.rotary_emb(x, pos)
        for blk in model.model.layers[layer:]:
            out = blk(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
            x = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(model.model.norm(x))[0]
    target = torch.tensor(IDS[PROMPT:])
    lp = torch.log_softmax(logits[PROMPT - 2 : -1], dim=-1)  # row a < PROMPT-1 is gone
    want = -lp.gather(1, target[:, None])[:, 0]
    assert torch.allclose(run.nll, want, atol=1e-5)
    # and it is not the unfused model (the check can fail)
    assert not torch.allclose(run.nll, fused_forward(model, IDS, PROMPT, {}).nll, atol=1e-4)
    assert run.active_prompt_rows == [PROMPT, PROMPT, PROMPT - 1, PROMPT - 1]
    assert run.removed_fraction == pytest.approx(2 / (PROMPT * 4))


def test_never_fuses_the_last_prompt_row_or_exempt_rows(model) -> None:
    rules = {1: FusionRule(tau_fuse=1e9)}  # everything fusable fuses
    run = fused_forward(model, IDS, PROMPT, rules)
    assert [(e.first_token, e.last_token) for e in run.events] == [(0, PROMPT - 2)]
    exempt = torch.zeros(PROMPT, dtype=torch.bool)
    exempt[3] = True
    run = fused_forward(model, IDS, PROMPT, rules, exempt=exempt)
    assert [(e.first_token, e.last_token) for e in run.events] == [(0, 2), (4, PROMPT - 2)]
    assert run.active_prompt_rows[1:] == [4] * 3  # rows 2, 3, 6, 7 of 8


def test_fusing_again_and_progressive_mass(model) -> None:
    rules = {1: FusionRule(tau_fuse=1e9, max_group=2), 2: FusionRule(tau_fuse=1e9)}
    run = fused_forward(model, IDS, PROMPT, rules)
    # layer 1: (0,1) (2,3) (4,5), row 6 alone; layer 2: rows 1,3,5,6 become one group
    assert [(e.layer, e.first_token, e.last_token, e.rows) for e in run.events] == [
        (1, 0, 1, 2), (1, 2, 3, 2), (1, 4, 5, 2), (2, 0, 6, 4),
    ]  # fmt: skip


def test_prefix_state_resume_and_other_weightings(model) -> None:
    rules = {2: FusionRule(tau_fuse=1e9, weighting="score", tau_attn=-2.0)}
    full = fused_forward(model, IDS, PROMPT, rules)
    start = prefix_state(model, IDS, 2, rules)
    assert start.score is not None and start.attn_sim is not None
    resumed = fused_forward(model, IDS, PROMPT, rules, start=start)
    assert torch.equal(full.nll, resumed.nll)
    uniform = fused_forward(model, IDS, PROMPT, {2: FusionRule(tau_fuse=1e9)})
    assert not torch.allclose(full.nll, uniform.nll, atol=1e-5)
    with pytest.raises(ValueError, match="fusion layers"):
        fused_forward(model, IDS, PROMPT, {4: FusionRule(tau_fuse=1.0)})


def test_event_plot(model, tmp_path) -> None:
    from vllm_adaptive.depth.calibration.fusion import plot_events

    run = fused_forward(model, IDS, PROMPT, {1: FusionRule(tau_fuse=1e9, max_group=2)})
    plot_events(run, tmp_path / "events.png")
    assert (tmp_path / "events.png").stat().st_size > 1000
