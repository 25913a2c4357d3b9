"""report.html: one self-contained page built from a run directory's files alone.

The page reads top to bottom the way a person debugs: what ran, what went wrong (anomalies
first, grouped by kind, each with what it means and what to do), then the plots, then the
per-step and per-component tables. Images are embedded as ``data:image/png;base64`` URIs and
the style sheet is inline, so the file can be mailed or attached to an issue on its own; the
page needs no JavaScript and references nothing outside itself.

This module reads the run into what each section shows; the HTML is ``templates/`` (one
template a section, ``macros.html`` for the tables and cells they share).

Limits: a long run's step table shows its first and last :data:`STEP_TABLE_EDGE` rows only.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

from ..errors import DiffusionDebugError
from ..record import RunData, load_json, load_run, write_atomic
from .columns import INFERENCE_STEP_COLUMNS, TRAINING_STEP_COLUMNS, end_label, field, run_warnings
from .html_anomalies import ANOMALY_CARDS_PER_KIND, ANOMALY_ROWS_PER_KIND, anomalies_context, step_ranges
from .html_env import data_uri, is_nonfinite, render
from .media import Figure, media, preview_strip
from .plots import build_plots
from .plots_common import number
from .text import local_time

__all__ = [
    "ANOMALY_CARDS_PER_KIND",
    "ANOMALY_ROWS_PER_KIND",
    "STEP_TABLE_EDGE",
    "render_html",
    "replay_command",
    "step_ranges",
    "write_html",
]

STEP_TABLE_EDGE = 15
"""A long run's step table shows this many first and last rows (summary.json has them all)."""

_VIEWERS = {
    "trace": "open it in https://ui.perfetto.dev or chrome://tracing",
    "memory_snapshot": "open it at https://pytorch.org/memory_viz",
}


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return ""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _kind_label(summary: dict[str, Any]) -> str:
    kind = summary.get("kind")
    return {"diffusion": "Inference", "training": "Training"}.get(kind, str(kind or "Debug").capitalize())


def _header(run: RunData) -> dict[str, Any]:
    """What ran: the facts line, versions, the main config options and the run's warnings."""
    s = run.summary
    facts: list[tuple[str, Any]] = []
    if s.get("started") is not None:  # a time the clock cannot show reads "unknown"
        facts.append(("started", local_time(number(s.get("started")))))
    duration = _duration(number(s.get("duration_s")))
    if duration:
        facts.append(("duration", duration))
    if s.get("pipeline"):
        facts.append(("pipeline", s["pipeline"]))
    model = field(s, "components", "model", "class")
    if model and s.get("kind") == "training":
        facts.append(("model", model))
    facts.append(("steps recorded", s.get("steps_recorded", len(run.steps))))
    ended = end_label(s.get("end"))
    if ended:
        facts.append(("ended", ended))
    if isinstance(s.get("runs"), int) and s["runs"] > 1:
        facts.append(("pipeline calls", s["runs"]))
    if isinstance(s.get("total_parameters"), int):
        facts.append(("parameters", f"{s['total_parameters']:,}"))
    if isinstance(s.get("world_size"), int) and s["world_size"] > 1:
        facts.append(("processes", s["world_size"]))
    versions = s.get("versions") or {}
    config = s.get("config") or {}
    return {
        "title": f"{_kind_label(s)} run {run.run_dir.name}",
        "facts": facts,
        "versions": [
            (k, v)
            for k, v in versions.items()
            if k in ("diffusion_debug", "torch", "diffusers", "transformers", "accelerate", "python", "cuda")
        ],
        "config": [(k, config[k]) for k in ("level", "policy", "probes", "strict") if k in config],
        "warnings": run_warnings(s),
    }


