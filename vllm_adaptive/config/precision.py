"""The ``precision`` section: entropy-routed gears (GEARBX, QuickSilver tiers) or one fixed gear."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from vllm_adaptive.config.base import (
    MANAGED_MODULES,
    GearMap,
    _check_gear_order,
    _Strict,
)
from vllm_adaptive.gears import (
    GEARBX_GEARS,
    GEARBX_GEARS_4BIT_GRID,
    GEARBX_GEARS_AMX,
    GEARBX_GEARS_BF16_DOT,
    GEARBX_GEARS_F32,
    GEARBX_GEARS_F32_NO_INT8_DOT,
    GEARBX_HEAD_4BIT_GRID,
    QUICKSILVER_GEARS,
    Precision,
)

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
    """Layers ``[start, end)`` whose linears map the gear levels to their own precisions
    (``gears``), or, under policy ``fixed``, run one precision of their own (``gear``)."""

    layers: tuple[int, int] = Field(strict=False)  # JSON lists
    gears: GearMap | None = Field(None, strict=False)
    gear: Precision | None = None

    @model_validator(mode="after")
    def _check(self) -> LayerGroup:
        start, end = self.layers
        if not 0 <= start < end:
            raise ValueError(f"layers must be [start, end) with 0 <= start < end: {self.layers}")
        if (self.gears is None) == (self.gear is None):
            raise ValueError(
                f'layer group {list(self.layers)}: give "gears" (gearbx, quicksilver) or '
                '"gear" (fixed), one of them'
            )
        if self.gears is not None:
            _check_gear_order(self.gears, "gears")
        return self

    @property
    def named_precisions(self) -> set[str]:
        """Every precision some level of some managed linear runs (layer groups and the LM
        head included)."""
        return {
            *self.level_gears,
            *(p for g in self.layer_groups for p in g.level_gears),
            *(self.head_map or ()),
        }

    @property
    def level_gears(self) -> GearMap:
        if self.gears is not None:
            return self.gears
        return (self.gear, self.gear, self.gear)  # type: ignore[return-value]


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
    activations ((int4, int8, int8) on CPUs whose plugin kernels run the bf16 dot product,
    (w8a8, full, full) on AMX where they do not; int4 at every level where they do and the
    checkpoint already lies on a 4-bit grid, which that gear gives back) and (w8a8, fp16, fp16)
    with float32 ones (the fast kernels for each), and (int2, int4, int8) for quicksilver."""
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
    bf16 GEMM at 8 tokens on an AMX Xeon; ``int8``, grouped, gives the default model's tied head
    back exactly, a Q8_0 dequantization, but did not measure faster through ``vllm serve`` on an
    AVX512-BF16 EPYC: docs/results.md)."""
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
    symmetric: bool | None = None
    """int4/int2 independent tiers: symmetric absmax (GEARBX) or asymmetric min/max. Default:
    asymmetric where the checkpoint's weights already lie on a 4-bit grid (a Q4_1 GGUF source,
    as the default model's: min/max groups of 32 give its values back, where absmax re-rounds
    them onto another grid), symmetric otherwise."""
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
            if self.gears is not None:
                raise ValueError('policy "fixed" takes "gear", not "gears"')
            for g in self.layer_groups:
                if g.gear is None:
                    raise ValueError(
                        f'policy "fixed": layer group {list(g.layers)} takes "gear" (its own '
                        'precision), not "gears"'
                    )
        else:
            if self.gear is not None:
                raise ValueError(
                    f'"gear" is for policy "fixed"; policy {self.policy!r} uses "gears"'
                )
            for g in self.layer_groups:
                if g.gears is None:
                    raise ValueError(
                        f'policy {self.policy!r}: layer group {list(g.layers)} takes "gears" '
                        '(low, mid, high), not "gear"'
                    )
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
                    *(p for g in self.layer_groups for p in g.level_gears),
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

    def for_dtype(
        self,
        dtype_name: str,
        amx_int8: bool = False,
        int8_dot: bool = True,
        native_bf16_dot: bool = False,
        on_4bit_grid: bool = False,
    ) -> PrecisionConfig:
        """This config with the dtype- and machine-dependent defaults filled in (``dtype_name``:
        the model's activation dtype, e.g. "float32"; ``amx_int8``: the CPU runs vLLM's AMX
        int8 GEMM, :func:`vllm_adaptive.kernels.float_linear.amx_int8_available`; ``int8_dot``:
        the CPU has an int8 dot product, :func:`~vllm_adaptive.kernels.float_linear.
        cpu_has_int8_dot`; ``native_bf16_dot``: the engine runs on a CPU whose plugin kernels
        take bf16 rows on AVX512-BF16's dot product, :func:`~vllm_adaptive.kernels.native.
        bf16_dot_available`; ``on_4bit_grid``: the checkpoint's weights already lie on a 4-bit
        grid, :func:`~vllm_adaptive.kernels.packed.coarse_grid_fraction`); errors name the key."""
        update: dict[str, Any] = {}
        half = dtype_name != "float32"
        if self.gears is None and self.policy == "gearbx":
            if not half:
                update["gears"] = GEARBX_GEARS_F32 if int8_dot else GEARBX_GEARS_F32_NO_INT8_DOT
            elif (
                native_bf16_dot
                and on_4bit_grid
                and self.symmetric is not True  # absmax tiers do not give the grid back
                and self.smoothing is None  # a W8A8 profile asks for the W8A8 gear
            ):
                update["gears"] = GEARBX_GEARS_4BIT_GRID
                if self.head_gears is None and "lm_head" in self.modules:
                    update["head_gears"] = GEARBX_HEAD_4BIT_GRID
            elif native_bf16_dot and not (amx_int8 and self.smoothing is not None):
                update["gears"] = GEARBX_GEARS_BF16_DOT  # AMX too: its tiles run these kernels
            elif amx_int8:  # no plugin kernels here, or a SmoothQuant profile for W8A8 given
                update["gears"] = GEARBX_GEARS_AMX
        if (
            half
            and self.head_gears is None
            and "lm_head" in self.modules
            and not update.get("head_gears")
        ):
            if self.modules == ("lm_head",):
                raise ValueError(
                    f'"modules" names only lm_head, which a {dtype_name} engine runs at its own '
                    'weight by default: name its "head_gears"'
                )
            update["head_gears"] = ("full", "full", "full")
        resolved = self.model_copy(update=update) if update else self
        if resolved.smoothing is not None and "w8a8" not in resolved.named_precisions:
            raise ValueError(
                f'"smoothing" applies to the w8a8 precision; the gears of this {dtype_name} '
                f"engine are {list(resolved.level_gears)}"
            )
        return resolved

    @property
    def named_precisions(self) -> set[str]:
        """Every precision some level of some managed linear runs (layer groups and the LM
        head included)."""
        return {
            *self.level_gears,
            *(p for g in self.layer_groups for p in g.level_gears),
            *(self.head_map or ()),
        }

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
                return g.level_gears
        if self.policy == "quicksilver" and not self.layer_groups and layer < num_layers // 2:
            high = self.level_gears[2]
            return (high, high, high)
        return self.level_gears
