"""The adaptive config: what `--additional-config '{"adaptive": {...}}'` may hold.

The schema is strict on purpose: unknown keys, wrong types and out-of-range
values are errors that name the key, raised when the engine starts. Each
mechanism that later joins the project adds one sub-model here; `mode: "off"`
(the default) runs the adaptive model class with every mechanism disabled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from vllm_adaptive.gears import (
    GEARBX_GEARS,
    GEARBX_GEARS_AMX,
    GEARBX_GEARS_F32,
    QUICKSILVER_GEARS,
    Precision,
    precision_rank,
)
from vllm_adaptive.strict_model import StrictModel

#: Key of the adaptive section inside vLLM's `additional_config`.
ADDITIONAL_CONFIG_KEY = "adaptive"


class AdaptiveConfigError(ValueError):
    """A bad adaptive config; the message names the offending key."""


_Strict = StrictModel

#: The managed linears of a decoder layer, by the names the model interface gives them
#: (``models/interface.py``; vLLM's fused module names), and the LM head.
MANAGED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
LAYER_MODULES = MANAGED_MODULES[:4]
GearMap = tuple[Precision, Precision, Precision]


def _check_gear_order(gears: GearMap, where: str) -> None:
    ranks = [precision_rank(g) for g in gears]
    if ranks != sorted(ranks):
        raise ValueError(f"{where}: gears go from the cheapest (low) to the most precise (high)")


# -- the gear policies' settings (their mechanisms: precision/policies/) --

VOCAB_REF = 32768


class GearbxSettings(_Strict):
    """GEARBX monitor settings; defaults are the paper's (PyTorch backend)."""

    window: int = Field(5, ge=1, le=1024)
    theta_low: float = Field(1.8, gt=0)
    theta_high: float = Field(3.5, gt=0)
    hysteresis: float = Field(0.1, ge=0)
    min_gear_duration: int = Field(4, ge=1)
    vocab_ref: int = Field(VOCAB_REF, ge=2)
    catastrophic_fraction: float = Field(0.9, gt=0, le=1)
    lookahead: int = Field(2, ge=0)
    calibration: Literal["first_prefill", "none"] = "first_prefill"
    """"first_prefill": thresholds from the entropies of the first prompt the engine sees (the
    paper's "calibrate if uncalibrated"); "none": the vocabulary-scaled defaults."""
    calibration_positions: int = Field(256, ge=5)
    p_low: float = Field(0.30, gt=0, lt=1)
    p_high: float = Field(0.60, gt=0, lt=1)
    min_band: float = Field(0.2, ge=0)
    cap_low: float | None = Field(0.06, gt=0)
    cap_high: float | None = Field(0.12, gt=0)
    cold_start: bool = True
    prefill: Literal["high", "cold_start"] = "high"
    """Level of the prompt's prefill, which also makes the first token. "high": the high gear
    (full precision with the default gears), so the first token is the model's own; the
    cold-start gear applies from the first decode step. "cold_start": the classifier's gear, as
    the paper's generation loop (listing 2) shifts before prefilling."""


class QuickSilverSettings(_Strict):
    tau_low: float = Field(0.3, ge=0, le=1)
    tau_high: float = Field(0.6, ge=0, le=1)
    history: int = Field(32, ge=2, le=4096)
    min_history: int = Field(4, ge=2)


class LayerGroup(_Strict):
    """Layers ``[start, end)`` whose linears map the gear levels to their own precisions."""

    layers: tuple[int, int] = Field(strict=False)  # JSON lists
    gears: GearMap = Field(strict=False)

    @model_validator(mode="after")
    def _check(self) -> LayerGroup:
        start, end = self.layers
        if not 0 <= start < end:
            raise ValueError(f"layers must be [start, end) with 0 <= start < end: {self.layers}")
        _check_gear_order(self.gears, "gears")
        return self


class SmoothingConfig(_Strict):
    """SmoothQuant for the ``w8a8`` precision: ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)``."""

    profile: str
    """Directory written by ``vllm-adaptive calibrate --smoothing`` for this model."""
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    """Migration strength (SmoothQuant section 4; 0.5 for most models)."""


