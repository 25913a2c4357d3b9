"""Which monitored steps read the per-module gradient figures (:class:`DetailSchedule`): the first
steps, then every :data:`DETAIL_EVERY`-th, and every step for a while after one that found something.

A detailed step turns the per-parameter norms into per-module norms on the device, brings them to
the host with the step's one transfer, and judges them: the module norms' book, the update-to-weight
ratios (``lr_spike`` per module), the modules whose gradients died (``module_health``), the record's
top and bottom modules. Every other step still measures every gradient: the global norm, the
non-finite count and the first non-finite gradient ride in its row, so a NaN/Inf gradient, an
exploding or vanishing global norm, a skipped fp16 step and a learning-rate jump are judged at the
step they happen, whatever the schedule; a step that finds something there reads its module norms
too (a second transfer, on that step only: the module an explosion sits in is named at its step).

>>> schedule = DetailSchedule(first=2, every=5, near=3)
>>> [m for m in range(1, 20) if schedule(m)]
[1, 2, 6, 11, 16]
>>> schedule.found_at(12)  # an anomaly at the 12th monitored step: the next three read them too
>>> [m for m in range(1, 20) if schedule(m)]
[1, 2, 6, 11, 13, 14, 15, 16]

Several optimizers (a GAN's): the reading due every five steps waits for a step whose optimizer's update is
the next in turn (``StallWatch.turn``; ``then``'s ``turn``), so that a loop whose cycle is a multiple of five
steps long has each optimizer's updates read, not always the same one's (a critic's four steps and the
generator's one, read at a fixed phase). With one optimizer nothing changes.

>>> schedule = DetailSchedule(first=2, every=5, near=0)
>>> # the steps whose optimizer is next in turn: 3, 8, 13 and 18 (a reading due at 5, 10, 15 waits for them)
>>> [m + 1 for m in range(1, 20) if schedule.then(m, found=False, turn=m % 5 == 3)]
[2, 9, 14, 19]

Limits: a module's slow failure (its gradients dying) is named from the detailed steps only: at
most :data:`DETAIL_EVERY` - 1 steps later than if every step were read (three low readings in a row
make a dead module: three detailed steps). The weight norms' refresh (every
``ModuleNormBook.refresh_every`` monitored steps, by the joined-step clock, the same on every rank)
is always a detailed step. The schedule keeps no per-rank state that a collective depends on: the
module norms are this rank's own (sharded parameters' norms are summed over the ranks every step).

Why the scheduled work is not spread over every step (a tenth of the weight norms a step, a rotating
part of the sketch): it would cost the same on average, and the benchmarks' figure, the median of the
paired ratios, moves by less than that average when the work sits on a few steps (each heavy step above
the median counts once, however heavy) and by all of it when every step carries a share.
"""

from __future__ import annotations

from dataclasses import dataclass

DETAIL_FIRST = 10
"""Monitored steps read in full from the start: the modules' histories settle and a module dead
from the first step is named at the step it is today (``module_health.DEAD_STEPS``)."""
DETAIL_EVERY = 5
"""After the first steps, one monitored step in this many reads the per-module figures (a divisor
of ``ModuleNormBook.refresh_every``: each weight-norm refresh falls on one of them)."""
DETAIL_NEAR = 10
"""Monitored steps read in full after one whose judging found anything."""


@dataclass
class DetailSchedule:
    """``schedule(monitored) -> bool``: whether the ``monitored``-th monitored step (from 1) reads
    the per-module figures."""

    first: int = DETAIL_FIRST
    every: int = DETAIL_EVERY
    near: int = DETAIL_NEAR
    trouble: int = -1
    """The last monitored step whose judging found something (-1: none yet)."""
    turns: bool = False
    """Several optimizers hold watched parameters: the scheduled reading goes to their updates in turn
    (:meth:`then`'s ``turn``), not to every :attr:`every`-th monitored step."""
    owed: bool = False
    """Of several, a scheduled reading is due and waits for the step of the optimizer whose turn it is."""
    turn_read: int = -1
    """Of several, the monitored step that reads the update in turn (-1: none)."""

    def __call__(self, monitored: int) -> bool:
        near = 0 < monitored - self.trouble <= self.near if self.trouble >= 0 else False
        if self.turns:
            return monitored <= self.first or near or monitored == self.turn_read
        return monitored <= self.first or near or (monitored - 1) % self.every == 0

    def found_at(self, monitored: int) -> None:
        """The ``monitored``-th step's judging found something: read the next :attr:`near` in full."""
        self.trouble = monitored

    def then(self, monitored: int, *, found: bool, turn: bool | None = None) -> bool:
        """After the ``monitored``-th step's judging (``found``: it found something): whether the
        next step is detailed, so that this step keeps what that one compares with. ``turn``: None with one
        optimizer; of several, whether the update this step's optimizer applies is the next in turn
        (``StallWatch.turn``): a scheduled reading (one per :attr:`every` monitored steps) waits for such a
        step, so that each optimizer's updates are read, whatever the phase of the loop's cycle."""
        if found:
            self.found_at(monitored)
        self.turns = turn is not None
        if turn is not None:
            self.owed = self.owed or monitored % self.every == 0
            if self.owed and turn:
                self.owed, self.turn_read = False, monitored + 1
        return self(monitored + 1)
