"""report.html: one self-contained page built from a run directory's files alone.

The page reads top to bottom the way a person debugs: what ran, what went wrong (anomalies
first, grouped by kind, each with what it means and what to do), then the plots, then the
per-step and per-component tables. Images are embedded as ``data:image/png;base64`` URIs and
the style sheet is inline, so the file can be mailed or attached to an issue on its own; the
page needs no JavaScript and references nothing outside itself.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import DiffusionDebugError
from ..record import Anomaly, RunData, by_cause, load_json, load_run, severity_rank, write_atomic
from .columns import INFERENCE_STEP_COLUMNS, TRAINING_STEP_COLUMNS, Column, field, run_warnings
from .guide import guide_for
from .media import media_html
from .plots import Plot, build_plots, kind_color, number

STEP_TABLE_EDGE = 15
"""A long run's step table shows this many first and last rows (summary.json has them all)."""
ANOMALY_CARDS_PER_KIND = 6
ANOMALY_ROWS_PER_KIND = 300


_STYLE = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#1f2328;
background:#f6f7f9}
main{max-width:1040px;margin:0 auto;padding:18px 22px 40px;background:#fff;min-height:100vh}
h1{font-size:21px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid #d8dee4}
h3{font-size:15px;margin:0 0 4px}
.incomplete{background:#fff4e5;border-left:4px solid #e65100;padding:6px 10px}
.meta{color:#57606a;margin:2px 0}.meta b{color:#1f2328;font-weight:600}
nav{margin:10px 0 0;font-size:13px}nav a{margin-right:14px;color:#0969da;text-decoration:none}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;background:#eff1f3;
padding:0 4px;border-radius:4px;overflow-wrap:anywhere}
.chip{display:inline-block;padding:1px 9px;border-radius:10px;font-size:12px;font-weight:600;margin-right:6px}
.chip.error{background:#ffebe9;color:#a40e26;border:1px solid #ffb3ad}
.chip.warning{background:#fff8c5;color:#7d4e00;border:1px solid #e8c96b}
.chip.info{background:#eef1f4;color:#424a53;border:1px solid #d0d7de}
.chip.ok{background:#dafbe1;color:#116329;border:1px solid #8fd9a1}
.verdict{margin:12px 0 0;padding:10px 14px;border-radius:6px;font-weight:600}
.verdict.error{background:#ffebe9;color:#82071e}.verdict.warning{background:#fff8c5;color:#6b4300}
.verdict.ok{background:#dafbe1;color:#0f5323}.verdict.info{background:#eef1f4;color:#424a53}
.group{border:1px solid #d8dee4;border-left:6px solid #999;border-radius:6px;padding:10px 14px;margin:12px 0}
.group .count{color:#57606a;font-weight:400}
.guide{margin:4px 0 8px;color:#424a53;font-size:13px}.guide b{color:#1f2328}
ol.anomalies{margin:0;padding-left:20px}
li.anomaly{margin:6px 0;padding:6px 10px;border-radius:5px}
li.anomaly.error{background:#fff5f5}li.anomaly.warning{background:#fffbea}li.anomaly.info{background:#f6f8fa}
.where{color:#424a53;font-size:13px;margin-top:2px}
details{margin-top:4px}summary{cursor:pointer;color:#0969da;font-size:13px}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px}
td,th{border:1px solid #d8dee4;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.bad{background:#ffebe9;color:#a40e26;font-weight:600}tr.flag td:first-child{box-shadow:inset 4px 0 #cf222e}
tr.gap td{text-align:center;color:#57606a;background:#fafbfc}
table.kv td:nth-child(odd){color:#57606a;white-space:nowrap;background:#fafbfc}
.scroll{overflow-x:auto}
figure{margin:14px 0 22px}figure img{max-width:100%;height:auto;display:block;border:1px solid #eaeef2}
figcaption{color:#57606a;font-size:13px;margin-top:4px;max-width:900px}
img.strip{image-rendering:pixelated;max-width:100%;height:auto}
img.final{image-rendering:pixelated;width:256px;max-width:100%;height:auto}
.media figure{display:inline-block;margin-right:1em}
.note{color:#57606a;font-size:13px}
footer{margin-top:30px;color:#57606a;font-size:12px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


# -- cells --------------------------------------------------------------------------------


def _is_nonfinite(value: Any) -> bool:
    return (
        isinstance(value, str)
        and value in ("nan", "inf", "-inf")
        or (isinstance(value, float) and not math.isfinite(value))
    )


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 300 else text[:299] + "…"
    return str(value)


def _cell(value: Any) -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) or _is_nonfinite(value)
    classes = " ".join(c for c in ("num" if numeric else "", "bad" if _is_nonfinite(value) else "") if c)
    return f"<td class='{classes}'>{_e(_format(value))}</td>" if classes else f"<td>{_e(_format(value))}</td>"


def _kv_table(pairs: Iterable[tuple[str, Any]], per_row: int = 1) -> str:
    """Name/value pairs, ``per_row`` pairs side by side (long lists stay short)."""
    pairs = list(pairs)
    rows = []
    for i in range(0, len(pairs), per_row):
        rows.append("<tr>" + "".join(f"<td>{_e(k)}</td>{_cell(v)}" for k, v in pairs[i : i + per_row]) + "</tr>")
    return f"<table class='kv'>{''.join(rows)}</table>" if rows else ""


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
    head = "".join(f"<th>{_e(h)}</th>" for h, _ in used) + "<th>anomalies</th>"
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
        flagged = bool(kinds) or any(_is_nonfinite(v) for v in values)
        cells = "".join(_cell(v) for v in values) + f"<td>{_e(', '.join(kinds))}</td>"
        body.append(f"<tr class='flag'>{cells}</tr>" if flagged else f"<tr>{cells}</tr>")
    return f"<div class='scroll'><table><tr>{head}</tr>{''.join(body)}</table></div>"


# -- sections -----------------------------------------------------------------------------


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


def _header(run: RunData) -> str:
    s = run.summary
    title = f"{_kind_label(s)} run {run.run_dir.name}"
    facts = []
    started = number(s.get("started"))
    if math.isfinite(started):
        facts.append(("started", time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))))
    duration = _duration(number(s.get("duration_s")))
    if duration:
        facts.append(("duration", duration))
    if s.get("pipeline"):
        facts.append(("pipeline", s["pipeline"]))
    model = field(s, "components", "model", "class")
    if model and s.get("kind") == "training":
        facts.append(("model", model))
    steps = s.get("steps_recorded", len(run.steps))
    facts.append(("steps recorded", steps))
    if isinstance(s.get("runs"), int) and s["runs"] > 1:
        facts.append(("pipeline calls", s["runs"]))
    if isinstance(s.get("total_parameters"), int):
        facts.append(("parameters", f"{s['total_parameters']:,}"))
    if isinstance(s.get("world_size"), int) and s["world_size"] > 1:
        facts.append(("processes", s["world_size"]))
    line = " · ".join(f"{_e(k)} <b>{_e(v)}</b>" for k, v in facts)
    versions = s.get("versions") or {}
    version_line = " · ".join(
        f"{_e(k)} {_e(v)}"
        for k, v in versions.items()
        if k in ("diffusion_debug", "torch", "diffusers", "transformers", "accelerate", "python", "cuda")
    )
    config = s.get("config") or {}
    config_line = " · ".join(
        f"{_e(k)} <b>{_e(_format(config[k]))}</b>" for k in ("level", "policy", "probes", "strict") if k in config
    )
    parts = [f"<h1>{_e('diffusion-debug · ' + title)}</h1>", f"<p class='meta'>{line}</p>"]
    if version_line:
        parts.append(f"<p class='meta'>versions: {version_line}</p>")
    if config_line:
        parts.append(f"<p class='meta'>config: {config_line}</p>")
    parts.append(f"<p class='meta'>run directory: <code>{_e(run.run_dir)}</code></p>")
    for warning in run_warnings(s):
        parts.append(f"<p class='incomplete'><b>{_e(warning)}</b></p>")
    parts.append(
        "<nav><a href='#anomalies'>Anomalies</a><a href='#plots'>Plots</a><a href='#steps'>Steps</a>"
        "<a href='#components'>Components</a><a href='#files'>Files and config</a></nav>"
    )
    return "<header>" + "".join(parts) + "</header>"


def _verdict(anomalies: list[Anomaly], summary: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for a in anomalies:
        counts[a.severity] = counts.get(a.severity, 0) + 1
    if not anomalies:
        return "<p class='verdict ok'>No anomalies: the debugger found nothing wrong in this run.</p>"
    worst = min(counts, key=lambda s: -severity_rank(s))
    chips = "".join(
        f"<span class='chip {_e(s)}'>{counts[s]} {_e(s)}</span>"
        for s in sorted(counts, key=lambda s: -severity_rank(s))
    )
    first = by_cause(anomalies)[0]  # cause before consequence: input, loss, gradients, update; lowest rank
    kinds = len({a.kind for a in anomalies})
    text = f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'} of {kinds} kind(s). "
    text += f"Most important: {first.kind}"
    where = first.where()
    if where:
        text += f" at {where}"
    return f"<p class='verdict {_e(worst)}'>{chips}{_e(text)}.</p>"


def _where(a: Anomaly, show_rank: bool) -> str:
    parts = []
    if a.component:
        parts.append(f"component <code>{_e(a.component)}</code>")
    if a.module:
        parts.append(f"module <code>{_e(a.module)}</code>")
    if a.parameter:
        parts.append(f"parameter <code>{_e(a.parameter)}</code>")
    if a.step is not None:
        parts.append(f"step <b>{_e(a.step)}</b>")
    if a.timestep is not None:
        parts.append(f"timestep <b>{_e(_format(number(a.timestep)))}</b>")
    if show_rank or a.rank:
        parts.append(f"rank <b>{_e(a.rank)}</b>")
    return " · ".join(parts) if parts else "the whole run"


def step_ranges(steps: Iterable[int]) -> str:
    """Steps as short ranges.

    >>> step_ranges([9, 10, 11, 3, 14, 15])
    '3, 9–11, 14–15'
    """
    ordered = sorted(set(steps))
    spans: list[list[int]] = []
    for step in ordered:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)


def _repeats(a: Anomaly) -> str:
    """What the debugger itself folded into one anomaly (``details.count``, ``last_step``)."""
    count = number(a.details.get("count")) if isinstance(a.details, dict) else math.nan
    if not math.isfinite(count) or count <= 1:
        return ""
    last = a.details.get("last_step")
    return f" · seen {int(count)} times" + (f", last at step {_e(last)}" if last is not None else "")


def _anomaly_card(cluster: Sequence[Anomaly], show_rank: bool) -> str:
    """One card for anomalies that repeat at the same place: the first one's message, and the
    steps where it came back."""
    a = cluster[0]
    details = ""
    if a.details:
        details = f"<details><summary>details</summary>{_kv_table(a.details.items())}</details>"
    again = ""
    if len(cluster) > 1:
        steps = [b.step for b in cluster if b.step is not None]
        again = (
            f"<div class='where'>repeated {len(cluster)} times"
            + (f", at steps {_e(step_ranges(steps))}" if steps else "")
            + "</div>"
        )
    return (
        f"<li class='anomaly {_e(a.severity)}'><span class='chip {_e(a.severity)}'>{_e(a.severity)}</span>"
        f"{_e(a.message)}<div class='where'>where: {_where(a, show_rank)}{_repeats(a)}</div>{again}{details}</li>"
    )


def _clusters(members: Sequence[Anomaly]) -> list[list[Anomaly]]:
    """Anomalies of one kind grouped by where they happened, most severe and earliest first."""
    clusters: dict[tuple[Any, ...], list[Anomaly]] = {}
    for a in members:
        clusters.setdefault((a.severity, a.component, a.module, a.parameter, a.rank), []).append(a)
    return sorted(
        clusters.values(),
        key=lambda c: (-severity_rank(c[0].severity), c[0].step if c[0].step is not None else -1),
    )


def _anomaly_rows(anomalies: Sequence[Anomaly], show_rank: bool) -> str:
    shown = anomalies[:ANOMALY_ROWS_PER_KIND]
    head = "<tr><th>severity</th><th>where</th><th>message</th></tr>"
    rows = "".join(
        f"<tr><td>{_e(a.severity)}</td><td>{_where(a, show_rank)}</td><td>{_e(a.message)}</td></tr>" for a in shown
    )
    more = len(anomalies) - len(shown)
    tail = f"<p class='note'>… and {more} more in summary.json.</p>" if more else ""
    return f"<div class='scroll'><table>{head}{rows}</table></div>{tail}"


def _anomalies_section(run: RunData) -> str:
    s = run.summary
    anomalies = run.anomalies
    parts = ["<section id='anomalies'><h2>Anomalies</h2>", _verdict(anomalies, s)]
    dropped = number(s.get("dropped_anomalies"))
    if math.isfinite(dropped) and dropped > 0:
        parts.append(
            f"<p class='note'>{int(dropped)} further anomalies were dropped when the record's buffer "
            "was full; the counts below include only those kept.</p>"
        )
    show_rank = isinstance(s.get("world_size"), int) and s["world_size"] > 1
    groups: dict[str, list[Anomaly]] = {}
    for a in anomalies:
        groups.setdefault(a.kind, []).append(a)

    def order(kind: str) -> tuple[int, int]:
        members = groups[kind]
        return min(-severity_rank(a.severity) for a in members), anomalies.index(members[0])

    for kind in sorted(groups, key=order):
        members = sorted(groups[kind], key=lambda a: (a.step if a.step is not None else -1, a.rank))
        severities: dict[str, int] = {}
        for a in members:
            severities[a.severity] = severities.get(a.severity, 0) + 1
        split = ", ".join(f"{n} {sev}" for sev, n in sorted(severities.items(), key=lambda i: -severity_rank(i[0])))
        guide = guide_for(kind)
        clusters = _clusters(members)
        cards = "".join(_anomaly_card(c, show_rank) for c in clusters[:ANOMALY_CARDS_PER_KIND])
        more = ""
        if len(clusters) > ANOMALY_CARDS_PER_KIND or len(clusters) < len(members):
            hidden = len(clusters) - ANOMALY_CARDS_PER_KIND
            label = f"all {len(members)} one by one" + (f" ({hidden} places not shown above)" if hidden > 0 else "")
            more = f"<details><summary>{_e(label)}</summary>{_anomaly_rows(members, show_rank)}</details>"
        parts.append(
            f"<section class='group' id='kind-{_e(kind)}' style='border-left-color:{kind_color(kind)}'>"
            f"<h3>{_e(kind)} <span class='count'>× {len(members)} ({_e(split)})</span></h3>"
            f"<p class='guide'><b>What it means:</b> {_e(guide.meaning)} <b>What to do:</b> {_e(guide.action)}</p>"
            f"<ol class='anomalies'>{cards}</ol>{more}</section>"
        )
    parts.append("</section>")
    return "".join(parts)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure_html(plot: Plot) -> str:
    caption = f"<figcaption>{_e(plot.caption)}</figcaption>" if plot.caption else ""
    return (
        f"<figure id='{_e(plot.id)}'><img src='{_data_uri(plot.png)}' alt='{_e(plot.alt)}' "
        f"title='{_e(plot.title)}'>{caption}</figure>"
    )


def _preview_strip(run: RunData) -> str:
    """The latent preview strip saved by the debugger, embedded as it is (PNG files only)."""
    previews = [p for p in run.summary.get("previews") or [] if isinstance(p, str)]
    candidates = [p for p in previews if p.endswith("strip.png")] or ["previews/strip.png"]
    for relative in candidates:
        path = run.run_dir / relative
        # only files inside the run directory: a copied run directory must show its own preview
        if (
            not Path(relative).is_absolute()
            and path.is_file()
            and path.resolve().is_relative_to(run.run_dir.resolve())
        ):
            data = path.read_bytes()
            if data.startswith(b"\x89PNG\r\n\x1a\n"):
                steps = len(run.steps)
                caption = (
                    "A cheap RGB preview of the latents, one tile per recorded denoising step, left to right"
                    + (f" ({steps} steps)" if steps else "")
                    + "; black or flat tiles show where the "
                    "latents broke. Decoded from the latents by a linear map, not the VAE."
                )
                # twice the saved size (tiles are small), never wider than the page
                width = min(2 * int.from_bytes(data[16:20], "big"), 1000)
                return (
                    f"<figure id='preview-strip'><img class='strip' width='{width}' src='{_data_uri(data)}' "
                    f"alt='Latent preview strip, one tile per denoising step'><figcaption>{_e(caption)}"
                    "</figcaption></figure>"
                )
    return ""


def _plots_section(run: RunData) -> str:
    plots, failures = build_plots(run.summary)
    parts = ["<section id='plots'><h2>Plots</h2>"]
    if run.summary.get("kind") != "training":
        parts.append(_preview_strip(run))
        parts.append(media_html(run))
    parts.extend(_figure_html(p) for p in plots)
    if not plots and not failures:
        parts.append("<p class='note'>This run recorded no per-step data to plot.</p>")
    for failure in failures:
        parts.append(f"<p class='note'>A plot could not be drawn from this run's data: {_e(failure)}</p>")
    parts.append("</section>")
    return "".join(parts)


def _steps_section(run: RunData) -> str:
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


def _components_section(run: RunData) -> str:
    s = run.summary
    components = s.get("components") or {}
    parts = ["<section id='components'><h2>Components</h2>"]
    rows = []
    for name, info in components.items():
        if not isinstance(info, dict) or not ("parameters" in info or "trainable_parameters" in info):
            continue
        rows.append(
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
        )
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
    if rows:
        keep = [i for i in range(len(headers)) if any(r[i] is not None for r in rows)]
        head = "".join(f"<th>{_e(headers[i])}</th>" for i in keep)
        body = "".join(
            "<tr>" + "".join(_cell(r[i]) if i else f"<td><code>{_e(r[i])}</code></td>" for i in keep) + "</tr>"
            for r in rows
        )
        parts.append(f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>")
    for name, info in components.items():
        if isinstance(info, dict) and isinstance(info.get("config"), dict) and "parameters" not in info:
            parts.append(f"<h3>{_e(name)}: {_e(info.get('class', ''))}</h3>")
            parts.append(_kv_table(list(info["config"].items()), per_row=3))
    model = components.get("model") if isinstance(components.get("model"), dict) else None
    if model:
        facts = [
            (k.replace("_", " "), model[k])
            for k in ("trainable_tensors", "modules_with_trainable_parameters", "num_train_timesteps")
            if k in model
        ]
        parts.append(_kv_table(facts, per_row=3))
        largest = model.get("module_grad_norm_max")
        last = model.get("module_grad_norm_last") or {}
        if isinstance(largest, dict) and largest:
            ranked = sorted(
                largest.items(), key=lambda item: -number(item[1]) if math.isfinite(number(item[1])) else -math.inf
            )[:10]
            body = "".join(
                f"<tr><td><code>{_e(m)}</code></td>{_cell(v)}"
                f"{_cell(last.get(m) if isinstance(last, dict) else None)}</tr>"
                for m, v in ranked
            )
            parts.append(
                "<h3>Largest gradient norms per module</h3><div class='scroll'><table><tr><th>module</th>"
                f"<th>largest norm</th><th>last norm</th></tr>{body}</table></div>"
            )
    training = s.get("training")
    if isinstance(training, dict):
        parts.append("<h3>Training summary</h3>")
        parts.append(
            _kv_table([(k.replace("_", " "), v) for k, v in training.items() if not isinstance(v, dict)], per_row=4)
        )
    if len(parts) == 1:
        parts.append("<p class='note'>No component information was recorded.</p>")
    parts.append("</section>")
    return "".join(parts)


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
    directory's ``invocation.json`` (written by ``diffusion-debug run``) names it."""
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


def _files_section(run: RunData) -> str:
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
            f"<li><code>{_e(b)}</code> — re-run it with full probes: <code>{_e(replay_command(run, b))}</code></li>"
            for b in bundles
        )
        parts.append(f"<h3>Repro bundles</h3><ul>{items}</ul>")
    previews = s.get("previews") or []
    if previews:
        parts.append("<h3>Previews</h3><ul>" + "".join(f"<li><code>{_e(p)}</code></li>" for p in previews) + "</ul>")
    config = s.get("config")
    if isinstance(config, dict) and config:
        parts.append(
            f"<details><summary>full config ({len(config)} options)</summary>{_kv_table(config.items(), per_row=3)}"
            "</details>"
        )
    versions = s.get("versions")
    if isinstance(versions, dict) and versions:
        parts.append(f"<details><summary>all versions</summary>{_kv_table(versions.items(), per_row=2)}</details>")
    parts.append("</section>")
    return "".join(parts)


def render_html(run: RunData) -> str:
    """The report page for a loaded run directory."""
    title = f"diffusion-debug: {_kind_label(run.summary).lower()} run {run.run_dir.name}"
    body = "".join(
        (
            _header(run),
            _anomalies_section(run),
            _plots_section(run),
            _steps_section(run),
            _components_section(run),
            _files_section(run),
        )
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body><main>{body}"
        "<footer>Made by diffusion-debug from the saved run directory; rebuild it with "
        f"<code>diffusion-debug report {_e(run.run_dir)}</code>.</footer></main></body></html>"
    )


def write_html(run_dir: str | os.PathLike) -> Path:
    """Build ``report.html`` from the run directory's saved files."""
    run = load_run(run_dir)
    return write_atomic(Path(run_dir) / "report.html", render_html(run))
