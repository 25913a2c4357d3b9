"""The per-step pipeline of the training debugger, one monitored step at a time:

accumulate (micro-steps) -> measure this rank's row (``measure.step_measurer``) -> the step's one host
transfer -> judge this rank's own row (``judges``) -> with several processes,
the step's one fixed-size ``all_reduce`` and, only where it says some rank found something (or on
the replica-check schedule), every rank's details (``ranks.exchange``) -> count, record, log -> the
stability actions the config asks for (``step.stability``) -> the policy (``step.policy``).

Nothing waits in a collective because of the debugger: every rank joins every collective even
when its own measurement or judging fails (a failed measurement sends a row of NaNs with its
failure slot set, and every rank records a ``debugger_error`` for it, not a NaN loss; training
goes on); every further collective and the policy's decision (skip, stop, raise) come from what
the exchange brought every rank alike, so all ranks take the same branch; a local failure after
the exchange (judging, recording, logging to trackers) is recorded once the step's collectives
are done and the policy has run, and with ``strict=True`` raised after the policy (on every rank
for a failed measurement, on its own rank for anything else). A user's ``torch.autocast`` region around the
call is left for the measurement and the transfer (its casts are no part of them, and its ``cat``/``stack`` raise
for the half dtype not its own: fp16 weights under bf16 autocast); the ``closure=`` replay runs under it.

Long because the step's one pass reads top to bottom here; each phase's work lives in the packages it names.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..config import DebugConfig
from ..core import AnomalySink, raised_by_debugger
from ..probes import BackwardOrder
from ..record import Anomaly
from ..stats import ANY_AUTOCAST, outside_autocast
from . import failures
from .judges import step_checks
from .judges.causes import trace_causes
from .judges.local_judging import Judgement, LocalJudge
from .judges.samples import SampleAccumulator, judge_samples
from .measure.gradients import TrainableParameters
from .measure.optimizer_state import (
    find_scaler,
    learning_rates,
    raw_optimizer,
    scale_tensor,
    tracking_enabled,
)
from .measure.pre_reduction import REDUCTIONS, engine_of, fsdp_groups
from .measure.shards import ShardNorms
from .measure.step_measurer import StepMeasurer
from .measure.step_row import SLOTS, LocalReadings, Measurement, StepRow, gathered_rows_to_host
from .ranks.exchange import RankExchange, same_on_other_ranks
from .ranks.origin import made_nonfinite, name_origin, name_overflow
from .ranks.processes import RankContext
from .step.coverage import COVERAGE_EVERY, CoverageWatch
from .step.found_scaler import FoundScalers, found_inf_by_optimizer, unscaled_values
from .step.outputs import across_ranks, record_row, step_info, tracker_values
from .step.policy import StepPolicy
from .step.stability import StabilityActions
from .step.state import Call, History, MonitoredStep, recorded_index
from .step.sync_off import SyncOffWatch, accumulation_steps, held_by, sync_off
from .watched_models import WatchedModels


class StepMonitor:
    """Runs :meth:`monitor` for each call of ``monitor_training_step``; holds what persists
    between steps (:attr:`history`). Each step ends with :attr:`policy` (``step.policy``), which
    is given ``save_report`` (it saves the run directory: policy ``raise``)."""

    def __init__(
        self,
        *,
        params: TrainableParameters,
        config: DebugConfig,
        ctx: RankContext,
        measurer: StepMeasurer,
        history: History,
        order: BackwardOrder,
        sink: AnomalySink,
        model: nn.Module,
        accelerator: Any,
        save_report: Callable[[], Path],
        watched: WatchedModels | None = None,
    ):
        self.params = params
        self.config = config
        self.ctx = ctx
        self.measurer = measurer
        self.history = history
        self.order = order
        self.sink = sink
        self.model = model
        self.accelerator = accelerator
        self.watched = watched if watched is not None else WatchedModels.of(model)
        self.samples = SampleAccumulator()
        self.local = LocalJudge(
            params=params,
            order=order,
            model=self.watched.replay_target,
            rank=ctx.rank,
            sketch=measurer.updates,
            history=history,
            rates=measurer.learning_rates,
        )
        self.exchange = RankExchange(ctx, strict=config.strict)
        self.sharded = params.sharded  # replicated: whole parameters on every rank (FSDP1's are shards)
        self.replicated = not self.sharded and not self.watched.flat_sharded()
        found = [fsdp_groups(m) for m in self.watched.models.values() if self.sharded and isinstance(m, nn.Module)]
        groups = {id(group): group for listed in found for group in listed}  # fully_shard([a, b]): one group
        self.fsdp_groups = [g for g in groups.values() if any(_trained(p) for p in g.fsdp_params)]
        """FSDP2's parameter groups that train: a call while one reduces no gradient is a micro-step
        (``gradients_incomplete``); a frozen group's sync, turned off, says nothing of the step."""
        history.causes.shared_weights = not self.replicated  # a rank's NaN update in every rank's forward
        if ctx.distributed and not self.replicated:  # FSDP2, ZeRO, FSDP1: each rank's shards -> the whole
            measurer.shards = ShardNorms(ctx.all_reduce_sum, len(params))
        self.stability = StabilityActions(params, config, sink, ctx.rank)
        self.policy = StepPolicy(params=params, ctx=ctx, history=history, sink=sink, save_report=save_report)
        self._last: tuple[Any, Any, Any, int] | None = None
        """The last monitored step's optimizer, scaler, the GradScaler's per-step state as its monitor
        found it (``update()`` replaces it: the step's optimizer step ran, or was skipped) and its ``history.joined``,
        for :meth:`last_skip`. Replaced when the next step counts the skip (``_record_step``), not before: the live
        server's ``get_summary()`` during that step still counts it."""
        self._held_joined: int | None = None
        """The monitored step (``history.joined``) of the held step last decided (``_decide_trial``): its row's."""
        self._taken: tuple[int, ...] | None = None
        """A raw DeepSpeed engine's steps taken (``DeepSpeedSteps.steps_taken``) when the last step was monitored:
        once they moved, its optimizer step ran, and a report judges its skip (None: no such engine)."""
        self._early: int | None = None
        """The monitored step (``history.joined``) whose skip a report recorded before the next step read it: not
        recorded again. Its count, not its number: a script's step numbers may repeat (one counting applied steps)."""
        self.coverage = CoverageWatch(params, self.watched, accelerator, ctx, sink, history)
        self.sync_off = SyncOffWatch(accumulation_steps(accelerator, params.deepspeed))
        """The micro-steps since the last optimizer step: a loop whose gradient sync stays off is told (past
        the accumulation length Accelerate or DeepSpeed declares, four times over, if longer than the floor)."""
        self.unmanaged_told = False
        """A DeepSpeed engine's unmanaged accumulation was said (:meth:`_unmanaged`): no sync left off said after."""
        self.found = FoundScalers(config.grad_explosion_threshold, config.update_ratio_threshold)
        """A GradScaler the script did not pass, found at a step that looks scaled (``step.found_scaler``)."""
        self._rows_of: dict[int, tuple[int, Any, float | None, Any]] = {}
        """``id`` of each optimizer monitored -> its last row: its monitored step (``joined``), step number,
        ``max_grad_norm`` and the GradScaler's per-optimizer state at its monitor (None: no scaler known). A GAN's
        skip marks the row of the optimizer the scaler found Inf in (:meth:`_skipped_rows`); a GAN's other
        optimizer, found stepped by a confirmed scaler not passed, has its row read unscaled
        (:meth:`_unscale_learnt`)."""
        self._scaler_states: Any = None
        """The GradScaler's per-optimizer state at the last monitored step that had a scaler: where another
        optimizer's step, monitored after it, has none (a GAN's generator in fp32), the skip the scale's fall tells
        is read in it (:meth:`_skipped_rows`)."""

    def monitor(self, call: Call, incomplete: str | None) -> dict[str, Any]:
        """One ``monitor_training_step`` call; ``incomplete``: the caller's
        :func:`~.measure.optimizer_state.gradients_incomplete` of it (a reason: a micro-step of gradient
        accumulation, the user's ``accumulating`` among them; None: an optimizer step), read once a call."""
        off = outside_autocast() if ANY_AUTOCAST() else None  # (entered as made; no Python call without one)
        try:
            failure = self._accumulate(call)
        finally:
            if off is not None:
                off.close()
        if incomplete is not None:
            if failure is not None:
                raise failure  # a micro-step has no collective: the local error path is safe
            self.history.counts.micro_steps += 1
            sync = self.sync_off
            sync.run += 1
            if sync.run == 1:
                sync.since = recorded_index(call.step, self.history.joined, self.config.step_offset)
            if incomplete == "deepspeed_unmanaged" and not self.unmanaged_told:  # no stretch ever ends: said once
                self.unmanaged_told = True
                self._unmanaged(call)
            if sync.run == sync.at and not self.unmanaged_told:  # a loop that turned gradient sync off for good
                self._sync_off(call, incomplete)
            return {"step": call.step, "gradients_read": False, "micro_steps": self.measurer.accumulated.count}
        if self.sync_off.run:  # the stretch of micro-steps this optimizer step ends
            self.sync_off.ended()
        step = self._begin(call.step, failure)
        released = None
        if self.found.trial is not None:
            released = self._decide_trial(call.optimizer, step.index)
            if self.found.confirmed_at is not None:
                self._unscale_row()
        if not self.history.coverage_checked:
            self.coverage.check(step.index, call.optimizer)
        elif self.history.joined % COVERAGE_EVERY == 0 and self.coverage.changed(call.optimizer):
            self.coverage.check(step.index, call.optimizer)  # a clean run learns of them too, not only a broken one
        off = outside_autocast() if off is not None else None  # (the closure's replay, judged after, runs under it)
        try:
            measured = self._measure(step, call)  # never raises: a failure is the failed row
            self._pre_reduction_failed(step)
            own, local = self._to_host(step, measured)  # the step's one host transfer
        finally:
            if off is not None:
                off.close()
        judged = self._judge(step, own, local, call, measured)  # this rank's own row; never raises
        # a GradScaler not passed (step.found_scaler); a clean step: this comparison and a set look-up
        if not own.grad_norm <= self.config.grad_explosion_threshold:
            self._hold_if_scaled(step, judged, call)
        elif id(call.optimizer) not in self.found.clean_ids:  # its first clean step: never searched after it
            self.found.clean(call.optimizer)
        if released is not None:  # a held step's verdict, emitted and acted on with this step's
            self._release(step, judged, *released)
        info = self._describe(step, own, judged, measured, call)  # before the exchange, which carries its row
        if self.ctx.distributed:
            rows = self._exchange(step, own, judged, info, measured, call)
        else:
            self._localize(step, own, judged, call)
            rows = [own]
        if judged.anomalies:
            judged.anomalies = trace_causes(judged.anomalies)  # cause before consequence, across ranks
            self.history.causes.renamed(self.watched.name_judged(judged))  # renamed after a NaN loss
        if step.details is not None:  # DDP, FSDP2: the rank whose own gradients made a NaN
            self._name_origin(step, judged)
        self.history.causes.remember(judged.anomalies, self.history.joined, self.ctx.rank)
        info = self._record_step(step, rows, judged, info, call)
        try:
            self.stability.act(self.config, judged.anomalies, step.index, self.history.joined, call, self.accelerator)
        except Exception as error:  # strict: raised after the policy's collectives, on this rank only
            step.late = step.late or error
        return self.policy.apply(step, rows, judged.anomalies, info, self.config)

    def _sync_off(self, call: Call, incomplete: str) -> None:
        """The stretch of micro-steps is far past any accumulation: what holds the sync off (``incomplete``, this
        call's reason), said once."""
        index = recorded_index(call.step, self.history.joined, self.config.step_offset)
        with self.sink.guard("telling a gradient sync left off", step=index, rank=self.ctx.rank):
            cause = held_by(incomplete, self.accelerator, self.params.deepspeed)
            anomaly = sync_off(self.sync_off, index, self.ctx.rank, cause, self.history.previous_step)
            self.sink.emit(anomaly, log=self.ctx.is_main)

    def _unmanaged(self, call: Call) -> None:
        """A raw DeepSpeed engine whose ``managed_gradient_accumulation`` is false steps in every
        ``engine.step()`` but is at its boundary only inside it (``DeepSpeedSteps.unmanaged``): every call reads
        as a micro-step and no gradient is read. Said as the debugger's own limit (a ``debugger_error``; raised
        with ``strict``), not as a sync left off: the weights do move (the ``not_learning`` said before was false)."""
        index = recorded_index(call.step, self.history.joined, self.config.step_offset)
        with self.sink.guard("reading DeepSpeed's gradients", step=index, rank=self.ctx.rank):
            raise NotImplementedError(  # under the 200 characters a debugger_error's message keeps
                "DeepSpeed's managed_gradient_accumulation is false: it reduces and steps only in engine.step(), "
                "after the monitor, so no gradient or row is read; set it true (the default)"
            )

    def judge_last_skip(self, at: str = "close") -> None:
        """At close (and at a report: ``at``): whether the last monitored step's optimizer step was
        skipped, which no later step shows yet (a GradScaler skip calls no optimizer step and no step
        hook: its lowered scale, or Accelerate's flag, is read at the next step). Recorded as that
        step's ``skipped_step``, its row marked; one read of the scale, no collective. Judged once
        its optimizer step ran (:meth:`last_skip`); once recorded, neither the next step nor close
        records it again (a report mid-run: the next step still counts its anomaly step, as without the
        report); one found not skipped is left to the next step (another rank's skip, which its detail
        exchange brings, is recorded then). Under Accelerate's DeepSpeed plugin, the flag its step
        left after the last monitor (``DeepSpeedSteps.last_skip``)."""
        step, last = self.history.previous_step, self._last
        if self.found.trial is not None:  # a held step's verdict, with no step after it (or in the report)
            released = self._decide_trial(None, at)
            if self.found.confirmed_at is not None:
                self._unscale_row()
            if released is not None:
                for anomaly in released[0] + released[1]:
                    self.sink.emit(anomaly, log=self.ctx.is_main)
                self._count_released(*released)
        with self.sink.guard("judging the last step's skip", step=step, rank=self.ctx.rank):
            skipped = self.last_skip(at)
            if at == "close":  # the optimizer is not held past close
                self._last = None
            if not skipped:  # not judged, or not skipped: the next step judges it (another rank's skip among them)
                return
            self._early = last[3]
            for anomaly in skipped:
                self.sink.emit(anomaly, log=self.ctx.is_main)
                for at in self._skipped_rows(last[2], last[3]):
                    self.sink.record.mark_skipped(anomaly.step, anomaly.details["reason"], joined=at)
            self.history.counts.add_skip(skipped)

    def last_skip(self, at: str) -> list[Anomaly] | None:
        """The last monitored step's ``skipped_step`` (``[]``: not skipped), judged without changing
        what the next step judges (on a copy of this rank's history): nothing recorded, one read of
        the scale. None: nothing to judge (no step, its skip recorded already, or its optimizer step has not run:
        the run stopped or raised between the monitor and ``optimizer.step()``, when Accelerate's
        ``step_was_skipped`` is still the step before's: the GradScaler's ``update()`` had not
        replaced the per-step state the monitor found). Before close (``at`` a report's, policy ``raise``'s
        inside the monitor among them) only a step known to have run is judged: a GradScaler's (its state tells) or a
        raw DeepSpeed engine's (its ``global_steps`` moved since the monitor, skipped steps counted too)."""
        history, last = self.history, self._last
        if last is None or history.previous_step is None or last[3] == self._early:
            return None
        optimizer, scaler, states, _ = last
        scaler = find_scaler(self.accelerator, optimizer, scaler)
        ran = states is not None and getattr(scaler, "_per_optimizer_states", None) is not states
        engines = self.params.deepspeed
        if self._taken is not None and engines is not None and engines.steps_taken() != self._taken:
            ran = True  # a raw DeepSpeed engine's step since the monitor: its overflow flag is that step's
        if not ran and (states is not None or at != "close"):
            return None  # not run yet; a report judges only a step known to have run (no sign of the others')
        values = dict.fromkeys(SLOTS, math.nan)
        values.update(failed=0.0, accelerate_skipped=self.measurer.skipped(optimizer, last=True))
        if scaler is not None and scale_tensor(scaler) is not None:
            values["grad_scale"] = float(scaler.get_scale())
        row = StepRow.from_row([values[name] for name in SLOTS])
        mine = history.ranks[0]
        mine = dataclasses.replace(mine, skips=deque(mine.skips, maxlen=mine.skips.maxlen))
        skipped = step_checks.judge_skipped([row], [mine], history.previous_step, at, self.ctx.rank)
        for a in skipped:  # as the next step's judging marks it
            a.local_rank, a.host = self.ctx.local_rank, self.ctx.host
        if history.overflowed is not None:  # the ranks whose own gradients overflowed, as the next detail step names
            skipped = name_overflow(skipped, *history.overflowed)
        return skipped

    def _row_of(self, key: int) -> tuple[int, Any, float | None, Any] | None:
        """The last row of the optimizer a GradScaler knows by ``key`` (``id`` of the optimizer ``scaler.step`` was
        given: the raw one under a wrapper the monitor was given, Accelerate's)."""
        row = self._rows_of.get(key)
        if row is not None:
            return row
        for given, entry in self.history.stall.each.items():
            optimizer = entry.ref()
            if optimizer is not None and id(raw_optimizer(optimizer)) == key:
                return self._rows_of.get(given)
        return None

    def _skipped_rows(self, states: Any, fallback: int) -> list[int]:
        """The monitored steps (``joined``) of the rows whose optimizer step a GradScaler's ``update()`` skipped,
        read when the scale fell: where several optimizers were monitored, the row of each one the per-optimizer
        ``states`` (the last monitored with a scaler: the state that ``update()`` read) found Inf in, taken while
        that state was the scaler's (a GAN's D, whose step the scaler skipped, not G's row monitored after it; both
        where both overflowed); else, or where none is known, ``fallback`` (the last monitored step's)."""
        if not states or len(self._rows_of) < 2:
            return [fallback]
        rows = []
        for key, count in found_inf_by_optimizer(states, updated=True).items():  # the scale fell: update() read it
            row = self._row_of(key) if count > 0 else None
            if row is not None and row[3] is states:
                rows.append(row[0])
        return sorted(rows) or [fallback]

    def _unscale_learnt(self) -> None:
        """The rows of the optimizers just found stepped by a confirmed GradScaler not passed (a GAN's other one:
        its norm, scaled, read clean, so it was never searched): its last row, where it was read with no scaler in
        the state the scaler stepped it in, read unscaled by that state's scale (as the held row is)."""
        learnt, self.found.learnt = self.found.learnt, []
        record = self.sink.record
        for key, scale, since in learnt:
            found = self._row_of(key)
            if found is None or found[0] < since or found[3] is not None:
                continue
            joined, index, max_grad_norm, _ = found
            with self.sink.guard(
                "unscaling a row of the optimizer a found scaler stepped", step=index, rank=self.ctx.rank
            ):
                row = record.step_row(index, joined)
                if row is not None and row.get("grad_scale") is None:
                    record.amend_step(index, unscaled_values(row, scale, max_grad_norm), joined=joined)

    def _hold_if_scaled(self, step: MonitoredStep, judged: Judgement, call: Call) -> None:
        """A step that looks scaled (no scaler known; no NaN loss, which no scaling makes): its verdict held while
        the GradScalers alive are tried (``step.found_scaler``), once for its optimizer. Several processes: held on
        every rank or released on every rank in the step (:meth:`_held_alone`). Not a step whose measurement failed
        (its row all NaN: no norm to look scaled; its debugger_error is said at once, as :meth:`_held_alone` releases
        a step some rank failed)."""
        if step.last is None or step.last[1] is not None or judged.flags.nonfinite_loss or step.failure is not None:
            return
        with self.sink.guard("looking for a GradScaler not passed", step=step.index, rank=self.ctx.rank):
            own = [a for a in judged.anomalies if a.kind != "skipped_step"]
            if self.found.hold(call.optimizer, step.index, own, call.max_grad_norm, self.history.joined):
                judged.anomalies = [a for a in judged.anomalies if a.kind == "skipped_step"]
                flags = judged.flags  # counted when released (in place: :meth:`_after_reduce`)
                step.held_flags = {"nonfinite": flags.nonfinite, "explosion": flags.explosion}
                flags.nonfinite = flags.explosion = False
                step.held = True

    def _held_alone(self, summary: Any) -> bool:
        """Whether some rank held no verdict at a step this rank held (several processes): one held none
        (``unheld``), some rank's loss was NaN (no scaling makes one), a rank failed, or some rank's gradient norm
        read below the threshold (not scaled-looking). The same on every rank. DDP's all-reduced gradients give
        every rank the same norm and every rank of the same script finds the same scalers, so the ranks hold
        together; where they do not, the holders release the step in place, before the details: every rank then
        judges and counts the same anomalies in the same step."""
        flags, norm = summary.flags, summary.aggregates.get("grad_norm", {}).get("min")
        scaled = isinstance(norm, str) or norm is None or not norm <= self.config.grad_explosion_threshold
        return (
            flags.get("unheld", False)
            or flags.get("nonfinite_loss", False)
            or flags.get("failed", False)
            or not scaled
        )

    def _unhold(self, judged: Judgement) -> None:
        """This step's held verdict released as it was read (its optimizer searched again once:
        ``FoundScalers.search_again``)."""
        trial, self.found.trial = self.found.trial, None
        trial.end()
        self.found.search_again(trial)
        judged.anomalies = trial.held + judged.anomalies

    def _decide_trial(self, optimizer: Any, at: Any) -> tuple[list[Anomaly], list[Anomaly]] | None:
        """The held step's anomalies (unscaled where its scaler is confirmed, else as read) and its skip;
        None while the trial waits for the held optimizer's ``scaler.step``."""
        trial = self.found.trial
        self._held_joined = trial.joined  # what names its row where a GAN's optimizers share a step number
        with self.sink.guard("trying a GradScaler not passed", step=trial.step, rank=self.ctx.rank):
            released = self.found.resolve(optimizer, at)
            for skip in released[1] if released is not None else ():  # in the row from the start, as one judged
                self.history.ranks[0].count_skip(skip.step)
            return released
        self.found.trial = None  # failed (recorded): nothing held is lost
        trial.end()
        return trial.held, []

    def _unscale_row(self) -> None:
        """The held step's recorded row, its scaler confirmed: read unscaled (``found_scaler.unscaled_values``)."""
        (index, scale, max_grad_norm, joined), self.found.confirmed_at = self.found.confirmed_at, None
        with self.sink.guard("unscaling the held step's row", step=index, rank=self.ctx.rank):
            record = self.sink.record
            row = record.step_row(index, joined)  # the held row itself, not another optimizer's of that step
            if row is not None:
                record.amend_step(index, unscaled_values(row, scale, max_grad_norm), joined=joined)

    def _release(
        self, step: MonitoredStep, judged: Judgement, anomalies: list[Anomaly], skipped: list[Anomaly]
    ) -> None:
        """An earlier step's held verdict, emitted with this step's and counted as its own step
        (:meth:`_record_step`, from what every rank received)."""
        judged.anomalies = anomalies + skipped + judged.anomalies
        judged.skipped = skipped + judged.skipped
        step.released_skips = skipped  # they mark the held row, whatever step number this call has
        if anomalies or skipped:
            step.released = (anomalies + skipped)[0].step

    def _count_released(self, anomalies: list[Anomaly], skipped: list[Anomaly]) -> None:
        """At close: the held step counted as a step is (its anomaly step, explosion, NaN gradients); a released
        skip always (its step's row marked). At a later step its anomalies are counted with that step's."""
        nonfinite = any(a.kind == "nonfinite" and a.severity == "error" for a in anomalies)
        self.history.counts.add_step(anomalies, step_checks.StepFlags(nonfinite=nonfinite), skipped)
        for a in skipped:
            self.sink.record.mark_skipped(a.step, "grad_scaler", joined=self._held_joined)

    def _pre_reduction_failed(self, step: MonitoredStep) -> None:
        """A failure of the check inside the engine's hook (the reduction still ran): recorded
        once it happened, as this rank's ``debugger_error``; the step reads as not checked."""
        check = self.measurer.pre_reduction
        if check is not None and check.failure is not None:
            error, check.failure = check.failure, None
            where = "checking the gradients before the reduction"
            self.sink.debugger_error(where, error, step=step.index, rank=self.ctx.rank)

    def _name_origin(self, step: MonitoredStep, judged: Judgement) -> None:
        """Every rank's NaN gradients say which rank's own gradients made them before the all-reduce
        (``ranks.origin``), and a skipped step which rank overflowed (the GradScaler's skip is found
        at the next step). Every rank received the same rows: every rank names the same."""
        counts = [row.local_nonfinite for row in step.details.rows]
        through = REDUCTIONS[engine_of(self.params, self.watched.models.values(), self.accelerator) or "ddp"]
        judged.anomalies = name_origin(judged.anomalies, counts, step.index, through)
        made = made_nonfinite(counts)
        if made:
            self.history.overflowed = (step.index, made)
        if self.history.overflowed is not None:
            judged.anomalies = name_overflow(judged.anomalies, *self.history.overflowed)

    def _accumulate(self, call: Call) -> Exception | None:
        try:
            self.measurer.accumulated.add(
                call.loss,
                self.measurer.device,
                self.history.buckets,
                call.timesteps,
                call.per_sample_loss,
                call.batch_size,
                call.inputs,
            )
            self.samples.add(
                self.measurer.device, call.per_sample_loss, call.timesteps, call.loss_weights, call.sample_ids
            )
        except Exception as error:
            return error
        return None

    def _begin(self, index: Any, failure: Exception | None) -> MonitoredStep:
        """The step's number and schedules (from the joined-step clock: the same on every rank)."""
        every, monitored = self.config.rank_check_every, self.history.joined + 1
        return MonitoredStep(
            index=recorded_index(index, monitored - 1, self.config.step_offset),
            check_ranks=self.ctx.distributed and every > 0 and monitored % every == 0 and self.replicated,
            refresh_weights=self.config.per_module_grad_norms and self.history.modules.refresh_due(monitored),
            started=time.perf_counter(),
            failure=failure,
        )

    def _measure(self, step: MonitoredStep, call: Call) -> Measurement:
        shards, monitored = self.measurer.shards, self.history.joined + 1
        if shards is not None:
            shards.begin()
        try:
            if step.failure is not None:
                raise step.failure
            scaler = find_scaler(self.accelerator, call.optimizer, call.scaler)
            if scaler is None and self.found.any_confirmed:  # one the script did not pass (step.found_scaler)
                scaler = self.found.scaler_for(call.optimizer, self.history.joined + 1)
                if self.found.learnt:  # a GAN's other optimizer, stepped by it: its row read with no scaler
                    self._unscale_learnt()
            step.last = (call.optimizer, scaler, getattr(scaler, "_per_optimizer_states", None))
            measured = self.measurer.measure(
                scaler=scaler,
                optimizer=call.optimizer,
                check_ranks=step.check_ranks,
                refresh_weights=step.refresh_weights,
                per_module=step.refresh_weights
                or (self.config.per_module_grad_norms and self.history.detail(monitored)),
                memory_tracking=self.config.memory_tracking,
                read_skipped=self.history.previous_step is not None,
                clip_norm=call.grad_norm,
                updates_at=monitored,
                listed=call.gradients,
            )
            samples = self.samples.device_vector()
            if samples is not None:  # fetched with the step's one transfer
                measured.local["samples"] = samples
                step.sample_ids, step.samples_given = self.samples.ids, self.samples.given
            return measured
        except Exception as error:
            step.failure = error
            if shards is not None:  # every rank joins the shards' sum, a failed one too
                shards.join_failed(step.refresh_weights, self.measurer.device)
            return self.measurer.failed()
        finally:
            self.measurer.accumulated.reset()
            self.samples.reset()

    def _to_host(self, step: MonitoredStep, measured: Measurement) -> tuple[StepRow, LocalReadings]:
        """This rank's row and local figures on the host. One process: its "gather" is its own row;
        several meet in :meth:`_exchange`, after each has judged its own."""
        matrix = measured.vector.unsqueeze(0) if self.ctx.distributed else self.ctx.gather(measured.vector)
        rows, local, step.deferred = gathered_rows_to_host(matrix, measured, self.measurer.layout)
        self.history.joined += 1  # every rank counts the step it joins: the schedules stay aligned
        self.history.counts.total_steps += 1
        return rows[0], local

    def _exchange(
        self, step: MonitoredStep, own: StepRow, judged: Judgement, info: dict, measured, call: Call
    ) -> list[StepRow]:
        """The step's one fixed-size ``all_reduce``, and every rank's details where it says so
        (``ranks.exchange``); the rows of every rank on a detail step, else this rank's own. The
        ``closure=`` replay and the stall across ranks run between the two, so the details carry what they found."""
        summary, step.details = self.exchange.step(
            own,
            judged,
            index=step.index,
            joined=self.history.joined,
            record=step.record,
            check_ranks=step.check_ranks,
            checksums=lambda: measured.checksums_or_nan(len(self.params), self.measurer.device),
            params=self.params,
            before_details=lambda summary: self._after_reduce(step, own, judged, call, summary),
            # a stall alone needs the details only where it stands (no rank's weights moved)
            stalled=bool(judged.anomalies) and self.local.stall_alone(judged),
            held=step.held_flags if step.held else None,
        )
        info.update(across_ranks([], summary.aggregates))
        return step.details.rows if step.details is not None else [own]

    def _after_reduce(self, step: MonitoredStep, own: StepRow, judged: Judgement, call: Call, summary) -> None:
        """What every rank does once the reduce has OR-ed the flags, before the details: a verdict held where
        some rank holds none released in place (:meth:`_held_alone`), the stall judged across ranks
        (``LocalJudge.judge_across_ranks``), then the ``closure=`` replay, decided without the held flags (a
        step that looks scaled is no replay's), which then count on every rank alike where the step is released
        (the summary's ``nonfinite_held``, ``explosion_held``; held on every rank: counted when released). Never
        raises: every rank goes on to the details' gather."""
        released = False
        try:  # (not sink.guard: with strict=True it raises, and the other ranks would wait in the gather)
            released = self._held_alone(summary)  # (where no rank held, the held flags are the flags)
            if step.held and released:
                self._unhold(judged)
            self.local.judge_across_ranks(judged)
        except Exception as error:  # recorded, and raised after the policy with strict=True
            step.deferred = step.deferred or error
            failure = failures.judging_failed(self.ctx.rank, step.index, error, raised=self.config.strict)
            judged.anomalies.append(failure)
        self._localize(step, own, judged, call)
        if released:
            flags = summary.flags
            judged.flags.nonfinite |= flags.get("nonfinite_held", False)
            judged.flags.explosion |= flags.get("explosion_held", False)

    def _localize(self, step: MonitoredStep, own: StepRow, judged: Judgement, call: Call) -> None:
        """The ``closure=`` replay under anomaly mode, for a NaN loss or input, or NaN gradients not
        under a GradScaler (an overflow it handles is no error). The replay's forward runs DDP's own
        collectives (its buffer broadcast, the bucket rebuild), so under several processes every
        rank replays or none does: decided from the flags every rank received alike (``judged.flags``
        after the reduce); each rank's replay names its own anomalies. Never raises: a failure is
        recorded, and raised after the policy with ``strict=True`` (a failed replay's is recorded
        at ``replay`` already: not again at ``judging``)."""
        flags = judged.flags
        if call.closure is None or not (flags.nonfinite_loss or (flags.nonfinite and not own.scaled)):
            return
        try:
            self.local.localize(judged.anomalies, call.closure, self.config, step.index)
        except Exception as error:
            step.deferred = step.deferred or error
            if not raised_by_debugger(error):
                failure = failures.judging_failed(self.ctx.rank, step.index, error, raised=self.config.strict)
                judged.anomalies.append(failure)

    def _judge(self, step: MonitoredStep, own: StepRow, local: LocalReadings, call: Call, measured) -> Judgement:
        """This rank's own row; then what only this rank knows. An error is recorded; what was judged stays."""
        judged, history, ctx = Judgement(), self.history, self.ctx
        rank, mine, stall = ctx.rank, history.ranks[0], history.stall
        try:
            if stall.several or id(call.optimizer) != stall.given_to:  # several, or a new one: no call with one
                stall.given(call.optimizer, history.joined)
            if step.deferred is not None:
                raise step.deferred
            if not own.measured:
                judged.anomalies.append(
                    failures.measurement_failed(rank, step.index, step.failure, raised=self.config.strict)
                )
            else:
                judged.anomalies += step_checks.judge_rank(
                    rank, own, step.index, mine, self.params, self.config, judged.flags
                )
                history.buckets.add(list(own.buckets))
                if ctx.distributed and not ctx.is_main:  # the main process adds them at a detail step
                    self.exchange.add_buckets(own.buckets)
            judged.skipped = step_checks.judge_skipped([own], [mine], history.previous_step, step.index, rank)
            judged.anomalies += judged.skipped
            judged.anomalies += step_checks.judge_learning_rate([own], step.index, self.config.lr_jump_factor, rank)
            if own.measured:
                self.local.judge(
                    judged,
                    local,
                    call.optimizer,
                    measured.input_counts,
                    step.index,
                    self.config,
                    clip_scale=own.clip_scale(call.max_grad_norm),
                    input_producers=measured.input_producers,
                    grad_norm=own.grad_norm,
                    norms=measured.norms,
                    forwards=measured.forwards,
                )
            else:  # its update, read at the next step, applies gradients not measured: it is not judged
                stall.pending_grad_norm = math.nan
            stall.pending_optimizer, stall.pending_rates = id(call.optimizer), self.measurer.learning_rates.rates
            if local.samples is not None:
                found = judge_samples(
                    local.samples, step.sample_ids, step.index, rank, history.samples, step.samples_given
                )
                found.add_to(judged, rank, step.index)
            if judged.anomalies and self.history.coverage_checked and self.coverage.changed(call.optimizer):
                self.coverage.check(step.index, call.optimizer)
            if judged.anomalies:  # a clean step has nothing to note, link or name
                # a script that clips already is not told to clip
                clipping = call.max_grad_norm if call.max_grad_norm is not None else not math.isnan(own.clip_norm)
                judged.anomalies = step_checks.note_clipping(judged.anomalies, rank, clipping)
                # an earlier step's cause (a learning-rate jump, weights gone non-finite) for this step's consequences
                judged.anomalies = history.causes.link(judged.anomalies, rank=rank, joined=history.joined)
                history.causes.renamed(self.watched.name_judged(judged))  # several models: each names its own
            found = bool(judged.anomalies)  # several processes: a stall alone waits for the reduce to stand
            found = found and not (ctx.distributed and self.local.stall_alone(judged))
            turns = (stall, call.optimizer) if stall.several else None  # several: each one's updates in turn
            if history.detail.then(history.joined, found=found, turns=turns):  # the next step is detailed:
                self.local.sketch.keep(history.joined)  # the update it reads is this step's
        except Exception as error:
            step.deferred = error
            judged.anomalies.append(failures.judging_failed(rank, step.index, error, raised=self.config.strict))
        for a in judged.anomalies:  # where it happened: which process on which machine
            a.local_rank, a.host = ctx.local_rank, ctx.host
        return judged

    def _describe(
        self, step: MonitoredStep, own: StepRow, judged: Judgement, measured: Measurement, call: Call
    ) -> dict:
        """What the step returns and records about this rank (local work: a failure is recorded after
        the step's collectives, ``step.late``)."""
        history = self.history
        info: dict[str, Any] = {"step": step.index, "anomalies": []}
        elapsed = None if history.last_time is None else step.started - history.last_time
        history.last_time = step.started
        try:
            info.update(
                step_info(
                    own,
                    self.ctx.rank,
                    measured=step.failure is None,
                    error=step.failure if step.failure is not None else step.deferred,
                    # a measured step read them for its row (five calls through Accelerate's wrapper)
                    learning_rates=self.measurer.learning_rates.rates
                    if step.failure is None
                    else learning_rates(call.optimizer),
                    elapsed=elapsed,
                    memory=measured.memory,
                    module_norms=judged.module_norms,
                    update_ratio=judged.update_ratio,
                    max_grad_norm=call.max_grad_norm,
                    applied_update=judged.applied_update,
                )
            )
            step.record = record_row(info)
        except Exception as error:
            step.late = error
            info["error"] = repr(error)
        return info

    def _record_step(
        self, step: MonitoredStep, rows: list[StepRow], judged: Judgement, info: dict, call: Call
    ) -> dict:
        """Count (from what every rank judged or received alike), then record and log: local work,
        whose failure waits until the policy has run."""
        history, ctx = self.history, self.ctx
        info["anomalies"] = [a.kind for a in judged.anomalies] if judged.anomalies else []  # clean: no call
        found, states = step.last, self._scaler_states  # this step's from now on (the skip it counts is pending)
        if found is not None and found[2] is not None:
            self._scaler_states = found[2]
        self._last = (call.optimizer, call.scaler, None, history.joined) if found is None else (*found, history.joined)
        engines = self.params.deepspeed
        self._taken = engines.steps_taken() if engines is not None and not engines.capture else None
        recorded, skipped, counted, late_skips = judged.anomalies, judged.skipped, judged.anomalies, []
        late = step.released  # an earlier step's held verdict: counted as that step, apart from this one's
        if late is not None and late != step.index:
            held = [a for a in counted if a.step == late]
            late_skips = [a for a in skipped if a.step == late]
            counted, skipped = [a for a in counted if a.step != late], [a for a in skipped if a.step != late]
            nonfinite = any(a.kind == "nonfinite" and a.severity == "error" for a in held)
            history.counts.add_step(held, step_checks.StepFlags(nonfinite=nonfinite), late_skips)
        released = step.released_skips  # the held step's skips (its row: the one taken at self._held_joined)
        if skipped and self._early == history.joined - 1:  # a report recorded it before this step read it
            recorded = [a for a in recorded if a.kind != "skipped_step" or _among(a, released)]
            skipped = [a for a in skipped if _among(a, released)]
        # its anomaly step counted here, as in a run that does not report (a report counts the skip alone)
        history.counts.add_step(counted, judged.flags, skipped)
        history.previous_step = step.index
        if step.late is not None:
            return info
        try:
            copies = same_on_other_ranks(recorded) if ctx.distributed else set()
            for i, a in enumerate(recorded):
                if ctx.is_main or a.rank == ctx.rank:
                    # the main process logs every rank's anomalies (every one was exchanged), one
                    # line for an anomaly and its copies on other ranks
                    self.sink.emit(a, log=ctx.is_main and i not in copies)
            self.sink.end_step()  # repeats on consecutive monitored steps fold
            info.update(across_ranks(rows, None))
            row = dict(step.record, **{k: info[k] for k in ("ranks", "losses_by_rank") if k in info})
            if "grad_norms_by_rank" in info:
                row["grad_norms_by_rank"] = info["grad_norms_by_rank"]
            for skip in skipped + late_skips:  # found now: the held step's row, else the skipped optimizer's (a GAN's)
                rows = (
                    [self._held_joined] if _among(skip, released) else self._skipped_rows(states, history.joined - 1)
                )
                for at in rows:
                    self.sink.record.mark_skipped(skip.step, skip.details["reason"], joined=at)
            self.sink.record.add_step(row, joined=history.joined)
            step.row_joined = history.joined
            self._rows_of[id(call.optimizer)] = (
                history.joined,
                step.index,
                call.max_grad_norm,
                None if found is None else found[2],
            )
            if ctx.is_main and step.details is not None:  # the other ranks' rows of this step and the ones before it
                for joined, other in self.exchange.unrecorded(step.details):
                    self.sink.record.add_rank_step(other, joined=joined)
                for rank, buckets in enumerate(step.details.buckets):
                    if buckets and rank != ctx.rank:  # its own are added every step
                        history.buckets.add(buckets)
            if tracking_enabled(self.accelerator):
                self.accelerator.log(tracker_values(info), step=step.index)
        except Exception as error:
            step.late = error
            info["error"] = repr(error)
        return info


def _among(anomaly: Anomaly, anomalies: list[Anomaly]) -> bool:
    """Whether ``anomaly`` is one of ``anomalies`` itself (not an equal one: two skips of one step number, a
    GAN's optimizers', are equal)."""
    return any(anomaly is other for other in anomalies)


def _trained(fsdp_param: Any) -> bool:
    """Whether an FSDP2 parameter takes gradients (its sharded parameter's ``requires_grad``; not known: True)."""
    return getattr(getattr(fsdp_param, "sharded_param", None), "requires_grad", True)
