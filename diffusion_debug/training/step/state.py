"""What the training debugger keeps between monitored steps (:class:`History`), the arguments
of one ``monitor_training_step`` call (:class:`Call`) and one monitored step in progress
(:class:`MonitoredStep`): value holders the step pipeline (``monitor``, ``policy``) reads
and updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..judges.causes import CauseTracker
from ..judges.module_health import ModuleHealth
from ..judges.not_learning import StallWatch
from ..judges.samples import SampleHistory
from ..judges.step_checks import RankHistory
from ..measure.gradients import ModuleNormBook
from ..measure.loss import TimestepBuckets
from ..ranks.exchange import Details
from .detail import DetailSchedule
from .outputs import StepCounts


@dataclass
class History:
    """What the debugger keeps between monitored steps."""

    ranks: list[RankHistory]
    """This rank's own (one entry): each rank judges only its own row."""
    modules: ModuleNormBook
    buckets: TimestepBuckets
    counts: StepCounts = field(default_factory=StepCounts)
    causes: CauseTracker = field(default_factory=CauseTracker)
    """Earlier steps' causes (a learning-rate jump, weights gone non-finite): what a later NaN
    loss or spike points at."""
    health: ModuleHealth | None = None
    """Every module's gradient history and the map of the report (with per-module norms)."""
    stall: StallWatch = field(default_factory=StallWatch)
    """The current run of optimizer steps that moved no weight."""
    update_flagged: bool = False
    """The last measured update moved a module by more than its norm (flagged once, until an update under it)."""
    joined: int = 0
    """Steps whose collective this rank joined: the schedules' clock, the same on every rank and
    never cleared (``counts`` is)."""
    previous_step: Any = None
    last_time: float | None = None
    samples: SampleHistory = field(default_factory=SampleHistory)
    """This rank's recent per-sample losses (``per_sample_loss=``): what an outlying sample is judged against."""
    overflowed: tuple[Any, list[int]] | None = None
    """The last step whose gradients were non-finite on some rank before the all-reduce, and those
    ranks (``ranks.origin``): what the GradScaler's skip of it, found at the next step, names."""
    coverage_checked: bool = False
    """The optimizers were compared with the watched parameters (once, at the first step that has one)."""
    detail: DetailSchedule = field(default_factory=DetailSchedule)
    """Which monitored steps read the per-module gradient figures (the first ones, every few, near trouble)."""
    gradient_steps: dict[int, tuple[Any, bool]] = field(default_factory=dict)
    """Per optimizer object (by ``id``, with a weak reference that tells a new one at a reused id):
    whether its step moves a weight by lr x its gradient (``optimizer_state.steps_by_its_gradient``),
    decided once; only such a step gets the lr x gradient / weight estimate."""

    @classmethod
    def new(cls, config: Any, params: Any, buckets: TimestepBuckets) -> "History":
        """Nothing kept yet, for a run of ``config`` watching ``params`` (a ``gradients.TrainableParameters``):
        :attr:`ranks` holds this rank's own history alone (each rank judges its own row)."""
        modules = ModuleNormBook(params.module_names, params.module_of)
        return cls([RankHistory.new(config)], modules, buckets, health=ModuleHealth(params.module_names))

    def clear_reported(self) -> None:
        """Forget what was reported, with the record that held it (``clear_debug_history``): a stall,
        a loss trend, memory growth, a dead module, a too-large update or parameters in no optimizer
        that still hold are reported again in the new record, and no later anomaly points at a cause
        the record no longer holds."""
        self.causes = CauseTracker(self.causes.shared_weights)
        self.stall.flagged = False
        for each in self.stall.each.values():  # several optimizers: each one's own stall too
            each.watch.flagged = each.held_back = False
        self.update_flagged = False
        self.coverage_checked = False
        for rank in self.ranks:
            rank.memory_flagged.clear()
            rank.trend.flagged = False
        if self.health is not None:
            self.health.dead[:] = False


@dataclass
class Call:
    """The arguments of one ``monitor_training_step`` call."""

    loss: Any
    optimizer: Any
    step: Any
    timesteps: Any
    closure: Callable[[], torch.Tensor] | None
    per_sample_loss: Any
    scaler: Any
    batch_size: int | None
    inputs: Any = None
    max_grad_norm: float | None = None
    grad_norm: Any = None
    """The pre-clip norm ``clip_grad_norm_`` returned, when the user clipped before monitoring."""
    loss_weights: Any = None
    sample_ids: Any = None
    accumulating: bool = False
    """The user's word that no optimizer step follows this call (a plain loop's micro-step)."""
    gradients: list | None = None
    """Each parameter's ``.grad`` as the swap check listed them (None: not listed), which the step's norms
    take. Held by the call alone: once it returns, a ``zero_grad(set_to_none=True)`` frees them (kept on
    the measurer for the next measured call, a micro-step's list held a model's worth of gradients)."""


@dataclass
class MonitoredStep:
    """One monitored step in progress, and how it failed locally (each failure is recorded when
    the step's collectives allow, and raised with ``strict=True`` after the policy)."""

    index: Any
    check_ranks: bool
    refresh_weights: bool
    started: float
    failure: Exception | None = None
    """This rank could not measure the step: it sent the failed row."""
    record: dict | None = None
    """This rank's record row of the step (before the exchange; None: it could not be made)."""
    deferred: Exception | None = None
    """A failure after the gather (transfer, judging)."""
    late: Exception | None = None
    """A failure while recording the step (after the step's collectives)."""
    details: Details | None = None
    """Every rank's details, on a step whose details were exchanged."""
    sample_ids: list[Any] | None = None
    samples_given: set[str] = field(default_factory=set)
    last: tuple[Any, Any, Any] | None = None
    """The optimizer, scaler and the GradScaler's per-step state its measurement found (``StepMonitor._last``)."""
    held: bool = False
    """This rank holds the step's verdict while a GradScaler not passed is tried (``step.found_scaler``)."""
    held_flags: dict[str, bool] = field(default_factory=dict)
    """The held step's flags kept out of its counts until released (``nonfinite``, ``explosion``)."""
    released: Any = None
    """The number of an earlier step whose held verdict this step released (None: none): counted as that step."""
    row_joined: int | None = None
    """The monitored step (``History.joined``) this call's row was recorded at (``RunRecord.add_step``): what a
    policy skip marks (None: no row recorded, the record failed first)."""
    released_skips: list = field(default_factory=list)
    """The held step's ``skipped_step`` this step released (``StepMonitor._release``): they mark the held row
    (taken at ``StepMonitor._held_joined``), told apart by identity from the last step's skip this step read."""


def recorded_index(step: Any, default: int, offset: int = 0) -> Any:
    """A step's number as recorded (:attr:`MonitoredStep.index`): the user's ``step`` (else ``default``,
    the monitored-step count) plus ``config.step_offset``."""
    if step is None:
        return default + offset
    try:
        return int(step) + offset
    except (TypeError, ValueError):
        return step
