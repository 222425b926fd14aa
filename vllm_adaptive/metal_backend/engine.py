"""The MLX engine: one checkpoint, one request at a time, the configured adaptive mechanism.

With no mechanism (``{}``, ``mode: off``, or a request's ``adaptive_mode: off``) a request runs
mlx-lm's own model call and sampler in mlx-lm's own order (prompt minus its last token in
chunks, the last token alone, then one token per step, the next step queued before the current
token is returned), so its tokens are stock mlx-lm's (``generate_step``), greedy and seeded.
With a mechanism each step waits for its decision: the gear of step t+1 is the policy's answer
to step t's entropy; an exit is decided inside the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from vllm_adaptive.artifacts import ProfileError
from vllm_adaptive.bench.metrics import ForcedStream
from vllm_adaptive.config import AdaptiveConfig, AdaptiveConfigError, parse_adaptive_config
from vllm_adaptive.metal_backend.arch import LlamaLayout, UnsupportedArchitecture
from vllm_adaptive.metal_backend.depth import DepthRunner
from vllm_adaptive.metal_backend.gear_control import GearController
from vllm_adaptive.metal_backend.geared import GearSwitch
from vllm_adaptive.metal_backend.loading import load_mlx, model_dtype_name, read_hf_config
from vllm_adaptive.metal_backend.speculative import MlxLowBitDraft, SpecStats, verify
from vllm_adaptive.metal_backend.support import check_supported
from vllm_adaptive.overrides import RequestOverrides

logger = logging.getLogger("vllm_adaptive.mlx")

PREFILL_STEP = 2048  # mlx-lm generate_step's default prefill chunk
MAX_RECORDS = 4096


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling; temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def sampler(self) -> Any:
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(self.temperature, self.top_p, top_k=self.top_k)


@dataclass
class _Request:
    """One request's mechanism state."""

    tag: str
    overrides: RequestOverrides
    gear: Any = None
    depth: Any = None
    spec: SpecStats | None = None
    records: list[dict[str, Any]] = field(default_factory=list)


def _as_config(adaptive: AdaptiveConfig | Mapping[str, Any] | str | None) -> AdaptiveConfig:
    if isinstance(adaptive, AdaptiveConfig):
        return adaptive
    return parse_adaptive_config({} if adaptive is None else adaptive)


