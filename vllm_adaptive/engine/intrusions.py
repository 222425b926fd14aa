"""Every intrusion of the plugin into vLLM, in one registry (:data:`INTRUSIONS`).

An intrusion is a change to vLLM's own objects that vLLM offers no hook for. Each entry says
what it replaces, the vLLM versions it was written and checked against, and when it is applied;
:func:`apply` is the one way to apply one. It checks ``vllm.__version__`` (on another version
an entry either stays off with a warning, ``other_versions="skip"``, or is applied with a
warning when the plugin cannot work without it, ``"apply"``), applies it at most once per
process (a second call is a no-op that says so), and logs what it replaced. Like the rest of
the engine glue it imports no mechanism: the classes it hands to vLLM (the model classes, the
masked attention backend) go by their ``module:Class`` paths, which vLLM imports when it needs
them.

Applied by the general plugin (:func:`vllm_adaptive.engine.plugin.register`, every vLLM process,
before engines and the HTTP app are built), :func:`apply_at_register`:

``model-registry``
    ``ModelRegistry``: every adaptive architecture's stock name (``LlamaForCausalLM``, ...)
    gets a dispatcher (``models/dispatch.py``) that builds the stock class unless the engine's
    ``additional_config`` has an ``adaptive`` section, and the adaptive classes are registered
    under their own names, as are the plugin's own architectures (``OWN_ARCHITECTURES``: the
    MoEfied Llama), which have no stock class.
``admission-check``
    ``InputProcessor._build_logits_processors_params_validator`` (every engine front: ``LLM``,
    ``AsyncLLM``): the per-request validator it returns also checks the adaptive overrides
    against *this engine's* adaptive config, so a setting the engine cannot honour
    (``adaptive_gear`` without gears, a depth budget on a non-EMAD signal) is a
    ``VLLMValidationError`` (HTTP 400) naming why. vLLM's logits-processor hook
    (``validate_params``) is a classmethod that never sees the engine's config.
``check-before-stream``
    ``AsyncLLM.generate``: runs that check when the request is submitted, before the first
    ``await``. vLLM validates a request's parameters inside the async generator, which the
    OpenAI server first iterates inside a streaming response, after sending HTTP 200.
``xargs-booleans``
    The OpenAI request models' ``vllm_xargs`` field (completions, chat, responses, Anthropic
    messages): pydantic's lax union ``str | int | float`` turns a JSON ``true`` into ``1``; the
    field gets a wrap validator that puts back the JSON boolean of ``adaptive_*`` keys.

``request-validator``
    ``vllm.v1.sample.logits_processor._load_logitsprocs_plugins``: the plugin's
    ``AdaptiveRequestValidator`` joins the logits processors that vLLM loads from entry points.
    vLLM loads every ``vllm.logits_processors`` entry point whatever ``VLLM_PLUGINS`` says, so
    the validator is not one: it is added only in processes where the general plugin ran, and
    ``VLLM_PLUGINS=""`` gives stock vLLM with none of the plugin's code on its path.

Applied where they must be, through :func:`apply`:

``masked-attention-backend`` (adaptive model construction, ``kv_strategy: "mask"``, before the
    attention layers pick their backend)
    The class path of ``AttentionBackendEnum.CPU_ATTN`` in vLLM's backend registry, and the
    selector's cache: CPU_ATTN layers get the depth-masked impl
    (``attention/masked_backend.py``, registered by its class path). Only in engines that ask
    for the mask.
``cpu-expand-kernel`` (construction of the plugin's proposer)
    vLLM's CPU fallback of the rejection sampler's ``expand_kernel`` in
    ``vllm.triton_utils.dispatcher``, which loses its output and leaves draft temperatures
    uninitialised (see :func:`expand_kernel`). Only in the plugin's speculative engines, after
    the platform registered its fallbacks; stock engines keep vLLM's behaviour, bug included.
``drafter-runner`` (construction of the plugin's proposer)
    ``GPUModelRunner.load_model`` / ``CPUModelRunner.load_model``: once the runner has loaded
    the model and its drafter, a drafter with ``attach_runner`` is handed the runner, whose
    persistent batch says which request is in which row (vLLM's ``custom_class`` interface
    passes rows only). This replaced a walk up the call stack.
``hybrid-drafts`` (adaptive model construction, ``adaptive.hybrid``)
    ``GPUModelRunner.propose_draft_token_ids``, ``_bookkeeping_sync`` and
    ``take_draft_token_ids`` (the CPU runner inherits them): a model with a ``hybrid_drafts``
    object (``speculative/hybrid.py``) gets called to cap its learned drafter's length, to note
    the tokens each request kept, and to put lookup drafts in place of the learned ones where
    they match. vLLM runs one drafter per engine and has no hook between them. Runners whose
    model has none run vLLM's code unchanged.

``suffix-dynamic-k`` (adaptive model construction, a suffix ``speculative_config`` with
    ``num_speculative_tokens_per_batch_size``)
    ``SuffixDecodingProposer.propose``: vLLM's scheduler hands every proposer the k its
    per-batch-size schedule picks, and vLLM 0.32's suffix proposer asserts that k equals
    ``num_speculative_tokens``, which kills the engine at the first batch size whose k differs
    (seen through ``vllm serve``: every request above the schedule's first range failed). It
    gets that k as its longest draft instead (0: the suffix trees still learn the step's tokens,
    no draft). Other engines keep vLLM's proposer, assertion included.

Not in the registry, because vLLM or torch offers them as hooks: the entry points
``vllm.stat_logger_plugins`` (``metrics.py``) and ``vllm.endpoint_plugins`` (``routes.py``); the
``custom_class`` speculative proposer; a torch forward pre-hook the proposer puts on the model it
drafts for (``speculative/proposer.py``). Nor are changes to module instances of the model the
plugin itself built (gears swap a linear's ``quant_method`` in ``models/precision.py``; the Exit
River's backbone offloading replaces a linear's weight in ``depth/exit_river.py``).

Over 400 lines on purpose: every change to vLLM's objects sits in this one file, so that a
review of the plugin against a new vLLM release reads one module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vllm_adaptive.engine import vllm_api

logger = logging.getLogger("vllm.adaptive.patches")

#: vLLM versions every entry was written and checked against (prefixes of ``__version__``).
WRITTEN_FOR = ("0.32.",)
#: Request models whose ``vllm_xargs`` keep JSON booleans of ``adaptive_*`` keys.
XARGS_MODELS = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
    ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest"),
)
_MARK = "__vllm_adaptive_patched__"


@dataclass(frozen=True)
class Intrusion:
    """One change to vLLM's objects; ``patch`` returns whether it changed anything."""

    name: str
    replaces: str
    when: Literal["register", "model construction", "proposer construction"]
    patch: Callable[[], bool]
    #: on a vLLM outside ``versions``: "skip" (warn, leave vLLM alone) or "apply" (warn, apply:
    #: the feature that needs it cannot run otherwise)
    other_versions: Literal["skip", "apply"] = "skip"
    versions: tuple[str, ...] = WRITTEN_FOR
    #: a failing patch raises (True) or is logged and left off (False: vLLM must still start)
    required: bool = False


