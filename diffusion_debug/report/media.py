"""The pictures of a run directory, embedded in report.html as data URIs: the latent preview
strip, the final image(s), the VAE-decoded previews and the step animations.

Only files inside the run directory are read (a copied run directory shows its own pictures, a
link out of it shows nothing), and only PNG / GIF files by their signature.

Limits: at most :data:`MAX_IMAGES` final images are embedded; a large image makes a large page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..record import RunData
from ..record.messages import counted
from .html_env import data_uri

__all__ = ["MAX_IMAGES", "Figure", "final_images", "media", "preview_strip", "read_inside"]

MAX_IMAGES = 8
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "image/png", b"GIF87a": "image/gif", b"GIF89a": "image/gif"}


@dataclass(frozen=True)
class Figure:
    """One picture of the page (``templates/macros.html``'s ``figure``)."""

    id: str
    src: str
    alt: str
    caption: str = ""
    css_class: str = ""
    width: int | None = None
    title: str = ""


def read_inside(run_dir: Path, relative: str) -> tuple[bytes, str] | None:
    """``(bytes, mime type)`` of a PNG/GIF at ``relative`` inside ``run_dir``, else None."""
    if Path(relative).is_absolute():
        return None
    path = run_dir / relative
    try:
        if not path.is_file() or not path.resolve().is_relative_to(run_dir.resolve()):
            return None
        data = path.read_bytes()
    except OSError:
        return None
    for signature, mime in _SIGNATURES.items():
        if data.startswith(signature):
            return data, mime
    return None


def final_images(run_dir: Path) -> list[str]:
    """The final images a run directory holds: ``image.png``, then ``images/*.png`` by name."""
    names = ["image.png"] if (run_dir / "image.png").is_file() else []
    if (run_dir / "images").is_dir():
        names += sorted(f"images/{p.name}" for p in (run_dir / "images").glob("*.png"))
    return names[:MAX_IMAGES]


def first_nonfinite_latents(steps: list[Any]) -> Any:
    """The first recorded step whose latents held NaN/Inf (the record's counts), None if none did:
    the caption says it from the record, not from how a tile looks."""
    for row in steps:
        latents = row.get("latents") if isinstance(row, dict) else None
        if isinstance(latents, dict) and any(
            isinstance(latents.get(k), (int, float)) and latents.get(k) > 0 for k in ("nan", "posinf", "neginf")
        ):
            return row.get("step")
    return None


def preview_strip(run: RunData) -> Figure | None:
    """The latent preview strip saved by the debugger, embedded as it is (PNG files only)."""
    previews = [p for p in run.summary.get("previews") or [] if isinstance(p, str)]
    for relative in [p for p in previews if p.endswith("strip.png")] or ["previews/strip.png"]:
        found = read_inside(run.run_dir, relative)
        if found and found[1] == "image/png":
            steps = len(run.steps)
            broken = first_nonfinite_latents(run.steps)
            caption = (
                "A cheap RGB preview of the latents, one tile per recorded denoising step, left to right"
                + (f" ({counted(steps, 'step')})" if steps else "")
                + ". Decoded from the latents by a linear map, not the VAE: colours are rough and a dark tile "
                "is no fault; NaN/Inf values are drawn as 0 (flat tiles). "
                + (
                    f"The latents held NaN/Inf from step {broken} on."
                    if broken is not None
                    else "The latents stayed finite at every recorded step."
                )
            )
            return Figure(
                "preview-strip",
                data_uri(found[0]),
                "Latent preview strip, one tile per denoising step",
                caption,
                "strip",
                width=min(2 * int.from_bytes(found[0][16:20], "big"), 1000),  # twice the saved size, within the page
            )
    return None


def media(run: RunData) -> dict[str, Any]:
    """The final images, the VAE preview strip and the GIFs (each empty when there are none)."""
    run_dir = run.run_dir
    images = [(name, read_inside(run_dir, name)) for name in final_images(run_dir)]
    final = [
        Figure(f"final-image-{i}", data_uri(*found), f"Final image {name}", name, "final")
        for i, (name, found) in enumerate((name, found) for name, found in images if found)
    ]
    vae = read_inside(run_dir, "previews/vae_strip.png")
    vae_strip = None
    if vae:
        vae_strip = Figure(
            "vae-preview-strip",
            data_uri(*vae),
            "VAE-decoded preview strip",
            "The latents of some steps decoded by the pipeline's own VAE, left to right: what the image "
            "looked like at that step.",
            "strip",
        )
    gifs = [(name, read_inside(run_dir, f"previews/{name}")) for name in ("steps.gif", "vae_steps.gif")]
    animations = [
        Figure(
            name.replace(".", "-"),
            data_uri(*found),
            f"Animation {name}",
            "VAE-decoded steps, animated" if name.startswith("vae") else "Latent preview per step, animated",
            "final",
        )
        for name, found in gifs
        if found
    ]
    return {"final": final, "vae_strip": vae_strip, "animations": animations}
