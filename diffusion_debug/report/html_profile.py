"""The profile section of report.html (``run --profile STEP``): the files to open, then the
modules and the aten ops that took the most time in the profiled denoising step."""

from __future__ import annotations

from typing import Any

from ..record import RunData
from .html_cells import escape, named_rows_table

_VIEWERS = {
    "trace": "open it in https://ui.perfetto.dev or chrome://tracing",
    "memory_snapshot": "open it at https://pytorch.org/memory_viz",
}


def _rows(entries: Any, keys: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """The well-formed rows of a saved list of dicts (a damaged summary drops rows, not the page)."""
    return [tuple(e.get(k) for k in keys) for e in entries or () if isinstance(e, dict) and "name" in e]


def _table(title: str, headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    table = named_rows_table(headers, rows)
    return f"<h3>{escape(title)}</h3>{table}" if table else ""


def profile_section(run: RunData) -> str:
    """The profile section, or "" when the run was not profiled."""
    profile = run.summary.get("profile")
    if not isinstance(profile, dict):
        return ""
    clock = "device" if profile.get("time") == "device" else "CPU"
    parts = [f"<section id='profile'><h2>Profile of step {escape(profile.get('step'))}</h2>"]
    facts = []
    if profile.get("wall_ms") is not None:
        facts.append(f"the profiled step took {escape(profile['wall_ms'])} ms of wall time (profiling slows it)")
    for key, how in _VIEWERS.items():
        if profile.get(key):
            facts.append(f"<code>{escape(profile[key])}</code>: {how}")
    for key in ("note", "memory_note"):
        if profile.get(key):
            facts.append(escape(profile[key]))
    if facts:
        parts.append("<ul>" + "".join(f"<li>{fact}</li>" for fact in facts) + "</ul>")
    parts.append(
        _table(
            f"Modules by {clock} time (a block's time is inside its component's)",
            ("module", "calls", f"{clock} time ms"),
            _rows(profile.get("modules"), ("name", "calls", "total_ms")),
        )
    )
    parts.append(
        _table(
            f"Operators by self {clock} time",
            ("operator", "calls", f"self {clock} time ms"),
            _rows(profile.get("ops"), ("name", "calls", "self_ms")),
        )
    )
    parts.append("</section>")
    return "".join(parts)