class PrecisionConfig(_Strict):
    """Entropy-routed precision (GEARBX, QuickSilver AMQ) or one fixed packed gear."""

    policy: Literal["fixed", "gearbx", "quicksilver"]
    gear: Precision | None = None
    """policy "fixed": the precision every managed linear runs."""
    gears: GearMap | None = Field(None, strict=False)
    """(low, mid, high) precisions; default for gearbx (int4, int8, full) with bf16 / fp16
    activations and (w8a8, fp16, fp16) with float32 ones (the fast kernels for each), and
    (int2, int4, int8) for quicksilver."""
    routing: Literal["step", "token"] | None = None
    """"step": one gear per step for the whole batch (the most demanding request decides);
    "token": each token runs its request's gear, tokens grouped by gear. Default: step for
    gearbx, token for quicksilver."""
    modules: tuple[Literal["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"], ...] = (
        Field(MANAGED_MODULES, strict=False, min_length=1)
    )
    """Which linears are geared; ``lm_head`` is the output projection (a copy of the weights
    when they are tied to the embedding, which keeps its float weight)."""
    head_gears: GearMap | None = Field(None, strict=False)
    """(low, mid, high) precisions of the LM head. Default on float32 engines: ``fp16`` at every
    level whose layer precision is not ``full`` (an int4 / int8 head costs agreement that fp16
    keeps), ``full`` where it is; on bf16 / fp16 engines the head's own weight at every level
    (fp16 weights compute in float32 there: as many bytes as bf16, and 4x slower than vLLM's
    bf16 GEMM at 8 tokens on an AMX Xeon)."""
    smoothing: SmoothingConfig | None = None
    """SmoothQuant smoothing of the ``w8a8`` tiers, from a profile made by
    ``vllm-adaptive calibrate --smoothing``."""
    layer_groups: tuple[LayerGroup, ...] = Field((), strict=False)
    """Per layer-group gear maps; layers in no group use ``gears``. quicksilver with no groups
    runs the first half of the layers at its high gear (the paper quantizes from mid-network)."""
    tiers: Literal["independent", "matryoshka"] | None = None
    """independent: each precision quantized from the float weight; matryoshka: one int8 tensor,
    lower tiers are its top bits. Default: independent for gearbx/fixed, matryoshka for
    quicksilver."""
    group_size: int | None = Field(32, ge=32)
    """Group size of int4/int2 scales (and of the Matryoshka int8 base); null: per row."""
    symmetric: bool = True
    """int4/int2 independent tiers: symmetric absmax (GEARBX) or asymmetric min/max."""
    offload_inactive: bool = False
    """Release tiers the step does not use (and the policy does not pre-warm); restore on use."""
    telemetry_path: str | None = None
    """Append one JSON line per finished request (gear counts, entropy and gear trace)."""
    gearbx: GearbxSettings = GearbxSettings()
    quicksilver: QuickSilverSettings = QuickSilverSettings()

    @model_validator(mode="after")
    def _check(self) -> PrecisionConfig:
        if self.policy == "fixed":
            if self.gear is None:
                raise ValueError(
                    'policy "fixed" needs "gear" (full, fp16, w8a16, int8, w8a8, int4 or int2)'
                )
            if self.gears is not None or self.layer_groups:
                raise ValueError('policy "fixed" takes "gear", not "gears"/"layer_groups"')
        elif self.gear is not None:
            raise ValueError(f'"gear" is for policy "fixed"; policy {self.policy!r} uses "gears"')
        if self.gears is not None:
            _check_gear_order(self.gears, "gears")
        if self.head_gears is not None:
            _check_gear_order(self.head_gears, "head_gears")
            if "lm_head" not in self.modules:
                raise ValueError('"head_gears" needs "lm_head" in "modules"')
        if (
            self.smoothing is not None
            and (self.gears is not None or self.policy != "gearbx")
            and (
                "w8a8"
                not in {
                    *self.level_gears,
                    *(p for g in self.layer_groups for p in g.gears),
                    *(self.head_gears or ()),
                }
            )
        ):
            raise ValueError('"smoothing" applies to the w8a8 precision, which no gear uses')
        if self.group_size is not None and self.group_size not in (32, 64, 128, 256):
            raise ValueError("group_size must be one of 32, 64, 128, 256 or null (per row)")
        spans = sorted(g.layers for g in self.layer_groups)
        for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
            if s1 < e0:
                raise ValueError(f"layer_groups overlap: {spans}")
        if self.gearbx.theta_low >= self.gearbx.theta_high:
            raise ValueError("gearbx.theta_low must be below gearbx.theta_high")
        if self.quicksilver.tau_low >= self.quicksilver.tau_high:
            raise ValueError("quicksilver.tau_low must be below quicksilver.tau_high")
        return self

    def for_dtype(self, dtype_name: str, amx_int8: bool = False) -> PrecisionConfig:
        """This config with the dtype- and machine-dependent defaults filled in (``dtype_name``:
        the model's activation dtype, e.g. "float32"; ``amx_int8``: the CPU runs vLLM's AMX
        int8 GEMM, :func:`vllm_adaptive.kernels.float_linear.amx_int8_available`); errors name
        the key."""
        update: dict[str, Any] = {}
        half = dtype_name != "float32"
        if self.gears is None and self.policy == "gearbx":
            if not half:
                update["gears"] = GEARBX_GEARS_F32
            elif amx_int8:
                update["gears"] = GEARBX_GEARS_AMX
        if half and self.head_gears is None and "lm_head" in self.modules:
            if self.modules == ("lm_head",):
                raise ValueError(
                    f'"modules" names only lm_head, which a {dtype_name} engine runs at its own '
                    'weight by default: name its "head_gears"'
                )
            update["head_gears"] = ("full", "full", "full")
        resolved = self.model_copy(update=update) if update else self
        if resolved.smoothing is not None and "w8a8" not in {
            *resolved.level_gears,
            *(p for g in resolved.layer_groups for p in g.gears),
            *(resolved.head_gears or ()),
        }:
            raise ValueError(
                f'"smoothing" applies to the w8a8 precision; the gears of this {dtype_name} '
                f"engine are {list(resolved.level_gears)}"
            )
        return resolved

    @property
    def level_gears(self) -> GearMap:
        if self.policy == "fixed":
            return (self.gear, self.gear, self.gear)
        if self.gears is not None:
            return self.gears
        return GEARBX_GEARS if self.policy == "gearbx" else QUICKSILVER_GEARS

    @property
    def effective_routing(self) -> str:
        if self.routing is not None:
            return self.routing
        return "token" if self.policy == "quicksilver" else "step"

    @property
    def effective_tiers(self) -> str:
        if self.tiers is not None:
            return self.tiers
        return "matryoshka" if self.policy == "quicksilver" else "independent"

    @property
    def head_map(self) -> GearMap | None:
        """The (low, mid, high) precisions of the LM head, None if it is not geared."""
        if "lm_head" not in self.modules:
            return None
        if self.head_gears is not None:
            # a head at its own weight at every level is not geared at all
            return None if set(self.head_gears) == {"full"} else self.head_gears
        return tuple("full" if g == "full" else "fp16" for g in self.level_gears)  # type: ignore[return-value]

    def layer_map(self, layer: int, num_layers: int) -> GearMap:
        """The (low, mid, high) precisions of one decoder layer."""
        for g in self.layer_groups:
            if g.layers[0] <= layer < g.layers[1]:
                return g.gears
        if self.policy == "quicksilver" and not self.layer_groups and layer < num_layers // 2:
            high = self.level_gears[2]
            return (high, high, high)
        return self.level_gears


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


