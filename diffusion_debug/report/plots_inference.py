"""The plots of an inference run: latent statistics, the denoiser's output and the guidance gap
per denoising step, and time and memory per pipeline component.

Limits: steps are plotted as recorded (the record keeps a bounded ring buffer, so a long run
shows its last ``history_size`` steps).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .plots_common import (
    WIDE,
    Plot,
    has_data,
    legend,
    log_if_wide,
    mark_points,
    nan_steps,
    new_figure,
    number,
    png,
    series,
    shade_steps,
    span_steps,
    steps_axis,
)


def latent_stats_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    x, xlabel = steps_axis(rows)
    lines = {name: series(rows, "latents", name) for name in ("std", "absmax", "mean")}
    if not any(has_data(v) for v in lines.values()):
        return None
    bad = nan_steps(rows)
    fig, (ax,) = new_figure()
    for (name, values), label in zip(lines.items(), ("std", "|max|", "mean")):
        if has_data(values):
            ax.plot(x, values, marker="o", ms=3, lw=1.4, label=label)
            mark_points(ax, x, values, bad)
    shade_steps(ax, x, bad, "step with NaN/Inf")
    span_steps(ax, x)
    ax.set(title="Latent statistics per denoising step", xlabel=xlabel, ylabel="value")
    legend(ax)
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
        "plot-latents", "Latent statistics", "Latent std, absolute max and mean per denoising step", png(fig), caption
    )


def denoiser_output_plot(summary: dict[str, Any]) -> Plot | None:
    rows = summary.get("steps") or []
    x, xlabel = steps_axis(rows)
    norms = {
        label: series(rows, key, "l2")
        for key, label in (("model_output", "denoiser output"), ("cond", "conditional"), ("uncond", "unconditional"))
    }
    gap = series(rows, "guidance_gap")
    has_norms, has_gap = (
        any(has_data(v) for v in norms.values()),
        has_data(gap) or (gap.size and np.isinf(gap).any()),
    )
    if not has_norms and not has_gap:
        return None
    bad = nan_steps(rows)
    fig, axes = new_figure(ncols=2 if has_norms and has_gap else 1)
    if has_norms:
        ax = axes[0]
        for label, values in norms.items():
            if has_data(values):
                ax.plot(x, values, marker="o", ms=3, lw=1.4, label=label)
                mark_points(ax, x, values, bad)
        shade_steps(ax, x, bad, "step with NaN/Inf")
        log_if_wide(ax, *norms.values())
        span_steps(ax, x)
        ax.set(title="Denoiser output L2 norm per step", xlabel=xlabel, ylabel="L2 norm")
        legend(ax)
    if has_gap:
        ax = axes[-1]
        ax.plot(x, gap, marker="o", ms=3, lw=1.4, color="#2ca02c", label="‖cond − uncond‖")
        mark_points(ax, x, gap, bad)
        stored = np.array([r.get("guidance_gap") is not None for r in rows], dtype=bool)
        shade_steps(ax, x, bad | (~np.isfinite(gap) & stored), "step with NaN/Inf")
        span_steps(ax, x)
        ax.set(title="Guidance gap per step", xlabel=xlabel, ylabel="L2 norm of cond − uncond")
        legend(ax)
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
        png(fig),
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
    fig, axes = new_figure((WIDE[0], height), ncols=len(panels))
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
        png(fig),
        caption,
    )
