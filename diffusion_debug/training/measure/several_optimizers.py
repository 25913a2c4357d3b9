"""Several optimizers on one debugger, each monitored before its own step (a GAN's discriminator
and generator): a step judges the gradients its optimizer steps on, not those another optimizer
steps at a step of its own.

``loss_d.backward(); monitor(loss_d, optimizer=opt_d); opt_d.step(); opt_g.zero_grad();
loss_g.backward(); monitor(loss_g, optimizer=opt_g); opt_g.step()``: at the discriminator's step
the generator still holds its previous step's gradients, and at the generator's the discriminator
holds ``loss_g``'s share, which its next ``zero_grad`` drops. Judged with the step's own, they
made each step's norm both models' and named a NaN the next ``zero_grad`` drops as an error of the
run. The parameters another optimizer seen so far holds and this one does not are left out of
the step's judged slots (``StepMeasurer.not_judged``), as ``launch`` does for the optimizers it
watches. With one optimizer (the common case) nothing changes, and a monitored step makes no
Python call here: the optimizer is compared with the last one by identity.

>>> import torch
>>> generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
>>> opt_g, opt_d = torch.optim.SGD(generator.parameters()), torch.optim.SGD(discriminator.parameters())
>>> turns = OptimizerTurns()
>>> turns.now(opt_d); turns.apart is None      # the only optimizer seen yet: every gradient judged
True
>>> turns.now(opt_g); turns.apart == {id(p) for p in discriminator.parameters()}
True

Limits: an optimizer is known from the first step it is passed at; one that holds no
``param_groups`` of parameters (a wrapper of ours cannot read) judges every gradient. The
optimizers are held weakly.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_no_optimizer: Callable[[], None] = type(None)
"""Called, None: a reference to no optimizer that calls no Python function (``NoneType()``)."""


def _ref(optimizer: Any) -> Callable[[], Any]:
    """A weak reference to ``optimizer`` (a strong one where it takes none)."""
    try:
        return weakref.ref(optimizer)
    except TypeError:
        return lambda: optimizer


def _held(optimizer: Any) -> set[int] | None:
    """The ids of the parameters ``optimizer`` steps (None: it has no parameter groups to read)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    try:
        return {id(p) for group in groups for p in group["params"]}
    except (TypeError, KeyError):
        return None


class OptimizerTurns:
    """The optimizers monitored so far and, for the last one, the parameters (by ``id``) its step
    leaves to another's (:attr:`apart`; None: it judges every gradient)."""

    def __init__(self) -> None:
        self.last: Callable[[], Any] = _no_optimizer
        """The optimizer of the last measured step (called: compared by identity, no Python call)."""
        self.apart: frozenset[int] | None = None
        self._seen: list[Callable[[], Any]] = []
        self._apart: dict[int, frozenset[int] | None] = {}

    def now(self, optimizer: Any) -> None:
        """``optimizer`` steps next (it differs from the last one): :attr:`apart` becomes its."""
        self.last = _ref(optimizer) if optimizer is not None else _no_optimizer
        if optimizer is None:
            self.apart = None
            return
        alive = [ref for ref in self._seen if ref() is not None]
        if len(alive) != len(self._seen) or all(ref() is not optimizer for ref in alive):
            alive += [] if any(ref() is optimizer for ref in alive) else [_ref(optimizer)]
            self._apart.clear()  # who holds what changed (an id may be a new optimizer's)
        self._seen = alive
        key = id(optimizer)
        if key not in self._apart:
            self._apart[key] = self._others_only(optimizer)
        self.apart = self._apart[key]

    def _others_only(self, optimizer: Any) -> frozenset[int] | None:
        mine = _held(optimizer)
        if mine is None:
            return None
        others: set[int] = set()
        for ref in self._seen:
            other = ref()
            if other is not None and other is not optimizer:
                others |= _held(other) or set()
        return frozenset(others - mine) or None
