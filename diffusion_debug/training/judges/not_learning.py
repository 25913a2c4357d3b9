"""A run that does not learn: the optimizer steps move no weight although the gradients are
normal (:class:`StallWatch`), and which of the usual causes it looks like (:func:`diagnose`).

The update each optimizer step applied comes from the weights themselves (``updates``: the sketch's
``||dw|| / ||w||`` per module, known at the next monitored step). When :data:`STALL_UPDATES` updates in a row
moved no module by more than :data:`STILL_RATIO` of its norm while the gradients they should have applied were
finite and above the vanishing threshold, the run is stalled at the step that showed the last of them; the cause
is read from the optimizer, once (``stall_causes.diagnose``), with the lr its still updates were made with
(:attr:`StallWatch.run`): it holds none of the watched parameters, or that lr is 0 for them, or every update rounds
away (fp16/bf16 weights: optimizer state, or a plain step below half their epsilon of the weights' norm), else what
``optimizer.step()`` itself received (:class:`StepGradients`, a step pre-hook on each optimizer the debugger is given,
reading only while a run of still updates lasts; a compiled step reads nothing): no gradient (``gradients_cleared``),
zeroed ones (``gradients_zeroed``: a mask or hook between the monitor and the step), or the gradients the monitor read:
float32 steps below a quarter of its epsilon round away (``below_precision``), else ``undone_after_step``. Where no
step was seen an optimizer without state for them is read as cleared gradients, one with state as ``unknown``; under
DeepSpeed's copies (ZeRO-1/2's flat partitions, stage 0's float32 masters) past an lr of 0 the cause is ``unknown``.

>>> watch = StallWatch()
>>> [watch.update(step, {"a": 0.0, "b": 0.0}, grad_norm=0.5, skipped=False) for step in range(5)]
[False, False, False, False, True]
>>> watch.first_step, watch.updates, watch.largest
(0, 5, 0.0)

Under several processes a stall is the whole model's, not one rank's: each rank says whether the
update it read moved its weights (:attr:`StallWatch.moved`, a flag of the step's one reduce), and
where any rank's did, every rank's run of still updates ends and a ``not_learning`` found at that
step is withdrawn before the ranks exchange their anomalies (``LocalJudge.judge_across_ranks``). Under
FSDP2 or ZeRO a rank's shard may never move while the run learns: textual inversion trains an
embedding table's new rows, all in the last rank's shard, and puts every other row back.

>>> watch.moved, watch.flagged
(False, True)
>>> watch.some_rank_moved()  # another rank's shard moved in the update read at this step
>>> watch.updates, watch.flagged
(0, False)

Where several optimizers hold watched parameters (a GAN's generator's and discriminator's), each keeps its own run
of still updates too (:meth:`StallWatch.update_each`): a reading is the update of the optimizer the monitored step
before it was given (the monitor's contract: one call before each optimizer's step, with it), read from its own
modules. Its stall names it (``stalled_optimizer``) where the whole model's is not reported: the whole model's run is
a stall only once a still update of every live optimizer is in it and each one's ``step()`` was seen in it where any
was (a critic monitored at each iteration and stepped at one in six is not stalled), told once; an optimizer's own
is told only once another one's update read since its run began moved weights (or at its 2 x STALL_UPDATES-th); one
told and going on is not told again as the run's (:meth:`StallWatch._told_in_run`). One stepped every k monitored
steps counts only its own readings; after the first ten the scheduled readings take the optimizers' updates in turn
(:meth:`StallWatch.turn`, ``step.detail``). The optimizers counted are the live ones (:meth:`StallWatch.given`):
given within the last :data:`LIVE_STEPS` monitored steps (or twice their own longest gap); one of the same parameters
replaces the one before it (recreated: Accelerate's ``_optimizers`` keeps the old one alive). A run made at lr 0 by
an optimizer whose lr has left 0 since, or whose LR scheduler, not stepped since built, set that 0 (a warmup from 0:
a GAN's first iteration is n_critic + 1 such updates), is clear only if it goes on, or at its 2 x STALL_UPDATES-th; a
schedule stepped past its start (ended at 0), or an lr set to 0 by hand under one, is told at the fifth.

Before a stall is reported the whole weights' float64 norms are checked too (read when the run began and at its
end), since the ratios come from one sampled block per parameter.

Limits: a step skipped by the GradScaler (or by policy ``skip``) restarts the count; a warmup that starts at lr 0
moves nothing for one step (five are needed). Across ranks an update counts where every rank reads it: every rank
reads the steps the schedule details on every rank (``step.detail``: the first ten, then one in five), so each run
of five still updates holds one; a shard moving only in updates another rank alone read is not seen moving. A rank
reading every step after a finding of its own may count five still updates before the next such step, its stall
withdrawn there (the reduce's ``stalled`` flag: no details exchange). Weight decay alone still moves the weights
(AdamW, ``zero_grad(set_to_none=False)`` before ``step()``): not reported. An elimination, not a proof.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import learning_rates, param_groups, raw_optimizer, warming_up_from_zero
from .step_gradients import StepGradients

STALL_UPDATES = 5
"""Updates in a row that moved nothing before the run is reported."""
LIVE_STEPS = 2 * STALL_UPDATES
"""Monitored steps an optimizer not given since stays one of several (or twice its own longest gap)."""
STILL_RATIO = 1e-9
"""An update below this share of every module's norm moved nothing (one float32 rounding step of
one sampled element is already about 1e-8 of a 128-element block)."""


@dataclass
class StallWatch:
    """The current run of updates that moved nothing, and the gradient norm of the step whose
    update the next reading shows."""

    first_step: Any = None
    last_step: Any = None
    updates: int = 0
    largest: float = 0.0
    """The largest module ratio over the run of still updates."""
    grad_norm: float = math.nan
    """The smallest gradient norm over that run (each one normal)."""
    pending_grad_norm: float = math.nan
    """The global gradient norm of the last monitored step: the gradients its update should apply."""
    flagged: bool = False
    policy_skipped: bool = False
    """Policy ``skip`` zeroed the last step's gradients: its update is not judged."""
    fingerprint: list[float] | None = None
    """The whole weights' float64 norms when this run of still updates began (:meth:`update`)."""
    moved: bool = False
    """The last update taken moved this rank's weights (its sampled blocks, or the whole weights checked before a
    report): under several processes every rank learns whether any rank's did (:meth:`some_rank_moved`)."""
    seen: StepGradients = field(default_factory=lambda: StepGradients())
    """What the optimizer's step received, watched while a run of still updates lasts (:meth:`follow_step`)."""
    each: dict[int, OptimizerStall] = field(default_factory=dict)
    """Each optimizer given that holds watched parameters (by ``id``): its own run of still updates."""
    several: bool = False
    """Several live optimizers hold watched parameters (a GAN's generator's and discriminator's)."""
    pending_optimizer: int = 0
    """``id`` of the optimizer the last monitored step was given: the one whose step the next reading shows."""
    read: OptimizerStall | None = None
    """Of several, the optimizer whose update the last reading was (:meth:`update_each`)."""
    pending_rates: list[float] | None = None
    """The learning rates of the last monitored step's optimizer (``optimizer_state.learning_rates``, read for its
    row): those its update, the next reading, was made with (a scheduler stepped after it moves them)."""
    run: dict[int, float] = field(default_factory=dict)
    """The optimizers (by ``id``) whose updates are among the current run's still readings, each with the largest
    lr its still updates in it were made with (NaN: not known): of several, the run is the whole model's only once
    every live one is in it (:meth:`update`), and its cause is read from these (``stall_findings``)."""
    clock: int = 0
    """The last monitored step :meth:`given` was told of (every step of several)."""
    given_to: int = 0
    """``id`` of the optimizer :meth:`given` was told of last; :attr:`before`: of the one before it."""
    before: int = 0
    params: TrainableParameters | None = None
    """The watched parameters (what each optimizer's holdings are listed in)."""
    withheld: bool = False
    """This run is no stall of the run: one optimizer of it was not stepped (:meth:`_not_stepped`); ``read_on``: just
    withheld, the steps after read in full (the others' own stalls, held back, wait for a moving update read)."""
    read_on: bool = False
    readings: int = 0
    """Of several, the scheduled readings taken so far (:attr:`OptimizerStall.read_at` counts by it:
    :meth:`turn`, :meth:`read_in_turn`)."""

    def follow_step(self, optimizer: Any, params: TrainableParameters) -> None:
        """Watch what ``optimizer.step()`` receives while a run of still updates is counted and not yet
        reported (the whole model's, or of several optimizers one's own; the diagnosis reads it); otherwise
        pause the watch. The hook goes on ``optimizer`` at the first call with it (its first step judged,
        before the user's step is ever compiled) and stays to close, beside each other optimizer's: put on and
        taken off, it recompiled a ``torch.compile``'d step each time. An optimizer seen for the first time
        that holds watched parameters gets its own run of still updates (:attr:`each`)."""
        if optimizer is None:
            return
        if id(optimizer) not in self.seen.followed:
            self._count_each(optimizer, params)
        still = bool(self.updates) and not self.flagged
        if self.several and not still and not self.flagged:  # one optimizer's own run counted, another's moving
            still = any(entry.watch.updates and not entry.watch.flagged for entry in self.each.values())
        if self.seen.active and not still:
            self.seen.pause()
        self.seen.watch(optimizer, params, active=still)

    def update(
        self,
        update_step: Any,
        ratios: dict[str, float],
        *,
        grad_norm: float,
        skipped: bool,
        weights: Callable[[], list[float]] | None = None,
        holder: OptimizerStall | None = None,
    ) -> bool:
        """Take the update of ``update_step`` (its per-module ratios) and the norm of the gradients it should have
        applied; True when this update makes the stall clear. ``weights``: the whole weights' float64 norms, read when
        a run begins and before it is reported (a run moving only rows outside the sampled blocks, as textual
        inversion's, is not stalled). ``holder``: the optimizer whose own run this watch counts (:meth:`update_each`);
        the lr each still update was made with is kept in :attr:`run` (:meth:`_leaving_lr_zero`)."""
        skipped, self.policy_skipped = skipped or self.policy_skipped, False
        if self.several:  # the optimizer whose update this is (its stall's, or the run's named from it)
            self.read = self.each.get(self.pending_optimizer)
        values = np.fromiter(ratios.values(), dtype=np.float64, count=len(ratios))
        finite = values[np.isfinite(values)]  # one numpy pass where a per-module loop ran every step
        largest = float(finite.max()) if len(finite) else math.nan
        still = bool(len(finite)) and largest <= STILL_RATIO
        self.moved = largest > STILL_RATIO  # NaN (no finite ratio): not known to have moved
        if skipped or not still or not (math.isfinite(grad_norm) and grad_norm > 0):
            if self.flagged and not still and self.several:  # the run's stall ends: the held-back ones' are told
                self._release()
            self.updates, self.flagged = 0, self.flagged and still
            return False
        if self.updates == 0:
            self.first_step, self.largest, self.grad_norm = update_step, 0.0, grad_norm
            self.fingerprint = weights() if weights is not None else None
            self.run.clear()
            self.withheld = False
        self.updates += 1
        self.last_step = update_step
        self.largest = max(self.largest, largest)
        self.grad_norm = min(self.grad_norm, grad_norm)
        # the lr it was made with, by optimizer: the run is the whole model's once every optimizer's update is in it
        self._made_at(holder if holder is not None else self.each.get(self.pending_optimizer))
        if self.updates >= STALL_UPDATES and not self.flagged:
            if self.several and not set(self.run).issuperset(self.live()):  # one optimizer's: its own run tells it
                return False
            if self.several and self._told_in_run():  # that optimizer's stall, told: not again as the run's
                return False
            if self.several and self._not_stepped():  # no run's stall: the next updates read in full, once a run
                self.withheld, self.read_on = True, not self.withheld
                return False
            # a warmup from 0 (held 2 x STALL_UPDATES at most: a schedule's lr-0 steps, read alone, held it for ever)
            if self.updates < 2 * STALL_UPDATES and self._leaving_lr_zero(holder):
                return False
            if weights is not None and weights() != self.fingerprint:  # moved outside the sampled blocks
                self.updates, self.moved = 0, True
                return False
            self.flagged = True
            return True
        return False

    def _made_at(self, entry: OptimizerStall | None) -> None:
        """The still update just counted was made with :attr:`pending_rates`: :attr:`run` keeps, for its optimizer,
        the largest lr of its groups that hold watched parameters over the run (NaN once one is not known)."""
        key, made = self.pending_optimizer, _held_lr(entry, self.pending_rates)
        before = self.run.get(key, made)
        self.run[key] = math.nan if math.isnan(before) or math.isnan(made) else max(before, made)

    def _told_in_run(self) -> bool:
        """An optimizer of the run has its own stall told and going on (flagged, not held back): the run's stall is
        that one, told already. A generator at lr 0 beside a critic stepped at one iteration in six (monitored at
        each) was told as its own at 12 and again as the run's at 16 (its still updates and the critic's between
        two steps)."""
        return any(
            self.each[key].watch.flagged and not self.each[key].held_back for key in self.run if key in self.each
        )

    def _leaving_lr_zero(self, holder: OptimizerStall | None) -> bool:
        """Of the run's optimizers (``holder``, the live ones of several, or the one) one made each of its still
        updates in it at lr 0 and has an lr above 0 now (not of one optimizer: set by hand), or a scheduler at its
        start set that 0 (``warming_up_from_zero``): a warmup from 0, whose next updates tell if it learns. A GAN whose
        scheduler steps once per iteration makes n_critic + 1 such updates (at n_critic 6 the critic's first five,
        read before the generator is given, are one optimizer's): the clean run stays quiet. Kept at lr 0: told."""
        keys = self.live() if self.several else [self.pending_optimizer]
        for entry in [holder] if holder is not None else [self.each[key] for key in keys if key in self.each]:
            optimizer = entry.ref()
            if self.run.get(id(optimizer)) != 0:
                continue
            if (self.several or holder is not None) and _held_lr(entry, learning_rates(optimizer)) > 0:
                return True
            if warming_up_from_zero(optimizer, _rated(entry, param_groups(optimizer))):
                return True
        return False

    def _not_stepped(self) -> bool:
        """Of the run's optimizers one's ``step()`` was not seen in it while another's was (the hooks read: not
        compiled): a critic monitored at each iteration and stepped at one in six is not stalled (the run's stall, its
        cause guessed, was told at 5 and the generator's own lr 0 again at 12); not for ever (a step that never runs:
        the run's stall after that one's 2 x STALL_UPDATES-th still update)."""
        seen = {k: id(raw_optimizer(self.each[k].ref())) in self.seen.readings for k in self.run if k in self.each}
        late = 2 * STALL_UPDATES
        return any(seen.values()) and any(not s and self.each[k].watch.updates < late for k, s in seen.items())

    def some_rank_moved(self) -> None:
        """Some rank's weights moved in the update this step read (this rank's or another's: a rank's
        shard of a parameter, FSDP2's or ZeRO's, may never move while another rank's does): the run
        learns, so its run of still updates ends, and a stall reported before may be reported again
        once one is clear; of several optimizers, the one whose update it was learns too."""
        if self.flagged and self.several:
            self._release()
        self.updates, self.flagged = 0, False
        if self.several and self.read is not None:
            self.read.watch.some_rank_moved()
            for other in self.each.values():  # each other one's own stall is true now (as in :meth:`update_each`)
                if other is not self.read:
                    other.others_moved = True
                    if other.held_back:
                        other.held_back = other.watch.flagged = False

    def _count_each(self, optimizer: Any, params: TrainableParameters) -> None:
        """``optimizer``, given for the first time, gets its own run of still updates where it holds watched
        parameters (none under DeepSpeed, whose engine steps copies of them); gone optimizers' are dropped."""
        alive = {key: entry for key, entry in self.each.items() if entry.ref() is not None}
        groups = param_groups(optimizer) if params.deepspeed is None else None
        self.params = params
        indices, modules, rated = _holdings(groups, params)
        if indices:
            try:
                ref: Any = weakref.ref(optimizer)
            except TypeError:  # no weak reference: held
                ref = lambda held=optimizer: held  # noqa: E731
            # one of the same parameters replaces the one before (recreated: Accelerate's ``_optimizers`` and a
            # kept LR scheduler hold that one alive, which made a one-optimizer run one of two)
            alive = {key: entry for key, entry in alive.items() if set(entry.held).isdisjoint(indices)}
            entry = OptimizerStall(ref, indices, modules, StallWatch(), given_at=self.clock, groups=_shape(groups))
            entry.rated = rated
            alive[id(optimizer)] = entry
        self.each = alive
        self._count_live()

    def _follow_groups(self, entry: OptimizerStall) -> None:
        """``entry``'s holdings again where its optimizer's ``param_groups`` changed (``add_param_group``: a
        model trained from step N); its own run restarts with what it holds now."""
        groups = param_groups(entry.ref())
        if _shape(groups) == entry.groups or self.params is None:
            return
        indices, modules, rated = _holdings(groups, self.params)
        if indices:
            entry.held, entry.modules, entry.groups, entry.watch.updates = indices, modules, _shape(groups), 0
            entry.rated = rated

    def given(self, optimizer: Any, joined: int) -> None:
        """The ``joined``-th monitored step was given ``optimizer``: asked at every step of several, and at a step
        given another one than the step before (no call with one). An optimizer is live while it was given within
        the last :data:`LIVE_STEPS` monitored steps, or twice its own longest gap (a WGAN generator's, one in
        ``n_critic + 1``): one kept alive and no longer given (a phase's) leaves a one-optimizer run."""
        key = id(optimizer)
        if key != self.given_to:
            before = self.each.get(self.given_to)
            if before is not None:  # given up to the step before (with one, no call told so)
                before.given_at = joined - 1
            self.before, self.given_to = self.given_to, key
            entry = self.each.get(key)
            if entry is not None:
                entry.gap = max(entry.gap, joined - entry.given_at)
        entry = self.each.get(key)
        if entry is not None:
            entry.given_at = joined
        self.clock = joined
        self._count_live()

    def _count_live(self) -> None:
        """:attr:`several` from the live optimizers (:meth:`live`); where it turns true, the one given before
        takes the whole model's run over as its own (:meth:`_seed`)."""
        several = len(self.live()) > 1
        if several and not self.several and self.before in self.each:
            self._seed(self.before, self.each[self.before])
        elif self.several and not several and len(live := self.live()) == 1:  # one left: its stall is the run's
            if (own := self.each[live[0]].watch).flagged and not self.each[live[0]].held_back:  # not told again
                self.first_step, self.last_step, self.updates = own.first_step, own.last_step, own.updates
                self.largest, self.grad_norm, self.flagged = own.largest, own.grad_norm, True
        self.several = several

    def _seed(self, key: int, entry: OptimizerStall) -> None:
        """A second optimizer is seen: ``entry``'s, the only one stepped so far, did not count its own run (one
        optimizer's is the whole model's): it takes the whole model's run over (a critic's stall five steps long
        before the generator's first step is its own, not the run's)."""
        own, self.run = entry.watch, {key: self.run.get(key, math.nan)} if self.updates else {}
        own.run = dict(self.run)  # the lrs its updates were made with (recorded by the one-optimizer watch too)
        own.first_step, own.last_step, own.updates = self.first_step, self.last_step, self.updates
        own.largest, own.grad_norm, own.flagged = self.largest, self.grad_norm, self.flagged
        own.fingerprint = None if self.fingerprint is None else _subset(self.fingerprint, entry.held)

    def update_each(
        self,
        update_step: Any,
        ratios: dict[str, float],
        *,
        grad_norm: float,
        skipped: bool,
        weights: Callable[[], list[float]] | None = None,
    ) -> OptimizerStall | None:
        """Of several optimizers, the one whose step this reading shows (the one the monitored step before
        was given: the monitor is called before each optimizer's step, with it) takes the update into its own
        run of still updates, read from the modules of the parameters it holds; it is returned where that run
        is clear (:meth:`update`'s rules) and the whole model's is not reported: a stall of every optimizer
        is the run's, reported once as one, and an optimizer's own is told only once another one's update read in
        its run moved weights (:attr:`OptimizerStall.others_moved`; held back until then, told at its next still
        update; without a stall of the run, at its 2 x STALL_UPDATES-th still update all the same). An optimizer
        stepped every k monitored steps only (a discriminator on alternate iterations)
        counts only the readings of its own steps."""
        entry = self.read = self.each.get(self.pending_optimizer)
        if entry is None or entry.ref() is None:
            self.read = None
            return None
        self._follow_groups(entry)
        modules = entry.modules
        own = {module: ratio for module, ratio in ratios.items() if module in modules}
        held = entry.held
        its = None if weights is None else lambda: _subset(weights(), held)
        watch = entry.watch  # the step and the lrs its update was made with
        watch.pending_optimizer, watch.pending_rates = self.pending_optimizer, self.pending_rates
        clear = watch.update(update_step, own, grad_norm=grad_norm, skipped=skipped, weights=its, holder=entry)
        if entry.watch.updates == 1:  # its run of still updates begins at this reading
            entry.others_moved = False
        if entry.watch.moved:  # its update moved: each other one's own stall is true now (told at its next still)
            for other in self.each.values():
                if other is not entry:
                    other.others_moved = True
                    if other.held_back:
                        other.held_back = other.watch.flagged = False
        # held back (its flag kept: no whole weights read again at each still reading) while the whole run's stall
        # stands, and until another one's update read in its run moved weights: both optimizers' lr 0 at n_critic 5
        # was told as the critic's own stall "while the other's moved" before the generator's update was read
        if clear and (self.flagged or not entry.others_moved):
            entry.held_back = True
            return None
        # not for ever (the other's steps all skipped by a GradScaler): told as not known to be alone (a run withheld
        # for a step not seen is told as the run's instead: :meth:`_not_stepped`)
        if entry.held_back and not (self.flagged or self.withheld) and entry.watch.updates >= 2 * STALL_UPDATES:
            entry.held_back = False
            return entry
        return entry if clear else None

    def _release(self) -> None:
        """The whole run's stall ends (an update moved): each optimizer's own stall held back beside it is told
        at its next still update (:meth:`update_each`)."""
        for entry in self.each.values():
            if entry.held_back:
                entry.held_back = entry.watch.flagged = False

    def live(self) -> list[int]:
        """The optimizers (by ``id``) that hold watched parameters, are still alive and are still given: the last
        step's, and each one given within :data:`LIVE_STEPS` monitored steps or twice its longest gap."""
        clock, given = self.clock, self.given_to
        return [
            key
            for key, entry in self.each.items()
            if entry.ref() is not None and (key == given or clock - entry.given_at <= max(LIVE_STEPS, 2 * entry.gap))
        ]

    def turn(self, optimizer: Any) -> bool:
        """Of several, whether the update ``optimizer`` (given at this monitored step) applies is the next in
        turn to be read: its own were read least recently of the live optimizers'. After the first steps one
        monitored step in five reads an update (``step.detail``): at a fixed phase of a loop whose cycle is a
        multiple of five steps (a critic's four steps and the generator's one) it was always the same
        optimizer's, and the other's stall was never read."""
        entry = self.each.get(id(optimizer))
        if entry is None:  # it holds none of the watched parameters: its update is no one's own
            return False
        return entry.read_at <= min(self.each[key].read_at for key in self.live())

    def read_in_turn(self, optimizer: Any) -> None:
        """The next monitored step takes the scheduled reading (``DetailSchedule.take``): the update ``optimizer``
        (given at this step) applies is the one read in turn. Only these count in the turns: the readings after
        a finding are one rank's, and counted they made the ranks read different steps from then on."""
        entry = self.each.get(id(optimizer))
        if entry is not None:
            self.readings += 1
            entry.read_at = self.readings


