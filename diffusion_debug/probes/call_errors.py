"""Errors raised inside a module's call, seen on their way out: a forward pre-hook notes the error
already in flight (if any) and an ``always_call`` forward hook, which torch runs from its own
``except`` block, reads the one raised during the call. The error goes on unchanged.

>>> import torch
>>> seen = []
>>> layer = torch.nn.Linear(2, 2)
>>> def fail(module, args):
...     raise torch.OutOfMemoryError("planted")
>>> with apply_call_errors(layer, CallErrorsConfig(lambda module, error: seen.append(str(error)))):
...     with layer.register_forward_pre_hook(fail):
...         layer(torch.ones(1, 2))
Traceback (most recent call last):
...
torch.OutOfMemoryError: planted
>>> seen
['planted']

Limits: only errors of the configured types, and only ``Exception`` subclasses (torch runs
``always_call`` hooks for those); an error already in flight when the call began (a retry inside
an ``except`` block) is not reported again; inside code ``torch.compile`` traced, the hooks do
nothing (no graph break), so an OOM there is seen by an outer hook or by ``with`` / ``watch``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .handles import ForwardHooks, ProbeHandle
from .tracing import compiling


@dataclass(frozen=True)
class CallErrorsConfig:
    """``on_error(module, error)`` for each error of ``errors`` raised inside a call;
    ``on_start()`` (optional) as each call begins."""

    on_error: Callable[[nn.Module, BaseException], None]
    errors: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)
    on_start: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.on_error):
            raise TypeError(f"CallErrorsConfig.on_error must be callable, not {type(self.on_error).__name__}.")


def apply_call_errors(module: nn.Module, config: CallErrorsConfig) -> ProbeHandle:
    """Report errors raised inside ``module``'s calls as ``config`` says; the handle removes the hooks."""
    in_flight: list[BaseException | None] = []  # per open call: the error in flight when it began

    on_start = config.on_start

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if compiling():  # traced into a graph: nothing a compiler cannot trace (sys.exc_info)
            return
        in_flight.append(sys.exc_info()[1])
        if on_start is not None:
            on_start()

    def post_hook(module: nn.Module, args: tuple, output: object) -> None:
        if compiling():
            return
        before = in_flight.pop() if in_flight else None
        error = sys.exc_info()[1]
        if error is not None and error is not before and isinstance(error, config.errors):
            try:
                config.on_error(module, error)
            except Exception:  # pragma: no cover - never replace the user's error with ours
                pass

    # straight into the hook dicts (a reused debugger attaches these at every call): see ForwardHooks
    return ProbeHandle([ForwardHooks([(module, post_hook)], pre_hooks=[(module, pre_hook)], always_call=True)])
