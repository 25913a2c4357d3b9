"""Instance-attribute wrappers for pipeline and scheduler methods, restored exactly.

A wrapper is set on the *instance* (``pipe.scheduler.step = wrapped``), never on the class, so
other pipelines and schedulers are untouched; :meth:`MethodPatch.restore` deletes the instance
attribute again (the class method shows through), or puts back an instance attribute the user had.
``functools.wraps`` keeps ``inspect.signature`` right: diffusers inspects ``scheduler.step`` and
``scheduler.set_timesteps`` to decide which arguments to pass.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_MISSING = object()


class MethodPatch:
    """Replace ``owner.name`` by ``make(original)`` until :meth:`restore`."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]):
        self.owner = owner
        self.name = name
        self.previous = vars(owner).get(name, _MISSING)
        self.original = getattr(owner, name)
        wrapper = make(self.original)
        self.wrapper = functools.wraps(self.original)(wrapper)
        object.__setattr__(owner, name, self.wrapper)
        self.active = True

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.previous is _MISSING:
            if vars(self.owner).get(self.name, _MISSING) is not _MISSING:
                object.__delattr__(self.owner, self.name)
        else:
            object.__setattr__(self.owner, self.name, self.previous)