@dataclass
class OptimizerStall:
    """One optimizer's own run of still updates, where several hold watched parameters: a GAN's two, whose
    updates the monitor reads in turn (the other one's moving update ended the whole model's run at every
    step, so one optimizer's lr 0 was never told)."""

    ref: Callable[[], Any]
    """The optimizer as the monitor was given it (weakly)."""
    held: list[int]
    """The indices (in the watched parameters) of those it holds."""
    modules: frozenset[str]
    """Their modules: its updates are read from their ratios."""
    watch: StallWatch
    held_back: bool = False
    """Its own run was clear while the whole run's stall stood: flagged, not told, until that stall ends
    (:meth:`StallWatch._release`)."""
    groups: tuple[int, int] = (0, 0)
    """Its ``param_groups`` by identity and length when :attr:`held` was listed (``add_param_group`` changes it)."""
    given_at: int = 0
    """The last monitored step it was given at (:meth:`StallWatch.given`)."""
    gap: int = 0
    """Its longest run of monitored steps between two given to it (a WGAN generator's: ``n_critic + 1``)."""
    others_moved: bool = False
    """Another optimizer's update read since its own run of still updates began moved weights: only then is its
    own stall told (its message says the others' updates moved theirs; :meth:`StallWatch.update_each`)."""
    read_at: int = 0
    """When its update was last read (:attr:`StallWatch.readings`; 0: never): the least recent is the next
    read (:meth:`StallWatch.turn`)."""
    rated: list[int] = field(default_factory=list)
    """The positions, in its learning rates (``optimizer_state.learning_rates``: each group's that has one), of its
    groups that hold watched parameters: the lr an update of its was made with is their largest (:func:`_held_lr`)."""


