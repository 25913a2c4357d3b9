"""Errors raised inside a module's call, seen on their way out: an ``always_call`` forward hook, which
torch runs from its own ``except`` block, reads the one raised during the call (as
:mod:`.call_args`' post-hook does with ``on_error``: the same :func:`~.call_args.raised_here`); a
forward pre-hook runs ``on_start``, if any. The error goes on unchanged.

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

from .call_args import raised_here
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
    on_start, on_error, errors = config.on_start, config.on_error, config.errors

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if not compiling():  # traced into a graph: nothing a compiler cannot trace
            on_start()

    def post_hook(module: nn.Module, args: tuple, output: object) -> None:
        # what call_args' post-hook does with ``on_error`` (:func:`~.call_args.raised_here`), but
        # not while traced (sys.exc_info, sys._getframe)
        if not compiling() and sys.exc_info()[1] is not None:
            raised_here(module, on_error, errors)

    # straight into the hook dicts (a reused debugger attaches these at every call): see ForwardHooks
    pre_hooks = [(module, pre_hook)] if on_start is not None else []
    return ProbeHandle([ForwardHooks([(module, post_hook)], pre_hooks=pre_hooks, always_call=True)])
