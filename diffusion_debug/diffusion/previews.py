"""Cheap latent-to-RGB previews of the denoising steps: a strip PNG and an animated GIF.

A step keeps a copy of its first image's latents on their device (one op, no transfer: at SD1.5
size 32 KB in fp16, less than the 3x64x64 float32 preview made from it) in a bounded buffer; the
preview (a 3xC matrix product, six ops) is made from it only when the report is built (:meth:`Previews.files`),
so watching the steps costs one op a step and no transfer.

Limits: what is kept can be larger than the preview it makes: packed Flux latents at 1024x1024
(512 KB against 192 KB) and video's first frames (about 3.7 MB against 0.9 MB at 720p), of which
at most 32 are kept.

:class:`Previews` holds a run's two kinds: the cheap latent ones (every step) and, every
``preview_vae_every`` steps, a real VAE decode of the first image.

For 4-channel SD and SDXL latents the linear factors are the public approximations (as used by
ComfyUI and others); any other latent space gets a generic fallback (channel groups averaged
into R, G, B and the result stretched to the image's own range), which shows structure, not colour.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .components.compiled import eager
from .components.inventory import module_dtype
from .components.vae_details import sdxl_scaling

# Rows: latent channels; columns: R, G, B.
SD_FACTORS = (
    (0.3512, 0.2297, 0.3227),
    (0.3250, 0.4974, 0.2350),
    (-0.2829, 0.1762, 0.2721),
    (-0.2120, -0.2616, -0.7177),
)
SDXL_FACTORS = (
    (0.3651, 0.4232, 0.4341),
    (-0.2533, -0.0042, 0.1068),
    (0.1076, 0.1111, -0.0362),
    (-0.3165, -0.2492, -0.2188),
)
SDXL_BIAS = (0.1084, -0.0175, -0.0011)


def latent_space(channels: int, scaling_factor: float | None) -> str:
    """``"sd"``, ``"sdxl"`` or ``"generic"``."""
    if channels != 4:
        return "generic"
    return "sdxl" if sdxl_scaling(scaling_factor) else "sd"


MAX_FRAMES = 8  # frames side by side in a video preview


def channels_first(latents: torch.Tensor, channels: int | None) -> torch.Tensor:
    """Video latents as (B, C, F, H, W): AnimateDiff's are already; StableVideoDiffusion's are
    (B, F, C, H, W), told apart by the VAE's ``latent_channels`` (``channels``)."""
    if latents.dim() == 5 and channels is not None and latents.shape[2] == channels and latents.shape[1] != channels:
        return latents.transpose(1, 2)
    return latents