def _holdings(groups: list[dict] | None, params: TrainableParameters) -> tuple[list[int], frozenset[str], list[int]]:
    """The indices (in ``params``) of the watched parameters ``groups`` hold, their modules, and the positions (in
    ``learning_rates``) of the groups holding any of them (:attr:`OptimizerStall.rated`)."""
    held = {id(p) for g in groups or () for p in g["params"]}
    indices = [i for i, p in enumerate(params.params) if id(p) in held]
    watched = {id(p) for p in params.params}
    rated = [g for g in groups or () if g.get("lr") is not None]  # ``learning_rates``' groups, in its order
    rated = [i for i, g in enumerate(rated) if any(id(p) in watched for p in g["params"])]
    return indices, frozenset(params.module_names[params.module_of[i]] for i in indices), rated


def _held_lr(entry: OptimizerStall | None, rates: list[float] | None) -> float:
    """The largest of ``rates`` (an optimizer's ``learning_rates``) over ``entry``'s groups that hold watched
    parameters; NaN where not known (no entry: DeepSpeed's copies; an Adafactor that makes its own lr)."""
    known = [rates[i] for i in entry.rated if i < len(rates)] if entry is not None and rates is not None else []
    return max(known) if known else math.nan


def _rated(entry: OptimizerStall, groups: list[dict] | None) -> list[dict]:
    """``entry``'s groups that hold watched parameters and have an lr (:attr:`OptimizerStall.rated`)."""
    rated = [g for g in groups or () if g.get("lr") is not None]
    return [rated[i] for i in entry.rated if i < len(rated)]


def _shape(groups: list[dict] | None) -> tuple[int, int]:
    return id(groups), -1 if groups is None else len(groups)


def _subset(values: list[float], indices: list[int]) -> list[float]:
    return [values[i] for i in indices]
