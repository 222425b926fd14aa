"""Which decoder layers a fixed low-bit gear may take at a quality target.

A W8A8 gear over every layer of a small model costs more greedy agreement than users accept
(SmolLM2-135M in bf16: 0.917 teacher-forced), but the loss is not spread evenly: some layers'
inputs carry outliers that per-token int8 rounds away, others lose almost nothing. The plan
measures that offline and keeps the sensitive layers at the model's own weights:

1. the model (transformers, at the engine's dtype) on calibration windows gives the reference
   greedy tokens;
2. each layer alone is simulated at the gear (its linears' weights rounded as the engine rounds
   them, per-token int8 activations, smoothing if a profile is given): its agreement with the
   reference is the layer's sensitivity;
3. layers are added cheapest first, bisecting for the most layers whose joint simulation keeps
   agreement >= the target.

The result is a precision config: ``policy fixed`` with ``layer_groups`` that run the sensitive
layers ``full``. The engine's figure (``vllm-adaptive bench``, held-out text, through vLLM's
decode path) is what the docs report; the simulation only ranks and chooses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_adaptive.kernels.float_linear import W8A8Weight, quantize_per_token, smoothing_factors

#: HF Llama linears of one decoder layer, by the fused vLLM module whose smoothing statistics
#: they share (q/k/v read one input, as gate/up do)
_FUSED_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
PLAN_GEARS = ("w8a8",)


@dataclass
class GearPlan:
    """A fixed gear on the layers the target allows; the rest at the model's own weights."""

    gear: str
    target_agreement: float
    quantized_layers: list[int]
    full_layers: list[int]
    simulated_agreement: float
    layer_agreement: list[float]
    all_layers_agreement: float
    tokens: int
    seconds: float
    modules: tuple[str, ...]
    smoothing: dict[str, Any] | None = None
    steps: list[dict[str, float]] = field(default_factory=list)

    def precision_config(self) -> dict[str, Any]:
        """The ``precision`` section that serves this plan."""
        cfg: dict[str, Any] = {"policy": "fixed", "gear": self.gear}
        if tuple(self.modules) != tuple(_FUSED_PARTS):
            cfg["modules"] = list(self.modules)
        groups = [{"layers": [s, e], "gear": "full"} for s, e in spans(self.full_layers)]
        if groups:
            cfg["layer_groups"] = groups
        if self.smoothing is not None:
            cfg["smoothing"] = dict(self.smoothing)
        return cfg

    def summary(self) -> dict[str, Any]:
        return {
            "gear": self.gear,
            "target_agreement": self.target_agreement,
            "simulated_agreement": round(self.simulated_agreement, 4),
            "all_layers_agreement": round(self.all_layers_agreement, 4),
            "quantized_layers": self.quantized_layers,
            "full_layers": self.full_layers,
            "layer_agreement": [round(a, 4) for a in self.layer_agreement],
            "search": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 1),
            "precision": self.precision_config(),
        }


def spans(layers: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted layer indices as ``[start, end)`` runs: [0, 1, 2, 7] -> [(0, 3), (7, 8)]."""
    out: list[tuple[int, int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class _SimulatedW8A8(torch.nn.Module):
    """A linear at the engine's W8A8 numerics: per-row int8 weights, per-token int8 inputs."""

    def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor | None) -> None:
        super().__init__()
        q = W8A8Weight.from_float(linear.weight, smooth)
        self.weight_q = q.dequantize()
        self.inv = q.inv_smooth
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.inv is not None:
            xf = xf * self.inv
        y = torch.nn.functional.linear(quantize_per_token(xf), self.weight_q, self.bias)
        return y.to(x.dtype)


class LayerSimulator:
    """Swaps a decoder layer's linears between the model's own and their simulated gear."""

    def __init__(
        self,
        model: torch.nn.Module,
        modules: Sequence[str],
        act_absmax: dict[str, torch.Tensor] | None = None,
        alpha: float = 0.5,
    ) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        self._own: dict[tuple[int, str], torch.nn.Module] = {}
        self._sim: dict[tuple[int, str], torch.nn.Module] = {}
        for i, layer in enumerate(self.layers):
            for fused in modules:
                parts = _FUSED_PARTS[fused]
                smooth = None
                if act_absmax is not None:
                    w = torch.cat([layer.get_submodule(p).weight.detach().float() for p in parts])
                    smooth = smoothing_factors(act_absmax[f"layers.{i}.{fused}"], w, alpha)
                for p in parts:
                    own = layer.get_submodule(p)
                    self._own[(i, p)] = own
                    self._sim[(i, p)] = _SimulatedW8A8(own, smooth)
        self._parts = [p for fused in modules for p in _FUSED_PARTS[fused]]

    def set_quantized(self, layers: set[int]) -> None:
        for i, layer in enumerate(self.layers):
            table = self._sim if i in layers else self._own
            for p in self._parts:
                parent_name, _, attr = p.rpartition(".")
                setattr(layer.get_submodule(parent_name), attr, table[(i, p)])


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """The model's argmax next token at every position of every window, ``[W, T]``."""
    return torch.stack(
        [model(windows[i : i + 1]).logits[0].argmax(-1) for i in range(len(windows))]
    )