def unpack_patches(latents: torch.Tensor, channels: int | None) -> torch.Tensor:
    """Flux-style packed latents (B, h/2 * w/2, C * 4: 2x2 patches of a C-channel latent image) as
    (B, C, h, w) when the VAE's ``latent_channels`` (``channels``) says so and the grid is square;
    other latents unchanged (a non-square grid is not known from the shape: it stays 3-D).

    >>> import torch
    >>> image = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)  # C=2, h=4, w=6
    >>> packed = image.view(1, 2, 2, 2, 3, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 6, 8)
    >>> unpack_patches(packed, 2).shape  # 2 x 3 patches: not square, left packed
    torch.Size([1, 6, 8])
    >>> square = torch.randn(1, 2, 4, 4)
    >>> packed = square.view(1, 2, 2, 2, 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 4, 8)
    >>> torch.equal(unpack_patches(packed, 2), square)
    True
    """
    if latents.dim() != 3 or not channels or latents.shape[-1] != 4 * channels:
        return latents
    side = math.isqrt(latents.shape[1])
    if side * side != latents.shape[1]:
        return latents
    batch = latents.shape[0]
    x = latents.reshape(batch, side, side, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(batch, channels, 2 * side, 2 * side)


def latent_to_rgb(latents: torch.Tensor, space: str, max_size: int = 128) -> torch.Tensor:
    """The first image of ``latents`` as a 3xHxW float tensor in [0, 1], on the same device,
    downsampled to at most ``max_size`` pixels a side: (B, C, H, W) images; (B, C, F, H, W)
    video as a strip of its first :data:`MAX_FRAMES` frames side by side; (B, C, L) audio as a
    C x L grey map."""
    if latents.dim() == 5:
        frames = [latent_to_rgb(latents[:, :, f], space, max_size) for f in range(min(latents.shape[2], MAX_FRAMES))]
        return downsample(torch.cat(frames, dim=-1), max_size * len(frames))
    if latents.dim() == 3:
        return audio_to_rgb(latents, max_size)
    with torch.no_grad():
        x = latents.detach()[0].float()
        if x.dim() != 3:
            raise ValueError(f"cannot preview latents of shape {tuple(latents.shape)}")
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        if space in ("sd", "sdxl"):
            rgb = torch.einsum("chw,cr->rhw", x, _on_device(SD_FACTORS if space == "sd" else SDXL_FACTORS, x.device))
            if space == "sdxl":
                rgb = rgb + _on_device(SDXL_BIAS, x.device)[:, None, None]
            rgb = ((rgb + 1.0) / 2.0).clamp(0.0, 1.0)
        else:
            groups = torch.tensor_split(x, 3, dim=0) if x.shape[0] >= 3 else [x] * 3
            rgb = torch.stack([g.mean(dim=0) for g in groups])
            low = rgb.amin(dim=(1, 2), keepdim=True)
            high = rgb.amax(dim=(1, 2), keepdim=True)
            rgb = (rgb - low) / (high - low).clamp(min=1e-6)
        return downsample(rgb, max_size)


_CONSTANTS: dict[tuple[tuple, torch.device], torch.Tensor] = {}


def _on_device(values: tuple, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once: a tensor made from Python numbers on a
    GPU is a blocking copy, and a report makes up to 32 previews."""
    key = (values, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, device=device)
    return _CONSTANTS[key]


def audio_to_rgb(latents: torch.Tensor, max_size: int = 128) -> torch.Tensor:
    """The first item of audio latents (B, C, L) as a grey 3 x rows x columns map in [0, 1]
    (each channel a band of rows, time left to right), at most ``max_size`` columns."""
    with torch.no_grad():
        x = torch.nan_to_num(latents.detach()[0].float(), nan=0.0, posinf=0.0, neginf=0.0)
        x = (x - x.amin()) / (x.amax() - x.amin()).clamp(min=1e-6)
        columns = min(x.shape[-1], max_size)
        rows = max(8, min(4 * x.shape[0], max_size // 2))
        grey = torch.nn.functional.interpolate(x[None, None], size=(rows, columns), mode="area")[0, 0]
        return grey[None].expand(3, -1, -1).contiguous()


def downsample(rgb: torch.Tensor, max_size: int = 128) -> torch.Tensor:
    """``rgb`` (3xHxW) area-downsampled so that its longer side is at most ``max_size``."""
    if max(rgb.shape[-2:]) <= max_size:
        return rgb
    scale = max_size / max(rgb.shape[-2:])
    size = (max(1, round(rgb.shape[-2] * scale)), max(1, round(rgb.shape[-1] * scale)))
    with torch.no_grad():
        return torch.nn.functional.interpolate(rgb[None], size=size, mode="area")[0]


class PreviewBuffer:
    """At most ``capacity`` previews (or what they are made from), spread over the whole run: when
    full, every other one is dropped and only every second later step is kept (so memory stays bounded)."""

    def __init__(self, capacity: int = 32):
        self.capacity = max(2, capacity)
        self.stride = 1
        self.items: list[tuple[int, Any]] = []

    def wants(self, step: int) -> bool:
        return step % self.stride == 0

    def add(self, step: int, image: Any) -> None:
        if step % self.stride:  # (not self.wants(step), inline: at every step)
            return
        self.items.append((step, image))
        if len(self.items) > self.capacity:
            self.items = self.items[::2]
            self.stride *= 2

    def clear(self) -> None:
        self.items, self.stride = [], 1

    def __len__(self) -> int:
        return len(self.items)


def _to_pil(images: list[torch.Tensor], min_size: int = 64) -> list[Any]:
    from PIL import Image

    out = []
    for image in images:
        array = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        pil = Image.fromarray(array, mode="RGB")
        if max(pil.size) < min_size:
            factor = -(-min_size // max(pil.size))
            pil = pil.resize((pil.width * factor, pil.height * factor), Image.NEAREST)
        out.append(pil)
    return out


def render_files(buffer: PreviewBuffer, prefix: str = "previews") -> dict[str, bytes]:
    """``{"previews/strip.png": ..., "previews/steps.gif": ...}`` (empty when nothing was kept)."""
    from PIL import Image

    if not buffer.items:
        return {}
    frames = _to_pil([image for _, image in buffer.items])
    width = sum(f.width for f in frames)
    height = max(f.height for f in frames)
    strip = Image.new("RGB", (width, height))
    x = 0
    for frame in frames:
        strip.paste(frame, (x, 0))
        x += frame.width
    png = io.BytesIO()
    strip.save(png, format="PNG")
    gif = io.BytesIO()
    size = frames[0].size
    frames = [f if f.size == size else f.resize(size) for f in frames]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
    return {f"{prefix}/strip.png": png.getvalue(), f"{prefix}/steps.gif": gif.getvalue()}


def every(n: int | None) -> Callable[[int], bool]:
    """A schedule: ``every(5)(10)`` is True; ``every(0)`` and ``every(None)`` are never due."""
    if not n:
        return lambda step: False
    return lambda step: step % n == 0


@dataclass(frozen=True)
class KeptLatents:
    """A step's first image of latents, copied on their device, with what its preview needs from
    the VAE's config (:meth:`Previews.add_latents`); made a preview by :meth:`preview`."""

    latents: torch.Tensor
    """``(1, ...)``: the first item of 3-D audio, 4-D image or packed latents; of 5-D video its
    first :data:`MAX_FRAMES` frames, channels first."""
    channels: int | None
    scaling: float | None

    def preview(self) -> torch.Tensor:
        latents = unpack_patches(self.latents, self.channels)
        return latent_to_rgb(latents, latent_space(latents.shape[1], self.scaling))


def kept_latents(latents: torch.Tensor, vae: Any) -> KeptLatents:
    """The first image of ``latents`` (3-D audio, 4-D images, 5-D video either way round), copied in one op."""
    config = getattr(vae, "config", None) if vae is not None else None
    channels = getattr(config, "latent_channels", None)
    first = channels_first(latents.detach()[:1], channels)
    if first.dim() == 5:
        first = first[:, :, :MAX_FRAMES]
    return KeptLatents(first.clone(), channels, getattr(config, "scaling_factor", None))  # detached: no graph


class Previews:
    """The latent previews (up to 32) and the VAE-decoded ones (up to 16) of a debugger. A latent
    preview is kept as its step's latents (:class:`KeptLatents`) until :meth:`files` makes it."""

    def __init__(self, vae_every: int | None = None):
        self.latents = PreviewBuffer(32)
        self.vae = PreviewBuffer(16)
        self.vae_due = every(vae_every)
        self.vae_every = vae_every
        """None or 0: no VAE preview is ever due (:meth:`wants_vae` is then not asked at each step)."""

    def add_latents(self, step: int, latents: torch.Tensor | None, vae: Any) -> None:
        """Keep the first image of ``latents`` (3-D audio, 4-D images, 5-D video) for ``step``'s
        preview, on their device (one op; the preview is made by :meth:`files`)."""
        kept = self.latents
        if latents is None or latents.dim() not in (3, 4, 5) or step % kept.stride:  # (kept.wants, inline)
            return
        kept.add(step, kept_latents(latents, vae))

    def latent_previews(self) -> list[tuple[int, torch.Tensor]]:
        """``(step, 3xHxW preview in [0, 1])`` of each kept step, each made once (and kept made)."""
        items = self.latents.items
        for i, (step, kept) in enumerate(items):
            if isinstance(kept, KeptLatents):
                items[i] = (step, kept.preview())
        return list(items)

    def wants_vae(self, step: int, latents: torch.Tensor | None, vae: Any) -> bool:
        return (
            vae is not None
            and self.vae_due(step)
            and isinstance(latents, torch.Tensor)
            and latents.dim() == 4
            and self.vae.wants(step)
        )

    def add_vae(self, step: int, image: torch.Tensor) -> None:
        """Keep a decoded image (C x H x W in [-1, 1]) as a preview."""
        self.vae.add(step, downsample((image.float().clamp(-1, 1) + 1) / 2, 128))

    def files(self) -> dict[str, bytes]:
        """``previews/strip.png``, ``previews/steps.gif`` and their ``previews/vae_`` twins."""
        self.latent_previews()
        files = render_files(self.latents) if self.latents.items else {}
        if self.vae.items:
            files.update({k.replace("previews/", "previews/vae_"): v for k, v in render_files(self.vae).items()})
        return files

    def clear(self) -> None:
        self.latents.clear()
        self.vae.clear()

    def __len__(self) -> int:
        return len(self.latents) + len(self.vae)


def decode_first_image(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's decode of the first latent (unscaled, unshifted as the pipelines do), in the
    VAE's dtype, without gradients and without touching the torch RNG state; a VAE the user compiled
    (its ``decode``, its decoder) runs eagerly, so its graphs stay the ones its own calls made (one
    image, not the batch: a recompile)."""
    dtype = module_dtype(vae)
    config = vae.config
    z = latents[:1].detach() / getattr(config, "scaling_factor", 1.0)
    shift = getattr(config, "shift_factor", None)
    if shift:
        z = z + shift
    with torch.no_grad(), torch.random.fork_rng(devices=[]), eager(vae):
        return vae.decode(z.to(dtype or z.dtype), return_dict=False)[0][0]
