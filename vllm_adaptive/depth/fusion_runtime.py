"""Contextual token fusion inside the depth runtime's layer loop (issue 20; the design is
docs/token-fusion.md, "Engine mechanism").

Mechanism only: which adjacent rows merge is the policy's (`policies/fusion.py`, the same
`fusion_groups` the plain-torch reference `fusion_reference.fused_forward` calls). One step:

1. :meth:`EngineFusion.plan`: the prefill rows that fuse (requests with depth on, not resumed
   after preemption: those prefill unfused and are counted), and which of their tokens may
   fuse: prompt positions before the last prompt row, not exempt (special, anchor, rare
   tokens of the profile). The runtime then writes a provisional record ``L`` for every slot
   the step writes, so that the masked backend can apply the record to this step's own keys.
2. :meth:`EngineFusion.fuse` after ``l`` blocks (a fusion layer): per fusing row, groups of
   adjacent rows whose residual streams are within ``tau_fuse(l)``, never across a KV block
   (a cached block must not hold members whose super-token lives in another block) nor across
   a chunk (each chunk fuses among its own rows). Each group's last row carries the weighted
   mean (as the residual, with ``h`` zeroed: vLLM's fused-residual form); the members are
   recorded as written up to ``l`` at once and leave the step's rows, positions and slot
   mapping (the runtime slices the metadata as `_peel` does for exits, but inside a request).
3. Output: a member's output row is its super-token's (only prompt logprobs read it; the
   sampled row, a request's last, never fuses). Commit: members keep ``l`` in the record.

Attention from the fusion layer on runs the masked torch path with per-query positions
(`mask_context.StepMask.query_positions`), since a request's queries are no longer its last
``query_len`` positions.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_adaptive.depth.policies.fusion import apply_fusion, fusion_groups

logger = logging.getLogger("vllm.adaptive.depth")

#: fusion events kept for telemetry (the bench's event plot reads the newest)
MAX_EVENTS = 20000


@dataclass
class FusionCounters:
    steps: int = 0  # steps where some row fused
    rows: int = 0  # prefill rows (request chunks) that ran with fusion on
    groups: int = 0
    removed_tokens: int = 0  # (token, fusion layer) removals: members that stopped
    removed_token_layers: int = 0  # token-layers not computed: sum over members of L - l
    prefill_token_layers: int = 0  # token-layers of the rows that ran with fusion on
    resumed_prefills: int = 0  # prefill rows of resumed (preempted) requests, run unfused
    resumed_requests: int = 0


@dataclass
class FusionEvent:
    """One group: a request's prompt positions ``first .. last`` merged after ``layer`` blocks
    into the row at ``last``."""

    tag: str
    layer: int
    first: int
    last: int
    rows: int


@dataclass
class StepFusion:
    """One step's fusion state, indexed by the step's token order."""

    fusable: torch.Tensor  # [N] bool: the token may join a group
    mass: torch.Tensor  # [N] float32: prompt tokens the row stands for
    span_first: torch.Tensor  # [N] int64: first prompt position the row stands for
    tags: dict[int, str]  # row -> request tag
    members: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    # (member step tokens, their kept step token, layer), in fusion order

    @property
    def fused(self) -> bool:
        return bool(self.members)


@dataclass
class FuseResult:
    keep: torch.Tensor  # [T'] indices into the active tokens that keep running
    counts: torch.Tensor  # [A] kept tokens per active row
    h: torch.Tensor  # [T', H]
    res: torch.Tensor  # [T', H]


class EngineFusion:
    """The fusion profile's rules applied in the engine (see the module doc)."""

    def __init__(self, profile: Any, num_layers: int) -> None:
        self.rules = dict(profile.rules)
        self.exemptions = profile.exemptions
        self.meta = profile.meta
        self.num_layers = num_layers
        self.counters = FusionCounters()
        self.events: deque[FusionEvent] = deque(maxlen=MAX_EVENTS)
        self._resumed_seen: set[int] = set()

    @property
    def layers(self) -> list[int]:
        return sorted(self.rules)

    # -- 1. plan -------------------------------------------------------------------------------
    def plan(
        self,
        states: list | None,
        decode: Any,
        qsl: torch.Tensor,
        positions: torch.Tensor,
        input_ids: torch.Tensor | None,
    ) -> StepFusion | None:
        """Which tokens of this step may fuse; None when no row fuses."""
        if not self.rules or states is None or input_ids is None:
            return None
        n = int(qsl[-1])
        fusable = torch.zeros(n, dtype=torch.bool)
        tags: dict[int, str] = {}
        pos_cpu = positions[:n].cpu()
        ids_cpu = input_ids[:n].cpu()
        c = self.counters
        for r, state in enumerate(states):
            if decode[r] or state is None or state.mode_off:
                continue
            s, e = int(qsl[r]), int(qsl[r + 1])
            if getattr(state, "resumed", False):
                c.resumed_prefills += 1
                if id(state) not in self._resumed_seen:
                    self._resumed_seen.add(id(state))
                    c.resumed_requests += 1
                continue
            p = pos_cpu[s:e]
            ok = p < state.prompt_len - 1  # the last prompt row is sampled from: never fused
            if int(ok.sum()) < 2:
                continue
            ok &= ~self.exemptions.mask(ids_cpu[s:e].tolist())
            fusable[s:e] = ok
            tags[r] = state.tag
            c.rows += 1
            c.prefill_token_layers += (e - s) * self.num_layers
        if not tags:
            return None
        return StepFusion(
            fusable=fusable,
            mass=torch.ones(n),
            span_first=pos_cpu.long().clone(),
            tags=tags,
        )

    # -- 2. fuse -------------------------------------------------------------------------------
    def fuse(
        self,
        sf: StepFusion,
        layer: int,
        rows: torch.Tensor,
        qsl: torch.Tensor,
        tok: torch.Tensor,
        pos: torch.Tensor,
        h: torch.Tensor,
        res: torch.Tensor,
        input_ids: torch.Tensor,
        block_size: int,
    ) -> FuseResult | None:
        """Groups after ``layer`` blocks among the active rows (``rows``, their tokens from
        ``qsl`` in ``h``); None when nothing fuses."""
        rule = self.rules[layer]
        tok_cpu = tok.cpu()
        pos_cpu = pos.cpu()
        counts = (qsl[1:] - qsl[:-1]).clone()
        keep = torch.ones(int(tok.shape[0]), dtype=torch.bool)
        h_new, res_new = h, res
        any_group = False
        for a, r in enumerate(rows.tolist()):
            if r not in sf.tags:
                continue
            s, e = int(qsl[a]), int(qsl[a + 1])
            if e - s < 2:
                continue
            st = tok_cpu[s:e]
            ok = sf.fusable[st]
            if int(ok.sum()) < 2:
                continue
            p = pos_cpu[s:e]
            cut = (p[1:] // block_size) != (p[:-1] // block_size)
            stream = h[s:e] + res[s:e]
            groups = fusion_groups(
                stream,
                rule,
                exempt=~ok,
                mass=sf.mass[st],
                token_ids=input_ids[tok[s:e]].cpu(),
                cut=cut,
            )
            if groups.num_groups == 0:
                continue
            if not any_group:
                h_new, res_new = h.clone(), res.clone()
                any_group = True
            kept_local, mixed = apply_fusion(stream, groups)
            ends = groups.ends
            # the super-token runs as the residual; the block adds h to it first
            res_new[s + ends.to(h.device)] = mixed[_kept_pos(kept_local, ends).to(h.device)]
            h_new[s + ends.to(h.device)] = 0
            removed = 0
            for g_s, g_e in zip(groups.starts.tolist(), ends.tolist(), strict=True):
                members = st[g_s:g_e]
                owner = st[g_e]
                sf.mass[owner] = sf.mass[st[g_s : g_e + 1]].sum()
                first = int(sf.span_first[st[g_s]])
                sf.span_first[owner] = first
                sf.members.append((members, owner.expand(members.shape[0]), layer))
                keep[s + g_s : s + g_e] = False
                removed += g_e - g_s
                self.events.append(
                    FusionEvent(sf.tags[r], layer, first, int(p[g_e]), g_e - g_s + 1)
                )
            counts[a] -= removed
            c = self.counters
            c.groups += groups.num_groups
            c.removed_tokens += removed
            c.removed_token_layers += removed * (self.num_layers - layer)
        if not any_group:
            return None
        idx = torch.nonzero(keep).squeeze(1)
        d = idx.to(h.device)
        return FuseResult(keep=idx, counts=counts, h=h_new[d], res=res_new[d])

    # -- 3. output and commit ------------------------------------------------------------------
    @staticmethod
    def alias_outputs(sf: StepFusion, out: torch.Tensor) -> None:
        """Members' output rows take their super-token's (latest fusion first, so a chain of
        fusions resolves to the final row)."""
        for members, owners, _ in reversed(sf.members):
            out[members.to(out.device)] = out[owners.to(out.device)]

    @staticmethod
    def commit(sf: StepFusion, record: Any, slot_mapping: torch.Tensor) -> None:
        """Members keep the layer they fused at in the depth record."""
        for members, _, layer in sf.members:
            record.write(slot_mapping[members.to(slot_mapping.device)], layer)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "layers": self.layers,
            "tau_fuse": {str(k): v.tau_fuse for k, v in sorted(self.rules.items())},
            "steps": c.steps,
            "rows": c.rows,
            "groups": c.groups,
            "removed_tokens": c.removed_tokens,
            "removed_token_layers": c.removed_token_layers,
            "prefill_token_layers": c.prefill_token_layers,
            "removed_fraction": (
                c.removed_token_layers / c.prefill_token_layers if c.prefill_token_layers else 0.0
            ),
            "resumed_prefills": c.resumed_prefills,
            "resumed_requests": c.resumed_requests,
        }

    def recent_events(self, limit: int = MAX_EVENTS) -> list[dict[str, Any]]:
        return [e.__dict__.copy() for e in list(self.events)[-limit:]]


def _kept_pos(kept_local: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Index in ``apply_fusion``'s kept rows of each group end."""
    return torch.searchsorted(kept_local.cpu(), ends.cpu())


def check_fusion_profile(profile: Any) -> str | None:
    """Why the engine cannot run this fusion profile (a config error message), or None."""
    for rule in profile.rules.values():
        if rule.weighting != "uniform":
            return (
                f'adaptive.depth.fusion.profile: weighting "{rule.weighting}" needs each row\'s '
                "attention scores at the block before the fusion layer, which vLLM's attention "
                'op does not return; the engine fuses with "uniform" weighting only'
            )
        if rule.tau_attn is not None:
            return (
                "adaptive.depth.fusion.profile: tau_attn needs query/key cosines from the "
                "attention op, which the engine does not collect; calibrate without "
                "--fusion-tau-attn"
            )
    return None