def search_plan(
    measure: Callable[[set[int]], float],
    num_layers: int,
    target: float,
    progress: Callable[[str], None] = lambda s: None,
) -> tuple[list[float], list[int], float, float, list[dict[str, float]]]:
    """Per-layer agreement, then the most layers (cheapest first) whose joint agreement stays
    >= ``target`` (bisection over the count; agreement falls nearly monotonically as layers
    are added, and every probed count is checked, never assumed)."""
    layer_agreement = []
    for i in range(num_layers):
        layer_agreement.append(measure({i}))
        progress(f"layer {i}: agreement {layer_agreement[-1]:.4f} alone")
    order = sorted(range(num_layers), key=lambda i: -layer_agreement[i])
    all_agreement = measure(set(range(num_layers)))
    progress(f"all {num_layers} layers: agreement {all_agreement:.4f}")
    steps = [{"layers": num_layers, "agreement": all_agreement}]
    if all_agreement >= target:
        return layer_agreement, order, all_agreement, all_agreement, steps
    lo, hi, best = 0, num_layers, 1.0  # lo layers are known to pass, hi to fail
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a = measure(set(order[:mid]))
        steps.append({"layers": mid, "agreement": a})
        progress(f"{mid} cheapest layers: agreement {a:.4f}")
        if a >= target:
            lo, best = mid, a
        else:
            hi = mid
    return layer_agreement, order[:lo], best, all_agreement, steps


def plan_gear(
    model_dir: str | Path,
    corpora: Sequence[str | Path],
    target_agreement: float,
    gear: str = "w8a8",
    modules: Sequence[str] = tuple(_FUSED_PARTS),
    dtype: str = "bfloat16",
    smoothing_profile: str | Path | None = None,
    alpha: float = 0.5,
    tokens: int = 6144,
    window: int = 256,
    progress: Callable[[str], None] = print,
) -> GearPlan:
    """Measure each layer's sensitivity to ``gear`` on the calibration split and choose the
    layers that take it at ``target_agreement``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaptive.corpora import read_corpus, token_windows_with_next
    from vllm_adaptive.precision.smoothing import load_smoothing

    if gear not in PLAN_GEARS:
        raise ValueError(f"gear plans are made for {list(PLAN_GEARS)}, not {gear!r}")
    if not 0.0 < target_agreement <= 1.0:
        raise ValueError(f"target agreement must be in (0, 1], not {target_agreement}")
    unknown = set(modules) - set(_FUSED_PARTS)
    if unknown:
        raise ValueError(f"modules {sorted(unknown)}: a plan covers {list(_FUSED_PARTS)}")
    t0 = time.perf_counter()
    files = [read_corpus(c) for c in corpora]
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    wins, _ = token_windows_with_next(
        tok, [f.calibration_text for f in files], window, max(1, tokens // window)
    )
    windows = torch.tensor(wins)
    act_absmax = None
    smoothing = None
    if smoothing_profile is not None:
        act_absmax = load_smoothing(smoothing_profile, model_dir)
        smoothing = {"profile": str(smoothing_profile), "alpha": alpha}
    sim = LayerSimulator(model, modules, act_absmax, alpha)
    sim.set_quantized(set())
    reference = greedy_tokens(model, windows)
    progress(f"reference: {reference.numel()} positions, {dtype}")

    def measure(layers: set[int]) -> float:
        sim.set_quantized(layers)
        try:
            return (greedy_tokens(model, windows) == reference).float().mean().item()
        finally:
            sim.set_quantized(set())

    num_layers = len(sim.layers)
    layer_agreement, chosen, agreement, all_agreement, steps = search_plan(
        measure, num_layers, target_agreement, progress
    )
    return GearPlan(
        gear=gear,
        target_agreement=target_agreement,
        quantized_layers=sorted(chosen),
        full_layers=sorted(set(range(num_layers)) - set(chosen)),
        simulated_agreement=agreement,
        layer_agreement=layer_agreement,
        all_layers_agreement=all_agreement,
        tokens=int(reference.numel()),
        seconds=time.perf_counter() - t0,
        modules=tuple(modules),
        smoothing=smoothing,
        steps=steps,
    )


def plot_plan(plan: GearPlan, out: str | Path) -> None:
    """Each layer's agreement alone at the gear, the layers the plan keeps full marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    layers = range(len(plan.layer_agreement))
    colors = ["tab:gray" if i in plan.full_layers else "tab:blue" for i in layers]
    ax.bar(layers, [1.0 - a for a in plan.layer_agreement], color=colors)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("agreement lost, layer alone")
    ax.set_title(
        f"{plan.gear} plan at target {plan.target_agreement}: {len(plan.quantized_layers)} layers "
        f"at {plan.gear} (blue), {len(plan.full_layers)} full (gray); simulated "
        f"{plan.simulated_agreement:.3f}, all layers {plan.all_layers_agreement:.3f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run_from_args(args: Any) -> int:
    """``vllm-adaptive calibrate --gear-plan w8a8 --target-agreement A``."""
    import json

    if args.target_agreement is None:
        raise SystemExit("calibrate --gear-plan needs --target-agreement (e.g. 0.97)")
    stamp = time.perf_counter()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[gear-plan {time.perf_counter() - stamp:6.1f} s] {line}", flush=True)

    plan = plan_gear(
        args.model,
        args.corpus,
        args.target_agreement,
        gear=args.gear_plan,
        dtype=args.dtype,
        smoothing_profile=args.smoothing_profile,
        alpha=args.smoothing_alpha,
        tokens=args.tokens,
        window=args.window,
        progress=progress,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"model": str(args.model), "dtype": args.dtype, **plan.summary()}
    (out / "plan.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "adaptive-config.json").write_text(
        json.dumps({"adaptive": {"precision": plan.precision_config()}}) + "\n"
    )
    if args.plot:
        plot_plan(plan, args.plot)
    print(
        f"{plan.gear} on {len(plan.quantized_layers)} of {len(plan.layer_agreement)} layers "
        f"(full: {plan.full_layers}); simulated agreement {plan.simulated_agreement:.4f} "
        f"(all layers {plan.all_layers_agreement:.4f}) in {plan.seconds:.0f} s"
    )
    print(f'serve it: ADAPTIVE_CONFIG="$(cat {out / "adaptive-config.json"})" scripts/serve.sh')
    return 0
