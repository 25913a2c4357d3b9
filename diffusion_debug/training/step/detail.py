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

Several optimizers (a GAN's): the reading due every five steps that does not fall on a weight-norm refresh
(itself a reading: ``refresh``) waits for a step whose optimizer's update is the next in turn
(``StallWatch.turn``; :meth:`~DetailSchedule.take`), at most :attr:`~DetailSchedule.every` - 1 steps, so that a loop
whose cycle is a multiple of five steps long has each optimizer's updates read, not always the same one's (a
critic's four steps and the generator's one, read at a fixed phase). A refresh whose step's update is not the
one in turn keeps a reading owed, taken at a step in turn within :attr:`~DetailSchedule.every` - 1 steps (none
when no such step comes): at most one step more per refresh than with one optimizer; with one nothing changes.

>>> schedule = DetailSchedule(first=2, every=5, near=0, refresh=10)
>>> # the steps whose optimizer is next in turn: 3, 8, 13, 18, 23 (the readings due at 5, 15, 25 wait for them;
>>> # the refreshes at 10, 20, 30 read another's update: theirs stay owed, read at 13, 23), then none: the one
>>> # due at 25 is read at 30 all the same (a refresh), the one owed from 30 never
>>> [m + 1 for m in range(1, 35) if schedule.take(m, turn=m % 5 == 3 and m < 25)]
[9, 11, 14, 19, 21, 24, 30, 31]

Limits: a module's slow failure (its gradients dying) is named from the detailed steps only: at
most :data:`DETAIL_EVERY` - 1 steps later than if every step were read (of several optimizers, at most
2 x :data:`DETAIL_EVERY` - 2: a reading waits for its turn) (three low readings in a row
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
from typing import Any

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
    (:meth:`take`), not to every :attr:`every`-th monitored step."""
    refresh: int = 2 * DETAIL_EVERY
    """``ModuleNormBook.refresh_every``: the steps that refresh the weight norms are detailed anyway; of several
    optimizers each is the scheduled reading of its :attr:`every` steps."""
    owed: int = -1
    """Of several, the monitored step since which a scheduled reading is due, waiting for the step of the
    optimizer whose turn it is (-1: none)."""
    extra: bool = False
    """The reading owed is a refresh's second (its step's update was not the one in turn): taken at a step in turn
    within :attr:`every` - 1 steps, or not at all."""
    turn_read: int = -1
    """Of several, the monitored step that takes the scheduled reading (-1: none)."""

    def __call__(self, monitored: int) -> bool:
        near = 0 < monitored - self.trouble <= self.near if self.trouble >= 0 else False
        if self.turns:
            return monitored <= self.first or near or monitored == self.turn_read
        return monitored <= self.first or near or (monitored - 1) % self.every == 0

    def found_at(self, monitored: int) -> None:
        """The ``monitored``-th step's judging found something: read the next :attr:`near` in full."""
        self.trouble = monitored

    def then(self, monitored: int, *, found: bool, turns: tuple[Any, Any] | None = None) -> bool:
        """After the ``monitored``-th step's judging (``found``: it found something): whether the
        next step is detailed, so that this step keeps what that one compares with. ``turns``: None with one
        optimizer; of several, the ``StallWatch`` and this step's optimizer: whether its update is the next in
        turn (``StallWatch.turn``) decides the scheduled reading (:meth:`take`), and one taken is counted in
        the turns (``StallWatch.read_in_turn``)."""
        if found:
            self.found_at(monitored)
        self.turns = turns is not None
        if turns is not None and self.take(monitored, turn=turns[0].turn(turns[1])):
            turns[0].read_in_turn(turns[1])
        return self(monitored + 1)

    def take(self, monitored: int, *, turn: bool) -> bool:
        """Of several optimizers, after the ``monitored``-th step: whether the next step takes the scheduled
        reading. ``turn``: the update this step's optimizer applies is the next in turn. A scheduled reading
        (one per :attr:`every` monitored steps) waits for such a step, so that each optimizer's updates are
        read, whatever the phase of the loop's cycle; it waits :attr:`every` - 1 steps at most (an optimizer
        still live and no longer given), and a weight-norm refresh is the reading of its steps
        (:attr:`refresh`). Decided from the joined-step clock and the optimizers given alone: the same on every
        rank."""
        if monitored < self.first:
            return False
        if monitored % self.refresh == 0:  # the next step refreshes the weight norms: detailed anyway
            # not the update in turn: the reading stays owed, or an optimizer given only in the steps after the
            # refresh (positions 0-3 of a ten-step cycle) was never read again, its lr 0 never told
            # (a second reading, taken only at the step in turn: none when no such step comes)
            self.owed, self.extra, self.turn_read = (-1 if turn else monitored), True, monitored + 1
            return True
        if monitored % self.every == 0:
            self.owed, self.extra = monitored, False
        late = self.owed >= 0 and monitored - self.owed >= self.every - 1
        scheduled = self.owed >= 0 and (turn or (late and not self.extra))
        if scheduled or late:
            self.owed = -1
        if scheduled:
            self.turn_read = monitored + 1
        return scheduled
