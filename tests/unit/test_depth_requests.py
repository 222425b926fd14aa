"""Per-request depth settings (no engine): parsed once when the request joins the batch
(`batch_mirror.admit`), resolved to thresholds there, and read by the runtime's plan."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_adaptive import batch_mirror
from vllm_adaptive.batch_mirror import admit
from vllm_adaptive.depth.requests import BudgetThresholds, DepthRequests
from vllm_adaptive.overrides import RequestOverrideError


class _Profile:
    # thresholds below 0.4 at every probe lie under the proxy's range: they never pass
    proxy_floor = np.full(3, 0.4)

    def __init__(self) -> None:
        self.calls: list[float] = []

    def thresholds_for(self, budget: float) -> np.ndarray:
        self.calls.append(budget)
        return np.full(3, budget)


def _params(**extra) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra)


def _update(added=(), removed=(), moved=()) -> SimpleNamespace:
    return SimpleNamespace(added=list(added), removed=list(removed), moved=list(moved))


def _requests(signals=("emad",)) -> tuple[DepthRequests, _Profile]:
    profile = _Profile()
    reqs = DepthRequests(
        num_layers=8,
        thresholds=BudgetThresholds(profile, 0.3),
        signal_names=signals,
        telemetry_path=None,
    )
    return reqs, profile


def test_admission_resolves_budget_mode_and_tag(monkeypatch) -> None:
    monkeypatch.setattr("vllm_adaptive.depth.requests.exchange", lambda *a: None)
    reqs, profile = _requests()
    finished = reqs.update_batch(
        admit(
            _update(
                added=[
                    (0, _params(adaptive_request_tag="a"), [1, 2], []),
                    (1, _params(adaptive_depth_budget=0.5), [3], []),
                    (2, _params(adaptive_mode="off"), [4, 5, 6], []),
                    (3, _params(adaptive_depth_budget=1.0), [7], []),
                ]
            )
        )
    )
    assert finished == 0
    a, b, off, full = reqs.rows(4)
    assert (a.tag, a.budget, a.off, a.prompt_len) == ("a", None, False, 2)
    assert a.thresholds.tolist() == [0.3] * 3  # the engine's budget
    assert (b.budget, b.off) == (0.5, False) and b.thresholds.tolist() == [0.5] * 3
    assert off.off and off.thresholds.tolist() == [1.0] * 3
    assert full.off and full.budget == 1.0
    # quiet (the plan may be skipped): off, or no threshold within the proxy's range
    assert [r.quiet for r in (a, b, off, full)] == [True, False, True, True]
    assert sorted(profile.calls) == [0.3, 0.5, 1.0]  # one per budget, cached
    assert reqs.update_batch(admit(_update(removed=[0, 2]))) == 2
    finished, running = reqs.records()
    assert [r["tag"] for r in finished] == ["a", "req3"]
    assert len(running) == 2


def test_bad_keys_fail_at_admission() -> None:
    with pytest.raises(RequestOverrideError, match="adaptive_depth_budget"):
        admit(_update(added=[(0, _params(adaptive_depth_budget=2.0), [1], [])]))


def test_notify_parses_once_for_every_listener(monkeypatch) -> None:
    seen: list = []

    class Listener:
        def update_batch(self, update) -> None:
            seen.append(update)

    parses: list = []
    real = batch_mirror.parse_overrides
    monkeypatch.setattr(
        batch_mirror, "parse_overrides", lambda extra: parses.append(extra) or real(extra)
    )
    monkeypatch.setattr(batch_mirror, "_LISTENERS", {"a": Listener(), "b": Listener()})
    batch_mirror.notify(_update(added=[(0, _params(adaptive_mode="off"), [1], [])]))
    assert len(parses) == 1 and len(seen) == 2 and seen[0] is seen[1]
    assert seen[0].added[0][1].mode == "off"


def test_listeners_do_not_keep_a_finished_engines_controllers_alive(monkeypatch) -> None:
    """The model holds its controllers; once it is gone, the batch hook forgets them."""
    import gc

    # an empty table of the module's own kind (a plain dict would keep the controller alive)
    monkeypatch.setattr(batch_mirror, "_LISTENERS", type(batch_mirror._LISTENERS)())

    class Controller:
        def __init__(self) -> None:
            self.layers = [bytearray(1 << 20)]  # what a controller keeps: the engine's layers

        def update_batch(self, update) -> None:
            pass

    model = {"precision": Controller()}  # the engine's model holds it
    batch_mirror.register_listener("precision", model["precision"])
    gc.collect()
    assert batch_mirror.listener("precision") is model["precision"]
    del model
    gc.collect()
    assert batch_mirror.listener("precision") is None
    batch_mirror.notify(_update(added=[(0, _params(), [1], [])]))  # no listener: nothing to do


def test_requests_module_does_not_know_the_runtime() -> None:
    """One-way dependency: the runtime owns and calls DepthRequests, never the reverse."""
    src = Path(__file__).resolve().parents[2] / "vllm_adaptive/depth/requests.py"
    tree = ast.parse(src.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    mods = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module is not None
    }
    assert "runtime" not in names | attrs
    assert not any(m.endswith("runtime") for m in mods)


def test_only_an_emad_engine_knows_a_request_cannot_exit() -> None:
    """Another signal ignores budgets: its requests may exit unless switched off."""
    reqs, _ = _requests(signals=("emad", "quicksilver"))
    reqs.update_batch(
        admit(
            _update(
                added=[
                    (0, _params(adaptive_depth_budget=0.3), [1], []),
                    (1, _params(adaptive_mode="off"), [2], []),
                ]
            )
        )
    )
    low, off = reqs.rows(2)
    assert not low.quiet and off.quiet
