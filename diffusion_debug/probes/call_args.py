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

With ``on_error``, an error of ``errors`` raised inside the call (its forward, or a hook before
ours) is reported on its way out, and goes on unchanged: the post-hook is registered with
``always_call``, which torch runs from its own ``except`` block, so one pair of hooks does what
:func:`~.call_errors.apply_call_errors`' pair does besides (a pipeline's component call runs 2
hooks, not 4). ``after`` is not called for a call that raised.

>>> def fail(module, args):
...     raise torch.OutOfMemoryError("planted")
>>> config = CallArgsConfig(after=lambda *a: seen.append("after"), on_error=lambda m, e: seen.append(str(e)))
>>> with apply_call_args(layer, config), layer.register_forward_pre_hook(fail):
...     layer(torch.ones(1, 2))
Traceback (most recent call last):
...
torch.OutOfMemoryError: planted
>>> seen[1:]
['planted']

Limits (of ``on_error``, as of ``apply_call_errors``): only ``Exception`` subclasses (torch runs
``always_call`` hooks for those); an error already in flight when the call began (a retry inside
an ``except`` block) is not reported again; ``skip`` does not silence it; a module compiled in
place, whose wrapper (:func:`call_hooks`) runs no hook on an error, reports nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .handles import ForwardHooks, ProbeHandle

PreHook = Callable[[nn.Module, tuple, dict], None]
PostHook = Callable[[nn.Module, tuple, dict, Any], None]
OnError = Callable[[nn.Module, BaseException], None]


@dataclass(frozen=True)
class CallArgsConfig:
    """``before(module, args, kwargs)`` ahead of each call, ``after(module, args, kwargs, output)``
    once it returned; neither while ``skip()`` is true (the caller running the module itself);
    ``on_error(module, error)`` for each error of ``errors`` raised inside a call (skipped or not)."""

    before: PreHook | None = None
    after: PostHook | None = None
    skip: Callable[[], bool] | None = None
    on_error: OnError | None = None
    errors: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

    def __post_init__(self) -> None:
        for name in ("before", "after", "skip", "on_error"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"CallArgsConfig.{name} must be callable or None, not {type(value).__name__}.")
        if self.before is None and self.after is None and self.on_error is None:
            raise ValueError("CallArgsConfig needs `before`, `after` or both (or `on_error`).")


def call_hooks(config: CallArgsConfig) -> tuple[PreHook, PostHook]:
    """The forward pre-hook and forward hook (``with_kwargs`` signatures) that ``config`` asks
    for; :func:`apply_call_args` registers them, a compiled-call wrapper runs them around it."""
    before, after, skip, on_error, errors = config.before, config.after, config.skip, config.on_error, config.errors
    # ``skip()`` may walk the stack: the pre-hook's answer is kept for the post-hook of the same
    # call (per module; a post-hook without one, after a call that re-entered the module or a
    # pre-hook that did not run, asks again)
    skipped: dict[int, bool] = {}
    exc_info = sys.exc_info

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        skipping = skip is not None and skip()
        if after is not None and skip is not None:
            skipped[id(module)] = skipping
        if before is not None and not skipping:
            before(module, args, kwargs)

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if on_error is not None and exc_info()[1] is not None and raised_here(module, on_error, errors):
            skipped.pop(id(module), None)
            return
        if after is None:
            return
        skipping = skipped.pop(id(module), None)
        if skipping is None:
            skipping = skip is not None and skip()
        if not skipping:
            after(module, args, kwargs, output)

    return pre_hook, post_hook


_RAISED_IN_CALL = nn.Module._call_impl.__code__
"""The code torch runs ``always_call`` forward hooks from when a call raised (its ``except Exception``
block; torch >= 2.1); a call that returned runs its hooks from a function nested in it."""


def raised_here(module: nn.Module, on_error: OnError, errors: tuple[type[BaseException], ...]) -> bool:
    """Called by a forward hook (``always_call``, called by torch itself) while an error is in
    flight: whether it was raised in the call the hook ends, and then ``on_error(module, error)``
    if it is one of ``errors`` (never raising). Raised in the call when torch's ``except`` block
    runs the hook (from ``_call_impl`` itself; a call that returned runs it from its ``inner``),
    else it is the error a call made inside an ``except`` block began with. Read from the frame,
    not kept from a pre-hook: a call stopped by a BaseException (no hook runs) leaves nothing held."""
    if sys._getframe(2).f_code is not _RAISED_IN_CALL:
        return False
    error = sys.exc_info()[1]
    if isinstance(error, errors):
        try:
            on_error(module, error)
        except Exception:  # pragma: no cover - never replace the user's error with ours
            pass
    return True


def apply_call_args(module: nn.Module, config: CallArgsConfig) -> ProbeHandle:
    """Run ``config``'s callbacks around each call of ``module``; the handle removes them."""
    return ProbeHandle(forward_hooks([(module, config, call_hooks(config))]))


def forward_hooks(
    calls: Iterable[tuple[nn.Module, CallArgsConfig, tuple[PreHook, PostHook]]],
) -> list[ForwardHooks]:
    """:func:`apply_call_args` for several modules at once, each with its config and the hooks
    :func:`call_hooks` made of it (which a caller attaching at every call makes once): put straight
    into the hook dicts by one :class:`~.handles.ForwardHooks` (two where some configs have
    ``on_error``, whose post-hooks are ``always_call``); each one's ``remove()`` takes its hooks off."""
    pre_hooks: list[tuple[nn.Module, PreHook]] = []
    post_hooks: tuple[list[tuple[nn.Module, PostHook]], list[tuple[nn.Module, PostHook]]] = ([], [])
    for module, config, (pre_hook, post_hook) in calls:
        watching = config.on_error is not None  # the post-hook sees a call that raised
        if config.before is not None or (config.after is not None and config.skip is not None):
            pre_hooks.append((module, pre_hook))
        if config.after is not None or watching:
            post_hooks[watching].append((module, post_hook))
    added = [ForwardHooks(post_hooks[0], pre_hooks=pre_hooks, with_kwargs=True)]
    if post_hooks[1]:
        try:
            added.append(ForwardHooks(post_hooks[1], with_kwargs=True, always_call=True))
        except BaseException:
            added[0].remove()
            raise
    return added
