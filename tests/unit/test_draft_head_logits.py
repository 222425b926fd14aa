"""A draft's head logits are not a sampled row of the step: the precision controller, which
reads the entropy of sampled rows, must never see them (their row count can equal the batch's,
which is all the controller could check)."""

from types import SimpleNamespace

import torch

from vllm_adaptive.speculative.drafts.head import DraftHead


class _Model:
    def __init__(self) -> None:
        self.observed: list[torch.Tensor] = []
        self.weight = torch.randn(10, 4)

    def adaptive_parts(self):
        return SimpleNamespace(vocab_size=8, head=SimpleNamespace(weight=self.weight))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.weight.t()
        self.observed.append(logits)  # what the adaptive model's compute_logits does
        return logits

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.t()


def test_full_precision_draft_head_bypasses_the_controller() -> None:
    model = _Model()
    head = DraftHead(model, "full")
    hidden = torch.randn(3, 4)
    got = head.logits(model, hidden)
    assert got.shape == (3, 8) and not model.observed
    torch.testing.assert_close(got, (hidden @ model.weight.t())[:, :8])


def test_adaptive_models_observe_sampled_logits_only() -> None:
    from vllm_adaptive.models.base import AdaptiveCausalLM

    class _Stock:
        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden * 2

    class _Twin(AdaptiveCausalLM, _Stock):
        pass

    seen: list[torch.Tensor] = []
    twin = object.__new__(_Twin)
    twin.precision = SimpleNamespace(observe_logits=seen.append)
    h = torch.ones(2, 3)
    assert torch.equal(twin.draft_logits(h), h * 2) and not seen
    assert torch.equal(twin.compute_logits(h), h * 2) and len(seen) == 1  # the control