def _plots(run: RunData) -> dict[str, Any]:
    """The preview strip and pictures (inference), then the figures and the plots that failed."""
    plots, failures = build_plots({**run.summary, "steps": run.rank_steps})  # every rank's every step
    inference = run.summary.get("kind") != "training"
    return {
        "preview_strip": preview_strip(run) if inference else None,
        "media": media(run) if inference else None,
        "figures": [Figure(p.id, data_uri(p.png), p.alt, p.caption, title=p.title) for p in plots],
        "failures": failures,
    }


def _steps(run: RunData) -> dict[str, Any]:
    """One row per recorded step and rank (the columns that hold a value; a long run's first and last)."""
    steps = [s for s in run.rank_steps if isinstance(s, dict)]
    columns = TRAINING_STEP_COLUMNS if run.summary.get("kind") == "training" else INFERENCE_STEP_COLUMNS
    used = [(h, get) for h, get in columns if any(get(s) is not None for s in steps)]
    if len({s.get("run") for s in steps}) <= 1:
        used = [(h, get) for h, get in used if h != "run"]
    anomaly_steps: dict[Any, list[str]] = {}
    for a in run.anomalies:
        if a.step is not None and a.kind not in anomaly_steps.setdefault(a.step, []):
            anomaly_steps[a.step].append(a.kind)
    chosen: list[dict[str, Any] | None] = list(steps)
    hidden = 0
    if len(steps) > 2 * STEP_TABLE_EDGE + 1:
        hidden = len(steps) - 2 * STEP_TABLE_EDGE
        chosen = list(steps[:STEP_TABLE_EDGE]) + [None] + list(steps[-STEP_TABLE_EDGE:])
    rows: list[dict[str, Any] | None] = []
    for step in chosen:
        if step is None:
            rows.append(None)  # the gap
            continue
        values = [get(step) for _, get in used]
        kinds = anomaly_steps.get(step.get("step"), [])
        flagged = bool(kinds) or any(is_nonfinite(v) for v in values)
        rows.append({"values": values, "kinds": ", ".join(kinds), "flagged": flagged})
    return {"count": len(steps), "headers": [h for h, _ in used], "rows": rows, "hidden": hidden}


def _components(run: RunData) -> dict[str, Any]:
    """The components table, configs, the model's facts and gradient norms, the training summary."""
    components = run.summary.get("components") or {}
    rows = [
        (
            name,
            info.get("class"),
            info.get("role"),
            info.get("parameters", info.get("trainable_parameters")),
            info.get("dtype"),
            info.get("device"),
            info.get("calls"),
            info.get("total_time_s"),
            info.get("mean_time_s"),
            info.get("peak_memory_mb"),
        )
        for name, info in components.items()
        if isinstance(info, dict) and ("parameters" in info or "trainable_parameters" in info)
    ]
    headers = [
        "component",
        "class",
        "role",
        "parameters",
        "dtype",
        "device",
        "calls",
        "total time s",
        "mean time s",
        "peak CUDA MB" if any(str(r[5]).startswith("cuda") for r in rows) else "process RSS MB (peak)",
    ]
    keep = [i for i in range(len(headers)) if any(r[i] is not None for r in rows)]
    configs = [
        (name, info.get("class", ""), list(info["config"].items()))
        for name, info in components.items()
        if isinstance(info, dict) and isinstance(info.get("config"), dict) and "parameters" not in info
    ]
    model = components.get("model") if isinstance(components.get("model"), dict) else None
    model_facts, grad_norms = None, []
    if model:
        model_facts = [
            (k.replace("_", " "), model[k])
            for k in ("trainable_tensors", "modules_with_trainable_parameters", "num_train_timesteps")
            if k in model
        ]
        largest = model.get("module_grad_norm_max")
        last = model.get("module_grad_norm_last") or {}
        if isinstance(largest, dict) and largest:
            ranked = sorted(
                largest.items(), key=lambda item: -number(item[1]) if math.isfinite(number(item[1])) else -math.inf
            )[:10]
            grad_norms = [(m, v, last.get(m) if isinstance(last, dict) else None) for m, v in ranked]
    training = run.summary.get("training")
    if isinstance(training, dict):
        training = [(k.replace("_", " "), v) for k, v in training.items() if not isinstance(v, dict)]
    else:
        training = None
    return {
        "headers": [headers[i] for i in keep],
        "rows": [tuple(r[i] for i in keep) for r in rows],
        "configs": configs,
        "model_facts": model_facts,
        "grad_norms": grad_norms,
        "training": training,
        "empty": not rows and not configs and not model and training is None,
    }


