"""report.html: one self-contained page, anomalies first."""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from ..record import write_atomic
from .load import RunData, load_run

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.error{color:#b00020}.warning{color:#a15c00}.info{color:#555}
code{background:#f6f6f6;padding:0 .2em}
"""


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_html(run: RunData) -> str:
    summary = run.summary
    anomalies = run.anomalies
    title = f"diffusion-debug: {summary.get('kind', 'run')} {run.run_dir.name}"
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if anomalies:
        parts.append(f"<h2 id='anomalies'>Anomalies ({len(anomalies)})</h2><ul>")
        for a in anomalies:
            parts.append(
                f"<li class='{html.escape(a.severity)}'><b>{html.escape(a.kind)}</b> "
                f"[{html.escape(a.severity)}] {html.escape(a.where())}: {html.escape(a.message)}</li>"
            )
        parts.append("</ul>")
    else:
        parts.append("<h2 id='anomalies'>Anomalies</h2><p>None found.</p>")
    steps = run.steps
    if steps:
        columns = [c for c in steps[0] if not isinstance(steps[0][c], (dict, list))]
        parts.append(f"<h2>Steps ({len(steps)})</h2>" + _table(steps, columns))
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        + "".join(parts)
        + "</body></html>"
    )


def write_html(run_dir: str | os.PathLike) -> Path:
    """Build ``report.html`` from the run directory's saved files."""
    run = load_run(run_dir)
    return write_atomic(Path(run_dir) / "report.html", render_html(run))
