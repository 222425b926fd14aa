"""M2R2 accelerator adapters (parallel low-rank adapters of the accelerated residual stream).

For each adapted base layer ``i`` (layers ``0 .. adapted_layers - 1``) the accelerated stream
``p`` runs the frozen base layer with three low-rank additions (rank ``r``)::

    x   = input_layernorm_i(p)
    q   = q_proj_i(x) + delta_q(i, x)          # delta_q(i, x)   = q_B @ (q_A @ x)
    k,v = k_proj_i(x), v_proj_i(x)             # the base projections (this token's own K/V)
    q,k = rope(q, k, position)
    att = attention(q, [slow K/V of positions < t] + [own k, v])   # heads concatenated
    p   = p + o_proj_i(att) + delta_o(i, att)  # delta_o(i, att) = o_B @ (o_A @ att)
    y   = post_attention_layernorm_i(p)
    p   = p + mlp_i(y) + delta_mlp(i, y)       # delta_mlp(i, y) = mlp_U @ silu(mlp_D @ y)

The up-projections (``q_B``, ``o_B``, ``mlp_U``) start at zero, so fresh adapters are the
identity: the accelerated stream equals the base model's own (early-exit) stream. In exit mode
the adapter also holds one ARLA router per gate (``routers[j]`` decides at gate ``gates[j]``).

On disk: ``adapter.safetensors`` (float32 tensors ``layers.{i}.{q_A,q_B,o_A,o_B,mlp_D,mlp_U}``
and ``routers.{j}.*``) plus ``adapter.json`` (the config, the base model's fingerprint, the
training arguments and step, the tensor file's sha256). No pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_adaptive.m2r2.arla import ARLA

FORMAT_VERSION = 1
TENSORS_NAME = "adapter.safetensors"
JSON_NAME = "adapter.json"
MODES = ("spec", "exit")


class AdapterError(ValueError):
    """An adapter cannot be used: another model, a missing/corrupt file or another format."""


def distill_target(i: int, start: int, rate: float, num_layers: int) -> int:
    """Slow-stream layer that accelerated layer output ``i`` (1-based, after ``i`` layers) is
    distilled towards: ``(i - start) * rate + start`` rounded half up, capped at ``num_layers``
    (eq. 3 of the paper)."""
    return min(num_layers, int(math.floor((i - start) * rate + start + 0.5)))


@dataclass
class AdapterConfig:
    """Shapes and layout of an M2R2 adapter set.

    ``mode="spec"``: one interval [0, k) at rate N/k; the draft is read at layer ``k``.
    ``mode="exit"``: gates ``E_1 < ... < E_J`` (``gates``); interval j is [E_{j-1}, E_j) with
    E_0 = 0, the accelerated stream is re-initialised from the slow stream at E_{j-1} and runs
    at rate (N - E_{j-1}) / (E_j - E_{j-1}), so every gate's accelerated state is distilled
    towards the final (pre-norm) residual h_N. For N=30, gates 6,12,18,24 this is rates
    5,4,3,2: the paper's "2-(J+1)x" streams (Fig. 1, eq. 5 of A.1.1).
    """

    mode: str
    num_layers: int  # N, of the base model
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rank: int
    k: int | None = None  # spec: draft depth
    gates: list[int] | None = None  # exit: E_1..E_J (1-based layer counts)
    arla_latent: int = 64

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AdapterError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.rank < 1:
            raise AdapterError(f"rank must be >= 1, got {self.rank}")
        if self.mode == "spec":
            if self.k is None or not 1 <= self.k < self.num_layers:
                raise AdapterError(f"spec mode needs 1 <= k < {self.num_layers}, got k={self.k}")
            self.gates = None
        else:
            gates = [int(g) for g in (self.gates or [])]
            if not gates or gates != sorted(set(gates)) or gates[0] < 1:
                raise AdapterError(f"exit mode needs increasing gates >= 1, got {self.gates}")
            if gates[-1] >= self.num_layers:
                raise AdapterError(f"gates must be < num_layers={self.num_layers}: {gates}")
            self.gates = gates
            self.k = None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def adapted_layers(self) -> int:
        """Adapters exist for base layers 0 .. adapted_layers - 1."""
        return self.k if self.mode == "spec" else self.gates[-1]

    @property
    def intervals(self) -> list[tuple[int, int]]:
        """[(start, stop)]: the accelerated stream starts from h_start and runs layers
        start..stop-1; its state after layer stop-1 is read out at gate ``stop``."""
        if self.mode == "spec":
            return [(0, self.k)]
        bounds = [0, *self.gates]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def rate(self, start: int, stop: int) -> float:
        return (self.num_layers - start) / (stop - start)

    def distill_targets(self) -> dict[int, int]:
        """{accelerated layer output i (1-based): slow-stream layer count it is distilled to}."""
        out = {}
        for start, stop in self.intervals:
            r = self.rate(start, stop)
            for i in range(start + 1, stop + 1):
                out[i] = distill_target(i, start, r, self.num_layers)
        return out

    @classmethod
    def from_model_config(cls, cfg: Any, **kw: Any) -> AdapterConfig:
        """From a HF (Llama-family) config object or its config.json dict."""
        get = cfg.get if isinstance(cfg, dict) else lambda n, d=None: getattr(cfg, n, d)
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads", None) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            **kw,
        )


class LayerAdapter(nn.Module):
    """The three low-rank adapters of one base layer (weights in nn.Linear's [out, in] layout).

    q_A [r, d], q_B [q_dim, r]   -- query delta      q_B @ q_A @ x
    o_A [r, q_dim], o_B [d, r]   -- output delta     o_B @ o_A @ att
    mlp_D [r, d], mlp_U [d, r]   -- parallel MLP     mlp_U @ silu(mlp_D @ y)
    """

    def __init__(self, hidden: int, q_dim: int, rank: int) -> None:
        super().__init__()
        self.q_A = nn.Parameter(torch.zeros(rank, hidden))
        self.q_B = nn.Parameter(torch.zeros(q_dim, rank))
        self.o_A = nn.Parameter(torch.zeros(rank, q_dim))
        self.o_B = nn.Parameter(torch.zeros(hidden, rank))
        self.mlp_D = nn.Parameter(torch.zeros(rank, hidden))
        self.mlp_U = nn.Parameter(torch.zeros(hidden, rank))

    @torch.no_grad()
    def init_identity(self, generator: torch.Generator | None = None) -> None:
        """Down-projections ~ N(0, 1/fan_in), up-projections zero (the delta is zero)."""
        for a in (self.q_A, self.o_A, self.mlp_D):
            a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(a.shape[1]))
        for b in (self.q_B, self.o_B, self.mlp_U):
            b.zero_()


def _lowrank(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor, act=None) -> torch.Tensor:
    z = x.to(down.dtype) @ down.t()
    if act is not None:
        z = act(z)
    return (z @ up.t()).to(x.dtype)


class M2R2Adapters(nn.Module):
    """Per-layer accelerator adapters (and, in exit mode, one ARLA router per gate)."""

    def __init__(self, config: AdapterConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            LayerAdapter(config.hidden_size, config.q_dim, config.rank)
            for _ in range(config.adapted_layers)
        )
        n_routers = len(config.gates) if config.mode == "exit" else 0
        self.routers = nn.ModuleList(
            ARLA(config.hidden_size, config.arla_latent) for _ in range(n_routers)
        )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def zeros(cls, config: AdapterConfig | None = None, *, seed: int = 0, **kw: Any):
        """Identity adapters (zero deltas), ready to train: up-projections zero, down-projections
        small random (seeded). ``config`` or the AdapterConfig fields as keywords."""
        cfg = config if config is not None else AdapterConfig(**kw)
        ad = cls(cfg)
        g = torch.Generator().manual_seed(seed)
        for layer in ad.layers:
            layer.init_identity(g)
        for router in ad.routers:
            router.reset_parameters(g)
        return ad

    # -- the deltas (2-D [tokens, features]; any leading shape works) ----------------------
    def delta_q(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Query delta of layer i: x = input_layernorm_i(p) [.., d] -> [.., heads*head_dim],
        added to q_proj_i(x) before rotary."""
        a = self.layers[i]
        return _lowrank(x, a.q_A, a.q_B)

    def delta_o(self, i: int, att: torch.Tensor) -> torch.Tensor:
        """Output delta of layer i: att = attention output, heads concatenated
        [.., heads*head_dim] (the o_proj input) -> [.., d], added to o_proj_i(att)."""
        a = self.layers[i]
        return _lowrank(att, a.o_A, a.o_B)

    def delta_mlp(self, i: int, y: torch.Tensor) -> torch.Tensor:
        """Parallel MLP of layer i: y = post_attention_layernorm_i(p) [.., d] -> [.., d],
        added to mlp_i(y)."""
        a = self.layers[i]
        return _lowrank(y, a.mlp_D, a.mlp_U, torch.nn.functional.silu)

    def exit_probability(self, gate_index: int, states) -> torch.Tensor:
        """ARLA exit probability at gate ``gates[gate_index]``; see `ARLA.exit_probability`."""
        return self.routers[gate_index].exit_probability(states)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- disk ----------------------------------------------------------------------------
    def save(self, out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write adapter.safetensors (float32) + adapter.json (``meta`` plus the config)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        tpath = out / TENSORS_NAME
        save_file(tensors, str(tpath))
        doc = dict(meta or {})
        doc.update(
            format_version=FORMAT_VERSION,
            config=asdict(self.config),
            mode=self.config.mode,
            k=self.config.k,
            gates=self.config.gates,
            rank=self.config.rank,
            hidden_size=self.config.hidden_size,
            num_layers=self.config.num_layers,
            adapted_layers=self.config.adapted_layers,
            distill_targets={str(k): v for k, v in self.config.distill_targets().items()},
            num_parameters=self.num_parameters(),
            tensors_sha256=hashlib.sha256(tpath.read_bytes()).hexdigest(),
            tensor_names=sorted(tensors),
        )
        (out / JSON_NAME).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(
        cls, adapter_dir: str | Path, model_dir: str | Path | None = None
    ) -> tuple[M2R2Adapters, dict[str, Any]]:
        """Read an adapter (float32, CPU). With ``model_dir``, refuse (AdapterError) one made for
        another model: fingerprint or shape mismatch."""
        d = Path(adapter_dir)
        jpath, tpath = d / JSON_NAME, d / TENSORS_NAME
        if not jpath.is_file() or not tpath.is_file():
            raise AdapterError(f"adapter {d}: missing {JSON_NAME} or {TENSORS_NAME}")
        try:
            meta = json.loads(jpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterError(f"adapter {d}: {JSON_NAME} is corrupt ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise AdapterError(f"adapter {d}: {JSON_NAME} has no config")
        if meta.get("format_version") != FORMAT_VERSION:
            raise AdapterError(
                f"adapter {d}: format version {meta.get('format_version')!r}, "
                f"this code reads {FORMAT_VERSION}"
            )
        if hashlib.sha256(tpath.read_bytes()).hexdigest() != meta.get("tensors_sha256"):
            raise AdapterError(f"adapter {d}: {TENSORS_NAME} does not match its sha256")
        try:
            config = AdapterConfig(**meta["config"])
        except TypeError as e:
            raise AdapterError(f"adapter {d}: bad config ({e})") from None
        if model_dir is not None:
            check_model(config, meta, model_dir, where=str(d))
        ad = cls(config)
        tensors = load_file(str(tpath))
        want = {k: tuple(v.shape) for k, v in ad.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if want != got:
            bad = sorted(set(want.items()) ^ set(got.items()))[:4]
            raise AdapterError(f"adapter {d}: tensors do not match its config: {bad}")
        ad.load_state_dict(tensors)
        return ad, meta


def check_model(config: AdapterConfig, meta: dict[str, Any], model_dir, where: str = "") -> None:
    """Raise AdapterError unless the adapter's shapes and fingerprint match ``model_dir``."""
    from vllm_adaptive.artifacts import ProfileError, fingerprint_matches

    model_dir = Path(model_dir)
    try:
        mcfg = json.loads((model_dir / "config.json").read_text())
        mine = AdapterConfig.from_model_config(mcfg, mode="spec", k=1, rank=1)
    except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
        raise AdapterError(f"model {model_dir}: unreadable config.json ({e})") from None
    for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
        a, b = getattr(config, name), getattr(mine, name)
        if a != b:
            raise AdapterError(
                f"adapter {where} was made for another model: {name}={a}, {model_dir} has {b}"
            )
    theirs = meta.get("model_fingerprint")
    try:
        ok, fp = fingerprint_matches(theirs, model_dir)
    except ProfileError as e:
        raise AdapterError(str(e)) from None
    if not ok:
        raise AdapterError(
            f"adapter {where} was made for another model (fingerprint {str(theirs)[:12]}..., "
            f"{model_dir} is {fp[:12]}...)"
        )
