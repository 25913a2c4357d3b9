"""A ``record_function`` range around each call of named blocks, so that a ``torch.profiler`` trace
and its summary say which block the time went to (``unet.down_blocks.0``).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> with torch.profiler.profile() as prof, apply_ranges([("net", model), ("net.0", model[0])]):
...     _ = model(torch.ones(1, 2))
>>> sorted(e.key for e in prof.key_averages() if e.key.startswith("net"))
['net', 'net.0']

Limits: ranges are opened by Python only: under ``torch.compile`` no range is opened inside the
compiled code (a compiled region shows in the trace under its own name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .handles import ProbeHandle, register_all
from .tracing import compiling


class BlockRanges:
    """The ranges open now, per module (calls may nest); the state of :func:`apply_ranges`."""

    def __init__(self) -> None:
        self._open: dict[int, list[Any]] = {}

    def enter(self, label: str, module: nn.Module) -> None:
        """Open the range ``label`` for a call of ``module`` (also from outside a hook: a call
        that began before the hooks were added)."""
        if compiling():
            return
        scope = torch.autograd.profiler.record_function(label)
        self._open.setdefault(id(module), []).append(scope.__enter__())

    def exit(self, module: nn.Module) -> None:
        ranges = self._open.get(id(module))
        if ranges:
            ranges.pop().__exit__(None, None, None)

    def close_all(self) -> None:
        """End the ranges a forward that raised left open."""
        for ranges in self._open.values():
            while ranges:
                ranges.pop().__exit__(None, None, None)
        self._open.clear()


def apply_ranges(blocks: list[tuple[str, nn.Module]]) -> ProbeHandle:
    """A range named ``label`` around each call of each ``(label, module)``; the handle's
    ``state`` is the :class:`BlockRanges`, and ``remove()`` ends any range left open."""
    ranges = BlockRanges()

    def register():
        for label, module in blocks:
            yield module.register_forward_pre_hook(lambda m, _args, label=label: ranges.enter(label, m))
            yield module.register_forward_hook(lambda m, _args, _output: ranges.exit(m), always_call=True)

    return register_all(register, on_remove=ranges.close_all, state=ranges)
