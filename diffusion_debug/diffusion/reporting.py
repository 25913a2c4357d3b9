"""A debugger's summary and report, assembled from its record, its components and what the call
sites measured (plain values in, a dict or a :class:`~diffusion_debug.core.DebugReport` out)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ..core import DebugReport
from ..errors import DiffusionDebugError
from ..record import RunRecord
from .components.cache_hooks import Placement
from .components.inventory import Component, analyze_pipeline, component_report
from .replay.why import explain_run


def debug_summary(
    record: RunRecord,
    pipe: Any,
    attached: bool,
    runs: int,
    runtime: dict[str, dict[str, Any]],
    bundles: list[str],
    total_parameters: int,
) -> dict[str, Any]:
    """Counts and the first error, for a terminal or a log line."""
    first_error = next((a for a in record.anomalies if a.severity == "error"), None)
    return {
        "run_dir": str(record.run_dir),
        "pipeline": type(pipe).__name__,
        "attached": attached,
        "runs": runs,
        "steps_recorded": len(record.steps),
        "anomaly_counts": dict(record.anomaly_counts),
        "severity_counts": dict(record.severity_counts),
        "first_error": first_error.to_dict() if first_error else None,
        "components": {name: dict(v) for name, v in runtime.items()},
        "bundles": list(bundles),
        "total_parameters": total_parameters,
    }


def build_report(
    record: RunRecord,
    pipe: Any,
    components: list[Component],
    *,
    runs: int,
    runtime: dict[str, dict[str, Any]],
    bundles: list[str],
    files: dict[str, bytes],
    placement: Placement = (),
    raised_states: Callable[[], dict] | None = None,
    began_states: Callable[[], dict] | None = None,
) -> DebugReport:
    """The record so far, with every component (calls, time, memory) and the previews; ``placement``:
    the hooks the bundled call's registries held as it began (a guider's, for ``why()``);
    ``raised_states``: what gives the caches a call ended by policy ``raise`` left, by component, before
    their reset (read when ``why()`` runs, not held by the report); ``began_states``: likewise, the bundled
    call's hooks' state as it began."""
    analysis = analyze_pipeline(pipe)
    summary = record.summary()
    summary.update(
        pipeline=type(pipe).__name__,
        runs=runs,
        steps_recorded=len(record.steps),
        total_parameters=analysis["total_parameters"],
        bundles=list(bundles),
        previews=sorted(files),
    )
    return DebugReport(
        run_dir=record.run_dir,
        summary=summary,
        anomalies=list(record.anomalies),
        steps=list(record.steps),
        components=component_report(components, analysis, runtime),
        files=files,
        record=record,
        explain=_explainer(record, pipe, placement, raised_states or dict, began_states or dict),
    )


def _explainer(
    record: RunRecord,
    pipe: Any,
    placement: Placement,
    raised_states: Callable[[], dict],
    began_states: Callable[[], dict],
) -> Callable[[], Any]:
    """``report.why()``'s replay on the live ``pipe``, held weakly: a report the user keeps (it is
    small) does not keep the pipeline and its components alive; once they are gone it says so. The
    bundled call's ``placement`` (its registries hold the denoiser) is held only while ``pipe`` lives."""
    run_dir, anomalies = record.run_dir, list(record.anomalies)
    try:
        held = weakref.ref(pipe)
        placed = weakref.WeakKeyDictionary({pipe: placement})
    except TypeError:  # no weak reference to it: held as it is
        held = lambda: pipe  # noqa: E731
        placed = {pipe: placement}

    def explain() -> Any:
        live = held()
        if live is None:
            raise DiffusionDebugError(
                "why() replays on the pipeline this report was made of, which is gone; "
                f"run `diffusion-debug why {run_dir}` to replay on the pipeline the run directory names."
            )
        return explain_run(
            run_dir,
            anomalies,
            live,
            placement=placed.get(live, ()),
            raised_states=raised_states(),
            began_states=began_states(),
        )

    return explain
