"""A method set on one user object that a copy of the object does not carry.

Where a debugger must replace a method on one instance (the Accelerator's ``clip_grad_norm_``, a
GradScaler's ``unscale_``, a compared pipeline's ``scheduler.step``), the instance attribute is an
:class:`OnThisInstance`: ``copy.deepcopy`` and ``pickle`` of the owner give the copy what the
instance had without us (its class's method bound to the copy, or a copy of the attribute the user
had set), so the copy holds nothing of the debugger's (nor, through it, the watched model's
parameters) and runs as the plain one: LTX-2 deep-copies its scheduler inside its call, and a
copied wrapper would step the original. A :class:`StackedOnInstance` (several debuggers' wrappers of
one DeepSpeed engine's ``step`` or ``backward``) sets one too: a copy of the engine gets its own method.
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from typing import Any

MISSING = object()
"""``previous`` of an :class:`OnThisInstance` that replaced no instance attribute (the class's method)."""


class OnThisInstance(functools.partial):
    """``call`` set as ``owner.name``; a copy of ``owner`` gets ``previous`` (a copy of it), or the
    class's own method bound to the copy. A ``functools.partial``: called with no Python frame of
    its own.

    >>> class Owner:
    ...     def run(self):
    ...         return "plain"
    >>> owner = Owner()
    >>> owner.run = OnThisInstance(lambda: "watched", owner=owner, name="run")
    >>> twin = copy.deepcopy(owner)
    >>> owner.run(), twin.run(), twin.run.__self__ is twin
    ('watched', 'plain', True)

    A deep copy of the owner's ``__dict__`` alone (MultiDiffusion keeps its scheduler's state so,
    and puts it back with ``__dict__.update``) keeps this very object: it is put back on the owner.

    Limits: a shallow ``copy.copy`` of the owner shares the instance's dict entry, so it runs
    ``call`` (for the original object); the owner is held weakly.
    """

    def __new__(cls, call: Any, *, owner: Any, name: str, previous: Any = MISSING) -> "OnThisInstance":
        made = super().__new__(cls, call)
        made.owner, made.name, made.previous = weakref.ref(owner), name, previous
        return made

    def __deepcopy__(self, memo: dict) -> Any:
        owner = self.owner()
        twin = memo.get(id(owner)) if owner is not None else None
        if twin is None and owner is not None and id(vars(owner)) in memo:  # its ``__dict__`` copied alone,
            return self  # to be put back on it: ours
        if self.previous is not MISSING:
            return copy.deepcopy(self.previous, memo)
        target = twin if twin is not None else owner
        return getattr(type(target), self.name).__get__(target, type(target))

    def __reduce__(self) -> tuple:
        if self.previous is not MISSING:
            return operator.getitem, ((self.previous,), 0)  # pickles what it replaced
        return getattr, (self.owner(), self.name)  # the unpickled owner's own (its dict not yet set)


class StackedOnInstance:
    """A wrapper set as ``owner.name`` over what was there (:attr:`original`) that :meth:`remove` takes
    out alone, in any order among several such wrappers of the same method (two debuggers on one
    DeepSpeed engine): removed while another sits above it, it only calls on (:attr:`active` False)
    until the one above is removed, which then skips it and every removed one under it, down to a
    live wrapper, the owner's own attribute or the class's method. A subclass defines :meth:`_call`.
    What it sets is an :class:`OnThisInstance` over what was there: a copy or a pickle of the owner
    gets what the owner had before every wrapper (a stack falls through to it), nothing of theirs.

    >>> class Owner:
    ...     def run(self):
    ...         return "plain"
    >>> class Loud(StackedOnInstance):
    ...     def _call(self):
    ...         return self.original().upper() if self.active else self.original()
    >>> owner = Owner()
    >>> first, second = Loud(owner, "run"), Loud(owner, "run")
    >>> first.remove(); owner.run()
    'PLAIN'
    >>> second.remove(); "run" in vars(owner)
    False
    """

    def __init__(self, owner: Any, name: str):
        self.owner, self.name = owner, name
        self.had_own = name in vars(owner)
        self.original = getattr(owner, name)
        self.active = True
        # what ``owner.name`` is while this one is on top; a copy of the owner gets what was under it
        self.call = OnThisInstance(
            self._call, owner=owner, name=name, previous=self.original if self.had_own else MISSING
        )
        setattr(owner, name, self.call)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def remove(self) -> None:
        self.active = False
        if vars(self.owner).get(self.name) is not self.call:
            return  # another wrapper is above this one: it skips this one when removed
        wrap = self  # this one and the removed ones under it, down to a live one
        while wrap.had_own and isinstance(under := _stacked(wrap.original), StackedOnInstance):
            if under.active:
                break
            wrap = under
        if wrap.had_own:
            setattr(self.owner, self.name, wrap.original)
        else:
            vars(self.owner).pop(self.name, None)


def _stacked(call: Any) -> Any:
    """The :class:`StackedOnInstance` whose :attr:`~StackedOnInstance.call` ``call`` is, else None."""
    return getattr(call.func, "__self__", None) if isinstance(call, OnThisInstance) else None
