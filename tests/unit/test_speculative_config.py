"""adaptive.speculative: what parses, what is refused (and that the message names the key)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_adaptive.config import (
    SELF_SPECULATIVE_PROPOSER,
    AdaptiveConfigError,
    parse_adaptive_config,
)


def test_defaults_per_draft() -> None:
    low = parse_adaptive_config({"speculative": {"draft": "lowbit"}}).speculative
    assert (low.draft_precision, low.head_precision, low.symmetric) == ("int4", "int4", False)
    early = parse_adaptive_config({"speculative": {"draft": "early", "layers": 8}}).speculative
    assert (early.layers, early.head_precision) == (8, "full")
    m = parse_adaptive_config({"speculative": {"draft": "m2r2", "adapter": "/x"}}).speculative
    assert m.adapter == "/x"
    assert low.prompt_lookup is None  # the hybrid drafter is opt-in
    hybrid = {"draft": "lowbit", "prompt_lookup": {}}
    lookup = parse_adaptive_config({"speculative": hybrid}).speculative.prompt_lookup
    assert (lookup.min, lookup.max) == (2, 5)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"draft": "lowbit", "layers": 4}, "layers"),
        ({"draft": "early", "precision": "int8"}, "precision"),
        ({"draft": "m2r2"}, "adapter"),
        ({"draft": "early", "adapter": "/x"}, "adapter"),
        ({"draft": "medusa"}, "adaptive.speculative.draft"),
        ({"draft": "early", "layers": 0}, "adaptive.speculative.layers"),
        ({"draft": "lowbit", "precision": "int2"}, "adaptive.speculative.precision"),
        ({"draft": "lowbit", "window": 3}, "adaptive.speculative.window: unknown key"),
        ({"draft": "lowbit", "prompt_lookup": {"min": 4, "max": 2}}, "min 4 > max 2"),
        ({"draft": "lowbit", "prompt_lookup": {"min": 0}}, "prompt_lookup.min"),
    ],
)
def test_bad_settings_name_their_key(spec: dict, fragment: str) -> None:
    with pytest.raises(AdaptiveConfigError, match=fragment):
        parse_adaptive_config({"speculative": spec})


def test_not_combined_with_depth_or_gear_routing() -> None:
    with pytest.raises(AdaptiveConfigError, match="speculative"):
        parse_adaptive_config(
            {"speculative": {"draft": "lowbit"}, "precision": {"policy": "gearbx"}}
        )
    with pytest.raises(AdaptiveConfigError, match="speculative"):
        parse_adaptive_config({"speculative": {"draft": "lowbit"}, "depth": {"profile": "p"}})
    # a target at one fixed precision verifies the drafts (e.g. an fp16 target, a W8A8 draft)
    cfg = parse_adaptive_config(
        {
            "speculative": {"draft": "lowbit", "precision": "w8a8"},
            "precision": {"policy": "fixed", "gear": "fp16"},
        }
    )
    assert cfg.active_precision.gear == "fp16" and cfg.active_speculative.draft_precision == "w8a8"


def test_mode_off_disables_the_draft() -> None:
    cfg = parse_adaptive_config({"mode": "off", "speculative": {"draft": "lowbit"}})
    assert cfg.speculative is not None and cfg.active_speculative is None


def _vllm_config(spec):
    return SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        device_config=SimpleNamespace(device=SimpleNamespace(type="cpu")),
    )


def test_engine_start_needs_the_plugin_proposer() -> None:
    from vllm_adaptive.models.llama import check_engine_compatible

    adaptive = parse_adaptive_config({"speculative": {"draft": "lowbit"}})
    with pytest.raises(AdaptiveConfigError, match=SELF_SPECULATIVE_PROPOSER):
        check_engine_compatible(_vllm_config(None), adaptive)
    with pytest.raises(AdaptiveConfigError, match="custom_class"):
        check_engine_compatible(_vllm_config(SimpleNamespace(method="ngram")), adaptive)
    check_engine_compatible(_vllm_config(SimpleNamespace(method="custom_class")), adaptive)


def test_a_batch_size_schedule_is_refused_not_ignored() -> None:
    """vLLM hands the scheduler's per-batch-size k to its own proposers only; the plugin's
    custom_class proposer would draft num_speculative_tokens at every batch size."""
    from vllm_adaptive.models.llama import check_engine_compatible

    adaptive = parse_adaptive_config({"speculative": {"draft": "lowbit"}})
    schedule = [[1, 2, 4], [3, 1024, 0]]
    spec = SimpleNamespace(method="custom_class", num_speculative_tokens_per_batch_size=schedule)
    with pytest.raises(AdaptiveConfigError, match="num_speculative_tokens_per_batch_size"):
        check_engine_compatible(_vllm_config(spec), adaptive)


def test_proposer_without_settings_is_refused() -> None:
    from vllm_adaptive.speculative.proposer import SelfSpeculativeProposer

    cfg = SimpleNamespace(additional_config={"adaptive": {}}, speculative_config=None)
    with pytest.raises(AdaptiveConfigError, match="adaptive.speculative"):
        SelfSpeculativeProposer(cfg)


def test_requests_sent_with_mode_off_do_not_draft() -> None:
    """The proposer reads each row's request from the runner that loaded it, which hands
    itself over after loading (intrusions entry drafter-runner)."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_adaptive.engine.intrusions import attach_drafter_after
    from vllm_adaptive.speculative.requests import DraftingRequests

    def state(**extra) -> SimpleNamespace:
        return SimpleNamespace(sampling_params=SamplingParams(extra_args=extra or None))

    class Runner:
        def __init__(self) -> None:
            self.input_batch = SimpleNamespace(req_ids=["a", "b"])
            self.requests = {"a": state(adaptive_mode="off"), "b": state(adaptive_request_tag="t")}

        @attach_drafter_after
        def load_model(self):
            self.drafter = Drafter()
            return "loaded"

    class Drafter:
        runner = None

        def attach_runner(self, runner):
            self.runner = runner

    runner = Runner()
    assert runner.load_model() == "loaded"
    assert runner.drafter.runner is runner
    reqs = DraftingRequests(runner.drafter.runner)
    assert reqs.drafting(2) == [False, True]
    runner.input_batch.req_ids = ["b", "a"]  # rows moved
    assert reqs.drafting(2) == [True, False]
    assert reqs.drafting(3) == [True, True, True]  # not the batch's step (a dummy run): all draft
    with pytest.raises(RuntimeError, match="model runner"):
        DraftingRequests(object())


