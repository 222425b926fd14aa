"""QuickSilver's Dynamic Token Halting (sec. 2.1, 2.4, appendix B) as an exit signal.

A row halts at layer l when, for the token t it is processing,

    l_min < l <= l_max  and  t not protected  and  (t forced to halt  or
                                                   (drift < tau_drift and H < tau_entropy))

* **drift** ``||h_l - h_{l-1}||_2``: the paper's absolute L2 change of the residual stream over
  block l (float32, not normalised; on SmolLM2 it grows with depth, which is why the
  calibration pools it over the halting window as the paper does, appendix B.2).
* **H**: QuickSilver needs a next-token distribution at layer l and does not say which readout.
  We take the EMAD profile's: the proxy entropy (low-rank or feature, as calibrated; nats at
  the profile's temperature) of the calibrated readout ``a_l * RMSNorm(h) + b_l``. Why: it is
  the distribution the runtime emits when the row halts (so H is the confidence of what is
  sampled); Norm_l already *is* the plain lens at every layer where the fit did not help; and
  the exact entropy needs the whole LM head, 8 decoder blocks' linear FLOPs on the default
  model, at every layer of the window. The proxy is evaluated only for rows whose drift passes
  and that are neither protected nor forced (the conjunction short-circuits on the cheap test).
* **minimum halting depth** l_min (B.5: "enforce a minimum halting depth l_min = 5 globally";
  R: halting only if l > l_min(t)): no row halts at l <= l_min, forced ones included. l_max
  (optional, G.2's "halting window: layers 6-24") bounds the window from above.
* **protected tokens** (forced full processing, 2.1 "special tokens or domain-sensitive terms";
  the blocklist B_halt of B.5 / R): default the tokenizer's special token ids, plus configured
  ids. They never halt.
* **forced halting** (2.1 "halted regardless of drift, e.g. latency-critical contexts"; G.2
  "none by default"): configured token ids, and rows the runtime flags (``forced_halt``, e.g. a
  latency-critical request). They halt at the first layer of the window they are checked at.

Precedence. Sec. 2.1 writes ``H' = max{1[full], H} * min{1[no forced halt], H}`` (H = 0 halts);
taken literally, forced full processing never changes anything (max{1, 0} * min{1, 0} = 0),
and its nested reading lets a forced halt override full processing. Appendix R makes the
blocklist absolute ("halted only if ... t not in B_halt"), and special tokens are protected by
default, so we rank: protected > forced halt > the dual signal. The config refuses a token id
that is both protected and forced.

Probe layers: the rule is checked at every probe layer of the profile; ``vllm-adaptive
calibrate --signal quicksilver`` makes every layer 1..L-1 a probe, as the paper checks every
layer. With sparser probes the drift is still over one block (``prev_stream`` is the input of
block l, not the previous probe).

What the runtime must pass in `ProbeBatch`: ``stream`` and ``prev_stream`` (the residual
stream after and before block ``layer``, candidate rows only), ``token_ids`` (the input token
of each row: vLLM's ``input_ids`` at the row's token index), ``readout`` (the profile's
calibrated readout at ``probe``), and optionally ``forced_halt``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from vllm_adaptive.depth.policies.probe import ProbeBatch


def halting_rule(drift_ok: Any, entropy_ok: Any, protected: Any, forced: Any) -> Any:
    """protected > forced halt > (drift and entropy); bool numpy arrays or torch tensors."""
    return ~protected & (forced | (drift_ok & entropy_ok))


def _ids(ids: Iterable[int]) -> torch.Tensor:
    return torch.tensor(sorted({int(i) for i in ids}), dtype=torch.long)


class QuickSilverExitSignal:
    """Dual-signal halting; ``entropy(normed, probe)`` is the readout's (proxy) entropy in nats,
    e.g. `EmadExitSignal.proxy_entropy` of the same profile."""

    per_row = True
    needs_prev_stream = True
    needs_token_ids = True

    def __init__(
        self,
        entropy: Callable[[torch.Tensor, int], torch.Tensor],
        tau_drift: float,
        tau_entropy: float,
        min_halting_depth: int = 5,
        max_halting_layer: int | None = None,
        protected_ids: Iterable[int] = (),
        forced_halt_ids: Iterable[int] = (),
    ):
        self.entropy = entropy
        self.tau_drift = float(tau_drift)
        self.tau_entropy = float(tau_entropy)
        self.min_halting_depth = int(min_halting_depth)
        self.max_halting_layer = max_halting_layer
        self.protected_ids = _ids(protected_ids)
        self.forced_halt_ids = _ids(forced_halt_ids)
        both = set(self.protected_ids.tolist()) & set(self.forced_halt_ids.tolist())
        if both:
            raise ValueError(f"token ids both protected and forced to halt: {sorted(both)}")

    def to(self, device: torch.device) -> QuickSilverExitSignal:
        self.protected_ids = self.protected_ids.to(device)
        self.forced_halt_ids = self.forced_halt_ids.to(device)
        return self

    def in_window(self, layer: int) -> bool:
        """Whether any row may halt after ``layer`` blocks (l_min < l <= l_max)."""
        above = layer > self.min_halting_depth
        return above and (self.max_halting_layer is None or layer <= self.max_halting_layer)

    def exit_mask(self, batch: ProbeBatch) -> torch.Tensor:
        n = batch.rows
        device = batch.stream.device
        out = torch.zeros(n, dtype=torch.bool, device=device)
        if n == 0 or not self.in_window(batch.layer):
            return out
        if batch.prev_stream is None or batch.token_ids is None or batch.readout is None:
            raise ValueError("QuickSilver needs prev_stream, token_ids and readout")
        ids = batch.token_ids.to(device)
        protected = torch.isin(ids, self.protected_ids.to(device))
        forced = torch.isin(ids, self.forced_halt_ids.to(device))
        if batch.forced_halt is not None:
            forced |= batch.forced_halt.to(device)
        drift = (batch.stream.float() - batch.prev_stream.float()).norm(dim=-1)
        drift_ok = drift < self.tau_drift
        entropy_ok = torch.zeros(n, dtype=torch.bool, device=device)
        need = torch.nonzero(drift_ok & ~protected & ~forced).squeeze(1)
        if need.numel():
            normed = batch.readout(batch.stream[need])
            entropy_ok[need] = self.entropy(normed, batch.probe).to(device) < self.tau_entropy
        return halting_rule(drift_ok, entropy_ok, protected, forced)