class MlxEngine:
    """``generate`` (a token iterator) and ``teacher_force`` for one request at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        adaptive: AdaptiveConfig | Mapping[str, Any] | str | None = None,
        *,
        dtype: str = "auto",
        num_speculative_tokens: int = 4,
    ) -> None:
        self.model_dir = str(model_dir)
        self.config = _as_config(adaptive)
        check_supported(self.config)
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens
        self.hf_config = read_hf_config(model_dir)
        self.model, self.tokenizer = load_mlx(model_dir, dtype)
        self.dtype = model_dtype_name(self.model)
        self.gears: GearController | None = None
        self.depth: DepthRunner | None = None
        self.draft: MlxLowBitDraft | None = None
        self.layout: LlamaLayout | None = None
        if self.config.any_mechanism_enabled:
            try:
                self.layout = LlamaLayout.of(self.model)
            except UnsupportedArchitecture as e:
                raise AdaptiveConfigError(f"adaptive: {e}") from None
        if self.config.active_precision is not None:
            try:
                self.gears = GearController(
                    self.config.active_precision, self.layout, self.tokenizer, GearSwitch()
                )
            except ValueError as e:  # a group size this model's widths cannot take
                raise AdaptiveConfigError(str(e)) from None
        if self.config.active_depth is not None:
            try:
                self.depth = DepthRunner(self.config.active_depth, self.layout, model_dir)
            except (ProfileError, ValueError, OSError) as e:
                raise AdaptiveConfigError(f"adaptive.depth.profile: {e}") from None
        if self.config.active_speculative is not None:
            try:
                self.draft = MlxLowBitDraft(self.layout, self.config.active_speculative)
            except ValueError as e:
                raise AdaptiveConfigError(str(e)) from None
        self.lock = threading.Lock()
        self.records: dict[str, list[dict[str, Any]]] = {}
        self._order: list[str] = []
        self.requests_seen = 0
        self.spec_totals = SpecStats()

    # -- helpers -------------------------------------------------------------------------------
    @property
    def mechanism(self) -> str:
        if self.gears is not None:
            return "precision"
        if self.depth is not None:
            return "depth"
        if self.draft is not None:
            return "speculative"
        return "none"

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids or ())

    def _new_request(self, prompt_ids: list[int], overrides: RequestOverrides) -> _Request:
        self.requests_seen += 1
        req = _Request(tag=overrides.request_tag or f"req{self.requests_seen}", overrides=overrides)
        if self.gears is not None:
            req.gear = self.gears.start(prompt_ids, overrides)
            req.gear.tag = req.tag
        if self.depth is not None:
            req.depth = self.depth.start(len(prompt_ids), overrides)
            req.depth.tag = req.tag
        if self.draft is not None and overrides.mode != "off":
            req.spec = SpecStats()
        return req

    def _finish(self, req: _Request) -> None:
        if req.gear is not None:
            req.records.append(self.gears.finish(req.gear))
        if req.depth is not None:
            req.records.append(self.depth.finish(req.depth))
        if req.spec is not None:
            for k in ("rounds", "drafted", "accepted", "emitted"):
                setattr(self.spec_totals, k, getattr(self.spec_totals, k) + getattr(req.spec, k))
            req.records.append(
                {"tag": req.tag, "mechanism": "speculative", "k": self.k, **req.spec.as_dict()}
            )
        if req.records:
            self.records.setdefault(req.tag, []).extend(req.records)
            self._order.append(req.tag)
            while len(self._order) > MAX_RECORDS:
                old = self._order.pop(0)
                if old not in self._order:
                    self.records.pop(old, None)

    def _forward(self, req: _Request, tokens: list[int], cache: list[Any]) -> mx.array:
        """Logits ``[1, n, V]`` of ``tokens`` at full depth, at the request's gear."""
        if self.gears is not None:
            self.gears.before_forward(req.gear)
        return self.model(mx.array(tokens)[None], cache=cache)

    def _prefill(self, req: _Request, prompt: list[int], cache: list[Any]) -> None:
        """Every prompt token but the last, in mlx-lm's chunks (full depth)."""
        rest = prompt[:-1]
        while rest:
            chunk, rest = rest[:PREFILL_STEP], rest[PREFILL_STEP:]
            logits = self._forward(req, chunk, cache)
            if self.gears is not None and self.gears.wants_calibration(req.gear):
                self.gears.calibrate(logits[0])
            mx.eval([c.state for c in cache])

    def _decode_logits(self, req: _Request, token: int, cache: list[Any]) -> mx.array:
        """Logits ``[1, V]`` of one decode step."""
        if self.depth is not None:
            return self.depth.decode(token, cache, req.depth)
        return self._forward(req, [token], cache)[:, -1]

    def _observe(self, req: _Request, logits: mx.array, first: bool) -> None:
        if req.gear is not None:
            self.gears.observe(req.gear, logits[0])
        if first and req.depth is not None:
            self.depth.prefilled(req.depth)

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Sampling | None = None,
        overrides: RequestOverrides | None = None,
        stop_token_ids: set[int] | None = None,
    ) -> Iterator[int]:
        """Token ids of one request, as they are produced; stops after ``max_tokens`` or at a
        token of ``stop_token_ids`` (which is yielded)."""
        from mlx_lm.models.cache import make_prompt_cache

        if not prompt_ids:
            raise ValueError("empty prompt")
        sampling = sampling or Sampling()
        overrides = overrides or RequestOverrides()
        stop = stop_token_ids or set()
        if sampling.seed is not None:
            mx.random.seed(sampling.seed)
        req = self._new_request(prompt_ids, overrides)
        cache = make_prompt_cache(self.model)
        try:
            if self.mechanism == "none" or overrides.mode == "off":
                yield from self._generate_plain(req, prompt_ids, max_tokens, sampling, stop, cache)
            elif req.spec is not None:
                yield from self._generate_spec(req, prompt_ids, max_tokens, sampling, stop, cache)
            else:
                yield from self._generate_stepwise(
                    req, prompt_ids, max_tokens, sampling, stop, cache
                )
        finally:
            self._finish(req)

    def _generate_plain(self, req, prompt, max_tokens, sampling, stop, cache) -> Iterator[int]:
        """mlx-lm's generate_step loop (the next step queued before a token is returned)."""
        sampler = sampling.sampler()
        if self.gears is not None:
            self.gears.before_forward(req.gear)  # OFF: full precision
        self._prefill(req, prompt, cache)

        def step(tokens: list[int] | mx.array) -> mx.array:
            x = mx.array(tokens) if isinstance(tokens, list) else tokens
            logits = self.model(x[None], cache=cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return sampler(logprobs)

        y = step(prompt[-1:])
        mx.async_eval(y)
        n = 0
        while n < max_tokens:
            nxt = step(y) if n + 1 < max_tokens else None
            if nxt is not None:
                mx.async_eval(nxt)
            tok = int(y.item())
            if req.gear is not None:
                req.gear.codes.append(3)
            if req.depth is not None:
                req.depth.depths.append(self.depth.num_layers)
            yield tok
            n += 1
            if tok in stop or nxt is None:
                break
            y = nxt

    def _generate_stepwise(self, req, prompt, max_tokens, sampling, stop, cache) -> Iterator[int]:
        """Gears or depth: every step waits for its decision."""
        sampler = sampling.sampler()
        self._prefill(req, prompt, cache)
        logits = self._forward(req, prompt[-1:], cache)[:, -1]
        tok = -1
        for n in range(max_tokens):
            if n > 0:
                logits = self._decode_logits(req, tok, cache)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            y = sampler(logprobs)
            mx.eval(y, logits)
            self._observe(req, logits, first=n == 0)
            tok = int(y.item())
            yield tok
            if tok in stop:
                break

    def _generate_spec(self, req, prompt, max_tokens, sampling, stop, cache) -> Iterator[int]:
        """Lowbit drafts verified by the full model, ``k`` per round."""
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        draft = self.draft
        stats = req.spec
        sampler = sampling.sampler()
        dcache = make_prompt_cache(self.model)
        self._prefill(req, prompt, cache)
        if len(prompt) > 1:
            draft.logits(mx.array(prompt[:-1])[None], dcache)
            mx.eval([c.state for c in dcache])
        logits = self.model(mx.array(prompt[-1:])[None], cache=cache)[:, -1]
        y = int(sampler(logits - mx.logsumexp(logits, keepdims=True)).item())
        pending = [prompt[-1]]  # tokens the draft cache lacks, before y
        emitted = 0
        while True:
            yield y
            emitted += 1
            stats.emitted += 1
            if y in stop or emitted >= max_tokens:
                return
            k = min(self.k, max_tokens - emitted - 1)
            pending.append(y)
            drafts: list[int] = []
            if k > 0:
                dl = draft.logits(mx.array(pending)[None], dcache)[:, -1]
                drafts.append(int(mx.argmax(dl, axis=-1).item()))
                while len(drafts) < k:
                    dl = draft.logits(mx.array(drafts[-1:])[None], dcache)[:, -1]
                    drafts.append(int(mx.argmax(dl, axis=-1).item()))
            tl = self.model(mx.array([y, *drafts])[None], cache=cache)[0]
            t = sampling.temperature
            n_acc, nxt = verify(tl, drafts, t, sampling.top_p, sampling.top_k)
            stats.rounds += 1 if k > 0 else 0
            stats.drafted += k
            stats.accepted += n_acc
            trim_prompt_cache(cache, k - n_acc)
            if k > 0:
                trim_prompt_cache(dcache, max(0, k - 1 - n_acc))
                pending = [drafts[-1]] if n_acc == k else []
            else:
                pending = []
            for d in drafts[:n_acc]:
                yield d
                emitted += 1
                stats.emitted += 1
                if d in stop:
                    return
            y = nxt

    # -- teacher forcing -----------------------------------------------------------------------
    def teacher_force(
        self, prefix: list[int], forced: list[int], overrides: RequestOverrides | None = None
    ) -> ForcedStream:
        """Feed ``forced`` after ``prefix`` through the decode path; per position (after the
        first, which the prompt's last step makes) the forced token's log-probability and the
        model's argmax, as the vLLM bench reads them. Mechanisms act as in generation (a
        self-draft changes no logits, so speculative engines score the target itself)."""
        from mlx_lm.models.cache import make_prompt_cache

        overrides = overrides or RequestOverrides()
        req = self._new_request(prefix, overrides)
        req.spec = None
        cache = make_prompt_cache(self.model)
        lps: list[float] = []
        greedy: list[int] = []
        try:
            self._prefill(req, prefix, cache)
            logits = self._forward(req, prefix[-1:], cache)[:, -1]
            mx.eval(logits)
            self._observe(req, logits, first=True)
            for pos in range(1, len(forced)):
                logits = self._decode_logits(req, forced[pos - 1], cache)
                logp = logits[0].astype(mx.float32) - mx.logsumexp(logits[0].astype(mx.float32))
                best = mx.argmax(logits[0])
                mx.eval(logp, best)
                self._observe(req, logits, first=False)
                lps.append(float(logp[forced[pos]].item()))
                greedy.append(int(best.item()))
        finally:
            self._finish(req)
        return ForcedStream(lps, greedy)

    # -- telemetry -----------------------------------------------------------------------------
    def request_records(self, tag: str) -> list[dict[str, Any]]:
        return list(self.records.get(tag, []))

    def telemetry(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backend": "mlx",
            "model": self.model_dir,
            "dtype": self.dtype,
            "device": str(mx.default_device()),
            "mechanism": self.mechanism,
            "mode": self.config.mode,
            "requests": self.requests_seen,
            "time": time.time(),
        }
        if self.gears is not None:
            out["precision"] = self.gears.telemetry()
        if self.depth is not None:
            out["depth"] = self.depth.telemetry()
        if self.draft is not None:
            out["speculative"] = {
                "draft": self.draft.name,
                "k": self.k,
                "resident_bytes": self.draft.resident_bytes(),
                **self.spec_totals.as_dict(),
            }
        return out