def _eagle_engine(method: str | None, dtype):
    cfg = _vllm_config(SimpleNamespace(method=method) if method else None)
    cfg.model_config = SimpleNamespace(dtype=dtype)
    return cfg


def test_draft_head_gear_is_checked_at_engine_start() -> None:
    """adaptive.draft_head needs vLLM's EAGLE drafter and a gear the engine's dtype runs; a
    section nothing would read is refused, not ignored."""
    import torch

    from vllm_adaptive.kernels import native
    from vllm_adaptive.models.llama import check_engine_compatible
    from vllm_adaptive.models.llama_eagle3 import draft_head_problem

    int8 = parse_adaptive_config({"draft_head": {"gear": "int8"}})
    with pytest.raises(AdaptiveConfigError, match="EAGLE.*got 'suffix'"):
        check_engine_compatible(_eagle_engine("suffix", torch.bfloat16), int8)
    with pytest.raises(AdaptiveConfigError, match="got None"):
        check_engine_compatible(_eagle_engine(None, torch.bfloat16), int8)
    fp16 = parse_adaptive_config({"draft_head": {"gear": "fp16"}})
    with pytest.raises(AdaptiveConfigError, match="'fp16' runs on float32 engines, not bfloat16"):
        check_engine_compatible(_eagle_engine("eagle3", torch.bfloat16), fp16)
    assert draft_head_problem(fp16, _eagle_engine("eagle3", torch.float32)) is None
    if native.int8_linear_ops() is not None:
        assert draft_head_problem(int8, _eagle_engine("eagle3", torch.bfloat16)) is None
    with pytest.raises(AdaptiveConfigError, match="adaptive.draft_head.gear"):
        parse_adaptive_config({"draft_head": {"gear": "int4"}})


def test_the_draft_head_runs_the_targets_gear_unless_told() -> None:
    import torch

    from vllm_adaptive.kernels import native
    from vllm_adaptive.models.llama_eagle3 import draft_precision

    def head(adaptive: dict | None, dtype) -> str | None:
        extra = {} if adaptive is None else {"adaptive": adaptive}
        return draft_precision(
            SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(dtype=dtype))
        )

    fp16 = {"precision": {"policy": "fixed", "gear": "fp16"}}
    int8 = {"precision": {"policy": "fixed", "gear": "int8"}}
    assert head(None, torch.float32) is None
    assert head({}, torch.bfloat16) is None  # adaptivity off: vLLM's own head
    assert head(fp16, torch.float32) == "fp16"
    assert head(fp16, torch.bfloat16) is None
    assert head({**fp16, "draft_head": {"gear": "full"}}, torch.float32) is None
    assert head({"draft_head": {"gear": "int8"}}, torch.bfloat16) == "int8"
    assert head({"mode": "off", "draft_head": {"gear": "int8"}}, torch.bfloat16) is None
    want = "int8" if native.int8_linear_ops() is not None else None
    assert head(int8, torch.bfloat16) == want
