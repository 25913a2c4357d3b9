"""A run that does not learn: the optimizer steps move no weight although the gradients are
normal (:class:`StallWatch`), and which of the usual causes it looks like (:func:`diagnose`).

The update each optimizer step applied comes from the weights themselves (``updates``: the
sketch's ``||dw|| / ||w||`` per module, known at the next monitored step). When
:data:`STALL_UPDATES` updates in a row moved no module by more than :data:`STILL_RATIO` of its
norm while the gradients they should have applied were finite and above the vanishing threshold,
the run is stalled at the step that showed the last of them; the cause is read from the
optimizer, once: it holds none of the watched parameters, or its learning rate is 0 for them, or
the weights are fp16/bf16 and every update rounds away (the optimizer keeps state for them, or
it keeps none, as SGD without momentum, and a plain step ``lr x |g| / |w|`` is below half the
dtype's epsilon), else what ``optimizer.step()`` itself received (:class:`StepGradients`, a step
pre-hook on each optimizer the debugger is given, from its first step judged, reading only while a run of
still updates lasts; a compiled step reads nothing; of several optimizers, the one whose update the last
still reading was is diagnosed and named, ``stepped_optimizer``, in the message too): no
gradient at all (``gradients_cleared``: ``zero_grad()`` between ``backward()`` and ``step()``), zeroed
ones (``gradients_zeroed``: a mask or hook between the monitor and the step zeroed the rows that should
learn, as a textual-inversion mask that misses the placeholder token), or the gradients the monitor read
(``undone_after_step``: the step applied them and something after it put the weights back). Where no
step was seen (an optimizer without step hooks) an optimizer without state for the watched parameters is
read as cleared gradients, as AdamW's is; SGD without momentum keeps none whatever happens, so there only
the step's hook tells; one with state for them saw gradients, and its cause is ``unknown``. DeepSpeed's
engine steps copies of the watched tensors (ZeRO-1/2's flat partitions, whose step hook fires but reads
nothing of theirs; stage 0's float32 masters in bf16/fp16): past an lr of 0 the cause is ``unknown`` there.
Stage 0 in float32 steps the watched parameters themselves: its step is read as any optimizer's.

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

Where several optimizers hold watched parameters (a GAN's generator's and discriminator's, a text encoder's
beside a UNet's), each keeps its own run of still updates too (:meth:`StallWatch.update_each`): a reading
is the update of the optimizer the monitored step before it was given (the monitor's contract: one call
before each optimizer's step, with it), read from its own modules; the other's moving updates ended the
whole model's run at every step, so one optimizer's lr 0 was never told. Its stall names it
(``stalled_optimizer``) where the whole model's is not reported: the whole model's run is a stall only once
a still update of every live optimizer is in it (a critic's five steps before the generator's one are the
critic's), and a stall of every optimizer is the run's, told once. An optimizer's own stall is told only once
another one's update read since its run began moved weights (held until then: at n_critic 5 with both at lr 0
the critic's five were told as its own "while the other's moved" before any generator update was read).
One stepped every k monitored steps counts only the readings of its own steps; after the first ten the scheduled
readings take the optimizers' updates in turn (:meth:`StallWatch.turn`, ``step.detail``), whatever the phase of the
loop's cycle. The optimizers counted are the live ones (:meth:`StallWatch.given`): given within the last
:data:`LIVE_STEPS` monitored steps (or twice their own longest gap); one of the same parameters replaces the one before
it (an optimizer recreated, which Accelerate's ``_optimizers`` and a kept LR scheduler hold alive).

Before a stall is reported the whole weights are checked too (their float64 norms, read when the run of
still updates began and again at its end: two host reads per :data:`STALL_UPDATES` steps while
the sampled blocks stay still), since the ratios come from one sampled block per parameter.

Limits: a step skipped by the GradScaler (or by policy ``skip``) restarts the count, and a
warmup that starts at lr 0 moves nothing for one step (five are needed). Across ranks an update
counts where every rank reads it: every rank reads the steps the schedule details on every rank
(``step.detail``: the first ten, then one in five), so each run of five still updates holds one of
them; a shard that moves only in updates another rank alone read is not seen moving. A rank that
reads every step after a finding of its own may count five still updates before the next such step,
and its stall is withdrawn there (the reduce's ``stalled`` flag apart from ``anomalies``: a withdrawn stall
costs no details exchange). Weight decay
alone still moves the weights (AdamW with ``zero_grad(set_to_none=False)`` before ``step()``): such
a run is not reported. The diagnosis is an elimination from what the optimizer shows, not a proof.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...record import Anomaly, make_anomaly
from ..measure.deepspeed_fp16_scale import ISSUE, LossScaling
from ..measure.gradients import TrainableParameters
from ..measure.optimizer_state import param_groups, raw_optimizer
from .stall_causes import UNSCALED_LOSS, diagnose
from .step_gradients import StepGradients, named

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
    """The whole weights' float64 norms when this run of still updates began (see :meth:`update`)."""
    moved: bool = False
    """The last update taken moved this rank's weights (its sampled blocks, or the whole weights checked
    before a report): under several processes every rank learns whether any rank's did
    (:meth:`some_rank_moved`)."""
    seen: StepGradients = field(default_factory=lambda: StepGradients())
    """What the optimizer's step received, watched while a run of still updates lasts (:meth:`follow_step`)."""
    each: dict[int, OptimizerStall] = field(default_factory=dict)
    """Each optimizer the monitor was given that holds watched parameters (by ``id`` of the one given): its
    own run of still updates, counted where several do (:attr:`several`; :meth:`update_each`)."""
    several: bool = False
    """Several live optimizers hold watched parameters (a GAN's generator's and discriminator's)."""
    pending_optimizer: int = 0
    """``id`` of the optimizer the last monitored step was given: the one whose step the next reading shows."""
    read: OptimizerStall | None = None
    """Of several, the optimizer whose update the last reading was (:meth:`update_each`)."""
    run: set[int] = field(default_factory=set)
    """Of several, the optimizers (by ``id``) whose updates are among the current run's still readings: the
    run is the whole model's only once every one of them is (:meth:`update`)."""
    clock: int = 0
    """The last monitored step :meth:`given` was told of (every step of several)."""
    given_to: int = 0
    """``id`` of the optimizer :meth:`given` was told of last; :attr:`before`: of the one before it."""
    before: int = 0
    params: TrainableParameters | None = None
    """The watched parameters (what each optimizer's holdings are listed in)."""
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
    ) -> bool:
        """Take the update of ``update_step`` (its per-module ratios) and the norm of the gradients
        it should have applied; True when this update makes the stall clear. ``weights``: the whole
        weights' float64 norms, read when a run of still updates begins and again before it is reported:
        the ratios come from a sampled block of each parameter, and a run that moves only rows
        outside it (textual inversion trains one row of the token embedding) is not stalled."""
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
        self.updates += 1
        self.last_step = update_step
        self.largest = max(self.largest, largest)
        self.grad_norm = min(self.grad_norm, grad_norm)
        if self.several:  # the run is the whole model's once every optimizer's update is in it
            self.run.add(self.pending_optimizer)
        if self.updates >= STALL_UPDATES and not self.flagged:
            if self.several and not self.run.issuperset(self.live()):  # one optimizer's: its own run tells it
                return False
            if weights is not None and weights() != self.fingerprint:  # moved outside the sampled blocks
                self.updates, self.moved = 0, True
                return False
            self.flagged = True
            return True
        return False

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
        indices, modules = _holdings(groups, params)
        if indices:
            try:
                ref: Any = weakref.ref(optimizer)
            except TypeError:  # no weak reference: held
                ref = lambda held=optimizer: held  # noqa: E731
            # one of the same parameters replaces the one before (recreated: Accelerate's ``_optimizers`` and a
            # kept LR scheduler hold that one alive, which made a one-optimizer run one of two)
            alive = {key: entry for key, entry in alive.items() if set(entry.held).isdisjoint(indices)}
            entry = OptimizerStall(ref, indices, modules, StallWatch(), given_at=self.clock, groups=_shape(groups))
            alive[id(optimizer)] = entry
        self.each = alive
        self._count_live()

    def _follow_groups(self, entry: OptimizerStall) -> None:
        """``entry``'s holdings again where its optimizer's ``param_groups`` changed (``add_param_group``: a
        model trained from step N); its own run restarts with what it holds now."""
        groups = param_groups(entry.ref())
        if _shape(groups) == entry.groups or self.params is None:
            return
        indices, modules = _holdings(groups, self.params)
        if indices:
            entry.held, entry.modules, entry.groups, entry.watch.updates = indices, modules, _shape(groups), 0

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
        own, self.run = entry.watch, {key} if self.updates else set()
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
        clear = entry.watch.update(update_step, own, grad_norm=grad_norm, skipped=skipped, weights=its)
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
        # not for ever (the other's steps all skipped by a GradScaler): told as not known to be alone
        if entry.held_back and not self.flagged and entry.watch.updates >= 2 * STALL_UPDATES:
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


