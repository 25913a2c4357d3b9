"""The steps section of report.html: one row per recorded step (the columns of
:mod:`.columns` that hold a value), rows with NaN/Inf or anomalies marked.

Limits: a long run shows its first and last :data:`STEP_TABLE_EDGE` rows only.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..record import RunData
from .columns import INFERENCE_STEP_COLUMNS, TRAINING_STEP_COLUMNS, Column
from .html_cells import cell, escape, is_nonfinite

STEP_TABLE_EDGE = 15
"""A long run's step table shows this many first and last rows (summary.json has them all)."""


def _steps_table(steps: Sequence[dict[str, Any]], columns: list[Column], anomaly_steps: dict[Any, list[str]]) -> str:
    used = [(h, get) for h, get in columns if any(get(s) is not None for s in steps)]
    if len({s.get("run") for s in steps}) <= 1:
        used = [(h, get) for h, get in used if h != "run"]
    if not used:
        return ""
    chosen: list[dict[str, Any] | None] = list(steps)
    hidden = 0
    if len(steps) > 2 * STEP_TABLE_EDGE + 1:
        hidden = len(steps) - 2 * STEP_TABLE_EDGE
        chosen = list(steps[:STEP_TABLE_EDGE]) + [None] + list(steps[-STEP_TABLE_EDGE:])
    head = "".join(f"<th>{escape(h)}</th>" for h, _ in used) + "<th>anomalies</th>"
    body = []
    for row in chosen:
        if row is None:
            body.append(
                f"<tr class='gap'><td colspan='{len(used) + 1}'>… {hidden} steps not shown "
                f"(all are in summary.json) …</td></tr>"
            )
            continue
        values = [get(row) for _, get in used]
        kinds = anomaly_steps.get(row.get("step"), [])
        flagged = bool(kinds) or any(is_nonfinite(v) for v in values)
        cells = "".join(cell(v) for v in values) + f"<td>{escape(', '.join(kinds))}</td>"
        body.append(f"<tr class='flag'>{cells}</tr>" if flagged else f"<tr>{cells}</tr>")
    return f"<div class='scroll'><table><tr>{head}</tr>{''.join(body)}</table></div>"


def steps_section(run: RunData) -> str:
    """The steps section: one table row per recorded step."""
    steps = [s for s in run.steps if isinstance(s, dict)]
    if not steps:
        return "<section id='steps'><h2>Steps</h2><p class='note'>No steps were recorded.</p></section>"
    training = run.summary.get("kind") == "training"
    anomaly_steps: dict[Any, list[str]] = {}
    for a in run.anomalies:
        if a.step is not None and a.kind not in anomaly_steps.setdefault(a.step, []):
            anomaly_steps[a.step].append(a.kind)
    table = _steps_table(steps, TRAINING_STEP_COLUMNS if training else INFERENCE_STEP_COLUMNS, anomaly_steps)
    note = "Rows with NaN/Inf values or anomalies are marked red at the left."
    return f"<section id='steps'><h2>Steps ({len(steps)} recorded)</h2><p class='note'>{note}</p>{table}</section>"