#: The proposer class vLLM's ``speculative_config`` names (``method: "custom_class"``).
SELF_SPECULATIVE_PROPOSER = "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer"


class PromptLookupConfig(_Strict):
    """Prompt lookup before the self-draft (a hybrid drafter): a request whose last ``min`` ..
    ``max`` tokens occurred earlier in its own context takes the tokens that followed them
    (vLLM's n-gram proposer); only the others run the draft model."""

    min: int = Field(2, ge=1)
    max: int = Field(5, ge=1)

    @model_validator(mode="after")
    def _check(self) -> PromptLookupConfig:
        if self.min > self.max:
            raise ValueError(f"prompt_lookup: min {self.min} > max {self.max}")
        return self


class SpeculativeConfig(_Strict):
    """Self-speculative decoding (docs/speculative.md): the target model drafts its own tokens
    and vLLM's rejection sampler verifies them with the full model, so output is unchanged.

    Needs vLLM's ``speculative_config`` too: ``{"method": "custom_class", "model":
    "vllm_adaptive.speculative.proposer.SelfSpeculativeProposer", "num_speculative_tokens": k}``.
    """

    draft: Literal["early", "lowbit", "m2r2"]
    """"early": the first ``layers`` blocks, then the final norm and LM head (LayerSkip, DEED);
    "m2r2": the same blocks plus M2R2's trained accelerator adapters (``adapter``);
    "lowbit": every block with packed low-precision copies of the model's own weights."""
    layers: int | None = Field(None, ge=1)
    """Draft depth for "early" and "m2r2" (default 4; "m2r2" takes the adapter's)."""
    precision: Literal["int8", "int4", "w8a8", "fp16"] | None = None
    """"lowbit": the weight precision of the draft (default int4). int8 is per-row symmetric
    weight-only; w8a8 adds per-token int8 activations (the fast path for float32 engines)."""
    group_size: int = Field(32, ge=8)
    """"lowbit" int4: quantization group along the input dimension."""
    symmetric: bool = False
    """"lowbit" int4: False is asymmetric min/max (on the default model's Q4_1 grid, so close
    to the model itself: a control), True symmetric absmax (off that grid)."""
    head: Literal["full", "fp16", "w8a8", "int8", "int4"] | None = None
    """Precision of the draft's LM head; default the draft precision for "lowbit", else full."""
    adapter: str | None = None
    """"m2r2": directory written by ``vllm-adaptive train m2r2 --mode spec``."""
    prompt_lookup: PromptLookupConfig | None = None
    """Try prompt lookup first for each request (drafts from its own context); the draft
    model runs only for requests without a match. Off by default."""

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.draft == "lowbit":
            if self.layers is not None:
                raise ValueError('"layers": a "lowbit" draft runs every layer (remove layers)')
        elif self.precision is not None:
            raise ValueError(f'"precision" is for draft "lowbit", not "{self.draft}"')
        if self.draft == "m2r2" and not self.adapter:
            raise ValueError('draft "m2r2" needs "adapter" (vllm-adaptive train m2r2 --out DIR)')
        if self.draft != "m2r2" and self.adapter is not None:
            raise ValueError(f'"adapter" is for draft "m2r2", not "{self.draft}"')
        return self

    @property
    def draft_precision(self) -> str:
        return self.precision or "int4"

    @property
    def head_precision(self) -> str:
        if self.head is not None:
            return self.head
        return self.draft_precision if self.draft == "lowbit" else "full"


