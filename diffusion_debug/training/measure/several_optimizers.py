"""Several optimizers on one debugger, each monitored before its own step (a GAN's discriminator
and generator): a step judges the gradients its optimizer steps on, not those another optimizer
steps at a step of its own.

``loss_d.backward(); monitor(loss_d, optimizer=opt_d); opt_d.step(); opt_g.zero_grad();
loss_g.backward(); monitor(loss_g, optimizer=opt_g); opt_g.step()``: at the discriminator's step
the generator still holds its previous step's gradients, and at the generator's the discriminator
holds ``loss_g``'s share, which its next ``zero_grad`` drops. Judged with the step's own, they
made each step's norm both models' and named a NaN the next ``zero_grad`` drops as an error of the
run. The parameters another optimizer seen so far holds and this one does not are left out of
the step's judged slots (``StepMeasurer.not_judged``) and of its module figures (norms, the top
modules, module health: ``LocalJudge``), as ``launch`` does for the optimizers it watches. Who
holds what is worked out again when an optimizer's ``param_groups`` changed (``add_param_group``
mid-run: a text encoder trained from step N), told by the lists' identity and length. With one
optimizer (the common case) nothing changes, and a monitored step makes no Python call here: the
optimizer is compared with the last one by identity; with several, one call a step.

>>> import torch
>>> generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
>>> opt_g, opt_d = torch.optim.SGD(generator.parameters()), torch.optim.SGD(discriminator.parameters())
>>> turns = OptimizerTurns()
>>> turns.now(opt_d); turns.apart is None      # the only optimizer seen yet: every gradient judged
True
>>> turns.now(opt_g); turns.apart == {id(p) for p in discriminator.parameters()}
True
>>> opt_g.add_param_group({"params": [discriminator.bias]}); turns.now(opt_g)
>>> turns.apart == {id(discriminator.weight)}   # the generator's optimizer steps the bias now
True

Limits: an optimizer is known from the first step it is passed at; one that holds no
``param_groups`` of parameters (a wrapper of ours cannot read) judges every gradient; a parameter
appended to an existing group's ``"params"`` list in place (not through ``add_param_group``) is
not seen. The optimizers are held weakly.
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


def _groups_shape(optimizer: Any) -> tuple[int, int]:
    """``optimizer``'s ``param_groups`` by identity and length (what ``add_param_group`` changes)."""
    groups = getattr(optimizer, "param_groups", None)
    try:
        return id(groups), len(groups)
    except TypeError:
        return id(groups), -1


class OptimizerTurns:
    """The optimizers monitored so far and, for the last one, the parameters (by ``id``) its step
    leaves to another's (:attr:`apart`; None: it judges every gradient)."""

    def __init__(self) -> None:
        self.last: Callable[[], Any] = _no_optimizer
        """The optimizer of the last measured step (called: compared by identity, no Python call)."""
        self.apart: frozenset[int] | None = None
        self.several = False
        """More than one optimizer seen: :meth:`now` is asked at every step, also for the last one
        again (a group added to another since is left to it)."""
        self._seen: list[Callable[[], Any]] = []
        self._apart: dict[int, frozenset[int] | None] = {}
        self._groups: list[tuple[int, int]] = []
        """Each seen optimizer's ``param_groups`` (id, length) when :attr:`_apart` was filled."""

    def now(self, optimizer: Any) -> None:
        """``optimizer`` steps next: :attr:`apart` becomes its (worked out again when the
        optimizers seen, or their ``param_groups``, changed: ``add_param_group`` mid-run)."""
        self.last = _ref(optimizer) if optimizer is not None else _no_optimizer
        if optimizer is None:
            self.apart = None
            return
        alive = [ref for ref in self._seen if ref() is not None]
        if len(alive) != len(self._seen) or all(ref() is not optimizer for ref in alive):
            alive += [] if any(ref() is optimizer for ref in alive) else [_ref(optimizer)]
            self._apart.clear()  # who holds what changed (an id may be a new optimizer's)
        self._seen = alive
        self.several = len(alive) > 1
        groups = [_groups_shape(ref()) for ref in alive]
        if groups != self._groups:  # a group added (or the list replaced): who holds what changed
            self._groups = groups
            self._apart.clear()
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