#: name -> outcome in this process: "replaced", "unchanged" (nothing to replace), "skipped"
#: (other vLLM version) or "failed"
_outcomes: dict[str, str] = {}


def vllm_version() -> str:
    return vllm_api.version()


def apply(name: str) -> bool:
    """Apply the registry entry ``name`` once per process; True when it changed vLLM now."""
    entry = INTRUSIONS[name]
    if name in _outcomes:
        logger.debug(
            "vllm-adaptive: %s already handled in this process (%s)", name, _outcomes[name]
        )
        return False
    version = vllm_version()
    if not version.startswith(entry.versions):
        if entry.other_versions == "skip":
            logger.warning(
                "vllm-adaptive: vLLM %s is not one %s was written for (%s); left %s as it is",
                version,
                name,
                ", ".join(v + "x" for v in entry.versions),
                entry.replaces,
            )
            _outcomes[name] = "skipped"
            return False
        logger.warning(
            "vllm-adaptive: vLLM %s is not one %s was written for (%s); replacing %s anyway "
            "(the plugin needs it)",
            version,
            name,
            ", ".join(v + "x" for v in entry.versions),
            entry.replaces,
        )
    try:
        changed = entry.patch()
    except Exception:
        if entry.required:
            raise  # not recorded: the engine that needed it fails, a later one may try again
        _outcomes[name] = "failed"
        logger.exception("vllm-adaptive: could not replace %s (%s)", entry.replaces, name)
        return False
    _outcomes[name] = "replaced" if changed else "unchanged"
    if changed:
        logger.info("vllm-adaptive: %s: replaced %s", name, entry.replaces)
    else:
        logger.debug("vllm-adaptive: %s: nothing to replace in %s", name, entry.replaces)
    return changed