class HybridConfig(_Strict):
    """Hybrid drafting with vLLM's own learned drafter (docs/speculative.md): per request and
    step, drafts from the request's own text where it repeats itself (a suffix tree or n-gram
    lookup, vLLM's proposers), the learned drafter's (EAGLE / EAGLE-3, vLLM's
    ``speculative_config``) otherwise. The learned drafter runs every step either way: its KV
    cache must cover every accepted token.

    vLLM's ``num_speculative_tokens`` is the longest lookup draft; ``learned_tokens`` how many
    positions the learned drafter drafts (each costs a pass of the head)."""

    lookup: Literal["suffix", "ngram"] = "suffix"
    """"suffix": vLLM's suffix decoding (Arctic Inference's trees; its ``suffix_decoding_*``
    settings are read from ``speculative_config``); "ngram": vLLM's prompt lookup."""
    learned_tokens: int = Field(1, ge=0)
    """Draft positions of the learned drafter (at most vLLM's ``num_speculative_tokens``)."""
    min_lookup_tokens: int = Field(1, ge=1)
    """A lookup draft shorter than this gives way to the learned drafter's."""
    prompt_lookup: PromptLookupConfig | None = None
    """"ngram": the match lengths (default min 2, max 5)."""

    @model_validator(mode="after")
    def _check(self) -> HybridConfig:
        if self.lookup != "ngram" and self.prompt_lookup is not None:
            raise ValueError('"prompt_lookup" sets lookup "ngram"\'s match lengths')
        return self

    @property
    def ngram(self) -> PromptLookupConfig:
        return self.prompt_lookup if self.prompt_lookup is not None else PromptLookupConfig()


