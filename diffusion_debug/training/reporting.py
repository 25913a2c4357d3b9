"""What a training debugger hands out: its summary and ``DebugReport`` (the record, the headline, the
per-model and per-module figures: :class:`TrainingResults`, the debugger's methods that give them) and
what its live server answers (``serve_port``)."""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any, Callable

from ..core import DebugReport
from ..record import RunRecord, headline
from .measure.gradients import TrainableParameters
from .ranks.elsewhere import RankFiles, causes_kept_elsewhere, kept_elsewhere
from .ranks.processes import RankContext
from .step.state import History
from .watched_models import WatchedModels


def training_report(
    record: RunRecord,
    history: History,
    watched: WatchedModels,
    params: TrainableParameters,
    ctx: RankContext,
    training_summary: dict[str, Any],
    files: RankFiles | None = None,
) -> DebugReport:
    """The record so far as a :class:`~diffusion_debug.core.DebugReport` (no collective). ``files``: the other
    ranks' events files, which the main process reads from where its last report stopped (None: none read)."""
    buckets = history.buckets
    timesteps = {"loss_by_timestep_bucket": buckets.summary(), "num_train_timesteps": buckets.num_train_timesteps}
    health = history.health.summary() if history.health is not None else {}
    components = {"model": {**watched.component_summary(params), **history.modules.summary(), **health, **timesteps}}
    full = len(record.anomalies) >= record.max_anomalies  # a full record would count it again at each report
    if ctx.is_main and ctx.world_size > 1 and files is not None:
        # what only its rank recorded, outside the step's exchange: a cause (a forward's error) first, then the
        # rest (a debugger_error recording its step), each once, as that rank's own
        for cause in causes_kept_elsewhere(record.anomalies, files, ctx.rank) if not full else ():
            record.add_anomaly(cause)
        for own in kept_elsewhere(record.anomalies, files, ctx.rank, ctx.world_size) if not full else ():
            record.add_anomaly(own)
        files.read(range(ctx.world_size))  # (read already, unless the record is full)
        for (rank, step, joined), values in files.amended.items():  # a row its rank read anew (unscaled): its copy
            record.amend_rank_step(rank, step, values, joined=joined)
    summary = {
        **record.summary(),
        "headline": headline(record.anomalies, ctx.world_size),  # the anomaly to fix first (cause before consequence)
        "training": training_summary,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
    }
    return DebugReport.of_rows(  # steps: the main process's rows, as load_run reads them; all kept in summary.json
        record.all_steps(),
        run_dir=record.run_dir,
        summary=summary,
        anomalies=list(record.anomalies),
        components=components,
        record=record,
        is_main=ctx.is_main,
    )


class TrainingResults:
    """The results a ``TrainingDebugger`` hands out (a base of it, as ``core.Lifecycle`` is): read from its
    record (``record``, ``sink``), its steps' history (``_steps.history``), its rank context (``_ctx``), its
    watched models and parameters and its check before the reduction (``_pre_reduction``)."""

    def get_summary(self) -> dict[str, Any]:
        """Counts and rates over the monitored (optimizer) steps (the name both debuggers share).

        The step counts and rates are judged from every rank's gathered figures and are identical
        on every rank (unless a rank failed to judge a step itself: its ``debugger_error`` is
        recorded, and its counts for that step may miss what it could not judge).
        ``total_steps`` counts optimizer steps; ``accumulating_micro_steps`` (also under its first
        name ``micro_steps``) the calls that only accumulated gradients, so every call made is
        ``total_steps + accumulating_micro_steps``.
        ``anomaly_counts`` (per kind) is this process's record: on the main process every
        rank's anomalies, on another rank only its own. Both are cleared by
        :meth:`clear_debug_history`. The last step's skip, which the next step (or close, or
        :meth:`report`) records, is counted already (judged here, not recorded: the live server asks
        from its own thread).
        """
        counts, anomaly_counts = self._steps.history.counts, dict(self.record.anomaly_counts)
        try:
            pending = self._steps.last_skip("report")
        except Exception:  # recorded when report() or close judges it
            pending = None
        if pending:
            counts = dataclasses.replace(counts)
            counts.add_skip(pending)
            anomaly_counts["skipped_step"] = anomaly_counts.get("skipped_step", 0) + 1
        summary = {**counts.summary(), "anomaly_counts": anomaly_counts, "world_size": self._ctx.world_size}
        check = self._pre_reduction
        if check is not None:  # several processes: whether a NaN's rank can be named, and why not
            summary["pre_reduction_check"] = {"checked": check.watching, "off": list(check.off)}
        return summary

    def get_training_summary(self) -> dict[str, Any]:
        """The old name of :meth:`get_summary` (a DeprecationWarning, then the same dict)."""
        warnings.warn("get_training_summary() is now get_summary().", DeprecationWarning, stacklevel=2)
        return self.get_summary()

    def report(self) -> DebugReport:
        """The record so far (on the main process every rank's anomalies, with their ``rank``). No collective:
        ``save()`` writes the summary and report on the main process, elsewhere flushes the rank's events.
        The last step's skip (once its optimizer step ran), which no later step shows yet, is judged and
        recorded first (a script that saves a report and never closes); the next step and close do not
        record it again."""
        self._steps.judge_last_skip("report")
        history = self._steps.history
        summary = self.get_summary()
        return training_report(self.record, history, self.watched, self.params, self._ctx, summary, self._rank_files)

    def clear_debug_history(self) -> None:
        """Forget the recorded steps and anomalies, and the counts with them (the schedules'
        clock, the loss and memory histories and the module norms are kept); a problem that goes
        on is reported again in the new record."""
        self.record.clear()
        self.sink.clear()
        self._rank_files.clear()
        self._steps.history.counts.clear()
        self._steps.history.clear_reported()


def _live_summary(tdbg: Any) -> dict[str, Any]:
    return {"run": tdbg.record.run_dir.name, "training_debugger": tdbg.get_summary()}


LIVE_ENDPOINTS: dict[str, Callable[[Any], Any]] = {
    "/debug/training/summary": operator.methodcaller("get_summary"),
    "/debug/summary": _live_summary,
}
"""``serve_port``: what the live server answers from the debugger itself, as it is at the request:
``/debug/training/summary`` its ``get_summary()``, ``/debug/summary`` ``{"run": NAME,
"training_debugger": <the same>}`` (the seed documents' shape); the other endpoints are
``diffusion-debug serve``'s over ``output_dir`` (this run's summary rebuilt from events.jsonl)."""
