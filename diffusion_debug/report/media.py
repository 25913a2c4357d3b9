"""The pictures of a run directory, embedded in report.html as data URIs: the final image(s), the
VAE-decoded previews and the step animations.

Only files inside the run directory are read (a copied run directory shows its own pictures, a
link out of it shows nothing), and only PNG / GIF files by their signature.

Limits: at most :data:`MAX_IMAGES` final images are embedded; a large image makes a large page.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from ..record import RunData

__all__ = ["MAX_IMAGES", "final_images", "media_html", "read_inside"]

MAX_IMAGES = 8
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "image/png", b"GIF87a": "image/gif", b"GIF89a": "image/gif"}


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


def _figure(found: tuple[bytes, str], element_id: str, alt: str, caption: str, css_class: str = "strip") -> str:
    data, mime = found
    uri = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return (
        f"<figure id='{element_id}'><img class='{css_class}' src='{uri}' alt='{html.escape(alt)}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def media_html(run: RunData) -> str:
    """The final images, the VAE preview strip and the GIFs, in that order (empty when none)."""
    run_dir = run.run_dir
    parts = []
    images = [(name, read_inside(run_dir, name)) for name in final_images(run_dir)]
    images = [(name, found) for name, found in images if found]
    if images:
        tiles = "".join(
            _figure(found, f"final-image-{i}", f"Final image {name}", name, "final")
            for i, (name, found) in enumerate(images)
        )
        parts.append(f"<div id='final-images' class='media'><h3>Final image</h3>{tiles}</div>")
    vae_strip = read_inside(run_dir, "previews/vae_strip.png")
    if vae_strip:
        parts.append(
            _figure(
                vae_strip,
                "vae-preview-strip",
                "VAE-decoded preview strip",
                "The latents of some steps decoded by the pipeline's own VAE, left to right: what the image "
                "looked like at that step.",
            )
        )
    gifs = [(name, read_inside(run_dir, f"previews/{name}")) for name in ("steps.gif", "vae_steps.gif")]
    gifs = [(name, found) for name, found in gifs if found]
    if gifs:
        tiles = "".join(
            _figure(
                found,
                name.replace(".", "-"),
                f"Animation {name}",
                "VAE-decoded steps, animated" if name.startswith("vae") else "Latent preview per step, animated",
                "final",
            )
            for name, found in gifs
        )
        parts.append(f"<div id='step-animations' class='media'>{tiles}</div>")
    return "".join(parts)