def _holdings(groups: list[dict] | None, params: TrainableParameters) -> tuple[list[int], frozenset[str]]:
    """The indices (in ``params``) of the watched parameters ``groups`` hold, and their modules."""
    held = {id(p) for g in groups or () for p in g["params"]}
    indices = [i for i, p in enumerate(params.params) if id(p) in held]
    return indices, frozenset(params.module_names[params.module_of[i]] for i in indices)


def _shape(groups: list[dict] | None) -> tuple[int, int]:
    return id(groups), -1 if groups is None else len(groups)


def _subset(values: list[float], indices: list[int]) -> list[float]:
    return [values[i] for i in indices]


def judge_stall(rank: int, watch: StallWatch, step: Any, optimizer: Any, params: TrainableParameters) -> list[Anomaly]:
    """``not_learning`` at ``step``, the monitored step whose reading made the stall clear. Of several
    optimizers, the one whose update the last still reading was is diagnosed and named (``stepped_optimizer``),
    from the reading itself: a compiled step records nothing in its hook."""
    read = watch.read.ref() if watch.several and watch.read is not None else None
    stepped = read if read is not None else watch.seen.stepped()  # whose step the last still update was
    seen = watch.seen.read(raw_optimizer(read)) if read is not None else watch.seen.read()
    details = {
        **diagnose(optimizer if stepped is None else stepped, params, watch.grad_norm, seen),
        "first_step": watch.first_step,
        "last_step": watch.last_step,
        "updates": watch.updates,
        "max_update_ratio": watch.largest,
        "grad_norm": watch.grad_norm,
    }
    if read is not None and watch.read is not None:  # (one alive and no longer given is none of several)
        details["stepped_optimizer"] = named(read, watch.read.held, params)
        # every live optimizer's still update is in the run: each is named, not only the one read last
        live = [watch.each[key] for key in watch.live()]
        details["still_optimizers"] = [named(entry.ref(), entry.held, params) for entry in live]
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]


