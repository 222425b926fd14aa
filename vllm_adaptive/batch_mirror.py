"""Per-request state kept in step with vLLM's persistent batch.

vLLM lays a step's tokens out in persistent-batch order, and the one hook it calls before
every forward with the batch's changes is a logits processor's ``update_state``. Controllers
that keep per-request state (precision gears, depth budgets) register here; the request
validator forwards each ``BatchUpdate`` to `notify`, which parses every added request's
``adaptive_*`` keys once (`admit`) and hands the listeners an `AdmittedUpdate` whose added
entries carry the typed `RequestOverrides` instead of the raw sampling parameters.
``SlotMirror`` applies it so that slot ``i`` is always the request whose tokens come ``i``-th
in the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from vllm_adaptive.overrides import RequestOverrides, parse_overrides

S = TypeVar("S")


@dataclass(frozen=True)
class AdmittedUpdate:
    """vLLM's ``BatchUpdate`` with each added request's overrides parsed: ``added`` holds
    ``(index, overrides, prompt_ids, output_ids)``; ``removed`` and ``moved`` are vLLM's."""

    removed: Sequence[Any]
    added: Sequence[tuple[int, RequestOverrides, list[int] | None, list[int] | None]]
    moved: Sequence[Any]


def admit(batch_update: Any) -> AdmittedUpdate | None:
    """Parse the ``adaptive_*`` keys of every request ``batch_update`` adds, once."""
    if not batch_update:
        return None
    added = [
        (index, parse_overrides(params.extra_args if params is not None else None), prompt, out)
        for index, params, prompt, out in batch_update.added
    ]
    return AdmittedUpdate(batch_update.removed, added, batch_update.moved)


class BatchListener(Protocol):
    def update_batch(self, batch_update: AdmittedUpdate | None) -> Any: ...


class SlotMirror(Generic[S]):
    """A dict ``batch index -> state`` that follows added/removed/moved requests."""

    def __init__(
        self,
        make: Callable[[Any, list[int] | None, list[int] | None], S],
        finish: Callable[[S], None],
    ) -> None:
        self.slots: dict[int, S] = {}
        self._make = make
        self._finish = finish

    def _drop(self, index: int) -> None:
        state = self.slots.pop(index, None)
        if state is not None:
            self._finish(state)

    def apply(self, batch_update: Any) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self._drop(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            self._drop(index)
            self.slots[index] = self._make(params, prompt_ids, output_ids)
        for a, b, direction in batch_update.moved:
            sa, sb = self.slots.pop(a, None), self.slots.pop(b, None)
            if sa is not None:
                self.slots[b] = sa
            if sb is not None and direction.name == "SWAP":
                self.slots[a] = sb
            elif sb is not None:
                self._finish(sb)

    def rows(self, num_reqs: int) -> list[S] | None:
        """States of rows ``0..num_reqs-1``, or None when the step does not match the mirror
        (a dummy or profiling run)."""
        if num_reqs != len(self.slots):
            return None
        try:
            return [self.slots[i] for i in range(num_reqs)]
        except KeyError:
            return None


#: weak: the engine's model holds its controllers, and a finished engine's (with the layers
#: they reference) must not stay alive in the process through this table
_LISTENERS: weakref.WeakValueDictionary[str, BatchListener] = weakref.WeakValueDictionary()


def register_listener(name: str, listener: BatchListener) -> None:
    """One listener per name and process; a newer engine's controller replaces the old. The
    caller keeps the listener alive (the model holds it): it is dropped here once it is gone."""
    _LISTENERS[name] = listener


def listener(name: str) -> BatchListener | None:
    return _LISTENERS.get(name)


def notify(batch_update: Any) -> None:
    """Hand the batch's changes, requests admitted (`admit`), to every listener."""
    if not _LISTENERS:
        return
    admitted = admit(batch_update)
    for listener_ in list(_LISTENERS.values()):
        listener_.update_batch(admitted)
