"""The module x step map of a training run: log10 gradient norm of every module (or, for a large
model, of every block) over the run, from the bounded map the training debugger saves
(``components.<name>.module_grad_map``), so one dead block shows as one dark row.

Limits: the map's columns are the saved ones (at most 64: each column is the mean log10 norm of the
steps it spans); with more than :data:`MAP_MAX_ROWS` modules each row is a block (the first two
parts of the name, e.g. ``down_blocks.0``; the first part alone when that is still too many) and
shows the median of its modules; the colour scale spans at most :data:`MAP_DECADES` orders of
magnitude below the largest value (a zero norm is drawn at that floor).
"""

from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np

from .plots_common import NONFINITE_COLOR, WIDE, Plot, new_figure, number, png, short_name

MAP_MAX_ROWS = 40
MAP_DECADES = 20


def _saved_map(summary: dict[str, Any]) -> dict[str, Any] | None:
    for component in (summary.get("components") or {}).values():
        found = component.get("module_grad_map") if isinstance(component, dict) else None
        if isinstance(found, dict) and found.get("modules") and found.get("steps"):
            return found
    return None


def block_rows(modules: list[str], values: np.ndarray, limit: int = MAP_MAX_ROWS) -> tuple[list[str], np.ndarray]:
    """One row per module when they fit in ``limit``; else one per block (the median of its modules,
    blocks in the order their first module comes)."""
    if len(modules) <= limit:
        return list(modules), values
    for depth in (2, 1):
        blocks: dict[str, list[int]] = {}
        for i, name in enumerate(modules):
            blocks.setdefault(".".join(name.split(".")[:depth]), []).append(i)
        if len(blocks) <= limit or depth == 1:
            break
    rows = np.full((len(blocks), values.shape[1]), np.nan)
    for r, members in enumerate(blocks.values()):
        chunk = values[members]
        seen = np.isfinite(chunk).any(axis=0)
        rows[r, seen] = np.nanmedian(chunk[:, seen], axis=0)
    return list(blocks), rows


def module_map_plot(summary: dict[str, Any]) -> Plot | None:
    saved = _saved_map(summary)
    if saved is None:
        return None
    modules = [str(m) for m in saved["modules"]]
    values = np.array([[number(v) for v in row] for row in saved.get("log10") or []], dtype=float)
    if values.shape != (len(modules), len(saved["steps"])) or not np.isfinite(values).any():
        return None
    bad = np.zeros(values.shape, dtype=bool)
    for pair in saved.get("nonfinite") or []:
        if isinstance(pair, list) and len(pair) == 2 and 0 <= pair[0] < len(modules) and 0 <= pair[1] < bad.shape[1]:
            bad[pair[0], pair[1]] = True
    names, rows = block_rows(modules, values)
    if len(names) < len(modules):
        _, bad_rows = block_rows(modules, bad.astype(float))
        bad = np.nan_to_num(bad_rows) > 0
    top = float(np.nanmax(rows))
    floor = max(float(np.nanmin(rows)), top - MAP_DECADES)
    fig, (ax,) = new_figure((WIDE[0], min(9.0, 1.4 + 0.2 * len(names))))
    ax.grid(False)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    image = ax.imshow(
        np.ma.masked_invalid(np.clip(rows, floor, None)),
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=floor,
        vmax=top if top > floor else floor + 1,
    )
    fig.colorbar(image, ax=ax, label="log10 gradient norm", pad=0.01)
    if bad.any():
        ii, jj = np.nonzero(bad)
        ax.scatter(jj, ii, marker="x", s=22, color=NONFINITE_COLOR, linewidths=1.2)
    dead = _dead_blocks(summary)
    ax.set_yticks(range(len(names)), [short_name(n) for n in names], fontsize=6 if len(names) > 24 else 7)
    for label, name in zip(ax.get_yticklabels(), names):
        if any(name == d or name.startswith(d + ".") or d.startswith(name + ".") for d in dead):
            label.set_color(NONFINITE_COLOR)
    spans = saved["steps"]
    ticks = np.unique(np.linspace(0, len(spans) - 1, min(len(spans), 10)).astype(int))
    ax.set_xticks(ticks, [f"{number(spans[t][0]):g}" for t in ticks])
    ax.set(title="Gradient norm of every module over steps (log10)", xlabel="step", ylabel="module")
    what = "module" if len(names) == len(modules) else f"block (median of its modules; {len(modules)} modules)"
    caption = (
        f"One row per {what}, one column per step or span of steps (mean log10 norm); a dark row is a part "
        "whose gradients fell far below the rest. Names in red: modules reported as dead (gradient_vanishing); "
        "red × = NaN/Inf; grey = not measured."
    )
    return Plot(
        "plot-module-map",
        "Gradient norm of every module",
        "Heatmap of log10 gradient norm per module and step",
        png(fig),
        caption,
    )


def _dead_blocks(summary: dict[str, Any]) -> set[str]:
    """The modules the run's per-module ``gradient_vanishing`` anomalies name."""
    return {
        str(a.get("module"))
        for a in summary.get("anomalies") or []
        if isinstance(a, dict)
        and a.get("kind") == "gradient_vanishing"
        and isinstance(a.get("details"), dict)
        and a["details"].get("reason") == "module"
    }