def apply_at_register() -> list[str]:
    """Apply every entry applied by the general plugin; the names handled so far."""
    for entry in INTRUSIONS.values():
        if entry.when == "register":
            apply(entry.name)
    return applied()


def applied() -> list[str]:
    """Entries this process replaced something for."""
    return [name for name, outcome in _outcomes.items() if outcome == "replaced"]


def _mark(fn: Callable) -> Callable:
    setattr(fn, _MARK, True)
    return fn


def _patched(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


# -- model registry ------------------------------------------------------------------------------


def _patch_model_registry() -> bool:
    from vllm import ModelRegistry

    from vllm_adaptive.architectures import registry_entries

    changed = False
    for name, target in registry_entries():
        current = ModelRegistry.models.get(name)
        module, _, cls = target.partition(":")
        if (
            getattr(current, "module_name", None) == module
            and getattr(current, "class_name", None) == cls
        ):
            continue
        ModelRegistry.register_model(name, target)
        changed = True
    return changed


# -- 1. engine-aware admission check ----------------------------------------------------------


def _patch_input_processor() -> bool:
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._build_logits_processors_params_validator
    if _patched(original):
        return False

    @functools.wraps(original)
    def build(self):
        from vllm_adaptive.engine.request_validator import engine_request_check

        base = original(self)
        check = engine_request_check(self.vllm_config)
        self._vllm_adaptive_check = check

        def validate(params) -> None:
            base(params)
            check(params)

        return validate

    InputProcessor._build_logits_processors_params_validator = _mark(build)
    return True


# -- 2. the check before the stream starts ----------------------------------------------------


def _patch_async_generate() -> bool:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.generate
    if _patched(original):
        return False

    @functools.wraps(original)
    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        # A plain function returning vLLM's async generator: the check raises at the call,
        # which the OpenAI serving code makes before it returns a StreamingResponse.
        check = getattr(getattr(self, "input_processor", None), "_vllm_adaptive_check", None)
        if check is not None and isinstance(sampling_params, SamplingParams):
            check(sampling_params)
        return original(self, prompt, sampling_params, request_id, *args, **kwargs)

    AsyncLLM.generate = _mark(generate)
    return True


# -- 3. JSON booleans in vllm_xargs -------------------------------------------------------------


def keep_adaptive_booleans(value: Any, handler: Callable[[Any], Any]) -> Any:
    """Wrap validator of ``vllm_xargs``: vLLM's validation, then the ``adaptive_*`` keys that
    were JSON booleans get their boolean back (to be refused by name, not read as 0 / 1)."""
    from vllm_adaptive.engine.request_validator import EXTRA_ARGS_PREFIX

    out = handler(value)
    if isinstance(value, dict) and isinstance(out, dict):
        for key, raw in value.items():
            if isinstance(key, str) and key.startswith(EXTRA_ARGS_PREFIX) and isinstance(raw, bool):
                out[key] = raw
    return out


def _patch_xargs_models() -> bool:
    import importlib
    from typing import Annotated

    from pydantic import WrapValidator
    from pydantic.fields import FieldInfo

    done = 0
    for module_name, cls_name in XARGS_MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            logger.debug("vllm-adaptive: no %s.%s in this vLLM", module_name, cls_name)
            continue
        fields = cls.model_fields
        field = fields.get("vllm_xargs")
        if field is None or getattr(cls, _MARK, False):
            continue
        annotation = Annotated[field.annotation, WrapValidator(keep_adaptive_booleans)]
        fields["vllm_xargs"] = FieldInfo.merge_field_infos(field, annotation=annotation)
        cls.model_rebuild(force=True)
        setattr(cls, _MARK, True)
        done += 1
    return done > 0


# -- 4. the request validator among vLLM's logits processors -----------------------------------


def _patch_logitsprocs_loader() -> bool:
    """``AdaptiveRequestValidator`` (the admission check; ``update_state`` is the per-step batch
    hook of ``batch_mirror``) after the entry-point logits processors, in this process only."""
    from vllm.v1.sample import logits_processor as lp

    original = lp._load_logitsprocs_plugins
    if _patched(original):
        return False

    @functools.wraps(original)
    def load_plugins() -> list:
        from vllm_adaptive.engine.request_validator import AdaptiveRequestValidator

        classes = list(original())
        if AdaptiveRequestValidator not in classes:
            classes.append(AdaptiveRequestValidator)
        return classes

    lp._load_logitsprocs_plugins = _mark(load_plugins)
    lp.cached_load_custom_logitsprocs.cache_clear()  # a list loaded before the patch
    return True


# -- masked attention backend --------------------------------------------------------------------


#: The depth-masked CPU_ATTN backend, by path: vLLM imports it when a layer picks its backend.
MASKED_BACKEND_PATH = "vllm_adaptive.attention.masked_backend.MaskedCPUAttentionBackend"


def _clear_selector_cache() -> None:
    """``vllm.v1.attention.selector._cached_get_attn_backend`` is ``functools.cache``d on the
    selection (not on the registry), so a layer built after an override change would otherwise
    get the class resolved before it."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


def register_masked_backend() -> bool:
    """Make vLLM build CPU_ATTN layers with the masked impl (in this process). Call before the
    model's attention layers are built (through ``apply("masked-attention-backend")``).
    Idempotent: True when it changed the registry, False when the masked backend was already
    registered. Refuses to replace another override of CPU_ATTN."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    cpu = AttentionBackendEnum.CPU_ATTN
    if cpu.get_path() == MASKED_BACKEND_PATH:
        return False
    if cpu.is_overridden():
        raise RuntimeError(
            f"CPU_ATTN is already overridden with {cpu.get_path()!r}; the KV mask would replace "
            "it (unregister that backend first)"
        )
    register_backend(cpu, MASKED_BACKEND_PATH)
    _clear_selector_cache()
    return True


def unregister_masked_backend() -> bool:
    """Undo :func:`register_masked_backend` (layers already built keep their impl; for tests).
    True when the masked backend was registered."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu = AttentionBackendEnum.CPU_ATTN
    if cpu.get_path() != MASKED_BACKEND_PATH:
        return False
    cpu.clear_override()
    _clear_selector_cache()
    return True


# -- the rejection sampler's CPU expand_kernel ---------------------------------------------------


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(output, input_ptr, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[t] = x[r]`` for every token ``t`` of request ``r`` (``replace_from`` in ``x``
    becomes ``replace_to``), in ``output``'s own dtype.

    Replaces vLLM 0.32's CPU fallback (``vllm/utils/cpu_triton_utils.py``), which converts its
    output buffer to int64 before the C++ call (``_ensure_int64`` copies a float tensor) and
    never copies the result back. ``expand_batch_to_tokens`` uses it to give every draft token
    its request's temperature, so with random sampling the temperatures of draft positions are
    uninitialised memory and the rejection sampler accepts and recovers tokens from garbage
    distributions; greedy requests do not read it. It breaks every proposer on CPU, vLLM's own
    ``ngram`` included (measured: docs/speculative.md)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    vals = torch.where(
        input_ptr == replace_from, torch.as_tensor(replace_to, dtype=input_ptr.dtype), input_ptr
    )
    output.copy_(torch.repeat_interleave(vals, counts, output_size=output.numel()))


def _patch_expand_kernel() -> bool:
    from vllm.triton_utils import dispatcher

    current = dispatcher._registry.get(EXPAND_KERNEL)
    if current is None or getattr(current[1], "__module__", "") != "vllm.utils.cpu_triton_utils":
        return False  # Triton runs it, or it is replaced already
    dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel})
    return True


# -- the model runner for the plugin's drafter ---------------------------------------------------


def attach_drafter_after(load_model: Callable) -> Callable:
    """``load_model`` of a model runner, then ``drafter.attach_runner(runner)`` for a drafter
    that has one."""

    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        attach = getattr(getattr(self, "drafter", None), "attach_runner", None)
        if callable(attach):
            attach(self)
        return out

    return _mark(wrapped)


def _patch_runner_load_model() -> bool:
    import importlib

    changed = False
    for module_name, cls_name in (
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),  # overrides load_model
    ):
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except ImportError:  # a build without this runner cannot be running it
            continue
        original = cls.__dict__.get("load_model")
        if original is None or _patched(original):
            continue
        cls.load_model = attach_drafter_after(original)
        changed = True
    return changed


def _hybrid_hook(runner: Any) -> Any:
    """The model's ``hybrid_drafts`` (``speculative/hybrid.py``), looked up once per runner."""
    hook = runner.__dict__.get("_adaptive_hybrid_drafts", _UNSET)
    if hook is _UNSET:
        try:
            model = runner.get_model()
        except (AttributeError, AssertionError):  # no model loaded yet
            return None
        hook = getattr(model, "hybrid_drafts", None)
        runner._adaptive_hybrid_drafts = hook
    return hook


_UNSET = object()


def hybrid_propose(propose: Callable) -> Callable:
    """``propose_draft_token_ids``: the hook caps the learned drafter's draft length first."""

    @functools.wraps(propose)
    def wrapped(self, *args, **kwargs):
        hook = _hybrid_hook(self)
        if hook is not None:
            hook.cap_drafter(getattr(self, "drafter", None))
        return propose(self, *args, **kwargs)

    return _mark(wrapped)


def hybrid_bookkeeping(bookkeeping: Callable) -> Callable:
    """``_bookkeeping_sync``: the hook notes the tokens each request kept (4th result)."""

    @functools.wraps(bookkeeping)
    def wrapped(self, *args, **kwargs):
        out = bookkeeping(self, *args, **kwargs)
        hook = _hybrid_hook(self)
        if hook is not None:
            hook.kept(out[3])
        return out

    return _mark(wrapped)


def hybrid_take_drafts(take: Callable) -> Callable:
    """``take_draft_token_ids``: the hook replaces drafts where a lookup matches."""

    @functools.wraps(take)
    def wrapped(self, *args, **kwargs):
        out = take(self, *args, **kwargs)
        hook = _hybrid_hook(self)
        if hook is None or out is None:
            return out
        out.draft_token_ids = hook.drafts(
            self.input_batch, list(out.req_ids), [list(d) for d in out.draft_token_ids]
        )
        return out

    return _mark(wrapped)


def suffix_dynamic_k(propose: Callable) -> Callable:
    """``SuffixDecodingProposer.propose`` drafting at most the scheduler's k this step."""

    @functools.wraps(propose)
    def wrapped(self, num_speculative_tokens: int, *args, **kwargs):
        full = self.num_speculative_tokens
        if num_speculative_tokens == full:
            return propose(self, num_speculative_tokens, *args, **kwargs)
        self.num_speculative_tokens = num_speculative_tokens  # read as the draft's length cap
        try:
            return propose(self, num_speculative_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = full

    return _mark(wrapped)


def _patch_suffix_dynamic_k() -> bool:
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    original = SuffixDecodingProposer.__dict__["propose"]
    if _patched(original):
        return False
    SuffixDecodingProposer.propose = suffix_dynamic_k(original)
    return True


def _patch_hybrid_drafts() -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    changed = False
    for name, wrap in (
        ("propose_draft_token_ids", hybrid_propose),
        ("_bookkeeping_sync", hybrid_bookkeeping),
        ("take_draft_token_ids", hybrid_take_drafts),
    ):
        original = GPUModelRunner.__dict__[name]
        if not _patched(original):
            setattr(GPUModelRunner, name, wrap(original))
            changed = True
    return changed


INTRUSIONS: dict[str, Intrusion] = {
    e.name: e
    for e in (
        Intrusion(
            "model-registry",
            "ModelRegistry entries of the adaptive architectures",
            "register",
            _patch_model_registry,
            other_versions="apply",
            required=True,
        ),
        Intrusion(
            "admission-check",
            "InputProcessor._build_logits_processors_params_validator",
            "register",
            _patch_input_processor,
        ),
        Intrusion("check-before-stream", "AsyncLLM.generate", "register", _patch_async_generate),
        Intrusion(
            "xargs-booleans",
            "the vllm_xargs field of the OpenAI request models",
            "register",
            _patch_xargs_models,
        ),
        Intrusion(
            "request-validator",
            "vllm.v1.sample.logits_processor._load_logitsprocs_plugins",
            "register",
            _patch_logitsprocs_loader,
            other_versions="apply",
            required=True,
        ),
        Intrusion(
            "masked-attention-backend",
            "AttentionBackendEnum.CPU_ATTN's class path",
            "model construction",
            register_masked_backend,
            other_versions="apply",
            required=True,
        ),
        Intrusion(
            "cpu-expand-kernel",
            "vllm.triton_utils.dispatcher's CPU expand_kernel",
            "proposer construction",
            _patch_expand_kernel,
        ),
        Intrusion(
            "hybrid-drafts",
            "GPUModelRunner.propose_draft_token_ids, _bookkeeping_sync and take_draft_token_ids",
            "model construction",
            _patch_hybrid_drafts,
            other_versions="apply",
            required=True,
        ),
        Intrusion(
            "suffix-dynamic-k",
            "SuffixDecodingProposer.propose",
            "model construction",
            _patch_suffix_dynamic_k,
            other_versions="apply",
            required=True,
        ),
        Intrusion(
            "drafter-runner",
            "GPUModelRunner.load_model and CPUModelRunner.load_model",
            "proposer construction",
            _patch_runner_load_model,
            other_versions="apply",
            required=True,
        ),
    )
}
