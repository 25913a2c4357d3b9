"""Component roles as a registry: what differs per role is written once, in its :class:`Role`.

>>> role("vae").checks
('vae',)
>>> [r for r in roles()][:3]
['denoiser', 'vae', 'text_encoder']

Adding a role is one :func:`register_role` call; detection (:func:`role_of`) stays in
:mod:`~diffusion_debug.diffusion.components.inventory`, and a role's ``matches`` (when given) is asked first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Role:
    """What one role of component gets."""

    name: str
    in_loop: bool = False
    """Runs every denoising step: cheap probes; the others run once per image, full probes."""
    call_phase: str = ""
    """What one call of it is (``""``: the role's name; the VAE's halves are encode / decode)."""
    checks: tuple[str, ...] = ()
    """Check families that apply (``"vae"``: VAE advice, fp16 SDXL VAE, decode halves)."""
    begins_run: bool = False
    """A call of it (encoding a prompt or an image) begins a pipeline run."""
    decodes_preview: bool = False
    """Its ``decode`` turns latents into the preview image."""
    label: str = ""
    """What to call it in messages."""
    matches: Callable[[str, nn.Module], bool] | None = None
    """Detection for an added role, asked before the built-in rules."""


_REGISTRY: dict[str, Role] = {}


def register_role(new: Role) -> Role:
    """Add (or replace) one role; :func:`roles` keeps registration order."""
    _REGISTRY[new.name] = new
    return new


def role(name: str) -> Role:
    """The registered role ``name`` (an unknown name gets the ``other`` role's behaviour)."""
    return _REGISTRY.get(name) or _REGISTRY["other"]


def roles() -> tuple[str, ...]:
    """Role names in registration order (``other`` last)."""
    names = [n for n in _REGISTRY if n != "other"]
    return (*names, "other")


def has_check(role_name: str, check: str) -> bool:
    """Whether components of ``role_name`` get the ``check`` family."""
    return check in role(role_name).checks


register_role(Role("denoiser", in_loop=True, label="denoiser"))
register_role(Role("vae", checks=("vae",), decodes_preview=True, label="VAE"))
register_role(Role("text_encoder", call_phase="encode_prompt", begins_run=True, label="text encoder"))
register_role(Role("image_encoder", call_phase="encode_image", begins_run=True, label="image encoder"))
register_role(Role("control", in_loop=True, label="ControlNet"))
register_role(Role("adapter", in_loop=True, label="adapter"))
register_role(Role("other", call_phase="call", label="component"))
