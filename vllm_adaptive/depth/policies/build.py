"""The exit signal an `adaptive.depth.signal` config asks for, built from a loaded profile.

Thresholds come from the config when given, else from the profile; a signal whose thresholds
are in neither is refused with a `ProfileError` that says how to get them. QuickSilver's
protected tokens: the tokenizer's special token ids (recorded in the profile at calibration,
or passed by the caller) unless ``protect_special_tokens`` is false, plus the configured ids.
ARLA's routers come with M2R2's exit-mode adapter (`load_arla_adapters`), which the runtime also
needs for the accelerated stream itself, so it is loaded once and handed to both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from vllm_adaptive.artifacts import ProfileError
from vllm_adaptive.config import SignalConfig
from vllm_adaptive.depth.exit_profile import ExitProfile
from vllm_adaptive.depth.policies.arla import ArlaExitSignal
from vllm_adaptive.depth.policies.combine import CombinedExitSignal
from vllm_adaptive.depth.policies.emad import EmadExitSignal
from vllm_adaptive.depth.policies.probe import ExitSignal
from vllm_adaptive.depth.policies.quicksilver import QuickSilverExitSignal
from vllm_adaptive.depth.policies.river import RiverExitSignal
from vllm_adaptive.depth.readout import entropy_nats
from vllm_adaptive.m2r2.adapters import AdapterError, M2R2Adapters


def emad_signal(profile: ExitProfile) -> EmadExitSignal:
    return EmadExitSignal(
        profile.lowrank_u,
        profile.lowrank_v,
        profile.temperature,
        profile.proxy,
        profile.feature_knots,
        profile.topk,
    )


def build_exit_signal(
    cfg: SignalConfig,
    profile: ExitProfile,
    special_token_ids: Iterable[int] | None = None,
    unembed: torch.Tensor | None = None,
    arla_adapters: M2R2Adapters | None = None,
) -> ExitSignal:
    """One signal, or a `CombinedExitSignal` in the order of ``cfg.policy``. ``unembed``
    (the LM head's [V, d] weight) is needed only for QuickSilver with the exact entropy;
    ``arla_adapters`` (from `load_arla_adapters`) only for ARLA."""
    emad = emad_signal(profile)
    built: list[ExitSignal] = []
    for name in cfg.policy:
        if name == "emad":
            built.append(emad)
        elif name == "quicksilver":
            built.append(_quicksilver(cfg, profile, emad, special_token_ids, unembed))
        elif name == "arla":
            built.append(_arla(cfg, arla_adapters))
        else:
            built.append(_river(cfg, profile))
    return built[0] if len(built) == 1 else CombinedExitSignal(built, cfg.combine)


def _quicksilver(cfg, profile, emad, special_token_ids, unembed) -> QuickSilverExitSignal:
    q = cfg.quicksilver
    calibrated = profile.quicksilver_thresholds
    if (q.tau_drift is None or q.tau_entropy is None) and calibrated is None:
        raise ProfileError(
            f"profile {profile.path} has no QuickSilver thresholds: recalibrate with "
            "`vllm-adaptive calibrate --signal quicksilver`, or set "
            "adaptive.depth.signal.quicksilver.tau_drift and tau_entropy"
        )
    kind = q.entropy or profile.quicksilver_entropy
    if q.tau_entropy is None and kind != profile.quicksilver_entropy:
        raise ProfileError(
            f"adaptive.depth.signal.quicksilver.entropy is {kind!r} but profile {profile.path} "
            f"calibrated tau_entropy for the {profile.quicksilver_entropy!r} entropy: set "
            "tau_entropy too, or recalibrate with --qs-entropy " + kind
        )
    if kind == "exact":
        if unembed is None:
            raise ValueError("QuickSilver's exact entropy needs the LM head weight (unembed)")
        w = unembed

        def entropy(normed: torch.Tensor, probe: int) -> torch.Tensor:
            return entropy_nats(normed.float() @ w.float().T, profile.temperature)

    else:
        entropy = emad.proxy_entropy
    tau_d = q.tau_drift if q.tau_drift is not None else calibrated[0]
    tau_h = q.tau_entropy if q.tau_entropy is not None else calibrated[1]
    special = profile.special_token_ids if special_token_ids is None else special_token_ids
    protected = {*q.protected_token_ids, *(special if q.protect_special_tokens else ())}
    forced = set(q.forced_halt_token_ids)
    if protected & forced:
        raise ValueError(
            f"adaptive.depth.signal.quicksilver.forced_halt_token_ids {sorted(protected & forced)}"
            " are special tokens, which are protected (set protect_special_tokens to false)"
        )
    return QuickSilverExitSignal(
        entropy,
        tau_d,
        tau_h,
        q.min_halting_depth,
        q.max_halting_layer,
        protected,
        forced,
    )


def _river(cfg, profile) -> RiverExitSignal:
    r = cfg.river
    if r.tau is None and profile.river_tau is None:
        raise ProfileError(
            f"profile {profile.path} has no River tau: recalibrate with "
            "`vllm-adaptive calibrate --signal river`, or set adaptive.depth.signal.river.tau"
        )
    tau = r.tau if r.tau is not None else profile.river_tau
    return RiverExitSignal(tau, r.batch_min, r.entry_layer)


def load_arla_adapters(
    cfg: SignalConfig, profile: ExitProfile, model_dir: str | Path
) -> M2R2Adapters:
    """The exit-mode M2R2 adapter ``adaptive.depth.signal.arla.adapter``, checked against the
    model (`M2R2Adapters.load` refuses another model's) and the profile: the runtime decides
    only at probe layers, so every gate must be one (ValueError naming the key otherwise)."""
    key = "adaptive.depth.signal.arla.adapter"
    if cfg.arla is None:
        raise ValueError(f'{key}: policy "arla" needs an adapter')
    try:
        adapters, _ = M2R2Adapters.load(cfg.arla.adapter, model_dir)
    except AdapterError as e:
        raise ValueError(f"{key}: {e}") from None
    ac = adapters.config
    if ac.mode != "exit":
        raise ValueError(
            f"{key}: {cfg.arla.adapter} was trained with --mode {ac.mode}; the ARLA exit signal "
            "needs --mode exit (gates and routers)"
        )
    if ac.num_layers != profile.num_layers:
        raise ValueError(
            f"{key}: made for {ac.num_layers} layers, the profile for {profile.num_layers}"
        )
    missing = [g for g in ac.gates if g not in profile.probe_layers]
    if missing:
        raise ValueError(
            f"{key}: gates {missing} of {ac.gates} are not probe layers of profile "
            f"{profile.path} ({profile.probe_layers}); calibrate with probes at every gate "
            "(e.g. --probe-every 1) or train the adapter with gates among the probes"
        )
    return adapters


def _arla(cfg: SignalConfig, adapters: M2R2Adapters | None) -> ArlaExitSignal:
    if adapters is None or cfg.arla is None:
        raise ValueError(
            'adaptive.depth.signal.arla: policy "arla" needs its adapter (load_arla_adapters)'
        )
    return ArlaExitSignal(adapters.routers, adapters.config.gates, cfg.arla.threshold)
