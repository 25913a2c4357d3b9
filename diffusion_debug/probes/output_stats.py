"""Full statistics of what each module returns: shape, dtype and :func:`stats.measure` of its first
floating output tensor, per call, for a one-off inspection (``inspect_model``).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
>>> with apply_output_stats(model) as handle:
...     _ = model(torch.ones(1, 2))
>>> [(o.module, o.type, o.shape, o.tensors) for o in handle.state.collect()]
[('0', 'Linear', (1, 3), 1), ('1', 'ReLU', (1, 3), 1), ('', 'Sequential', (1, 3), 1)]

Each output costs a dozen fused reductions on its device (too many to leave on: the sentinel and
full NaN/Inf probes of :mod:`.readings` read one value a tensor); everything queued reaches the
host in one transfer per device at :meth:`OutputStats.collect`. Only torch's forward hooks.

Limits: of an output holding several tensors (a tuple, a ``ModelOutput``) only the first floating
one is measured, ``tensors`` says how many there were; a module whose output holds no floating
tensor gets a row without statistics.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..stats import PendingStats, TensorStats, collect, measure, tensors_in
from .handles import ProbeHandle, register_all


@dataclass(frozen=True)
class ModuleOutput:
    """One call of one module: what it returned."""

    module: str
    call: int
    """Calls of this module before this one (0 for the first)."""
    type: str
    shape: tuple[int, ...] | None
    tensors: int
    """Tensors in the output (all of them; only the first floating one is measured)."""
    stats: TensorStats | None


class OutputStats:
    """The hooks' state: what was queued, in the order calls finished."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._calls: list[tuple[str, str, int, PendingStats | None]] = []

    def hook(self, name: str):
        def post_hook(module: nn.Module, args: tuple, output: Any) -> None:
            found = tensors_in(output)
            floating = next((t for t in found if t.is_floating_point()), None)
            pending = measure(floating) if floating is not None else None
            self._calls.append((name, type(module).__name__, len(found), pending))

        return post_hook

    def collect(self) -> list[ModuleOutput]:
        """Bring every queued measurement to the host (one transfer per device) and start afresh."""
        calls, self._calls = self._calls, []
        measured = iter(collect([p for *_, p in calls if p is not None]))
        counts: dict[str, int] = {}
        out = []
        for name, type_name, tensors, pending in calls:
            call = counts.get(name, 0)
            counts[name] = call + 1
            stats = next(measured) if pending is not None else None
            shape = stats.shape if stats is not None else None
            out.append(ModuleOutput(name, call, type_name, shape, tensors, stats))
        return out


def apply_output_stats(model: nn.Module) -> ProbeHandle:
    """Measure the output of every module of ``model`` (itself included, as ``""``); the handle's
    ``state`` is the :class:`OutputStats` whose ``collect()`` gives the rows."""
    state = OutputStats(model)

    def register():
        for name, module in model.named_modules():  # a shared module once, under its first name
            yield module.register_forward_hook(torch.no_grad()(state.hook(name)))

    return register_all(register, state=state)
