"""What every plot of the report shares: the :class:`Plot` value, reading numbers out of a saved
summary (strict JSON keeps NaN/Inf as text), and the drawing helpers (a figure on the Agg
canvas, its PNG bytes, NaN/Inf marks, anomaly lines, one colour per anomaly kind).

Figures are made with ``matplotlib.figure.Figure`` and the Agg canvas, not pyplot, so nothing is
kept in pyplot's global figure registry and no display is needed.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from ..record import kind_info
from .columns import field

DPI = 100
WIDE = (9.6, 3.0)
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
    """The value at ``path`` in each row, as floats (NaN where missing)."""
    return np.array([number(field(r, *path)) for r in rows], dtype=float)


def has_data(values: np.ndarray) -> bool:
    """Whether a series holds at least one finite value to draw."""
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


def nan_steps(rows: Sequence[dict[str, Any]]) -> np.ndarray:
    """Steps whose latents or denoiser output hold NaN/Inf: marked in every per-step plot."""
    return np.array([_nonfinite_count(r, "latents", "model_output") > 0 for r in rows], dtype=bool)


def mark_points(ax: Any, x: np.ndarray, values: np.ndarray, bad: np.ndarray) -> None:
    """Red crosses on the points of NaN/Inf steps: their value is over the finite elements only,
    so without the mark such a point looks like an ordinary one."""
    shown = bad & np.isfinite(values)
    if shown.any():
        ax.scatter(x[shown], values[shown], marker="X", s=42, color=NONFINITE_COLOR, zorder=6)


def steps_axis(rows: Sequence[dict[str, Any]]) -> tuple[np.ndarray, str]:
    """x values: the recorded step numbers, or the row index where steps repeat (several
    pipeline calls in one run) or are missing."""
    steps = series(rows, "step")
    if has_data(steps) and np.isfinite(steps).all() and len(np.unique(steps)) == len(steps):
        return steps, "step"
    return np.arange(len(rows), dtype=float), "recorded step (all pipeline calls in order)"


# -- drawing ------------------------------------------------------------------------------


def new_figure(size: tuple[float, float] = WIDE, ncols: int = 1) -> tuple[Figure, list[Any]]:
    """A figure on the Agg canvas with ``ncols`` gridded axes side by side."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, ncols, squeeze=False)[0])
    for ax in axes:
        ax.grid(True, alpha=0.3)
        # the title's height set where matplotlib's automatic place puts it when no tick labels
        # are above the axes (none here): set, each draw skips measuring the axes to place it
        ax.set_title("", y=1.0)
    return fig, axes


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes (the figure is not cleared: ``Figure.clear`` rebuilds every axes
    before dropping it, a tenth of a plot's time for a figure the caller drops anyway).

    The layout engine runs once here and is then taken off, so that ``savefig`` draws the figure
    once: with an engine set it first draws the whole figure without rendering, only to run the
    layout, then draws it again (the same pixels, a fifth of a report's plotting time less)."""
    engine = fig.get_layout_engine()
    if engine is not None:
        engine.execute(fig)
        fig._layout_engine = None  # not set_layout_engine(None): that reads the rcParams of the process
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def span_steps(ax: Any, x: np.ndarray) -> None:
    """Show every recorded step, also those whose values are NaN (they draw no line)."""
    finite = x[np.isfinite(x)]
    if finite.size:
        pad = max(0.5, 0.01 * float(finite.max() - finite.min()))
        ax.set_xlim(float(finite.min()) - pad, float(finite.max()) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "step 2.5"


def log_if_wide(ax: Any, *arrays: np.ndarray) -> None:
    """Log scale where positive values span more than three decades (a spike would flatten
    the rest of the curve)."""
    values = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    if values.size and (values > 0).all() and values.max() / values.min() > 1e3:
        ax.set_yscale("log")


def mark_nonfinite(ax: Any, x: np.ndarray, bad: np.ndarray, label: str = "NaN/Inf") -> None:
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


def shade_steps(ax: Any, x: np.ndarray, bad: np.ndarray, label: str) -> None:
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


def mark_anomalies(ax: Any, anomalies: Iterable[dict[str, Any]], steps: np.ndarray) -> None:
    """A vertical line at each anomaly's step, one colour per kind."""
    by_kind: dict[str, set[float]] = {}
    known = {float(step) for step in steps[np.isfinite(steps)]}
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


def legend(ax: Any) -> None:
    """A small legend, only where something is labelled."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)


def by_rank(rows: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Rows grouped by their ``rank`` (0 where missing)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        rank = number(row.get("rank"))
        groups.setdefault(int(rank) if math.isfinite(rank) else 0, []).append(row)
    return groups


def short_name(name: str, width: int = 42) -> str:
    """A module name cut from the left to ``width`` characters (its end tells most)."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]
