"""Around each call of a module: its arguments before it runs, its output after, for a caller that
keeps them (a localising replay, a repro bundle), times the call, or starts something at it.

>>> import torch
>>> seen = []
>>> layer = torch.nn.Linear(2, 2)
>>> config = CallArgsConfig(before=lambda module, args, kwargs: seen.append(args[0].shape))
>>> with apply_call_args(layer, config):
...     _ = layer(torch.ones(3, 2))
>>> seen
[torch.Size([3, 2])]

The callbacks are the caller's and run where the call runs: on a module that ``torch.compile``
wraps (``torch.compile(m)``) they run outside the compiled code, which is where a caller may read a
clock; for a module compiled in place, whose hooks would run inside it, the caller wraps the
compiled call with :func:`call_hooks` instead (``diffusion/components/compiled.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .handles import ForwardHooks, ProbeHandle

PreHook = Callable[[nn.Module, tuple, dict], None]
PostHook = Callable[[nn.Module, tuple, dict, Any], None]


@dataclass(frozen=True)
class CallArgsConfig:
    """``before(module, args, kwargs)`` ahead of each call, ``after(module, args, kwargs, output)``
    once it returned; neither while ``skip()`` is true (the caller running the module itself)."""

    before: PreHook | None = None
    after: PostHook | None = None
    skip: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        for name in ("before", "after", "skip"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"CallArgsConfig.{name} must be callable or None, not {type(value).__name__}.")
        if self.before is None and self.after is None:
            raise ValueError("CallArgsConfig needs `before`, `after` or both.")


def call_hooks(config: CallArgsConfig) -> tuple[PreHook, PostHook]:
    """The forward pre-hook and forward hook (``with_kwargs`` signatures) that ``config`` asks
    for; :func:`apply_call_args` registers them, a compiled-call wrapper runs them around it."""
    before, after, skip = config.before, config.after, config.skip
    # ``skip()`` may walk the stack: the pre-hook's answer is kept for the post-hook of the same
    # call (per module; a post-hook without one, after a call that re-entered the module or a
    # pre-hook that did not run, asks again)
    skipped: dict[int, bool] = {}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        skipping = skip is not None and skip()
        if after is not None and skip is not None:
            skipped[id(module)] = skipping
        if before is not None and not skipping:
            before(module, args, kwargs)

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if after is None:
            return
        skipping = skipped.pop(id(module), None)
        if skipping is None:
            skipping = skip is not None and skip()
        if not skipping:
            after(module, args, kwargs, output)

    return pre_hook, post_hook


def apply_call_args(module: nn.Module, config: CallArgsConfig) -> ProbeHandle:
    """Run ``config``'s callbacks around each call of ``module``; the handle removes them."""
    pre_hook, post_hook = call_hooks(config)
    # straight into the hook dicts (a reused debugger attaches these at every call): see ForwardHooks
    pre = config.before is not None or (config.after is not None and config.skip is not None)
    hooks = ForwardHooks(
        [(module, post_hook)] if config.after is not None else [],
        pre_hooks=[(module, pre_hook)] if pre else [],
        with_kwargs=True,
    )
    return ProbeHandle([hooks])