def judge_optimizer_stall(
    rank: int, watch: StallWatch, stalled: OptimizerStall, step: Any, params: TrainableParameters
) -> list[Anomaly]:
    """``not_learning`` at ``step`` of one optimizer of several (``stalled``, named ``stalled_optimizer``), the
    monitored step whose reading made its own run of still updates clear, or the next still one once another
    optimizer's update read in that run moved weights (held back until then: :meth:`StallWatch.update_each`)."""
    optimizer, own = stalled.ref(), stalled.watch
    inner = raw_optimizer(optimizer)
    details = {
        **diagnose(optimizer, params, own.grad_norm, watch.seen.read(inner)),
        "first_step": own.first_step,
        "last_step": own.last_step,
        "updates": own.updates,
        "max_update_ratio": own.largest,
        "grad_norm": own.grad_norm,
        "stalled_optimizer": named(inner, stalled.held, params),
        "optimizers": len(watch.live()),
    }
    if not stalled.others_moved:  # told without another's update read moving (``StallWatch.update_each``)
        details["others_moved"] = False
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]


def judge_unscaled_loss(rank: int, step: Any, scaling: LossScaling) -> list[Anomaly]:
    """``not_learning`` at the first monitored step where DeepSpeed's fp16 engine without ZeRO left the loss
    unscaled in ``engine.backward`` while its optimizer's step divides the gradients by the loss scale
    (deepspeedai/DeepSpeed#8393: every update ``loss_scale`` x too small), else nothing."""
    found = scaling.unscaled()
    if found is None:
        return []
    details = {"reason": UNSCALED_LOSS, **found, "issue": ISSUE}
    return [
        make_anomaly(
            kind="not_learning", severity="warning", component="optimizer", step=step, rank=rank, details=details
        )
    ]
