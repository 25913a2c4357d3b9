"""The files and config section of report.html: the repro bundles with the command that replays
each, the previews, the full config and the versions."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from ..record import RunData, load_json
from .html_cells import escape, kv_table


def _relative(path: Any, run_dir: Path) -> str:
    """A saved path relative to the run directory, also when the directory has been moved since
    (and when it was saved relative to another working directory)."""
    parts = Path(str(path)).parts
    if "bundles" in parts:
        return str(Path(*parts[len(parts) - 1 - parts[::-1].index("bundles") :]))
    return str(path)


def replay_command(run: RunData, bundle: str) -> str:
    """The ``replay`` command line for a bundle, runnable from the current directory: the path
    relative to it (absolute when outside it), and the pipeline the run used when the run
    directory's ``invocation.json`` (written by ``diffusion-debug run`` and the demo) names it."""
    path = (run.run_dir / bundle).resolve()
    here = Path.cwd().resolve()
    shown = str(path.relative_to(here)) if path.is_relative_to(here) else str(path)
    command = ["diffusion-debug", "replay", shown]
    invocation = run.run_dir / "invocation.json"
    try:
        used = load_json(invocation) if invocation.is_file() else {}
    except (OSError, ValueError, DiffusionDebugError):
        used = {}
    if isinstance(used, dict) and used.get("model"):
        model = Path(str(used["model"]))
        command += ["--model", str(model.relative_to(here)) if model.is_relative_to(here) else str(model)]
    elif isinstance(used, dict) and used.get("kind"):
        command += ["--kind", str(used["kind"])]
    else:
        command += ["--model", "DIR"]  # bundles hold no weights: the pipeline directory the run used
    return shlex.join(command)


def files_section(run: RunData) -> str:
    """The files and config section: repro bundles with their replay command, previews, config."""
    s = run.summary
    parts = [
        "<section id='files'><h2>Files and config</h2>",
        "<p class='note'>This page was built from the files of the run directory alone; "
        "<code>summary.json</code> holds every number shown here, <code>events.jsonl</code> the stream "
        "written while the run went on.</p>",
    ]
    bundles = [_relative(b, run.run_dir) for b in s.get("bundles") or []]
    if bundles:
        items = "".join(
            f"<li><code>{escape(b)}</code> — re-run it with full probes: "
            f"<code>{escape(replay_command(run, b))}</code></li>"
            for b in bundles
        )
        parts.append(f"<h3>Repro bundles</h3><ul>{items}</ul>")
    previews = s.get("previews") or []
    if previews:
        parts.append(
            "<h3>Previews</h3><ul>" + "".join(f"<li><code>{escape(p)}</code></li>" for p in previews) + "</ul>"
        )
    config = s.get("config")
    if isinstance(config, dict) and config:
        parts.append(
            f"<details><summary>full config ({len(config)} options)</summary>{kv_table(config.items(), per_row=3)}"
            "</details>"
        )
    versions = s.get("versions")
    if isinstance(versions, dict) and versions:
        parts.append(f"<details><summary>all versions</summary>{kv_table(versions.items(), per_row=2)}</details>")
    parts.append("</section>")
    return "".join(parts)
