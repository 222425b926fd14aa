"""The ``depth`` section: exit signals, floors, KV strategies, the exit river and token fusion."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vllm_adaptive.config.base import (
    _Strict,
)


class FloorConfig(_Strict):
    """EMAD floor schedule: depth >= F_t, a linear taper from all layers to ``min_layers``
    over the first ``tokens`` generated tokens (snapped up to a layer with a readout)."""

    tokens: int = Field(16, ge=0)
    min_layers: int | None = Field(None, ge=1)
    """Default: the profile's shallowest probe layer (the floor only protects the start)."""


class RefreshConfig(_Strict):
    """EMAD windowed refresh: every ``every`` generated tokens the depth cap rises by
    ``raise_layers`` (snapped up to a readout layer). Earlier tokens that stopped shallower
    get the missing K/V by state propagation from their stored exit states."""

    every: int = Field(ge=1)
    raise_layers: int = Field(ge=1)


SignalName = Literal["emad", "quicksilver", "river", "arla"]


class QuickSilverSignalConfig(_Strict):
    """QuickSilver dynamic token halting: drift and entropy both under their thresholds
    (``vllm_adaptive/depth/policies/quicksilver.py``)."""

    tau_drift: float | None = Field(None, gt=0.0)
    """||h_l - h_{l-1}||_2 threshold; default the profile's (``calibrate --signal quicksilver``)."""
    tau_entropy: float | None = Field(None, gt=0.0)
    """Entropy threshold in nats; default the profile's."""
    entropy: Literal["proxy", "exact"] | None = None
    """The readout entropy: "proxy" (the profile's EMAD proxy, cheap) or "exact" (the whole LM
    head per check). Default: the one the profile's thresholds were calibrated for."""
    min_halting_depth: int = Field(5, ge=0)
    """l_min: no token halts at a layer l <= l_min (appendix B.5: 5)."""
    max_halting_layer: int | None = Field(None, ge=1)
    """Upper end of the halting window (appendix G.2: 24 of 30); null: no upper end."""
    protect_special_tokens: bool = True
    """The tokenizer's special tokens are processed fully (never halt)."""
    protected_token_ids: tuple[int, ...] = Field((), strict=False)
    """More token ids that never halt (the halting blocklist)."""
    forced_halt_token_ids: tuple[int, ...] = Field((), strict=False)
    """Token ids that halt at the first layer of the window, whatever drift and entropy say."""

    @model_validator(mode="after")
    def _check(self) -> QuickSilverSignalConfig:
        if self.max_halting_layer is not None and self.max_halting_layer <= self.min_halting_depth:
            raise ValueError("max_halting_layer must be above min_halting_depth")
        both = sorted(set(self.protected_token_ids) & set(self.forced_halt_token_ids))
        if both:
            raise ValueError(
                f"token ids {both} are in both protected_token_ids and forced_halt_token_ids"
            )
        if any(i < 0 for i in (*self.protected_token_ids, *self.forced_halt_token_ids)):
            raise ValueError("token ids must be >= 0")
        return self


class RiverSignalConfig(_Strict):
    """River-LLM state-transition similarity: exit when cos(h_{l-1}, h_l) > tau
    (``vllm_adaptive/depth/policies/river.py``)."""

    tau: float | None = Field(None, ge=-1.0, le=1.0)
    """Default: the profile's (``calibrate --signal river``); the paper uses 0.5 to 0.9."""
    batch_min: bool = False
    """The paper's eq. 1: all candidate rows exit together when the batch minimum passes."""
    entry_layer: int = Field(1, ge=1)
    """L_s: the first layer a token may exit at."""


class ArlaSignalConfig(_Strict):
    """M2R2's ARLA router on the accelerated residual stream (``policies/arla.py``; the stream is
    computed by ``depth/accelerated.py``): exit at gate E_j when the router's exit probability
    is above ``threshold``. Checked at engine start: an exit-mode adapter made for this model
    whose gates are probe layers of the profile."""

    adapter: str = Field(min_length=1)
    """Directory written by ``vllm-adaptive train m2r2 --mode exit``."""
    threshold: float = Field(0.5, gt=0.0, lt=1.0)
    """Exit when P(exit) > threshold (the router was trained with BCE on "the gate's
    accelerated argmax is the full model's greedy token")."""


