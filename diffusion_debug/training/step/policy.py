"""The policy at the end of a monitored step: what ``core.POLICY_TABLE`` acts through for the
training debugger (save the run directory, agree, skip the step, stop the loop), decided from
the anomalies every rank received alike, so every rank takes the same branch; then, with
``strict=True``, the step's failures raised once the policy's collectives (its barrier) are done:
a failed measurement on every rank, any other failure on its own. Without ``strict``, a failure
while recording is recorded first, before a ``raise`` saves the report.

``skip`` zeroes the gradients of the step it acts at. A step held while a GradScaler not passed is tried
(``step.found_scaler``) is acted on when released, a monitored step late: a real NaN at an optimizer's first
step, with a stale enabled scaler alive that does not step it, was applied by that ``optimizer.step()`` before
(acting early would zero a scaled fp16 step's gradients, which its scaler skips anyway).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from ...config import DebugConfig
from ...core import AnomalySink, apply_policy
from ...errors import DiffusionDebugError
from ...record import Anomaly
from .. import failures as debugger_errors
from ..measure import gradients
from ..measure.gradients import TrainableParameters
from ..measure.step_row import StepRow
from ..ranks.processes import RankContext
from .state import History, MonitoredStep

logger = logging.getLogger("diffusion_debug.training")


class StepPolicy:
    """The :class:`~diffusion_debug.core.PolicyTarget` of the training debugger's steps.
    ``save_report`` saves the run directory (the main process's, policy ``raise``)."""

    def __init__(
        self,
        *,
        params: TrainableParameters,
        ctx: RankContext,
        history: History,
        sink: AnomalySink,
        save_report: Callable[[], Path],
    ):
        self.params = params
        self.ctx = ctx
        self.history = history
        self.sink = sink
        self.save_report = save_report
        self.should_stop = False
        self._acting: Any = None  # the step the policy acts on
        self._acting_row: int | None = None  # its row's monitored step (None: its row was not recorded)
        self.stop_reason: str | None = None
        """Policy ``stop``: the cause, with its rank (the first error, cause before consequence)."""

    def apply(
        self, step: MonitoredStep, rows: list[StepRow], anomalies: list[Anomaly], info: dict, config: DebugConfig
    ) -> dict:
        """Act on the step's error anomalies as ``config.policy`` says (``info["policy_action"]``);
        with ``strict=True`` then raise the step's own failure, or a failed rank's."""
        self.sink.take_errors()  # the decision below is the gathered list's, the same on every rank
        if step.late is not None and not config.strict:
            self._record_late_failure(step)  # before a raise policy saves the report
        errors = [a for a in anomalies if a.severity == "error"] if anomalies else []
        try:
            return self._act(step, errors, info, config)  # its collectives first
        finally:
            if config.strict:
                self._raise_if_strict(rows, step)

    def _act(self, step: MonitoredStep, errors: list[Anomaly], info: dict, config: DebugConfig) -> dict:
        self._acting, self._acting_row = step.index, step.row_joined
        info["policy_action"] = apply_policy(config, self, errors)
        return info

    # -- what core.POLICY_TABLE acts through ---------------------------------------------------------
    def save_run(self) -> Path:
        return self.save_report() if self.ctx.is_main else self.sink.record.run_dir

    def agree(self) -> None:
        self.ctx.barrier()  # every rank leaves the step together: nobody waits in a collective

    def skip_step(self, errors: list[Anomaly]) -> None:
        """Zero the gradients (to zero, not None, on every rank) so the following ``optimizer.step()``
        adds nothing from this batch; an optimizer with momentum or weight decay (Adam, SGD with
        momentum) still moves the weights by its state."""
        gradients.zero_gradients(self.params)
        self.history.stall.policy_skipped = True  # an update of zero gradients is no stalled run
        self.history.counts.skipped_steps += 1
        self.history.counts.skipped_by_policy += 1
        self.sink.record.add_event("policy_skip", step=self._acting, anomalies=[a.kind for a in errors])
        if self._acting_row is not None:  # its own row (not another optimizer's of that step number), which the
            self.sink.record.mark_skipped(self._acting, "policy", joined=self._acting_row)  # main's copy matches

    def stop(self, anomaly: Anomaly) -> str | None:
        self.should_stop = True
        self.stop_reason = f"{anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}"
        if self.ctx.is_main:
            logger.error("Stopping the training loop (policy stop) because of %s", self.stop_reason)
        return None

    def _record_late_failure(self, step: MonitoredStep) -> None:
        """Best effort: the record itself may be what failed."""
        try:
            self.sink.emit(debugger_errors.recording_failed(self.ctx.rank, step.index, step.late))
        except Exception:  # pragma: no cover - the record is broken: the log is all that is left
            logger.warning("The training debugger failed to record step %s: %r", step.index, step.late)

    def _raise_if_strict(self, rows: list[StepRow], step: MonitoredStep) -> None:
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
        if step.deferred is not None:
            raise step.deferred  # its debugger_error is among the step's anomalies
        if step.late is not None:  # the record failed: recorded (raised) if the record still can
            try:
                self.sink.raised("recording", step.late, step=step.index, rank=self.ctx.rank)
            except Exception:  # pragma: no cover - the record is broken: the error itself goes on
                pass
            raise step.late
