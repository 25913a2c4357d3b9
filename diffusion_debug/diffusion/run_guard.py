"""The guards of a watched pipeline run: a measurement of the debugger's that fails is recorded
(kind ``debugger_error``, at the step the run was at) and the run goes on.

Two forms, one outcome (:meth:`AnomalySink.guard` decides, with the step):

- ``with guards[where]:`` (:class:`RunGuard`), for the paths a clean call rarely takes;
- ``try: ... except Exception as error: guards.failed(where, error, step)``, for the paths every
  watched call takes (the hooks of each component call, each pipeline event): a ``with`` costs
  two Python calls a use even when nothing fails, and a reused debugger's 1-step call entered
  some twenty-three, where a ``try`` costs none.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from ..core import AnomalySink


class RunGuard:
    """One ``where``'s context manager: the step the run is at as it is entered (``RunState.current_step``,
    read without the property's call) is kept on a stack, so a guard entered inside itself names its
    own step."""

    __slots__ = ("guards", "where", "entered")

    def __init__(self, guards: "RunGuards", where: str):
        self.guards, self.where, self.entered = guards, where, []

    def __enter__(self) -> None:
        run = self.guards.owner.run
        self.entered.append(run.step if run.stepped else None)

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        step = self.entered.pop() if self.entered else None
        if error is None:
            return False
        return self.guards.sink.guard(self.where, step=step).__exit__(kind, error, traceback)

    def at(self, step: int | None) -> AbstractContextManager[None]:
        """This ``where``'s guard for work on ``step``, not on the step the run is at as it is
        entered: a step read late is checked (localised, replayed) after the run moved on."""
        return self.guards.sink.guard(self.where, step=step)


class RunGuards(dict):
    """:class:`RunGuard` by ``where``, made at its first use (``guards[where]``: the dict's own lookup,
    no Python call): the same guard is entered again at every step. ``owner``: what holds the run's
    state as ``owner.run`` (its ``step`` and ``stepped``; a new run replaces it)."""

    def __init__(self, sink: AnomalySink, owner: Any):
        super().__init__()
        self.sink, self.owner = sink, owner

    def __missing__(self, where: str) -> RunGuard:
        guard = self[where] = RunGuard(self, where)
        return guard

    def step(self) -> int | None:
        """The step the run is at now (None before its first)."""
        run = self.owner.run
        return run.step if run.stepped else None

    def failed(self, where: str, error: Exception, step: int | None) -> None:
        """A guarded ``try``'s ``except Exception``: ``error`` recorded at ``step`` (the step the run
        was at when the ``try`` began), or raised again where the guard would not keep it (the
        debugger's own errors, ``strict``)."""
        if not self.sink.guard(where, step=step).__exit__(type(error), error, error.__traceback__):
            raise error

    def failed_now(self, where: str, error: Exception) -> None:
        """:meth:`failed` at the step the run is at now (a component hook's, which does not hold the run)."""
        self.failed(where, error, self.step())
