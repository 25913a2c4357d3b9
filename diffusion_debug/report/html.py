"""report.html: one self-contained page built from a run directory's files alone.

The page reads top to bottom the way a person debugs: what ran, what went wrong (anomalies
first, grouped by kind, each with what it means and what to do), then the plots, then the
per-step and per-component tables. Images are embedded as ``data:image/png;base64`` URIs and
the style sheet is inline, so the file can be mailed or attached to an issue on its own; the
page needs no JavaScript and references nothing outside itself.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..record import RunData, load_run, write_atomic
from .columns import field, run_warnings
from .html_anomalies import ANOMALY_CARDS_PER_KIND, ANOMALY_ROWS_PER_KIND, anomalies_section, step_ranges
from .html_cells import escape, format_value
from .html_components import components_section
from .html_files import files_section, replay_command
from .html_plots import plots_section
from .html_profile import profile_section
from .html_steps import STEP_TABLE_EDGE, steps_section
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
.message{max-height:14em;overflow:auto;overflow-wrap:anywhere}
footer{margin-top:30px;color:#57606a;font-size:12px}
"""


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
    steps = s.get("steps_recorded", len(run.steps))
    facts.append(("steps recorded", steps))
    if isinstance(s.get("runs"), int) and s["runs"] > 1:
        facts.append(("pipeline calls", s["runs"]))
    if isinstance(s.get("total_parameters"), int):
        facts.append(("parameters", f"{s['total_parameters']:,}"))
    if isinstance(s.get("world_size"), int) and s["world_size"] > 1:
        facts.append(("processes", s["world_size"]))
    line = " · ".join(f"{escape(k)} <b>{escape(v)}</b>" for k, v in facts)
    versions = s.get("versions") or {}
    version_line = " · ".join(
        f"{escape(k)} {escape(v)}"
        for k, v in versions.items()
        if k in ("diffusion_debug", "torch", "diffusers", "transformers", "accelerate", "python", "cuda")
    )
    config = s.get("config") or {}
    config_line = " · ".join(
        f"{escape(k)} <b>{escape(format_value(config[k]))}</b>"
        for k in ("level", "policy", "probes", "strict")
        if k in config
    )
    parts = [f"<h1>{escape('diffusion-debug · ' + title)}</h1>", f"<p class='meta'>{line}</p>"]
    if version_line:
        parts.append(f"<p class='meta'>versions: {version_line}</p>")
    if config_line:
        parts.append(f"<p class='meta'>config: {config_line}</p>")
    parts.append(f"<p class='meta'>run directory: <code>{escape(run.run_dir)}</code></p>")
    for warning in run_warnings(s):
        parts.append(f"<p class='incomplete'><b>{escape(warning)}</b></p>")
    profile = "<a href='#profile'>Profile</a>" if isinstance(s.get("profile"), dict) else ""
    parts.append(
        "<nav><a href='#anomalies'>Anomalies</a><a href='#plots'>Plots</a><a href='#steps'>Steps</a>"
        f"<a href='#components'>Components</a>{profile}<a href='#files'>Files and config</a></nav>"
    )
    return "<header>" + "".join(parts) + "</header>"


def render_html(run: RunData) -> str:
    """The report page for a loaded run directory."""
    title = f"diffusion-debug: {_kind_label(run.summary).lower()} run {run.run_dir.name}"
    body = "".join(
        (
            _header(run),
            anomalies_section(run),
            plots_section(run),
            steps_section(run),
            components_section(run),
            profile_section(run),
            files_section(run),
        )
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body><main>{body}"
        "<footer>Made by diffusion-debug from the saved run directory; rebuild it with "
        f"<code>diffusion-debug report {escape(run.run_dir)}</code>.</footer></main></body></html>"
    )


def write_html(run_dir: str | os.PathLike) -> Path:
    """Build ``report.html`` from the run directory's saved files."""
    run = load_run(run_dir)
    return write_atomic(Path(run_dir) / "report.html", render_html(run))
