"""When a monitored step compares the optimizer with the watched parameters again (:class:`CoverageWatch`),
and what it records (``judges.optimizer_coverage`` compares): at the first step with an optimizer; at the
first step where the optimizer followed holds more groups, or an unwatched parameter it held frozen has a
gradient (``watched_models.ParameterSwaps.trained``: ``add_param_group``, a text encoder it holds unfrozen
at step N; the debugger sets :attr:`~.state.History.coverage_checked` back); then, every
:data:`COVERAGE_EVERY` monitored steps and at a step with an anomaly, where more of the parameters frozen
when the debugger was made train (``requires_grad_(True)`` mid-run) or the optimizer checked then holds
others. Those of the watched models join the watch at that step (``TrainingDebugger._parameters_joined``,
one process, parameters whole) and are compared as watched; a new optimizer that holds watched parameters is
compared at its first step. Unwatched, they are named before the step's consequences link to them (a NaN loss
then points at the ``unwatched_parameters`` warning); their own gradients are not read.

Limits: a GAN's other optimizer is not compared with the one checked; a look costs a walk of the frozen
parameters and the optimizer's groups, so it is not made at every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...core import AnomalySink
from ...record import cause_reference
from ..judges.optimizer_coverage import check_coverage
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import param_groups
from ..measure.wrappers import unwrap_model
from ..ranks.processes import RankContext
from ..watched_models import WatchedModels
from .state import History

COVERAGE_EVERY = 100
"""Monitored steps between two looks for parameters unfrozen or added mid-run (:meth:`CoverageWatch.changed`)."""


class CoverageWatch:
    """Compares the optimizer with :attr:`params` (:meth:`check`) and tells when to again (:meth:`changed`)."""

    def __init__(
        self,
        params: TrainableParameters,
        watched: WatchedModels,
        accelerator: Any,
        ctx: RankContext,
        sink: AnomalySink,
        history: History,
    ):
        self.params, self.watched, self.accelerator = params, watched, accelerator
        self.ctx, self.sink, self.history = ctx, sink, history
        self._frozen = [
            p for m in watched.models.values() for p in unwrap_model(m).parameters() if not p.requires_grad
        ]
        """The watched models' parameters frozen when the debugger was made: unwatched if unfrozen later."""
        self._covered = (0, 0, 0)  # _coverage at the last check

    def _coverage(self, optimizer: Any) -> tuple[int, int, int]:
        """(how many of :attr:`_frozen` train, the optimizer's ``param_groups``' id, their parameters)."""
        groups = param_groups(optimizer) if optimizer is not None else None
        held = sum(len(g.get("params", ())) for g in groups) if groups is not None else 0
        return sum(p.requires_grad for p in self._frozen), id(groups), held

    def changed(self, optimizer: Any) -> bool:
        """Whether, since the last :meth:`check`, more of the parameters frozen when the debugger was made
        train or the optimizer checked then holds others (a GAN's other optimizer is not compared)."""
        try:  # runs before the step's collective: never raises
            unfrozen, groups, held = self._coverage(optimizer)
        except Exception:
            return False  # the check itself names what it cannot read
        return unfrozen > self._covered[0] or (groups == self._covered[1] and held != self._covered[2])

    def check(self, step: Any, optimizer: Any) -> None:
        """At the first step with an optimizer (the same on every rank: each records its own finding, the
        main process logs it), and again when :meth:`changed`. Runs before the step's collective, so a
        failure is recorded and never raised, even with ``strict=True`` (no rank may miss the collective)."""
        history = self.history
        try:
            self._covered = self._coverage(optimizer)
            frozen_then = frozenset(map(id, self._frozen))
            checked, found = check_coverage(
                self.params, self.watched, optimizer, self.accelerator, step, self.ctx, frozen_then
            )
        except Exception as error:
            history.coverage_checked = True
            where = "comparing the optimizer with the watched parameters"
            self.sink.debugger_error(where, error, step=step, rank=self.ctx.rank)
            return
        history.coverage_checked = checked or history.coverage_checked
        if found is not None:
            self.sink.emit(found, log=self.ctx.is_main)
            if "outside" in found.details:  # the same on every rank: the main process's is in the report
                history.causes.unwatched = cause_reference(dataclasses.replace(found, rank=0))
