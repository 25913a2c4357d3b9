"""The plots of a training run: loss, gradient norm and learning rate per step (one line per
rank; the learning rate once where every rank has the same), the per-module gradient norm heatmap
and the loss per timestep bucket. The x axis is the step, never a row's position.

Limits: steps are plotted as the report is given them (report.html: every rank's event file);
the module heatmap shows the first rank's steps, and shows only the modules each step
recorded (the largest per step), at most :data:`HEATMAP_MAX_MODULES` of them, binned into
:data:`HEATMAP_MAX_COLUMNS` columns when there are more steps.
"""

from __future__ import annotations

import math
from typing import Any

import matplotlib
import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.ticker import FuncFormatter

from .columns import field
from .plots_common import (
    NONFINITE_COLOR,
    WIDE,
    Plot,
    by_rank,
    has_data,
    legend,
    log_if_wide,
    mark_anomalies,
    mark_nonfinite,
    new_figure,
    number,
    png,
    series,
    short_name,
    span_steps,
    steps_axis,
)

HEATMAP_MAX_COLUMNS = 400
HEATMAP_MAX_MODULES = 20


def _plot_rank_series(ax, group: list[dict[str, Any]], key: str, label: str, nonfinite_label: str | None):
    """One rank's ``key`` per step, with its NaN/Inf values marked; returns ``(x, values)``."""
    x, _ = steps_axis(group)
    values = series(group, key)
    ax.plot(x, values, lw=1.3, marker="o" if len(group) <= 60 else None, ms=3, label=label)
    stored = np.array([r.get(key) is not None for r in group], dtype=bool)
    mark_nonfinite(ax, x, ~np.isfinite(values) & stored, nonfinite_label)
    return x, values


def loss_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    loss_all = series(rows, "loss")
    if not loss_all.size or not (
        np.isfinite(loss_all).any() or np.isinf(loss_all).any() or any(isinstance(r.get("loss"), str) for r in rows)
    ):
        return None
    fig, (ax,) = new_figure()
    groups = by_rank(rows)
    for rank, group in sorted(groups.items()):
        _plot_rank_series(
            ax,
            group,
            "loss",
            f"loss, rank {rank}" if len(groups) > 1 else "loss",
            "NaN/Inf loss" if rank == min(groups) else None,
        )
    log_if_wide(ax, loss_all)
    mark_anomalies(ax, summary.get("anomalies") or [], series(rows, "step"))
    span_steps(ax, steps_axis(rows)[0] if len(groups) == 1 else series(rows, "step"))
    ax.set(title="Training loss per step, anomalies marked", xlabel="step", ylabel="loss")
    legend(ax)
    caption = "Dashed lines mark the steps with anomalies, one colour per kind; red triangles mark NaN/Inf losses."
    return Plot("plot-loss", "Loss", "Training loss per step with anomaly steps marked", png(fig), caption)


def grad_norm_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    norms = series(rows, "grad_norm")
    if not norms.size or not (np.isfinite(norms).any() or np.isinf(norms).any()):
        return None
    fig, (ax,) = new_figure()
    groups = by_rank(rows)
    for rank, group in sorted(groups.items()):
        x, values = _plot_rank_series(
            ax,
            group,
            "grad_norm",
            f"rank {rank}" if len(groups) > 1 else "gradient norm (before clipping)",
            "NaN/Inf norm" if rank == min(groups) else None,
        )
        clipped = np.array([r.get("grad_norm_clipped") is True for r in group], dtype=bool)
        if clipped.any():
            ax.scatter(
                x[clipped],
                values[clipped],
                s=18,
                facecolors="none",
                edgecolors="#ff7f0e",
                label="clipped" if rank == min(groups) else None,
                zorder=4,
            )
    threshold = number(field(summary, "config", "grad_explosion_threshold"))
    finite = norms[np.isfinite(norms)]
    if math.isfinite(threshold) and threshold > 0:
        ax.axhline(threshold, color="#d62728", ls="--", lw=1, label=f"explosion threshold ({threshold:g})")
    if finite.size and (finite > 0).all():
        ax.set_yscale("log")
    span_steps(ax, steps_axis(rows)[0] if len(groups) == 1 else series(rows, "step"))
    ax.set(
        title="Gradient norm per step (before clipping)",
        xlabel="step",
        ylabel="total gradient L2 norm (before clipping)",
    )
    legend(ax)
    caption = "The global gradient norm as the optimizer received it, before any clipping; log scale."
    return Plot(
        "plot-grad-norm",
        "Gradient norm",
        "Total gradient norm before clipping per step with the explosion threshold",
        png(fig),
        caption,
    )