def _rows(entries: Any, keys: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """The well-formed rows of a saved list of dicts (a damaged summary drops rows, not the page)."""
    return [tuple(e.get(k) for k in keys) for e in entries or () if isinstance(e, dict) and "name" in e]


def _profile(run: RunData) -> dict[str, Any] | None:
    """``run --profile STEP``: the files to open, the modules and the aten ops; None when not profiled."""
    profile = run.summary.get("profile")
    if not isinstance(profile, dict):
        return None
    clock = "device" if profile.get("time") == "device" else "CPU"
    facts: list[tuple[str, str]] = []  # (a file's path or "", text)
    if profile.get("wall_ms") is not None:
        facts.append(("", f"the profiled step took {profile['wall_ms']} ms of wall time (profiling slows it)"))
    facts += [(profile[key], how) for key, how in _VIEWERS.items() if profile.get(key)]
    facts += [("", profile[key]) for key in ("note", "memory_note") if profile.get(key)]
    return {
        "step": profile.get("step"),
        "facts": facts,
        "tables": [
            (
                f"Modules by {clock} time (a block's time is inside its component's)",
                ("module", "calls", f"{clock} time ms"),
                _rows(profile.get("modules"), ("name", "calls", "total_ms")),
            ),
            (
                f"Operators by self {clock} time",
                ("operator", "calls", f"self {clock} time ms"),
                _rows(profile.get("ops"), ("name", "calls", "self_ms")),
            ),
        ],
    }


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


def _files(run: RunData) -> dict[str, Any]:
    """The repro bundles with their replay command, the previews, the full config, the versions."""
    s = run.summary
    bundles = [_relative(b, run.run_dir) for b in s.get("bundles") or []]
    config, versions = s.get("config"), s.get("versions")
    return {
        "bundles": [(b, replay_command(run, b)) for b in bundles],
        "previews": s.get("previews") or [],
        **_why(run.run_dir),
        "config": list(config.items()) if isinstance(config, dict) else [],
        "versions": list(versions.items()) if isinstance(versions, dict) else [],
    }


def _why(run_dir: Path) -> dict[str, str | None]:
    """``why``: the verdict of ``why.json`` (written by ``diffusion-debug why`` / ``DebugReport.why()``), if any;
    ``why_note``: its note, what the replays could not reproduce of the call (read with the verdict it qualifies)."""
    try:
        why = load_json(run_dir / "why.json") if (run_dir / "why.json").is_file() else None
    except (OSError, ValueError, DiffusionDebugError):
        why = None
    if not isinstance(why, dict) or not why.get("verdict"):
        return {"why": None, "why_note": None}
    return {"why": str(why["verdict"]), "why_note": str(why["note"]) if why.get("note") else None}


def render_html(run: RunData) -> str:
    """The report page for a loaded run directory."""
    return render(
        "page.html",
        title=f"diffusion-debug: {_kind_label(run.summary).lower()} run {run.run_dir.name}",
        run_dir=run.run_dir,
        header=_header(run),
        anomalies=anomalies_context(run),
        plots=_plots(run),
        steps=_steps(run),
        components=_components(run),
        profile=_profile(run),
        files=_files(run),
    )


def write_html(run_dir: str | os.PathLike) -> Path:
    """Build ``report.html`` from the run directory's saved files."""
    run = load_run(run_dir)
    return write_atomic(Path(run_dir) / "report.html", render_html(run))
