"""The report's plots, drawn with matplotlib from a saved run's summary alone.

Each builder takes the summary dict and returns a :class:`Plot` (PNG bytes and the words around
it) or ``None`` when the run holds no data for it: a plot whose data is missing is left out,
never an error. Figures are made with ``matplotlib.figure.Figure`` and the Agg canvas, not
pyplot, so nothing is kept in pyplot's global figure registry and no display is needed.

This module holds the plots of both kinds of run (memory, anomaly distribution), the list of
plots each kind draws and :func:`build_plots`; the others are in :mod:`.plots_inference` and
:mod:`.plots_training`, the shared helpers (:class:`Plot`, :func:`number`, :func:`kind_color`,
the drawing) in :mod:`.plots_common`.

Limits: steps are plotted as recorded (the record keeps a bounded ring buffer, so a long run
shows its last ``history_size`` steps); the module heatmap shows only the modules each step
recorded (the largest per step), binned when there are more steps than pixel columns.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import numpy as np

from .plots_common import (
    DPI,
    NONFINITE_COLOR,
    WIDE,
    Plot,
    by_rank,
    has_data,
    kind_color,
    legend,
    mark_anomalies,
    nan_steps,
    new_figure,
    number,
    png,
    series,
    shade_steps,
    span_steps,
    steps_axis,
)
from .plots_inference import component_plot, denoiser_output_plot, latent_stats_plot
from .plots_modules import module_map_plot
from .plots_training import (
    HEATMAP_MAX_COLUMNS,
    HEATMAP_MAX_MODULES,
    grad_norm_plot,
    learning_rate_plot,
    loss_plot,
    module_grad_heatmap,
    timestep_bucket_plot,
)

__all__ = [
    "DPI",
    "HEATMAP_MAX_COLUMNS",
    "HEATMAP_MAX_MODULES",
    "INFERENCE_PLOTS",
    "NONFINITE_COLOR",
    "TRAINING_PLOTS",
    "WIDE",
    "Plot",
    "anomaly_distribution_plot",
    "build_plots",
    "component_plot",
    "denoiser_output_plot",
    "grad_norm_plot",
    "kind_color",
    "latent_stats_plot",
    "learning_rate_plot",
    "loss_plot",
    "memory_plot",
    "module_grad_heatmap",
    "module_map_plot",
    "number",
    "series",
    "timestep_bucket_plot",
]


def memory_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    keys: list[str] = []
    for row in rows:
        for key in (row.get("memory") or {}) if isinstance(row.get("memory"), dict) else ():
            if key not in keys and key.endswith("_mb") and (key == "rss_mb" or key.startswith("cuda")):
                keys.append(key)
    lines = {k: series(rows, "memory", k) for k in keys}
    lines = {k: v for k, v in lines.items() if has_data(v)}
    if not lines:
        return None
    x, xlabel = steps_axis(rows)
    fig, (ax,) = new_figure((WIDE[0], 2.5))
    labels = {
        "rss_mb": "process RSS",
        "cuda_allocated_mb": "CUDA allocated",
        "cuda_reserved_mb": "CUDA reserved",
        "cuda_peak_mb": "CUDA peak allocated",
    }
    ranks = by_rank(rows) if summary.get("kind") == "training" else {0: rows}
    if len(ranks) > 1:  # each rank's own line, by step
        x, xlabel = series(rows, "step"), "step"
    for rank, group in sorted(ranks.items()):
        for key in lines:
            label = labels.get(key, key) + (f", rank {rank}" if len(ranks) > 1 else "")
            ax.plot(x if len(ranks) == 1 else steps_axis(group)[0], series(group, "memory", key), lw=1.3, label=label)
    if summary.get("kind") != "training":
        shade_steps(ax, x, nan_steps(rows), "step with NaN/Inf")
    everything = np.concatenate([v[np.isfinite(v)] for v in lines.values()])
    low, high = float(everything.min()), float(everything.max())
    if high - low < 20:  # a flat line must look flat, not like a cliff of a few kilobytes
        middle = (high + low) / 2
        ax.set_ylim(max(0.0, middle - 10), middle + 10)
    span_steps(ax, x)
    mark_anomalies(
        ax, [a for a in summary.get("anomalies") or [] if a.get("kind") == "memory_growth"], series(rows, "step")
    )
    ax.set(title="Memory per step", xlabel=xlabel, ylabel="MB")
    legend(ax)
    return Plot(
        "plot-memory",
        "Memory",
        "Process and CUDA memory per step",
        png(fig),
        "Memory read at each step: host process RSS, and CUDA allocated/reserved where a GPU was used.",
    )


def anomaly_distribution_plot(summary: dict[str, Any]) -> Plot | None:
    counts = summary.get("anomaly_counts")
    if not isinstance(counts, dict) or not counts:
        counts = {}
        for a in summary.get("anomalies") or []:
            counts[str(a.get("kind"))] = counts.get(str(a.get("kind")), 0) + 1
    counts = {str(k): int(number(v)) for k, v in counts.items() if math.isfinite(number(v)) and number(v) > 0}
    if not counts:
        return None
    kinds = sorted(counts, key=lambda k: (-counts[k], k))
    fig, (ax,) = new_figure((WIDE[0], max(1.8, 0.9 + 0.32 * len(kinds))))
    bars = ax.barh(kinds[::-1], [counts[k] for k in kinds[::-1]], color=[kind_color(k) for k in kinds[::-1]])
    ax.bar_label(bars, fontsize=8, padding=2)
    ax.margins(x=0.1)
    ax.set(title="Anomaly distribution", xlabel="number of anomalies", ylabel="kind")
    return Plot(
        "plot-anomaly-kinds",
        "Anomaly distribution",
        "Bar chart of anomaly counts by kind",
        png(fig),
        "How many anomalies of each kind the run recorded.",
    )


INFERENCE_PLOTS: tuple[Callable[[dict[str, Any]], Plot | None], ...] = (
    latent_stats_plot,
    denoiser_output_plot,
    component_plot,
    memory_plot,
    anomaly_distribution_plot,
)


TRAINING_PLOTS: tuple[Callable[[dict[str, Any]], Plot | None], ...] = (
    loss_plot,
    grad_norm_plot,
    learning_rate_plot,
    module_grad_heatmap,
    module_map_plot,
    timestep_bucket_plot,
    memory_plot,
    anomaly_distribution_plot,
)


def build_plots(summary: dict[str, Any]) -> tuple[list[Plot], list[str]]:
    """The plots for a run's summary, and one line per plot that failed to draw (the report
    shows those lines instead of stopping). What matplotlib and numpy warn of while drawing odd
    data (values near the float's limits overflow an axis's margin) stays out of stderr: the
    plot is drawn all the same, and the saved values are in the tables. (Warnings are silenced
    process-wide while a plot draws: ``warnings.catch_warnings`` is not thread-local.)"""
    builders = TRAINING_PLOTS if summary.get("kind") == "training" else INFERENCE_PLOTS
    plots, failures = [], []
    for build in builders:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                plot = build(summary)
        except Exception as error:  # a malformed field costs one plot, never the report
            failures.append(f"{build.__name__}: {type(error).__name__}: {error}")
            continue
        if plot is not None:
            plots.append(plot)
    return plots, failures