class MoeConfig(_Strict):
    """Expert offloading for a MoEfied model (docs/moe.md, issue 19): every expert's weights in
    a slow tier (a memory-mapped file whose pages are dropped on eviction), a fast tier of at
    most ``capacity`` of them, and a predictor that prefetches the next layers' experts.
    Without this section a MoEfied model keeps every expert resident (the reference)."""

    predictor: Literal["none", "pregate", "m2r2"] = "none"
    """"none": on-demand loads only; "pregate": layer j's router on layer l's MLP input
    (Pre-gated MoE) names the experts of layers l+1..l+lookahead ahead of time; "m2r2": layer
    j's router on trained adapters' estimate of layer j's residual (``m2r2_adapters``)."""
    m2r2_adapters: str | None = None
    """Directory of the "m2r2" predictor's adapters (`vllm-adaptive moe train-m2r2`); checked
    against the model, its top-k and the lookahead at engine start."""
    lookahead: int = Field(1, ge=1)
    """How many layers ahead the predictor prefetches (d)."""
    capacity: float | None = Field(None, gt=0.0, le=1.0)
    """Fast-tier size as a fraction of all experts (default 1.0: every expert fits)."""
    eviction: Literal["cyclic", "lru"] = "cyclic"
    """Fast-tier eviction: "cyclic" (the expert whose layer comes back last in the fixed layer
    order goes first: Belady's choice when a step's experts outgrow the tier), or "lru". Cyclic
    is the default because layers run in a cycle: LRU then evicts the layer needed next, and
    a predictor's prefetches made it reload every expert each step (docs/moe-runtime.md,
    "Eviction policy")."""
    fast_tier_bytes: int | None = Field(None, ge=1)
    """Fast-tier size in bytes (instead of ``capacity``)."""
    slow_tier_dir: str | None = None
    """Directory of the slow-tier file (written at load, removed at exit); default: a new
    temporary directory. Put it on a real disk: a tmpfs has no page cache to drop."""

    @model_validator(mode="after")
    def _check(self) -> MoeConfig:
        if self.capacity is not None and self.fast_tier_bytes is not None:
            raise ValueError('give "capacity" (a fraction) or "fast_tier_bytes", not both')
        if self.predictor == "none" and "lookahead" in self.model_fields_set:
            raise ValueError('"lookahead" is for a predictor; predictor "none" prefetches nothing')
        if self.predictor == "m2r2" and not self.m2r2_adapters:
            raise ValueError(
                'predictor "m2r2" needs "m2r2_adapters": a directory written by '
                "`vllm-adaptive moe train-m2r2`"
            )
        if self.predictor != "m2r2" and self.m2r2_adapters is not None:
            raise ValueError('"m2r2_adapters" is only for predictor "m2r2"')
        return self