def _learning_rates(rows: list[dict[str, Any]], group: int) -> np.ndarray:
    return np.array(
        [
            number(r["learning_rates"][group])
            if isinstance(r.get("learning_rates"), list) and len(r["learning_rates"]) > group
            else math.nan
            for r in rows
        ]
    )


def _same_on_every_rank(ranks: dict[int, list[dict[str, Any]]], key: str) -> bool:
    """Whether every rank recorded the same ``key`` at each step that two ranks share."""
    seen: dict[Any, Any] = {}
    for group in ranks.values():
        for row in group:
            value = row.get(key)
            if seen.setdefault(row.get("step"), value) != value:
                return False
    return True


def learning_rate_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    width = max((len(r["learning_rates"]) for r in rows if isinstance(r.get("learning_rates"), list)), default=0)
    if not width:
        return None
    ranks = by_rank(rows)
    if _same_on_every_rank(ranks, "learning_rates"):  # the usual case: one line per param group, every step once
        ranks = {min(ranks): list({r.get("step"): r for group in ranks.values() for r in group}.values())}
    fig, (ax,) = new_figure((WIDE[0], 2.3))
    drawn = False
    for rank, group_rows in sorted(ranks.items()):
        group_rows = sorted(group_rows, key=lambda r: number(r.get("step")))
        x, _ = steps_axis(group_rows)
        for group in range(min(width, 8)):
            values = _learning_rates(group_rows, group)
            if has_data(values):
                label = f"param group {group}" + (f", rank {rank}" if len(ranks) > 1 else "")
                ax.plot(x, values, lw=1.3, drawstyle="steps-post", label=label)
                drawn = True
    if not drawn:
        return None
    log_if_wide(ax, *[np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()])
    span_steps(ax, series(rows, "step"))
    ax.set(title="Learning rate per step", xlabel="step", ylabel="learning rate")
    legend(ax)
    return Plot(
        "plot-lr",
        "Learning rate",
        "Learning rate per optimizer parameter group per step",
        png(fig),
        "The learning rate of each optimizer parameter group, as read at each step.",
    )


def _bin_columns(values: np.ndarray, bad: np.ndarray, x: np.ndarray, limit: int):
    """At most ``limit`` columns: each bin keeps the largest finite value and any NaN/Inf flag."""
    columns = values.shape[1]
    if columns <= limit:
        return values, bad, x
    edges = np.linspace(0, columns, limit + 1).astype(int)
    out = np.full((values.shape[0], limit), np.nan)
    out_bad = np.zeros((values.shape[0], limit), dtype=bool)
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        chunk = values[:, lo:hi]
        seen = np.isfinite(chunk).any(axis=1)
        out[seen, i] = np.nanmax(np.where(np.isfinite(chunk), chunk, -np.inf)[seen], axis=1)
        out_bad[:, i] = bad[:, lo:hi].any(axis=1)
    return out, out_bad, x[edges[:-1]]


