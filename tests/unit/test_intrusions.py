"""The registry of intrusions into vLLM (`vllm_adaptive/engine/intrusions.py`): each entry applied
once per process, version-checked, logged; nothing else in the package changes vLLM's objects
or walks the call stack."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from vllm_adaptive.engine import intrusions
from vllm_adaptive.engine.intrusions import INTRUSIONS, Intrusion, apply, attach_drafter_after

PACKAGE = Path(intrusions.__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch):
    """A registry with one fake entry per kind and no history."""
    calls: list[str] = []

    def patch(name: str, result: bool = True, fail: bool = False):
        def run() -> bool:
            calls.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")
            return result

        return run

    entries = {
        "skip": Intrusion("skip", "vllm.thing_a", "register", patch("skip")),
        "needed": Intrusion(
            "needed", "vllm.thing_b", "register", patch("needed"), other_versions="apply"
        ),
        "late": Intrusion("late", "vllm.thing_c", "model construction", patch("late")),
        "noop": Intrusion("noop", "vllm.thing_d", "register", patch("noop", result=False)),
        "broken": Intrusion("broken", "vllm.thing_e", "register", patch("broken", fail=True)),
        "broken-required": Intrusion(
            "broken-required", "vllm.thing_f", "late", patch("br", fail=True), required=True
        ),
    }
    monkeypatch.setattr(intrusions, "INTRUSIONS", entries)
    monkeypatch.setattr(intrusions, "_outcomes", {})
    monkeypatch.setattr(intrusions, "vllm_version", lambda: "0.32.0")
    return calls


def test_applied_once_and_logged(fresh, caplog):
    with caplog.at_level(logging.DEBUG, logger="vllm.adaptive.patches"):
        assert apply("skip") is True
        assert apply("skip") is False  # second time: a no-op that says so
    assert fresh == ["skip"]
    assert "skip: replaced vllm.thing_a" in caplog.text
    assert "skip already handled" in caplog.text


def test_register_applies_only_its_entries(fresh):
    applied = intrusions.apply_at_register()
    assert "late" not in fresh and "broken-required" not in fresh
    assert applied == ["skip", "needed"]  # noop changed nothing, broken failed (logged)
    assert intrusions._outcomes["noop"] == "unchanged"
    assert intrusions._outcomes["broken"] == "failed"
    assert intrusions.apply_at_register() == applied


def test_required_entry_failing_raises(fresh):
    with pytest.raises(RuntimeError, match="br broke"):
        apply("broken-required")
    with pytest.raises(RuntimeError, match="br broke"):  # not remembered: tried again
        apply("broken-required")


def test_other_vllm_version(fresh, monkeypatch, caplog):
    monkeypatch.setattr(intrusions, "vllm_version", lambda: "0.99.1")
    with caplog.at_level(logging.WARNING, logger="vllm.adaptive.patches"):
        assert apply("skip") is False
        assert apply("needed") is True
    assert fresh == ["needed"]
    assert "left vllm.thing_a as it is" in caplog.text
    assert "replacing vllm.thing_b anyway" in caplog.text


def test_registry_entries_are_complete():
    assert set(INTRUSIONS) == {
        "model-registry",
        "admission-check",
        "check-before-stream",
        "xargs-booleans",
        "request-validator",
        "masked-attention-backend",
        "cpu-expand-kernel",
        "drafter-runner",
        "hybrid-drafts",
        "suffix-dynamic-k",
    }
    for name, entry in INTRUSIONS.items():
        assert entry.name == name and entry.replaces and entry.versions
        assert entry.when in ("register", "model construction", "proposer construction")
        assert name in (intrusions.__doc__ or ""), f"{name} is not described in the docstring"


def test_drafter_runner_patches_both_runners_once(monkeypatch):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(CPUModelRunner, "load_model", CPUModelRunner.__dict__["load_model"])
    monkeypatch.setattr(GPUModelRunner, "load_model", GPUModelRunner.__dict__["load_model"])
    monkeypatch.setattr(intrusions, "_outcomes", {})
    original = CPUModelRunner.__dict__["load_model"]
    assert apply("drafter-runner") is True
    patched = CPUModelRunner.__dict__["load_model"]
    assert patched is not original and patched.__wrapped__ is original
    assert intrusions._patched(GPUModelRunner.__dict__["load_model"])
    monkeypatch.setattr(intrusions, "_outcomes", {})  # even without the registry's memory
    assert apply("drafter-runner") is False  # the marks say it is done
    assert CPUModelRunner.__dict__["load_model"] is patched


def test_attach_after_load_only_for_drafters_that_ask():
    class Drafter:
        def attach_runner(self, runner):
            self.runner = runner

    class Runner:
        def __init__(self, drafter):
            self.drafter = drafter

        @attach_drafter_after
        def load_model(self, x, y=0):
            return x + y

    with_drafter = Runner(Drafter())
    assert with_drafter.load_model(1, y=2) == 3
    assert with_drafter.drafter.runner is with_drafter
    assert Runner(object()).load_model(1) == 1  # vLLM's own drafters: untouched
    assert Runner(None).load_model(1) == 1


def _calls(tree: ast.AST) -> set[str]:
    """Names called or attributes read (last dotted part), plus ``inspect.stack`` calls."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            out.add("inspect.stack" if func == "inspect.stack" else func.rsplit(".", 1)[-1])
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_no_intrusion_outside_the_registry_and_no_stack_walks():
    """vLLM's registries are changed only from engine/intrusions.py (the masked backend is
    registered there by its class path); nothing inspects the call stack."""
    registry_calls = {"register_model", "register_backend", "register_kernels"}
    stack_walks = {"_getframe", "f_back", "f_locals", "currentframe", "inspect.stack"}
    allowed = {PACKAGE / "engine" / "intrusions.py": registry_calls}
    found = []
    for path in PACKAGE.rglob("*.py"):
        names = _calls(ast.parse(path.read_text()))
        for name in sorted(names & ((registry_calls - allowed.get(path, set())) | stack_walks)):
            found.append(f"{path.relative_to(PACKAGE.parent)}: {name}")
    assert not found, found
    direct = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if p.name != "intrusions.py"
        and "register_masked_backend" in _calls(ast.parse(p.read_text()))
    ]
    assert not direct, f"apply the masked backend through intrusions.apply: {direct}"


