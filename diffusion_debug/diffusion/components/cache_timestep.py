"""The timestep a caching hook asks for, given to a replay: PyramidAttentionBroadcast and FasterCache
ask their ``current_timestep_callback`` at every call (diffusers' examples: ``lambda:
pipe.current_timestep``), and a pipeline's call that ended normally has set its ``_current_timestep`` to
None, so a replay after it failed ("'<' not supported between instances of 'int' and 'NoneType'").

:func:`timestep_kept` makes each such callback of a component's stateful hooks answer the replayed
call's timestep for the block (a repro bundle's ``timestep``: the pipeline's ``current_timestep`` of
that step), and puts every callback back after it; the pipeline itself is not touched (a bundle's
replay has none). FasterCache's default weight callbacks ask the callback of the hook's config, which
they hold in their closure: it is answered too.

>>> class Hook:  # a PyramidAttentionBroadcast hook whose pipeline's call has ended
...     def __init__(self):
...         self.current_timestep_callback = lambda: None
>>> hook = Hook()
>>> with _answered(timestep_owners([hook]), 666.7):
...     hook.current_timestep_callback()
666.7
>>> hook.current_timestep_callback() is None
True

Limits: a callback the user's own callbacks call (an ``attention_weight_callback`` that reads
``pipe.current_timestep`` itself) is not seen; a callback held deeper than one closure is not followed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from .cache_hooks import stateful_hooks

CALLBACK = "current_timestep_callback"


def timestep_owners(hooks: list[Any]) -> list[Any]:
    """The objects whose ``current_timestep_callback`` ``hooks`` ask: each hook that has one, and an
    object holding one in the closure of a hook's callable (FasterCache's config, asked by its default
    weight callbacks), once each."""
    owners: dict[int, Any] = {}
    for hook in hooks:
        if callable(vars(hook).get(CALLBACK)):
            owners.setdefault(id(hook), hook)
        for value in vars(hook).values():
            if isinstance(value, nn.Module) or not callable(value):
                continue
            for cell in getattr(value, "__closure__", None) or ():
                held = _contents(cell)
                if not isinstance(held, nn.Module) and callable(getattr(held, CALLBACK, None)):
                    owners.setdefault(id(held), held)
    return list(owners.values())


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


_UNSET = object()


@contextlib.contextmanager
def _answered(owners: list[Any], timestep: Any) -> Iterator[None]:
    kept = [(owner, vars(owner).get(CALLBACK, _UNSET)) for owner in owners]
    try:
        for owner, _ in kept:
            owner.current_timestep_callback = lambda: timestep
        yield
    finally:
        for owner, callback in kept:
            if callback is _UNSET:  # (a class's callback: the instance's own taken off again)
                vars(owner).pop(CALLBACK, None)
            else:
                owner.current_timestep_callback = callback


def _answers(owner: Any) -> bool:
    """Whether ``owner``'s callback answers a timestep now (a pipeline's ended call answers None)."""
    try:
        return getattr(owner, CALLBACK)() is not None
    except Exception:
        return False


@contextlib.contextmanager
def timestep_kept(module: nn.Module, timestep: Any) -> Iterator[bool]:
    """Within the block, every ``current_timestep_callback`` of ``module``'s stateful diffusers hooks
    answers ``timestep`` (left as they are when it is None); each is put back after. Yields whether the
    hooks can be replayed: False when ``timestep`` is None and a callback answers no timestep now (the
    caller replays without its caching hooks, and says so)."""
    owners = timestep_owners(stateful_hooks(module))
    if not owners:
        yield True
        return
    if timestep is None:
        yield all(_answers(owner) for owner in owners)
        return
    with _answered(owners, timestep):
        yield True
