"""What a comparison of two pipeline setups found: the first divergence (where the drift was made,
or that it was received), the per-step latent divergence, the modules ranked by the error each
made, and the tolerance used; its one-line summary and its run directory.

>>> c = Comparison(None, (StepDivergence(0, 999.0, 0.0),), (), 1e-05, ("float32", "float32"))
>>> print(c)
equal within rtol 1e-05 (float32 against float32): 1 step compared
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from ...record.jsonio import dumps, write_atomic


class Divergence(NamedTuple):
    """Where the two setups first drift apart beyond the tolerance."""

    component: str
    """Pipeline attribute name (``unet``, ``text_encoder``...), ``scheduler`` (the latents a
    scheduler made: ``step``, ``init_noise_sigma``, ``scale_model_input``) or ``input`` (a call
    argument that differs between the setups)."""
    module: str
    """Qualified module inside the component (``""``: the component as a whole; for ``input``, the
    differing argument names)."""
    step: int | None
    """Denoising step from 0 (None for a call outside the loop: the text encoder, the VAE decode)."""
    timestep: float | None
    relative_error: float
    made_here: bool
    """True: the error appears with equal inputs (made there). False: it was received from upstream."""
    seen_in: str = ""
    """The component call where it was first seen, when that is not where it was made."""
    cause: str = ""
    """What in the component made it, when that is no module: a diffusers caching hook that only one
    setup has; or why the replay could not tell (``replay failed: ...``)."""


class StepDivergence(NamedTuple):
    """The relative error of one step's latents (after ``scheduler.step``)."""

    step: int
    timestep: float | None
    relative_error: float


class ModuleDivergence(NamedTuple):
    """One module of the replayed component call: its output error given equal component inputs,
    and whether it made it (its own inputs agreed within the tolerance) or received it."""

    component: str
    module: str
    relative_error: float
    input_error: float
    made_here: bool


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`~diffusion_debug.compare_pipelines`."""

    first_divergence: Divergence | None
    steps: tuple[StepDivergence, ...]
    modules: tuple[ModuleDivergence, ...]
    """The modules of the first diverging component call (replayed on equal inputs) whose output
    drifts: those that made it first, then by the error each added to what it received (at most 20)."""
    tolerance: float
    dtypes: tuple[str, str]
    modules_from: str = "the replayed call, on equal inputs"
    """Where :attr:`modules` were read (``diffusion-debug diff``: the first diverging call as recorded)."""

    def summary(self) -> str:
        """One line: the first divergence, or ``equal within ...``."""
        within = f"rtol {self.tolerance:g} ({self.dtypes[0]} against {self.dtypes[1]})"
        d = self.first_divergence
        if d is None:
            n = len(self.steps)
            return f"equal within {within}: {n} step{'' if n == 1 else 's'} compared"
        where = d.component + (f" {d.module}" if d.module else "")
        when = f"step {d.step}" if d.step is not None else "outside the denoising loop"
        how = "made there" if d.made_here else "received"
        seen = f", first seen in {d.seen_in}" if d.seen_in else ""
        cause = f" ({d.cause})" if d.cause else ""
        return (
            f"first divergence: {where}, {when}, relative error {d.relative_error:.3g} > {within}, {how}{cause}{seen}"
        )

    def __str__(self) -> str:
        return self.summary()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``comparison.json`` and ``report.html`` into ``directory`` (made if missing); returns it."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "summary": self.summary(),
            "first_divergence": self.first_divergence._asdict() if self.first_divergence else None,
            **{k: v for k, v in asdict(self).items() if k != "first_divergence"},
        }
        write_atomic(out / "comparison.json", dumps(record, indent=2) + "\n")
        write_atomic(out / "report.html", _html(self))
        return out


def _rows(cells: list[list[object]]) -> str:
    return "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in cells)


def _curve(c: Comparison, width: int = 480, height: int = 140) -> str:
    """The per-step latent divergence as an SVG line on a log scale, the tolerance dashed."""
    if not c.steps:
        return ""

    def log(value: float) -> float:
        return math.log10(value) if 0 < value < math.inf else (0.0 if value == math.inf else -12.0)

    values = [log(s.relative_error) for s in c.steps] + [log(c.tolerance)]
    low, high = min(values) - 0.5, max(values) + 0.5
    x = [20 + i * (width - 40) / max(1, len(c.steps) - 1) for i in range(len(c.steps))]

    def y(value: float) -> float:
        return height - 10 - (value - low) / (high - low) * (height - 20)

    points = " ".join(f"{xi:.1f},{y(v):.1f}" for xi, v in zip(x, values))
    tol = y(log(c.tolerance))
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="per-step latent divergence">'
        f'<line x1="0" x2="{width}" y1="{tol:.1f}" y2="{tol:.1f}" stroke="gray" stroke-dasharray="4"/>'
        f'<polyline points="{points}" fill="none" stroke="crimson" stroke-width="2"/></svg>'
    )


def _html(c: Comparison) -> str:
    steps = _rows([[s.step, s.timestep, f"{s.relative_error:.3g}"] for s in c.steps])
    tables = ""
    for title, made in (
        ("made there (their inputs agreed)", True),
        ("received (their inputs already differed)", False),
    ):
        rows = _rows(
            [[m.module, f"{m.relative_error:.3g}", f"{m.input_error:.3g}"] for m in c.modules if m.made_here is made]
        )
        tables += (
            f"<h3>{title}</h3><table><tr><th>module</th><th>output error</th><th>input error</th></tr>{rows}</table>"
        )
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>diffusion-debug comparison</title></head><body>'
        f"<h1>Where did my image change?</h1><p>{html.escape(c.summary())}</p>"
        f"<h2>Per-step latent divergence</h2>{_curve(c)}"
        "<p>relative error per step, log scale; dashed: the tolerance</p>"
        "<table><tr><th>step</th><th>timestep</th><th>relative error</th></tr>"
        f"{steps}</table>"
        f"<h2>Modules of {html.escape(c.modules_from)}</h2>{tables}</body></html>\n"
    )