class _Hook:
    def __init__(self):
        self.calls = []

    def cap_drafter(self, drafter):
        self.calls.append(("cap", drafter))

    def kept(self, sampled):
        self.calls.append(("kept", sampled))

    def drafts(self, input_batch, req_ids, learned):
        self.calls.append(("drafts", req_ids, learned))
        return [[9] * len(d) for d in learned]


class _Runner:
    def __init__(self, model):
        self.model = model
        self.drafter = "drafter"
        self.input_batch = "batch"

    def get_model(self):
        return self.model

    def propose(self, x):
        return ("proposed", x)

    def bookkeeping(self):
        return (0, 1, 2, [[5], [6, 7]], 4)

    def take(self):
        from types import SimpleNamespace

        return SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[1], [2, 3]])


@pytest.mark.parametrize("with_hook", [False, True])
def test_hybrid_wrappers_call_the_models_hook_and_only_it(with_hook):
    """Runners whose model has no ``hybrid_drafts`` get vLLM's results unchanged."""
    from types import SimpleNamespace

    hook = _Hook()
    runner = _Runner(SimpleNamespace(hybrid_drafts=hook if with_hook else None))
    propose = intrusions.hybrid_propose(_Runner.propose)
    book = intrusions.hybrid_bookkeeping(_Runner.bookkeeping)
    take = intrusions.hybrid_take_drafts(_Runner.take)
    assert propose(runner, 1) == ("proposed", 1)
    assert book(runner) == (0, 1, 2, [[5], [6, 7]], 4)
    drafts = take(runner).draft_token_ids
    if with_hook:
        assert drafts == [[9], [9, 9]]
        assert hook.calls == [
            ("cap", "drafter"),
            ("kept", [[5], [6, 7]]),
            ("drafts", ["a", "b"], [[1], [2, 3]]),
        ]
    else:
        assert drafts == [[1], [2, 3]] and hook.calls == []


def test_suffix_proposer_drafts_at_most_the_schedulers_k(monkeypatch):
    """vLLM's suffix proposer (Arctic Inference's trees) asserts k == num_speculative_tokens;
    patched, it drafts at most the k the scheduler asks this step, still learns the step's
    tokens at k 0, and keeps its own k for the next step."""
    pytest.importorskip("arctic_inference", reason="bash scripts/install-suffix-decoding.sh")
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    vllms = SuffixDecodingProposer.__dict__["propose"]
    vllms = getattr(vllms, "__wrapped__", vllms)  # an engine in this process may have patched it
    monkeypatch.setattr(SuffixDecodingProposer, "propose", vllms)
    monkeypatch.setattr(intrusions, "_outcomes", {})
    spec = SimpleNamespace(
        num_speculative_tokens=8,
        suffix_decoding_max_tree_depth=24,
        suffix_decoding_max_spec_factor=4.0,
        suffix_decoding_min_token_prob=0.0,
        suffix_decoding_max_cached_requests=0,
    )
    cfg = SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(max_model_len=256))
    proposer = SuffixDecodingProposer(cfg)
    tokens = np.zeros((1, 256), dtype=np.int32)
    prompt = [5, 6, 7, 8, 9] * 6
    tokens[0, : len(prompt)] = prompt

    def batch(n: int) -> SimpleNamespace:
        return SimpleNamespace(
            req_ids=["r"],
            req_id_to_index={"r": 0},
            num_tokens_no_spec=np.array([n]),
            num_prompt_tokens=np.array([len(prompt)]),
            token_ids_cpu=tokens,
        )

    with pytest.raises(AssertionError):  # vLLM's own: a k other than its own kills the step
        proposer.propose(2, batch(len(prompt)), [[]])
    assert apply("suffix-dynamic-k") is True
    tokens[0, 30] = 5
    assert proposer.propose(0, batch(31), [[5]]) == [[]]  # no draft, the token learned
    tokens[0, 31] = 6
    (two,) = proposer.propose(2, batch(32), [[6]])
    assert two == [7, 8] and proposer.num_speculative_tokens == 8
    tokens[0, 32] = 7
    (full,) = proposer.propose(8, batch(33), [[7]])
    assert len(full) == 8 and full[:3] == [8, 9, 5]
