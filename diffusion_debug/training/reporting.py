"""What a training debugger hands out: its ``DebugReport`` (the record, the headline, the
per-model and per-module figures) and what its live server answers (``serve_port``)."""

from __future__ import annotations

import operator
from typing import Any, Callable

from ..core import DebugReport
from ..record import RunRecord, headline
from .measure.gradients import TrainableParameters
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
) -> DebugReport:
    """The record so far as a :class:`~diffusion_debug.core.DebugReport` (no collective)."""
    buckets = history.buckets
    timesteps = {"loss_by_timestep_bucket": buckets.summary(), "num_train_timesteps": buckets.num_train_timesteps}
    health = history.health.summary() if history.health is not None else {}
    components = {"model": {**watched.component_summary(params), **history.modules.summary(), **health, **timesteps}}
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
