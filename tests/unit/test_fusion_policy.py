"""Contextual token fusion's policy (depth/policies/fusion.py) on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from vllm_adaptive.depth.policies.fusion import (
    FusionRule,
    adjacent_attention_similarity,
    anchor_sequences,
    apply_fusion,
    exemption_mask,
    fusion_groups,
)


def _line(*xs: float) -> torch.Tensor:
    """Rows on one axis of a 3-d space: row i is (x_i, 0, 0)."""
    h = torch.zeros(len(xs), 3)
    h[:, 0] = torch.tensor(xs)
    return h


def test_runs_of_adjacent_pairs_below_tau_form_groups() -> None:
    # distances: 0.1, 5, 0.1, 0.1, 5, 0.3
    h = _line(0.0, 0.1, 5.1, 5.2, 5.3, 10.3, 10.6)
    g = fusion_groups(h, FusionRule(tau_fuse=0.2))
    assert g.starts.tolist() == [0, 2]
    assert g.ends.tolist() == [1, 4]
    assert g.removed == 3
    assert g.kept_rows(7).tolist() == [1, 4, 5, 6]
    assert g.distance.tolist() == pytest.approx([0.1, 5.0, 0.1, 0.1, 5.0, 0.3], abs=1e-5)
    # strict inequality, as the paper's "< tau_fuse"
    assert fusion_groups(_line(0.0, 0.5), FusionRule(tau_fuse=0.5)).num_groups == 0


def test_pairwise_chaining_not_running_mean() -> None:
    # each step 0.15 < 0.2, but the ends are 0.45 apart: single linkage keeps one group
    g = fusion_groups(_line(0.0, 0.15, 0.3, 0.45), FusionRule(tau_fuse=0.2))
    assert (g.starts.tolist(), g.ends.tolist()) == ([0], [3])
    # max_group cuts the run left to right; a leftover single row stays alone
    g = fusion_groups(_line(0.0, 0.15, 0.3, 0.45, 0.6), FusionRule(tau_fuse=0.2, max_group=2))
    assert (g.starts.tolist(), g.ends.tolist()) == ([0, 2], [1, 3])
    assert g.kept_rows(5).tolist() == [1, 3, 4]


def test_uniform_weights_count_tokens_and_super_token_is_the_mean() -> None:
    h = _line(1.0, 1.1, 9.0)
    h[:, 1] = torch.tensor([2.0, 4.0, 0.0])
    g = fusion_groups(h, FusionRule(tau_fuse=3.0))
    kept, out = apply_fusion(h, g)
    assert kept.tolist() == [1, 2]
    assert out[0].tolist() == pytest.approx([1.05, 3.0, 0.0])
    assert out[1].tolist() == pytest.approx(h[2].tolist())
    # a row that already stands for 3 tokens weighs 3 under "uniform"
    g = fusion_groups(h, FusionRule(tau_fuse=3.0), mass=torch.tensor([3.0, 1.0, 1.0]))
    assert g.weights.tolist() == pytest.approx([0.75, 0.25, 0.0])


def test_score_weighting() -> None:
    h = _line(0.0, 0.1, 0.2)
    g = fusion_groups(
        h, FusionRule(tau_fuse=1.0, weighting="score"), score=torch.tensor([1.0, 1.0, 2.0])
    )
    assert g.weights.tolist() == pytest.approx([0.25, 0.25, 0.5])
    _, out = apply_fusion(h, g)
    assert out[0, 0].item() == pytest.approx(0.25 * 0.0 + 0.25 * 0.1 + 0.5 * 0.2)
    with pytest.raises(ValueError, match="score"):
        fusion_groups(h, FusionRule(tau_fuse=1.0, weighting="score"))


def test_exempt_rows_never_join_a_group() -> None:
    h = _line(0.0, 0.1, 0.2, 0.3, 0.4)
    exempt = torch.tensor([False, False, True, False, False])
    g = fusion_groups(h, FusionRule(tau_fuse=1.0), exempt=exempt)
    assert (g.starts.tolist(), g.ends.tolist()) == ([0, 3], [1, 4])
    assert 2 in g.kept_rows(5).tolist()


def test_attention_gate_only_narrows() -> None:
    h = _line(0.0, 0.1, 0.2, 0.3)
    sim = torch.tensor([0.9, 0.1, 0.9])
    g = fusion_groups(h, FusionRule(tau_fuse=1.0, tau_attn=0.5), attn_sim=sim)
    assert (g.starts.tolist(), g.ends.tolist()) == ([0, 2], [1, 3])
    with pytest.raises(ValueError, match="attn_sim"):
        fusion_groups(h, FusionRule(tau_fuse=1.0, tau_attn=0.5))


def test_adjacent_attention_similarity_with_grouped_heads() -> None:
    # 3 tokens, 2 query heads over 1 key head; q_1 parallel to k_0, q_2 opposite to k_1
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 1.0]]])
    q = torch.tensor(
        [[[5.0, 5.0], [5.0, 5.0]], [[2.0, 0.0], [3.0, 0.0]], [[0.0, -1.0], [0.0, -2.0]]]
    )
    sim = adjacent_attention_similarity([q, q], [k, k])
    assert sim.tolist() == pytest.approx([1.0, -1.0])


def test_exemptions_special_anchor_and_rare() -> None:
    ids = torch.tensor([0, 5, 7, 8, 5, 7, 9, 3])
    counts = torch.zeros(10, dtype=torch.long)
    counts[[0, 3, 5, 7, 8]] = 100
    counts[9] = 2
    m = exemption_mask(ids, special_ids=[0], anchors=[(5, 7, 9)], token_counts=counts, min_count=10)
    # 0 special; 5,7,9 at rows 4..6 anchor (rows 1,2 are 5,7 not followed by 9); 9 also rare
    assert m.tolist() == [True, False, False, False, True, True, True, False]
    # ids beyond the table are rare
    assert exemption_mask(torch.tensor([12]), token_counts=counts, min_count=1).tolist() == [True]


def test_anchor_sequences_spell_both_forms() -> None:
    enc = {"Answer:": [1, 2], " Answer:": [3, 2]}
    assert anchor_sequences(lambda s: enc[s], ["Answer:"]) == ((1, 2), (3, 2))
    with pytest.raises(ValueError, match="empty"):
        anchor_sequences(lambda s: [], [""])


def test_bad_rule() -> None:
    with pytest.raises(ValueError, match="weighting"):
        FusionRule(tau_fuse=1.0, weighting="attention")
    with pytest.raises(ValueError, match="max_group"):
        FusionRule(tau_fuse=1.0, max_group=1)
    with pytest.raises(ValueError, match="tau_fuse"):
        FusionRule(tau_fuse=float("nan"))


def test_split_repeats_blocks_pairs_of_one_token() -> None:
    h = _line(0.0, 0.1, 0.2, 0.3)
    ids = torch.tensor([5, 5, 6, 7])
    assert fusion_groups(h, FusionRule(tau_fuse=1.0), token_ids=ids).num_groups == 1
    g = fusion_groups(h, FusionRule(tau_fuse=1.0, split_repeats=True), token_ids=ids)
    assert (g.starts.tolist(), g.ends.tolist()) == ([1], [3])
    with pytest.raises(ValueError, match="token_ids"):
        fusion_groups(h, FusionRule(tau_fuse=1.0, split_repeats=True))


def test_cut_pairs_never_fuse() -> None:
    """The engine cuts groups at KV-block boundaries: a cut pair splits a run, whatever the
    distance."""
    h = torch.zeros(6, 4)
    rule = FusionRule(tau_fuse=1.0)
    assert fusion_groups(h, rule).num_groups == 1  # one run of six identical rows
    cut = torch.tensor([False, False, True, False, False])
    g = fusion_groups(h, rule, cut=cut)
    assert g.starts.tolist() == [0, 3] and g.ends.tolist() == [2, 5]
    with pytest.raises(ValueError, match="cut must be"):
        fusion_groups(h, rule, cut=torch.zeros(3, dtype=torch.bool))


def test_mass_must_have_one_entry_per_row() -> None:
    """A mass indexed by original token instead of by current row (the reference forward did
    this after a first fusion layer) is refused instead of silently misweighting."""
    h = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="mass must be"):
        fusion_groups(h, FusionRule(tau_fuse=1.0), mass=torch.ones(6))