class AdaptiveConfig(_Strict):
    """Engine-wide adaptive settings (one per vLLM engine)."""

    mode: Literal["on", "off"] = "on"
    """"off": every configured mechanism is disabled and the adaptive model class produces
    exactly stock vLLM's output (a kill switch that keeps the rest of the config)."""
    precision: PrecisionConfig | None = None
    depth: DepthConfig | None = None
    speculative: SpeculativeConfig | None = None
    hybrid: HybridConfig | None = None
    moe: MoeConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> AdaptiveConfig:
        if self.hybrid is not None and self.speculative is not None:
            raise ValueError(
                '"hybrid" mixes lookup drafts into vLLM\'s own EAGLE drafter; "speculative" is '
                'the plugin\'s self-drafting proposer (it has its own "prompt_lookup"): use one'
            )
        if self.moe is not None and (
            self.precision is not None or self.depth is not None or self.speculative is not None
        ):
            raise ValueError(
                '"moe" cannot be combined with "precision", "depth" or "speculative" yet: '
                "those mechanisms manage the dense Llama MLP, which a MoEfied model replaces"
            )
        if (
            self.precision is not None
            and self.depth is not None
            and (self.precision.policy != "fixed" or self.precision.effective_routing != "step")
        ):
            raise ValueError(
                '"depth" combines only with a "fixed" precision (one gear for the whole step): '
                "entropy-routed gear plans are made per token for the whole step, and "
                "depth-peeling shrinks the batch inside the step"
            )
        if self.speculative is not None and (
            self.depth is not None
            or (self.precision is not None and self.precision.policy != "fixed")
        ):
            raise ValueError(
                '"speculative" cannot be combined with "depth" or with an entropy-routed '
                '"precision" policy: verification scores several tokens per request per step (the '
                'draft already runs low precision or few layers: see "speculative.draft"; a '
                'target at one fixed precision, e.g. {"policy": "fixed", "gear": "fp16"}, works)'
            )
        return self

    @property
    def any_mechanism_enabled(self) -> bool:
        return self.mode == "on" and (
            self.precision is not None
            or self.depth is not None
            or self.speculative is not None
            or self.moe is not None
        )

    @property
    def active_precision(self) -> PrecisionConfig | None:
        return self.precision if self.mode == "on" else None

    @property
    def active_depth(self) -> DepthConfig | None:
        return self.depth if self.mode == "on" else None

    @property
    def active_speculative(self) -> SpeculativeConfig | None:
        return self.speculative if self.mode == "on" else None

    @property
    def active_hybrid(self) -> HybridConfig | None:
        return self.hybrid if self.mode == "on" else None

    @property
    def active_moe(self) -> MoeConfig | None:
        return self.moe if self.mode == "on" else None


def format_validation_error(err: ValidationError, root: str) -> str:
    """One line per problem, each naming the full key path (e.g. `adaptive.mode`)."""
    lines = []
    for e in err.errors():
        path = ".".join([root, *(str(p) for p in e["loc"])])
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def parse_adaptive_config(value: Any, root: str = ADDITIONAL_CONFIG_KEY) -> AdaptiveConfig:
    """Validate an adaptive config given as a mapping or a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise AdaptiveConfigError(f"{root}: not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise AdaptiveConfigError(f"{root}: expected a JSON object, got {type(value).__name__}")
    try:
        return AdaptiveConfig.model_validate(dict(value))
    except ValidationError as e:
        raise AdaptiveConfigError(
            f"invalid adaptive config: {format_validation_error(e, root)}"
        ) from None


def load_config_arg(text: str) -> dict[str, Any]:
    """A CLI config argument: a JSON object, or the path of a file holding one."""
    stripped = text.strip()
    if not stripped.startswith("{") and Path(text).is_file():
        stripped = Path(text).read_text()
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as e:
        raise AdaptiveConfigError(
            f"config {text!r}: neither a JSON object nor a readable file ({e})"
        ) from e
    if not isinstance(value, dict):
        raise AdaptiveConfigError(f"config {text!r}: expected a JSON object")
    parse_adaptive_config(value)  # validate early, before any engine starts
    return value


def adaptive_config_from_vllm(vllm_config: Any) -> AdaptiveConfig | None:
    """The engine's adaptive config, or None when adaptivity was not requested.

    `None` means stock vLLM: the plugin stays out of the way entirely.
    """
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping) or ADDITIONAL_CONFIG_KEY not in additional:
        return None
    return parse_adaptive_config(additional[ADDITIONAL_CONFIG_KEY])


def additional_config_for(adaptive: Mapping[str, Any]) -> dict[str, Any]:
    """The `additional_config` value that turns adaptivity on with `adaptive`."""
    return {ADDITIONAL_CONFIG_KEY: dict(adaptive)}
