"""QuickSilver's Contextual Token Fusion (sec. 2.3, appendix D) as a policy: tensors in, groups out.

At a fusion layer l, rows i and i+1 of one prompt (adjacent in the sequence of rows still
running, so a super-token made at an earlier fusion layer is one row) form a fusable pair when

    ||h_i - h_{i+1}||_2 < tau_fuse  and  neither row is exempt
                                     and  (no tau_attn  or  attn_sim(i+1, i) > tau_attn)

* **distance**: the paper's ``||h_t - h_u||_2`` on the raw residual stream at layer l (2.3,
  D.2, I.3; G.3 "L2 distance between token embeddings"). No normalisation is applied, as in the
  paper; tau_fuse is therefore in the stream's own units, which grow with depth, so it is
  calibrated per layer (D.3: a low percentile of the adjacent-pair distances).
* **groups**: D.2's fusion mask F_{t,u} is pairwise on adjacent rows; a run of consecutive
  fusable pairs is one group (the transitive closure of F over adjacency, i.e. single linkage
  along the sequence, *not* a test against the running group mean). D.2's "{t_1 .. t_k}" and
  Fig. 12's "successively fused" spans are such runs. ``max_group`` (optional) cuts long runs
  left to right into pieces of at most that many rows.
* **super-token**: ``h = sum_i a_i h_i / sum_i a_i`` (2.3). ``uniform``: a_i is the number of
  prompt tokens row i already stands for (``mass``; 1 for a plain token), so fusing a
  super-token again stays the uniform mean of its tokens (D.2's 1/2(h_t + h_u) for two plain
  tokens); ``score``: a_i is a caller-given importance score (I.3 "attention-derived
  importance weights"; the reference forward passes the attention each row receives at the
  block before l, see `depth/calibration/fusion_reference.py`).
* **kept slot**: the group's last row. Its position (and its KV slot) is the one the
  super-token runs at from layer l on; the other members are recorded as written up to l.
* **attention similarity** (2.3, optional): the paper's composite condition is
  ``L2 and (Adj or attn_sim > tau_attn)``: attention similarity is an *alternative* to
  adjacency that admits non-adjacent pairs. Only adjacent runs can share a KV slot range here,
  so non-adjacent fusion is not offered; with ``tau_attn`` set, the similarity is used as an
  additional gate on adjacent pairs (stricter than the paper, never looser). attn_sim(t, u) is
  the mean over layers (those run before l) and heads of cos(q_t, k_u)
  (`adjacent_attention_similarity`).
* **exemptions** (2.3 "Granularity Controls", "forced full-processing flags"): special tokens,
  configured anchor strings ("Question:", "Answer:"; every occurrence of their token sequence),
  rare tokens (a frequency table: fewer than ``min_count`` occurrences in the calibration
  text), and whatever the caller adds (rows whose logits are sampled, halted rows: D.6 forbids
  fusing a halted token). An exempt row never joins a group.
* **repeats** (not in the paper, off by default): ``split_repeats`` forbids a pair whose two
  rows hold the same token id. On SmolLM2 the L2 rule's nearest pairs are runs of one repeated
  token (newlines, non-breaking spaces), and merging them removes the count that the model
  copies into the continuation (docs/token-fusion.md).

`fusion_groups` returns the groups with at least two rows; `apply_fusion` builds the
super-tokens and the rows that keep running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

WEIGHTINGS = ("uniform", "score")


@dataclass(frozen=True)
class FusionRule:
    """The decision's parameters at one fusion layer."""

    tau_fuse: float
    tau_attn: float | None = None
    weighting: str = "uniform"
    max_group: int | None = None
    split_repeats: bool = False

    def __post_init__(self) -> None:
        if not self.tau_fuse >= 0.0:
            raise ValueError(f"tau_fuse must be >= 0, got {self.tau_fuse}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.max_group is not None and self.max_group < 2:
            raise ValueError(f"max_group must be >= 2 (or None), got {self.max_group}")


@dataclass
class FusionGroups:
    """Groups of adjacent rows to merge; rows ``starts[g] .. ends[g]`` (inclusive) form group g,
    ``ends[g]`` keeps the super-token. ``weights`` [T]: each row's share of its group's
    super-token (sums to 1 over a group; 0 outside groups)."""

    starts: torch.Tensor  # [G] int64
    ends: torch.Tensor  # [G] int64
    weights: torch.Tensor  # [T] float32
    distance: torch.Tensor  # [T-1] float32: ||h_i - h_{i+1}||_2, for plots and calibration

    @property
    def num_groups(self) -> int:
        return int(self.starts.numel())

    def members(self, g: int) -> torch.Tensor:
        return torch.arange(int(self.starts[g]), int(self.ends[g]) + 1)

    @property
    def removed(self) -> int:
        """Rows that stop at this layer (group members other than the kept one)."""
        return int((self.ends - self.starts).sum())

    def kept_rows(self, num_rows: int) -> torch.Tensor:
        """[T - removed] rows that keep running, in order (group ends and ungrouped rows)."""
        keep = torch.ones(num_rows, dtype=torch.bool)
        for s, e in zip(self.starts.tolist(), self.ends.tolist(), strict=True):
            keep[s:e] = False
        return torch.nonzero(keep).squeeze(1)


def adjacent_distance(hidden: torch.Tensor) -> torch.Tensor:
    """[T-1] ||h_i - h_{i+1}||_2 in float32."""
    h = hidden.float()
    return (h[1:] - h[:-1]).norm(dim=-1)


def adjacent_attention_similarity(
    queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor]
) -> torch.Tensor:
    """[T-1] mean over layers and query heads of cos(q_{i+1}, k_i) (the paper's q_t . k_u with
    t the later token). ``queries[j]`` [T, H, hd], ``keys[j]`` [T, Hkv, hd] (grouped-query
    attention: query head h reads key head h // (H / Hkv))."""
    if not queries or len(queries) != len(keys):
        raise ValueError("need the same number (>= 1) of query and key layers")
    total = None
    for q, k in zip(queries, keys, strict=True):
        rep = q.shape[1] // k.shape[1]
        kk = k.float().repeat_interleave(rep, dim=1)
        cos = torch.nn.functional.cosine_similarity(q[1:].float(), kk[:-1], dim=-1, eps=1e-12)
        total = cos.mean(-1) if total is None else total + cos.mean(-1)
    return total / len(queries)


