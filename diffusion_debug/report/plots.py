"""The report's plots, drawn with matplotlib from a saved run's summary alone.

Each builder takes the summary dict and returns a :class:`Plot` (PNG bytes and the words around
it) or ``None`` when the run holds no data for it: a plot whose data is missing is left out,
never an error. Figures are made with ``matplotlib.figure.Figure`` and the Agg canvas, not
pyplot, so nothing is kept in pyplot's global figure registry and no display is needed.

Limits: steps are plotted as recorded (the record keeps a bounded ring buffer, so a long run
shows its last ``history_size`` steps); the module heatmap shows only the modules each step
recorded (the largest per step), binned when there are more steps than pixel columns.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import matplotlib

matplotlib.use("Agg", force=False)  # headless; a caller's own backend choice is kept

import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from ..record import kind_info  # noqa: E402
from .columns import field  # noqa: E402

DPI = 100
WIDE = (9.6, 3.0)
HEATMAP_MAX_COLUMNS = 400
HEATMAP_MAX_MODULES = 20
NONFINITE_COLOR = "#c62828"


@dataclass(frozen=True)
class Plot:
    """One figure of the report: ``id`` is the HTML id, ``alt`` the image's alternative text."""

    id: str
    title: str
    alt: str
    png: bytes
    caption: str = ""


# -- reading the summary ------------------------------------------------------------------


def number(value: Any) -> float:
    """A float for a stored value: strict JSON keeps NaN/Inf as ``"nan"``/``"inf"``/``"-inf"``;
    anything missing or not a number is NaN.

    >>> number("inf"), number("-inf"), number(None), number(2)
    (inf, -inf, nan, 2.0)
    """
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # float() reads "nan", "inf", "-inf" and numbers written as text
        except ValueError:
            return math.nan
    return math.nan


def series(rows: Sequence[dict[str, Any]], *path: str) -> np.ndarray:
    return np.array([number(field(r, *path)) for r in rows], dtype=float)


def _has_data(values: np.ndarray) -> bool:
    return bool(values.size) and bool(np.isfinite(values).any())


def kind_color(kind: str) -> str:
    """One colour per anomaly kind, the same in every plot and in the HTML (from the registry)."""
    return kind_info(kind).colour


def _nonfinite_count(row: dict[str, Any], *names: str) -> int:
    total = 0
    for name in names:
        for key in ("nan", "posinf", "neginf"):
            value = number(field(row, name, key))
            total += int(value) if math.isfinite(value) else 0
    return total


def _nan_steps(rows: Sequence[dict[str, Any]]) -> np.ndarray:
    """Steps whose latents or denoiser output hold NaN/Inf: marked in every per-step plot."""
    return np.array([_nonfinite_count(r, "latents", "model_output") > 0 for r in rows], dtype=bool)


def _mark_points(ax: Any, x: np.ndarray, values: np.ndarray, bad: np.ndarray) -> None:
    """Red crosses on the points of NaN/Inf steps: their value is over the finite elements only,
    so without the mark such a point looks like an ordinary one."""
    shown = bad & np.isfinite(values)
    if shown.any():
        ax.scatter(x[shown], values[shown], marker="X", s=42, color=NONFINITE_COLOR, zorder=6)


def _steps_axis(rows: Sequence[dict[str, Any]]) -> tuple[np.ndarray, str]:
    """x values: the recorded step numbers, or the row index where steps repeat (several
    pipeline calls in one run) or are missing."""
    steps = series(rows, "step")
    if _has_data(steps) and np.isfinite(steps).all() and len(set(steps.tolist())) == len(steps):
        return steps, "step"
    return np.arange(len(rows), dtype=float), "recorded step (all pipeline calls in order)"


# -- drawing ------------------------------------------------------------------------------


def _figure(size: tuple[float, float] = WIDE, ncols: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0].tolist()
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    fig.clear()
    return buffer.getvalue()