class SignalConfig(_Strict):
    """Which exit signal decides (``policy``), or several combined (``combine``)."""

    policy: tuple[SignalName, ...] = Field(("emad",), strict=False)
    """"emad" (default), "quicksilver", "river", "arla" (alone), or a list of the first three."""
    combine: Literal["all", "any"] = "all"
    """With several signals: "all" must agree, or "any" suffices."""
    quicksilver: QuickSilverSignalConfig = QuickSilverSignalConfig()
    river: RiverSignalConfig = RiverSignalConfig()
    arla: ArlaSignalConfig | None = None
    """Settings of "arla" (required with it: ``{"adapter": DIR}``)."""

    @field_validator("policy", mode="before")
    @classmethod
    def _one_name(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> SignalConfig:
        if not self.policy:
            raise ValueError('"policy" names no signal')
        if len(set(self.policy)) != len(self.policy):
            raise ValueError(f"policy lists a signal twice: {list(self.policy)}")
        if "combine" in self.model_fields_set and len(self.policy) < 2:
            raise ValueError('"combine" needs at least two signals in "policy"')
        for name in ("quicksilver", "river", "arla"):
            if name in self.model_fields_set and name not in self.policy:
                raise ValueError(f'"{name}" settings given but "policy" does not use {name}')
        if "arla" in self.policy:
            if len(self.policy) > 1:
                # its exits emit the accelerated stream's state, the others' the calibrated
                # readout of the slow one; a combination would have to say whose exit it was
                raise ValueError('"arla" cannot be combined with other signals yet')
            if self.arla is None:
                raise ValueError(
                    'policy "arla" needs "arla": {"adapter": DIR} '
                    "(vllm-adaptive train m2r2 --mode exit --out DIR)"
                )
        return self


KvStrategy = Literal["monotone", "mask", "propagate", "recompute", "river"]


class ExitRiverConfig(_Strict):
    """River-LLM's Exit River (``vllm_adaptive/depth/exit_river.py``): a token that exits keeps
    going through 4-bit weight-only copies of the remaining layers, which write its K/V into the
    same cache slots the backbone would have written."""

    entry_layer: int = Field(1, ge=1)
    """L_s: the river holds copies of layers L_s+1 .. L (a token may exit after L_s blocks)."""
    precision: Literal["int4", "int8", "w8a8", "w8a16", "fp16"] = "int4"
    """The river's weights: int4 (River-LLM), int8 weight-only, W8A8 (int8 weights and
    per-token int8 activations: the fast path for float32 activations), W8A16 (the same int8
    weights, activations as two int8 planes: weight-only int8 quality on the int8 GEMM) or
    fp16."""
    group_size: int = Field(32, ge=8)
    """int4: quantization group along the input dimension."""
    symmetric: bool = False
    """False: asymmetric min/max (the Q4_1 grid the default model's weights sit on, so nearly
    lossless there); True: symmetric absmax, which is not on that grid."""
    prefill: Literal["backbone", "river"] = "backbone"
    """How prompt tokens run past the entry layer: the full-precision backbone, or the river
    (River-LLM's sequence-level exit for prefill; with offloading, prefills then never touch
    the offloaded backbone layers)."""
    offload_backbone: bool = False
    """River-LLM's backbone offloading: the backbone's linear weights of the river's layers
    leave memory (a memory-mapped file on CPU, host memory on a GPU) until a token needs them."""


class FusionConfig(_Strict):
    """Contextual token fusion at prefill (QuickSilver 2.3; docs/token-fusion.md): adjacent
    prompt rows whose residual streams are within the profile's ``tau_fuse`` merge at its
    fusion layers (``depth/fusion_runtime.py``). Engine-wide: the prefix cache shares fused
    blocks between requests, so there is no per-request fusion setting."""

    profile: str = Field(min_length=1)
    """Profile directory written by ``vllm-adaptive calibrate --fusion``."""


class DepthConfig(_Strict):
    """EMAD adaptive depth: calibrated early exit with a KV-consistent monotone schedule."""

    profile: str = Field(min_length=1)
    """Profile directory written by ``vllm-adaptive calibrate``."""
    budget: float | None = Field(None, gt=0.0, le=1.0)
    """Mean cost fraction (the profile's kind: layers or FLOPs); 1.0 means no exits.
    Default: the budget the profile was calibrated for."""
    floor: FloorConfig | None = FloorConfig()
    """null turns the floor off."""
    refresh: RefreshConfig | None = None
    telemetry_path: str | None = None
    """Append one JSON line per finished request (mean depth, exit histogram, depths)."""
    signal: SignalConfig = SignalConfig()
    """The exit signal; default EMAD. ``budget`` turns into EMAD's thresholds; QuickSilver and
    River use their own (the profile's or the configured ones)."""
    kv_strategy: KvStrategy = "monotone"
    """What the layers a token skipped hold (docs/kv-strategies.md): "monotone" (depth never
    rises, nothing is missing), "mask" (skipped layers write nothing and attention leaves those
    slots out), "propagate" (K/V from the exit state, CALM), "recompute" (EE-LLM's batching
    recompute: the next step resumes the exited token through its skipped layers) or "river"
    (River-LLM's Exit River)."""
    river: ExitRiverConfig | None = None
    """Settings of the "river" KV strategy (default ``{}``)."""
    fusion: FusionConfig | None = None
    """Contextual token fusion at prefill; needs kv_strategy "mask"."""

    @model_validator(mode="after")
    def _check_strategy(self) -> DepthConfig:
        if self.refresh is not None and self.kv_strategy != "monotone":
            raise ValueError(
                f'"refresh" raises a monotone depth cap; kv_strategy "{self.kv_strategy}" has no '
                "cap to raise (remove refresh or use kv_strategy monotone)"
            )
        if self.river is not None and self.kv_strategy != "river":
            raise ValueError('"river" settings given but kv_strategy is not "river"')
        if self.fusion is not None:
            if self.kv_strategy != "mask":
                raise ValueError(
                    '"fusion" needs kv_strategy "mask": fused tokens keep K/V only below the '
                    "fusion layer and later queries must leave them out there "
                    f'("{self.kv_strategy}" would read or cap on the missing layers)'
                )
        return self

    @property
    def river_settings(self) -> ExitRiverConfig:
        return self.river if self.river is not None else ExitRiverConfig()
