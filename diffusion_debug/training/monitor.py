"""The per-step pipeline of the training debugger, one monitored step at a time:

accumulate (micro-steps) -> measure this rank's row (``step_vector``) -> one ``all_gather`` and
one host transfer -> replica check (only where the rows say so) -> judge every rank's row
(``checks``) -> exchange the ranks' own anomalies (only where the rows say so) -> count, record,
log -> the stability actions the config asks for (``stability``) -> the policy.

The guarantees (see ``debugger``'s docstring): every rank joins every collective even when its
own measurement fails (it sends the failed row); every further collective and the policy's
decision come from the gathered rows alone; a local failure after the gather is recorded once
the step's collectives are done, and with ``strict=True`` raised after the policy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..config import DebugConfig
from ..core import AnomalySink, apply_policy
from ..errors import DiffusionDebugError
from ..probes import BackwardOrder
from ..record import Anomaly
from . import checks, gradients
from .causes import CauseTracker, trace_causes
from .checks import RankHistory
from .gradients import ModuleNormBook, TrainableParameters
from .local_judging import Judgement, LocalJudge
from .loss import TimestepBuckets
from .optimizer_state import find_scaler, gradients_complete, learning_rates, tracking_enabled
from .ranks import RankContext, exchange_anomalies
from .stability import StabilityActions
from .step_results import StepCounts, rank_row, record_row, step_info, tracker_values
from .step_vector import LocalReadings, Measurement, StepMeasurer, StepRow, fetch

logger = logging.getLogger("diffusion_debug.training")


@dataclass
class History:
    """What the debugger keeps between monitored steps."""

    ranks: list[RankHistory]
    modules: ModuleNormBook
    buckets: TimestepBuckets
    counts: StepCounts = field(default_factory=StepCounts)
    causes: CauseTracker = field(default_factory=CauseTracker)
    """Earlier steps' causes (a learning-rate jump, weights gone non-finite): what a later NaN
    loss or spike points at."""
    update_flagged: bool = False
    """The last measured update moved a module by more than its norm (flagged once, until an update under it)."""
    joined: int = 0
    """Steps whose collective this rank joined: the schedules' clock, the same on every rank and
    never cleared (``counts`` is)."""
    previous_step: Any = None
    last_time: float | None = None


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


@dataclass
class _Step:
    """One monitored step in progress, and how it failed locally (each failure is recorded when
    the step's collectives allow, and raised with ``strict=True`` after the policy)."""

    index: Any
    check_ranks: bool
    refresh_weights: bool
    started: float
    failure: Exception | None = None
    """This rank could not measure the step: it sent the failed row."""
    deferred: Exception | None = None
    """A failure after the gather (transfer, judging)."""
    late: Exception | None = None
    """A failure while recording the step (after the step's collectives)."""


class StepMonitor:
    """Runs :meth:`monitor` for each call of ``monitor_training_step``; holds what persists
    between steps (:attr:`history`). ``save_report`` saves the run directory (policy ``raise``)."""

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
        self.save_report = save_report
        self.local = LocalJudge(
            params=params,
            order=order,
            model=model,
            rank=ctx.rank,
            sketch=measurer.updates,
            history=history,
        )
        self.stability = StabilityActions(params, config, sink, ctx.rank)
        self.should_stop = False
        self._acting: Any = None  # the step the policy acts on
        self.stop_reason: str | None = None
        """Policy ``stop``: the cause, with its rank (the first error, cause before consequence)."""

    def monitor(self, call: Call) -> dict[str, Any]:
        failure = self._accumulate(call)
        if not gradients_complete(self.accelerator):
            if failure is not None:
                raise failure  # a micro-step has no collective: the local error path is safe
            self.history.counts.micro_steps += 1
            return {"step": call.step, "gradients_read": False, "micro_steps": self.measurer.accumulated.count}
        step = self._begin(call.step, failure)
        measured = self._measure(step, call)  # never raises: a failure sends the failed row
        rows, local = self._gather(step, measured)  # the step's all_gather and its one host transfer
        desync, per_param = self._compare_replicas(step, rows, measured)  # decided from the rows alone
        judged = self._judge(step, rows, local, desync, per_param, call, measured)
        if checks.needs_exchange(rows, desync):  # decided from the rows alone
            judged.anomalies = exchange_anomalies(
                self.ctx, judged.anomalies, lambda error: checks.judging_failed(self.ctx.rank, step.index, error)
            )
            judged.exchanged = True
        judged.anomalies = trace_causes(judged.anomalies)  # cause before consequence, across ranks
        self.history.causes.remember(judged.anomalies, self.history.joined)
        info = self._record_step(step, rows, judged, measured, call)
        self.stability.act(self.config, judged.anomalies, step.index, self.history.joined, call, self.accelerator)
        return self._apply_policy(step, rows, judged.anomalies, info)

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
        except Exception as error:
            return error
        return None

    def _begin(self, index: Any, failure: Exception | None) -> _Step:
        """The step's number and schedules (from the joined-step clock: the same on every rank)."""
        every, monitored = self.config.rank_check_every, self.history.joined + 1
        return _Step(
            index=_step_index(index, monitored - 1, self.config.step_offset),
            check_ranks=self.ctx.distributed and every > 0 and monitored % every == 0,
            refresh_weights=self.config.per_module_grad_norms and self.history.modules.refresh_due(monitored),
            started=time.perf_counter(),
            failure=failure,
        )

    def _measure(self, step: _Step, call: Call) -> Measurement:
        try:
            if step.failure is not None:
                raise step.failure
            return self.measurer.measure(
                scaler=find_scaler(self.accelerator, call.optimizer, call.scaler),
                optimizer=call.optimizer,
                check_ranks=step.check_ranks,
                refresh_weights=step.refresh_weights,
                per_module=self.config.per_module_grad_norms,
                memory_tracking=self.config.memory_tracking,
                read_skipped=self.history.previous_step is not None,
                clip_norm=call.grad_norm,
            )
        except Exception as error:
            step.failure = error
            return self.measurer.failed()
        finally:
            self.measurer.accumulated.reset()

    def _gather(self, step: _Step, measured: Measurement) -> tuple[list[StepRow], LocalReadings]:
        matrix = self.ctx.gather(measured.vector)
        rows, local, step.deferred = fetch(matrix, measured, self.measurer.layout)
        self.history.joined += 1  # every rank counts the step it joined: the schedules stay aligned
        self.history.counts.total_steps += 1
        return rows, local

    def _compare_replicas(
        self, step: _Step, rows: list[StepRow], measured: Measurement
    ) -> tuple[list[int], list[list[float]] | None]:
        """On replica-check steps where a checksum differs: every rank's per-parameter checksums."""
        desync = checks.differing_checksums(rows) if step.check_ranks else []
        if not desync:
            return [], None
        own = measured.checksums
        if own is None:
            own = torch.full((len(self.params),), float("nan"), dtype=torch.float64, device=self.measurer.device)
        return desync, self.ctx.gather(own.double()).tolist()

    def _judge(self, step, rows, local: LocalReadings, desync, per_param, call: Call, measured) -> Judgement:
        """Every rank's row; then what only this rank knows. An error here is recorded, and what
        was judged before it stays."""
        judged, history, rank = Judgement(), self.history, self.ctx.rank
        try:
            if step.deferred is not None:
                raise step.deferred
            for r, row in enumerate(rows):
                if not row.measured:
                    error = step.failure if r == rank else None
                    judged.anomalies.append(checks.measurement_failed(r, step.index, error))
                    continue
                judged.anomalies += checks.judge_rank(
                    r, row, step.index, history.ranks[r], self.params, self.config, judged.flags
                )
                history.buckets.add(list(row.buckets))
            judged.skipped = checks.judge_skipped(rows, history.ranks, history.previous_step, step.index)
            judged.anomalies += judged.skipped
            judged.anomalies += checks.judge_learning_rate(rows, step.index, self.config.lr_jump_factor)
            if desync:
                judged.anomalies += checks.judge_checksums(rows, desync, per_param, step.index, self.params)
            if local.param_norms is not None:
                self.local.judge(judged, local, call.optimizer, measured.input_counts, step.index, self.config)
            self.local.localize(judged.anomalies, call.closure, self.config)
            # an earlier step's cause (a learning-rate jump, weights gone non-finite) for this step's consequences
            judged.anomalies = history.causes.link(judged.anomalies, rank=rank, joined=history.joined)
        except Exception as error:
            step.deferred = error
            judged.anomalies.append(checks.judging_failed(rank, step.index, error))
        return judged

    def _record_step(self, step: _Step, rows, judged: Judgement, measured: Measurement, call: Call) -> dict:
        """Count (from the shared rows and list: the same on every rank), then record and log:
        local work, whose failure waits until the policy has run."""
        history, ctx = self.history, self.ctx
        info: dict[str, Any] = {"step": step.index, "anomalies": [a.kind for a in judged.anomalies]}
        history.counts.add_step(judged.anomalies, judged.flags, judged.skipped)
        history.previous_step = step.index
        elapsed = None if history.last_time is None else step.started - history.last_time
        history.last_time = step.started
        try:
            for a in judged.anomalies:
                if ctx.is_main or a.rank == ctx.rank:
                    # one log line per anomaly: the main process logs every rank's, another rank
                    # only what the main process cannot know (its local findings, not exchanged)
                    self.sink.emit(a, log=ctx.is_main or (not judged.exchanged and a in judged.local_only))
            self.sink.end_step()  # repeats on consecutive monitored steps fold
            info.update(
                step_info(
                    rows,
                    ctx.rank,
                    measured=step.failure is None,
                    error=step.failure if step.failure is not None else step.deferred,
                    learning_rates=learning_rates(call.optimizer),
                    elapsed=elapsed,
                    memory=measured.memory,
                    module_norms=judged.module_norms,
                    update_ratio=judged.update_ratio,
                    max_grad_norm=call.max_grad_norm,
                    applied_update=judged.applied_update,
                )
            )
            self.sink.record.add_step(record_row(info))
            if ctx.is_main:  # every other rank's loss and gradient norm: a one-rank NaN shows at its step
                for r, row in enumerate(rows):
                    if r != ctx.rank:
                        self.sink.record.add_step(rank_row(row, r, step.index, call.max_grad_norm))
            if tracking_enabled(self.accelerator):
                self.accelerator.log(tracker_values(info), step=step.index)
        except Exception as error:
            step.late = error
            info["error"] = repr(error)
        return info

    # -- the policy: decided from the gathered anomalies alone, so every rank takes it -----------
    def _apply_policy(self, step: _Step, rows: list[StepRow], anomalies: list[Anomaly], info: dict) -> dict:
        self.sink.take_errors()  # the decision below is the gathered list's, the same on every rank
        if step.late is not None and not self.config.strict:
            self._record_late_failure(step)  # before a raise policy saves the report
        try:
            return self._act(step, [a for a in anomalies if a.severity == "error"], info)  # its collectives first
        finally:
            if self.config.strict:
                self._raise_if_strict(rows, step)

    def _act(self, step: _Step, errors: list[Anomaly], info: dict) -> dict:
        self._acting = step.index
        info["policy_action"] = apply_policy(self.config, self, errors)
        return info

    # -- what core.POLICY_TABLE acts through ---------------------------------------------------------
    def save_run(self) -> Path:
        return self.save_report() if self.ctx.is_main else self.sink.record.run_dir

    def agree(self) -> None:
        self.ctx.barrier()  # every rank leaves the step together: nobody waits in a collective

    def skip_step(self, errors: list[Anomaly]) -> None:
        gradients.zero_gradients(self.params)
        self.history.counts.skipped_steps += 1
        self.history.counts.skipped_by_policy += 1
        self.sink.record.add_event("policy_skip", step=self._acting, anomalies=[a.kind for a in errors])

    def stop(self, anomaly: Anomaly) -> str | None:
        self.should_stop = True
        self.stop_reason = f"{anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}"
        if self.ctx.is_main:
            logger.error("Stopping the training loop (policy stop) because of %s", self.stop_reason)
        return None

    def _record_late_failure(self, step: _Step) -> None:
        """Best effort: the record itself may be what failed."""
        try:
            self.sink.emit(checks.recording_failed(self.ctx.rank, step.index, step.late))
        except Exception:  # pragma: no cover - the record is broken: the log is all that is left
            logger.warning("The training debugger failed to record step %s: %r", step.index, step.late)

    def _raise_if_strict(self, rows: list[StepRow], step: _Step) -> None:
        """strict=True: a failed measurement raises on every rank (all saw the failure slot), so no
        rank waits for another in the next step's collective."""
        if step.failure is not None:
            raise step.failure
        failed = [r for r, row in enumerate(rows) if not row.measured]
        if failed:
            raise DiffusionDebugError(
                f"Rank {failed[0]}'s training debugger failed to measure this step (strict=True).",
                run_dir=self.sink.record.run_dir,
            )
        if step.deferred is not None or step.late is not None:
            raise step.deferred if step.deferred is not None else step.late


def _step_index(step: Any, default: int, offset: int = 0) -> Any:
    """The step's number as recorded: the user's ``step`` (else the monitored-step count) plus
    ``config.step_offset``."""
    if step is None:
        return default + offset
    try:
        return int(step) + offset
    except (TypeError, ValueError):
        return step