def _span_steps(ax: Any, x: np.ndarray) -> None:
    """Show every recorded step, also those whose values are NaN (they draw no line)."""
    finite = x[np.isfinite(x)]
    if finite.size:
        pad = max(0.5, 0.01 * float(finite.max() - finite.min()))
        ax.set_xlim(float(finite.min()) - pad, float(finite.max()) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "step 2.5"


def _log_if_wide(ax: Any, *arrays: np.ndarray) -> None:
    """Log scale where positive values span more than three decades (a spike would flatten
    the rest of the curve)."""
    values = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    if values.size and (values > 0).all() and values.max() / values.min() > 1e3:
        ax.set_yscale("log")


def _mark_nonfinite(ax: Any, x: np.ndarray, bad: np.ndarray, label: str = "NaN/Inf") -> None:
    """Red triangles along the top edge where a value is NaN/Inf (those points have no height)."""
    if bad.any():
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(
            x[bad],
            np.full(int(bad.sum()), 0.96),
            transform=top,
            marker="v",
            s=36,
            color=NONFINITE_COLOR,
            label=label,
            zorder=5,
            clip_on=False,
        )


def _shade_steps(ax: Any, x: np.ndarray, bad: np.ndarray, label: str) -> None:
    """A red band over each step that holds non-finite values."""
    width = float(np.median(np.diff(x))) if len(x) > 1 else 1.0
    first = True
    for value in x[bad]:
        ax.axvspan(
            value - width / 2,
            value + width / 2,
            color=NONFINITE_COLOR,
            alpha=0.15,
            lw=0,
            label=label if first else None,
        )
        first = False


def _mark_anomalies(ax: Any, anomalies: Iterable[dict[str, Any]], steps: np.ndarray) -> None:
    """A vertical line at each anomaly's step, one colour per kind."""
    by_kind: dict[str, set[float]] = {}
    known = set(steps[np.isfinite(steps)].tolist())
    for a in anomalies:
        step = number(a.get("step"))
        if math.isfinite(step) and (not known or step in known or min(known) <= step <= max(known)):
            by_kind.setdefault(str(a.get("kind", "")), set()).add(step)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for kind, kind_steps in sorted(by_kind.items()):
        ax.vlines(
            sorted(kind_steps),
            0,
            1,
            transform=top,
            colors=kind_color(kind),
            alpha=0.55,
            lw=1.2,
            linestyles="--",
            label=f"anomaly: {kind}",
            zorder=1,
        )


def _legend(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)


def _by_rank(rows: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        rank = number(row.get("rank"))
        groups.setdefault(int(rank) if math.isfinite(rank) else 0, []).append(row)
    return groups


def _short_name(name: str, width: int = 42) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


# -- inference ----------------------------------------------------------------------------


def latent_stats_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    x, xlabel = _steps_axis(rows)
    lines = {name: series(rows, "latents", name) for name in ("std", "absmax", "mean")}
    if not any(_has_data(v) for v in lines.values()):
        return None
    bad = _nan_steps(rows)
    fig, (ax,) = _figure()
    for (name, values), label in zip(lines.items(), ("std", "|max|", "mean")):
        if _has_data(values):
            ax.plot(x, values, marker="o", ms=3, lw=1.4, label=label)
            _mark_points(ax, x, values, bad)
    _shade_steps(ax, x, bad, "step with NaN/Inf")
    _span_steps(ax, x)
    ax.set(title="Latent statistics per denoising step", xlabel=xlabel, ylabel="value")
    _legend(ax)
    caption = (
        "Latents after each scheduler step. Std starts at the scheduler's initial noise level and should change "
        "smoothly; a sudden jump or steady blow-up means the sampling diverges; "
    )
    caption += (
        f"{int(bad.sum())} step(s) hold NaN/Inf (red bands; red crosses: values over the finite elements only)."
        if bad.any()
        else "no step holds NaN/Inf."
    )
    return Plot(
        "plot-latents", "Latent statistics", "Latent std, absolute max and mean per denoising step", _png(fig), caption
    )


def denoiser_output_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    x, xlabel = _steps_axis(rows)
    norms = {
        label: series(rows, key, "l2")
        for key, label in (("model_output", "denoiser output"), ("cond", "conditional"), ("uncond", "unconditional"))
    }
    gap = series(rows, "guidance_gap")
    has_norms, has_gap = (
        any(_has_data(v) for v in norms.values()),
        _has_data(gap) or (gap.size and np.isinf(gap).any()),
    )
    if not has_norms and not has_gap:
        return None
    bad = _nan_steps(rows)
    fig, axes = _figure(ncols=2 if has_norms and has_gap else 1)
    if has_norms:
        ax = axes[0]
        for label, values in norms.items():
            if _has_data(values):
                ax.plot(x, values, marker="o", ms=3, lw=1.4, label=label)
                _mark_points(ax, x, values, bad)
        _shade_steps(ax, x, bad, "step with NaN/Inf")
        _log_if_wide(ax, *norms.values())
        _span_steps(ax, x)
        ax.set(title="Denoiser output L2 norm per step", xlabel=xlabel, ylabel="L2 norm")
        _legend(ax)
    if has_gap:
        ax = axes[-1]
        ax.plot(x, gap, marker="o", ms=3, lw=1.4, color="#2ca02c", label="‖cond − uncond‖")
        _mark_points(ax, x, gap, bad)
        stored = np.array([r.get("guidance_gap") is not None for r in rows], dtype=bool)
        _shade_steps(ax, x, bad | (~np.isfinite(gap) & stored), "step with NaN/Inf")
        _span_steps(ax, x)
        ax.set(title="Guidance gap per step", xlabel=xlabel, ylabel="L2 norm of cond − uncond")
        _legend(ax)
    caption = (
        "The denoiser's prediction per step (all classifier-free-guidance halves together, then each half) "
        "and the guidance gap, the L2 distance between the conditional and unconditional predictions: "
        "near zero means the prompt has no effect; a jump often comes before NaN. Red bands: steps with NaN/Inf "
        "(red crosses: norms over the finite elements only)."
    )
    return Plot(
        "plot-denoiser",
        "Denoiser output and guidance gap",
        "Denoiser output norm and guidance gap per denoising step",
        _png(fig),
        caption,
    )


def component_plot(summary: dict[str, Any]) -> Plot | None:
    components = {
        name: info
        for name, info in (summary.get("components") or {}).items()
        if isinstance(info, dict) and ("total_time_s" in info or "peak_memory_mb" in info)
    }
    times = {n: number(i.get("total_time_s")) for n, i in components.items()}
    memory = {n: number(i.get("peak_memory_mb")) for n, i in components.items()}
    times = {n: v for n, v in times.items() if math.isfinite(v)}
    memory = {n: v for n, v in memory.items() if math.isfinite(v)}
    if not times and not memory:
        return None
    on_cuda = any(str(components[n].get("device", "")).startswith("cuda") for n in memory)
    memory_title, memory_label, memory_note = (
        ("CUDA peak per component", "CUDA peak allocated during its calls (MB)", "the CUDA peak allocated")
        if on_cuda
        else (
            "Process RSS per component",
            "process RSS during its calls (MB)",
            "the process RSS (on CPU: the whole process, not the component's own memory)",
        )
    )
    panels = [
        (d, t, label)
        for d, t, label in (
            (times, "Time per component", "total time in calls (s)"),
            (memory, memory_title, memory_label),
        )
        if d
    ]
    height = max(2.2, 0.9 + 0.35 * max(len(d) for d, _, _ in panels))
    fig, axes = _figure((WIDE[0], height), ncols=len(panels))
    for ax, (data, title, label) in zip(axes, panels):
        names = list(data)[::-1]
        bars = ax.barh(names, [data[n] for n in names], color="#4c72b0")
        ax.bar_label(bars, labels=[f"{data[n]:.3g}" for n in names], fontsize=7, padding=2)
        ax.set(title=title, xlabel=label)
        ax.margins(x=0.15)
    caption = f"Wall time spent inside each component's forward calls, and {memory_note} while it ran."
    return Plot(
        "plot-components",
        "Time and memory per component",
        "Bar charts of time and peak memory per component",
        _png(fig),
        caption,
    )


# -- training -----------------------------------------------------------------------------


def _plot_rank_series(ax, group: list[dict[str, Any]], key: str, label: str, nonfinite_label: str | None):
    """One rank's ``key`` per step, with its NaN/Inf values marked; returns ``(x, values)``."""
    x, _ = _steps_axis(group)
    values = series(group, key)
    ax.plot(x, values, lw=1.3, marker="o" if len(group) <= 60 else None, ms=3, label=label)
    stored = np.array([r.get(key) is not None for r in group], dtype=bool)
    _mark_nonfinite(ax, x, ~np.isfinite(values) & stored, nonfinite_label)
    return x, values


def loss_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    loss_all = series(rows, "loss")
    if not loss_all.size or not (
        np.isfinite(loss_all).any() or np.isinf(loss_all).any() or any(isinstance(r.get("loss"), str) for r in rows)
    ):
        return None
    fig, (ax,) = _figure()
    groups = _by_rank(rows)
    for rank, group in sorted(groups.items()):
        _plot_rank_series(
            ax,
            group,
            "loss",
            f"loss, rank {rank}" if len(groups) > 1 else "loss",
            "NaN/Inf loss" if rank == min(groups) else None,
        )
    _log_if_wide(ax, loss_all)
    _mark_anomalies(ax, summary.get("anomalies") or [], series(rows, "step"))
    _span_steps(ax, _steps_axis(rows)[0] if len(groups) == 1 else series(rows, "step"))
    ax.set(title="Training loss per step, anomalies marked", xlabel="step", ylabel="loss")
    _legend(ax)
    caption = "Dashed lines mark the steps with anomalies, one colour per kind; red triangles mark NaN/Inf losses."
    return Plot("plot-loss", "Loss", "Training loss per step with anomaly steps marked", _png(fig), caption)


def grad_norm_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    norms = series(rows, "grad_norm")
    if not norms.size or not (np.isfinite(norms).any() or np.isinf(norms).any()):
        return None
    fig, (ax,) = _figure()
    groups = _by_rank(rows)
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
    _span_steps(ax, _steps_axis(rows)[0] if len(groups) == 1 else series(rows, "step"))
    ax.set(
        title="Gradient norm per step (before clipping)",
        xlabel="step",
        ylabel="total gradient L2 norm (before clipping)",
    )
    _legend(ax)
    caption = "The global gradient norm as the optimizer received it, before any clipping; log scale."
    return Plot(
        "plot-grad-norm",
        "Gradient norm",
        "Total gradient norm before clipping per step with the explosion threshold",
        _png(fig),
        caption,
    )


def learning_rate_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    width = max((len(r["learning_rates"]) for r in rows if isinstance(r.get("learning_rates"), list)), default=0)
    if not width:
        return None
    x, _ = _steps_axis(rows)
    fig, (ax,) = _figure((WIDE[0], 2.3))
    drawn = False
    for group in range(min(width, 8)):
        values = np.array(
            [
                number(r["learning_rates"][group])
                if isinstance(r.get("learning_rates"), list) and len(r["learning_rates"]) > group
                else math.nan
                for r in rows
            ]
        )
        if _has_data(values):
            ax.plot(x, values, lw=1.3, drawstyle="steps-post", label=f"param group {group}")
            drawn = True
    if not drawn:
        return None
    _log_if_wide(ax, *[np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()])
    _span_steps(ax, x)
    ax.set(title="Learning rate per step", xlabel="step", ylabel="learning rate")
    _legend(ax)
    return Plot(
        "plot-lr",
        "Learning rate",
        "Learning rate per optimizer parameter group per step",
        _png(fig),
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
    best: dict[str, float] = {}
    for row in rows:
        for name, value in row["top_module_grad_norms"].items():
            v = number(value)
            best[name] = max(best.get(name, -math.inf), v if math.isfinite(v) else math.inf)
    if not best:
        return None
    modules = sorted(best, key=lambda n: -best[n])[:HEATMAP_MAX_MODULES]
    x, _ = _steps_axis(rows)
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
    fig, (ax,) = _figure((WIDE[0], height))
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
    ax.set_yticks(range(len(modules)), [_short_name(m) for m in modules], fontsize=7)
    ticks = np.unique(np.linspace(0, values.shape[1] - 1, min(values.shape[1], 10)).astype(int))
    ax.set_xticks(ticks, [f"{x[t]:g}" for t in ticks])
    ax.set(title="Gradient norm per module over steps", xlabel="step", ylabel="module")
    caption = (
        f"The {len(modules)} modules with the largest gradient norms. Each step records only its largest "
        'modules, so grey cells mean "not among that step\'s largest", not zero; red × = NaN/Inf.'
    )
    if values.shape[1] < len(rows):
        caption += f" {len(rows)} steps are shown in {values.shape[1]} columns (largest value per column)."
    return Plot(
        "plot-module-grads",
        "Gradient norm per module",
        "Heatmap of per-module gradient norms over steps",
        _png(fig),
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
    fig, (ax,) = _figure()
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
        _png(fig),
        caption,
    )


# -- both ---------------------------------------------------------------------------------


def memory_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    keys: list[str] = []
    for row in rows:
        for key in (row.get("memory") or {}) if isinstance(row.get("memory"), dict) else ():
            if key not in keys and key.endswith("_mb") and (key == "rss_mb" or key.startswith("cuda")):
                keys.append(key)
    lines = {k: series(rows, "memory", k) for k in keys}
    lines = {k: v for k, v in lines.items() if _has_data(v)}
    if not lines:
        return None
    x, xlabel = _steps_axis(rows)
    fig, (ax,) = _figure((WIDE[0], 2.5))
    labels = {
        "rss_mb": "process RSS",
        "cuda_allocated_mb": "CUDA allocated",
        "cuda_reserved_mb": "CUDA reserved",
        "cuda_peak_mb": "CUDA peak allocated",
    }
    for key, values in lines.items():
        ax.plot(x, values, lw=1.3, label=labels.get(key, key))
    if summary.get("kind") != "training":
        _shade_steps(ax, x, _nan_steps(rows), "step with NaN/Inf")
    everything = np.concatenate([v[np.isfinite(v)] for v in lines.values()])
    low, high = float(everything.min()), float(everything.max())
    if high - low < 20:  # a flat line must look flat, not like a cliff of a few kilobytes
        middle = (high + low) / 2
        ax.set_ylim(max(0.0, middle - 10), middle + 10)
    _span_steps(ax, x)
    _mark_anomalies(
        ax, [a for a in summary.get("anomalies") or [] if a.get("kind") == "memory_growth"], series(rows, "step")
    )
    ax.set(title="Memory per step", xlabel=xlabel, ylabel="MB")
    _legend(ax)
    return Plot(
        "plot-memory",
        "Memory",
        "Process and CUDA memory per step",
        _png(fig),
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
    fig, (ax,) = _figure((WIDE[0], max(1.8, 0.9 + 0.32 * len(kinds))))
    bars = ax.barh(kinds[::-1], [counts[k] for k in kinds[::-1]], color=[kind_color(k) for k in kinds[::-1]])
    ax.bar_label(bars, fontsize=8, padding=2)
    ax.margins(x=0.1)
    ax.set(title="Anomaly distribution", xlabel="number of anomalies", ylabel="kind")
    return Plot(
        "plot-anomaly-kinds",
        "Anomaly distribution",
        "Bar chart of anomaly counts by kind",
        _png(fig),
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
    timestep_bucket_plot,
    memory_plot,
    anomaly_distribution_plot,
)


def build_plots(summary: dict[str, Any]) -> tuple[list[Plot], list[str]]:
    """The plots for a run's summary, and one line per plot that failed to draw (the report
    shows those lines instead of stopping)."""
    builders = TRAINING_PLOTS if summary.get("kind") == "training" else INFERENCE_PLOTS
    plots, failures = [], []
    for build in builders:
        try:
            plot = build(summary)
        except Exception as error:  # a malformed field costs one plot, never the report
            failures.append(f"{build.__name__}: {type(error).__name__}: {error}")
            continue
        if plot is not None:
            plots.append(plot)
    return plots, failures
