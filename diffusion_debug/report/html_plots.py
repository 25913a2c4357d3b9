"""The plots section of report.html: the latent preview strip and the run's pictures (inference),
then the matplotlib figures of :mod:`.plots`, each embedded as a ``data:image/png`` URI; a plot
that failed to draw is one line of text instead."""

from __future__ import annotations

import base64
from pathlib import Path

from ..record import RunData
from .html_cells import escape
from .media import media_html
from .plots import Plot, build_plots


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure_html(plot: Plot) -> str:
    caption = f"<figcaption>{escape(plot.caption)}</figcaption>" if plot.caption else ""
    return (
        f"<figure id='{escape(plot.id)}'><img src='{_data_uri(plot.png)}' alt='{escape(plot.alt)}' "
        f"title='{escape(plot.title)}'>{caption}</figure>"
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
                    f"alt='Latent preview strip, one tile per denoising step'><figcaption>{escape(caption)}"
                    "</figcaption></figure>"
                )
    return ""


def plots_section(run: RunData) -> str:
    """The plots section: preview strip and pictures (inference), then the figures."""
    plots, failures = build_plots(run.summary)
    parts = ["<section id='plots'><h2>Plots</h2>"]
    if run.summary.get("kind") != "training":
        parts.append(_preview_strip(run))
        parts.append(media_html(run))
    parts.extend(_figure_html(p) for p in plots)
    if not plots and not failures:
        parts.append("<p class='note'>This run recorded no per-step data to plot.</p>")
    for failure in failures:
        parts.append(f"<p class='note'>A plot could not be drawn from this run's data: {escape(failure)}</p>")
    parts.append("</section>")
    return "".join(parts)