def anchor_sequences(
    encode: Callable[[str], list[int]], anchors: Iterable[str]
) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences of each anchor string, as written and after a space (a BPE tokenizer
    spells "Answer:" differently at the start of a line and inside one)."""
    out: set[tuple[int, ...]] = set()
    for a in anchors:
        if not a:
            raise ValueError("an anchor string is empty")
        for s in (a, " " + a):
            ids = tuple(int(i) for i in encode(s))
            if ids:
                out.add(ids)
    return tuple(sorted(out))


def exemption_mask(
    token_ids: torch.Tensor,
    special_ids: Iterable[int] = (),
    anchors: Sequence[Sequence[int]] = (),
    token_counts: torch.Tensor | None = None,
    min_count: int = 0,
) -> torch.Tensor:
    """[T] bool: rows that never fuse. ``token_counts`` [V]: occurrences of each token id in
    the calibration text; ids seen fewer than ``min_count`` times are rare."""
    ids = token_ids.long()
    t = ids.numel()
    exempt = torch.isin(ids, torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.long))
    for seq in anchors:
        n = len(seq)
        if n == 0 or n > t:
            continue
        pat = torch.tensor(list(seq), dtype=torch.long)
        hits = (ids.unfold(0, n, 1) == pat).all(dim=1)  # [T-n+1] match starting at i
        for j in range(n):
            exempt[j : j + hits.numel()] |= hits
    if token_counts is not None and min_count > 0:
        counts = token_counts.long()
        inside = ids < counts.numel()
        rare = torch.ones(t, dtype=torch.bool)
        rare[inside] = counts[ids[inside]] < min_count
        exempt |= rare
    return exempt


def fusion_groups(
    hidden: torch.Tensor,
    rule: FusionRule,
    exempt: torch.Tensor | None = None,
    attn_sim: torch.Tensor | None = None,
    score: torch.Tensor | None = None,
    mass: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    cut: torch.Tensor | None = None,
) -> FusionGroups:
    """Groups of adjacent rows of ``hidden`` [T, H] to merge at this layer (see module doc).

    ``exempt`` [T] bool, ``attn_sim`` [T-1] (needed when ``rule.tau_attn`` is set), ``score``
    [T] > 0 (needed for ``weighting="score"``), ``mass`` [T] (tokens each row stands for),
    ``token_ids`` [T] (each row's token, needed for ``split_repeats``), ``cut`` [T-1] bool
    (pairs that may not fuse whatever their distance: the engine cuts groups at KV-block and
    request boundaries)."""
    t = hidden.shape[0]
    dist = adjacent_distance(hidden) if t > 1 else hidden.new_zeros(0, dtype=torch.float32)
    pair = dist < rule.tau_fuse
    if exempt is not None:
        if exempt.shape != (t,):
            raise ValueError(f"exempt must be [{t}], got {tuple(exempt.shape)}")
        ex = exempt.to(torch.bool).cpu()
        pair &= ~ex[1:] & ~ex[:-1]
    if rule.tau_attn is not None:
        if attn_sim is None or attn_sim.shape != (max(t - 1, 0),):
            raise ValueError("tau_attn is set: attn_sim [T-1] is required")
        pair &= attn_sim.float().cpu() > rule.tau_attn
    if rule.split_repeats:
        if token_ids is None or token_ids.shape != (t,):
            raise ValueError("split_repeats is set: token_ids [T] is required")
        ids = token_ids.cpu()
        pair &= ids[1:] != ids[:-1]
    if cut is not None:
        if cut.shape != (max(t - 1, 0),):
            raise ValueError(f"cut must be [{max(t - 1, 0)}], got {tuple(cut.shape)}")
        pair &= ~cut.to(torch.bool).cpu()
    starts, ends = _runs(pair.cpu().tolist(), rule.max_group)
    weights = torch.zeros(t, dtype=torch.float32)
    if rule.weighting == "score":
        if score is None or score.shape != (t,):
            raise ValueError('weighting="score" needs score [T]')
        alpha = score.float().cpu().clamp_min(1e-12)
    else:
        if mass is not None and mass.shape != (t,):
            raise ValueError(f"mass must be [{t}] (one per row), got {tuple(mass.shape)}")
        alpha = torch.ones(t) if mass is None else mass.float().cpu()
    for s, e in zip(starts, ends, strict=True):
        a = alpha[s : e + 1]
        weights[s : e + 1] = a / a.sum()
    return FusionGroups(
        starts=torch.tensor(starts, dtype=torch.long),
        ends=torch.tensor(ends, dtype=torch.long),
        weights=weights,
        distance=dist.cpu(),
    )


def _runs(pair: list[bool], max_group: int | None) -> tuple[list[int], list[int]]:
    """Maximal runs of consecutive True pairs -> (first row, last row) of each group."""
    starts: list[int] = []
    ends: list[int] = []
    i, n = 0, len(pair)
    while i < n:
        if not pair[i]:
            i += 1
            continue
        j = i
        while j < n and pair[j]:
            j += 1
        # rows i .. j form one run; cut it into pieces of <= max_group rows
        first, last = i, j
        size = max_group or (last - first + 1)
        while last - first + 1 >= 2:
            end = min(first + size - 1, last)
            starts.append(first)
            ends.append(end)
            first = end + 1
        i = j + 1
    return starts, ends


def apply_fusion(hidden: torch.Tensor, groups: FusionGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept rows [T'], their hidden states [T', H]): each group's last row carries the
    weighted mean of its members; other rows are unchanged."""
    out = hidden.clone()
    w = groups.weights.to(hidden.device, torch.float32)
    for g in range(groups.num_groups):
        s, e = int(groups.starts[g]), int(groups.ends[g])
        mix = (hidden[s : e + 1].float() * w[s : e + 1, None]).sum(0)
        out[e] = mix.to(hidden.dtype)
    kept = groups.kept_rows(hidden.shape[0]).to(hidden.device)
    return kept, out[kept]
