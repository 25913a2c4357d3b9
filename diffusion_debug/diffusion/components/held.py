"""The objects a debugger watches of its pipeline, and whether they are still the pipeline's.

A user who keeps one debugger replaces components between two watched calls (``pipe.scheduler =
EulerDiscreteScheduler.from_config(...)``, ``pipe.vae = fp16_fixed_vae``, ``pipe.vae.decoder =
...``, ``pipe.register_modules(controlnet=...)``). Each attach asks :attr:`HeldComponents.check`
whether anything changed, with no Python call (a reused debugger attaches at every call):

    state, size, (dicts, keys, held) = check
    same = state is not None and len(state) == size and all(map(is_, map(dict.get, dicts, keys), held))

``dicts``/``keys``/``held``: each public attribute of the pipeline (its ``__dict__``) that holds a
module, the scheduler, the guider or None, and each VAE half a call site begins at (its parent's ``_modules``),
with the object it held; ``size``: the number of the pipeline's attributes (a component registered
under a new name adds one). Only when they differ is the pipeline listed again
(:meth:`HeldComponents.compared`), and the debugger watches what changed.

>>> from operator import is_
>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("sd")
>>> held = HeldComponents(pipe, find_components(pipe))
>>> state, size, (dicts, keys, objects) = held.check
>>> len(state) == size and all(map(is_, map(dict.get, dicts, keys), objects))
True
>>> pipe.vae.decoder = type(pipe.vae.decoder)()
>>> all(map(is_, map(dict.get, dicts, keys), objects))
False
>>> [(c["component"], c["change"]) for c in held.compared(pipe)[1]]
[('vae.decoder', 'replaced')]

Limits: a ``ComponentsManager`` holds its components elsewhere: it is listed again at every
attach. A component replaced while the debugger is attached is followed from the next
``pipe.encode_prompt`` (between two calls of one attach: before the text and image encoders run,
an IP-Adapter's image encoder loaded between them too; a pipeline without one: not before its
encoders' first call) or ``scheduler.set_timesteps`` (before the denoiser's first call, so a
``torch.compile`` wrapper's first trace holds none of the hooks on the module it wraps) or
``scheduler.step``, which read ``check`` too, or, replaced in ``callback_on_step_end``, from the
next module call after it (:mod:`.step_end`: before the VAE's decode after the last step, before a
new UNet's first call);
``pipe.scheduler`` from the next denoiser call (``StepPipeline.scheduler_replaced``); else from the
next attach.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .compiled import eager_module
from .inventory import Component, call_sites, find_components, watchable_kind


class HeldComponents:
    """What :func:`~.inventory.find_components` found of a pipeline, and its scheduler, with the
    check that they are unchanged (see the module docstring)."""

    __slots__ = ("components", "scheduler", "guider", "halves", "check")

    def __init__(self, pipe: Any, components: list[Component]):
        self.components = components
        self.scheduler = getattr(pipe, "scheduler", None)
        self.guider = getattr(pipe, "guider", None)  # whether it places hooks: the denoiser's ``guided``
        state = vars(pipe) if watchable_kind(pipe) in ("pipeline", "modular") else None  # they hold them there
        dicts: list[dict] = []
        keys: list[str] = []
        held: list[Any] = []
        self.halves: dict[tuple[str, str], nn.Module] = {}
        """Per VAE half (component, prefix): the module its calls began at."""
        for name, value in (state or {}).items():
            if not name.startswith("_") and (value is None or name in _HELD_NAMES or isinstance(value, nn.Module)):
                dicts.append(state)
                keys.append(name)
                held.append(value)
        for component in components:
            for site in call_sites(component):
                if site.prefix:  # a VAE half: replaced inside its VAE
                    self.halves[(component.name, site.prefix)] = site.module
                    dicts.append(eager_module(component.module)._modules)  # a torch.compile wrapper's original's
                    keys.append(site.prefix)
                    held.append(site.module)
        self.check = (state, len(state) if state is not None else -1, (dicts, keys, held))

    def compared(self, pipe: Any) -> tuple[HeldComponents, list[dict[str, Any]]]:
        """The pipeline's components now, and each change from these: ``{"component", "change"
        ("replaced", "added", "removed"), "was", "now"}`` (class names; ``vae.decoder`` for a VAE
        half, ``scheduler`` for the scheduler), in the order the debugger lists components."""
        now = find_components(pipe)
        before = {c.name: c for c in self.components}
        after = {c.name: c for c in now}
        changes = []
        for name in [*before, *(name for name in after if name not in before)]:
            was, new = before.get(name), after.get(name)
            if was is None or new is None or was.module is not new.module:
                change = "added" if was is None else "removed" if new is None else "replaced"
                changes.append(_change(name, change, was and was.module, new and new.module))
                continue
            for site in call_sites(new):
                half = self.halves.get((name, site.prefix))
                if site.prefix and half is not site.module:
                    changes.append(_change(f"{name}.{site.prefix}", "replaced", half, site.module))
        scheduler = getattr(pipe, "scheduler", None)
        if scheduler is not self.scheduler:
            changes.append(_change("scheduler", "replaced", self.scheduler, scheduler))
        guider = getattr(pipe, "guider", None)
        if guider is not self.guider:  # (``pipe.update_components(guider=...)``)
            changes.append(_change("guider", "replaced", self.guider, guider))
        return HeldComponents(pipe, now), changes


_HELD_NAMES = ("scheduler", "guider")
"""The components other than modules that :attr:`HeldComponents.check` holds."""


def _change(component: str, change: str, was: Any, now: Any) -> dict[str, Any]:
    named = lambda obj: None if obj is None else type(obj).__name__  # noqa: E731
    return {"component": component, "change": change, "was": named(was), "now": named(now)}