def module_grad_heatmap(summary: dict[str, Any]) -> Plot | None:
    rows = [r for r in summary.get("steps") or [] if isinstance(r.get("top_module_grad_norms"), dict)]
    if not rows:
        return None
    ranks = by_rank(rows)
    rows = ranks[min(ranks)]  # a column per step: the first rank's (DDP's ranks share their gradients)
    best: dict[str, float] = {}
    for row in rows:
        for name, value in row["top_module_grad_norms"].items():
            v = number(value)
            best[name] = max(best.get(name, -math.inf), v if math.isfinite(v) else math.inf)
    if not best:
        return None
    modules = sorted(best, key=lambda n: -best[n])[:HEATMAP_MAX_MODULES]
    x, _ = steps_axis(rows)
    values = np.full((len(modules), len(rows)), np.nan)
    bad = np.zeros_like(values, dtype=bool)
    for j, row in enumerate(rows):
        norms = row["top_module_grad_norms"]
        for i, name in enumerate(modules):
            if name in norms:
                v = number(norms[name])
                if math.isfinite(v):
                    values[i, j] = v
                else:
                    bad[i, j] = True
    values, bad, x = _bin_columns(values, bad, x, HEATMAP_MAX_COLUMNS)
    positive = values[np.isfinite(values) & (values > 0)]
    height = min(8.0, 1.4 + 0.24 * len(modules))
    fig, (ax,) = new_figure((WIDE[0], height))
    ax.grid(False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    shown = np.where(values > 0, values, np.nan)
    norm = (
        LogNorm(vmin=positive.min(), vmax=positive.max())
        if positive.size and positive.max() > positive.min()
        else None
    )
    image = ax.imshow(
        np.ma.masked_invalid(shown),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=norm,
        extent=(-0.5, values.shape[1] - 0.5, len(modules) - 0.5, -0.5),
    )
    bar = fig.colorbar(image, ax=ax, label="gradient norm" + (" (log scale)" if norm else ""), pad=0.01)
    plain = FuncFormatter(lambda value, _: f"{value:.3g}")
    bar.ax.yaxis.set_major_formatter(plain)
    bar.ax.yaxis.set_minor_formatter(
        plain if positive.size and positive.max() / positive.min() < 10 else FuncFormatter(lambda value, _: "")
    )
    if bad.any():
        ii, jj = np.nonzero(bad)
        ax.scatter(jj, ii, marker="x", s=22, color=NONFINITE_COLOR, linewidths=1.2)
    ax.set_yticks(range(len(modules)), [short_name(m) for m in modules], fontsize=7)
    ticks = np.unique(np.linspace(0, values.shape[1] - 1, min(values.shape[1], 10)).astype(int))
    ax.set_xticks(ticks, [f"{x[t]:g}" for t in ticks])
    ax.set(title="Gradient norm per module over steps", xlabel="step", ylabel="module")
    caption = (
        f"The {len(modules)} modules with the largest gradient norms. Each step records only its largest "
        'modules, so grey cells mean "not among that step\'s largest", not zero; red × = NaN/Inf.'
    )
    if values.shape[1] < len(rows):
        caption += f" {len(rows)} steps are shown in {values.shape[1]} columns (largest value per column)."
    if len(ranks) > 1:
        caption += f" Rank {min(ranks)}'s steps."
    return Plot(
        "plot-module-grads",
        "Gradient norm per module",
        "Heatmap of per-module gradient norms over steps",
        png(fig),
        caption,
    )


def timestep_bucket_plot(summary: dict[str, Any]) -> Plot | None:
    buckets = field(summary, "components", "model", "loss_by_timestep_bucket")
    if not isinstance(buckets, list):
        buckets = next(
            (
                c.get("loss_by_timestep_bucket")
                for c in (summary.get("components") or {}).values()
                if isinstance(c, dict) and isinstance(c.get("loss_by_timestep_bucket"), list)
            ),
            None,
        )
    if not buckets:
        return None
    buckets = [b for b in buckets if isinstance(b, dict)]
    labels, means, counts, nonfinite = [], [], [], []
    for i, b in enumerate(buckets):
        span = b.get("timesteps")
        labels.append(
            f"{number(span[0]):g}–{number(span[1]):g}"
            if isinstance(span, list) and len(span) == 2
            else str(b.get("bucket", i))
        )
        means.append(number(b.get("mean_loss")))
        count, bad = number(b.get("count")), number(b.get("nonfinite"))
        counts.append(int(count) if math.isfinite(count) else 0)
        nonfinite.append(int(bad) if math.isfinite(bad) else 0)
    if not any(math.isfinite(m) for m in means) and not any(nonfinite):
        return None
    fig, (ax,) = new_figure()
    position = np.arange(len(buckets))
    bars = ax.bar(position, [m if math.isfinite(m) else 0 for m in means], color="#4c72b0")
    text = [f"n={c}" + (f"\n+{k} NaN/Inf" if k else "") for c, k in zip(counts, nonfinite)]
    ax.bar_label(bars, labels=text, fontsize=7, padding=2)
    for p, k in zip(position, nonfinite):
        if k:
            bars[p].set_edgecolor(NONFINITE_COLOR)
            bars[p].set_linewidth(1.5)
    ax.set_xticks(position, labels, fontsize=7, rotation=30 if len(buckets) > 10 else 0)
    ax.margins(y=0.2)
    ax.set(title="Mean loss per timestep bucket", xlabel="timestep range", ylabel="mean loss (finite samples)")
    caption = (
        "Mean per-sample loss by the diffusion timestep it was trained at; n = finite samples in the bucket, "
        "red edges mark buckets that also saw NaN/Inf losses. Expect higher loss at small timesteps for "
        "epsilon prediction; a single bucket far above the rest points at a noise-schedule problem."
    )
    return Plot(
        "plot-timestep-buckets",
        "Loss per timestep bucket",
        "Bar chart of mean loss per timestep bucket with counts",
        png(fig),
        caption,
    )
