"""A component call of each pipeline replayed on the same kept inputs: whether the drift was made
in the component (it persists on equal inputs) and, if so, the first module that made it.

Each module's input and output fingerprints are read by forward hooks on the component's eager
modules (a compiled component is replayed as it runs, then eagerly for the modules); the hooks
come off when the replay returns. A replay compiles nothing: the compiled call runs the user's cached
graphs where their guards pass and eagerly elsewhere (:func:`~..components.compiled.cached_graphs_only`),
the modules' call under ``force_eager`` (:func:`~..components.compiled.eager`): hooks on the blocks of a
regionally compiled component were traced into their compiled calls (6 graphs added to the user's cache
by one tiny Flux comparison), and a component compiled in place ran them nowhere (no module named).
A replay runs in the cache context and from the hooks' state that the
replayed call of this side began with (``Recording.kept_hooks``): the pipeline's ``cache_context`` has
ended by then, and diffusers' stateful hooks (TaylorSeer, FirstBlockCache) refuse a call outside one.
It leaves the component's stateful hooks as it found them: it runs after the pipelines' calls ended,
and a cache it advanced would be the next call's (``hook_state_kept``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple

import torch

from ...core.instance_methods import MISSING
from ...stats import tensors_in
from ..components.cache_hooks import hook_state_kept
from ..components.compiled import cached_graphs_only, compile_state, eager, eager_module
from ..components.inventory import call_sites, find_components
from .fingerprints import Fingerprint, errors_of
from .recording import applied, detached_copy, fingerprints_of


class ModuleReading(NamedTuple):
    """One module call inside a replayed component call."""

    module: str
    """Qualified name inside the component (the call site's prefix included)."""
    inputs: tuple[Fingerprint, ...]
    output: tuple[Fingerprint, ...]


def _site_module(pipe: Any, component: str, prefix: str) -> torch.nn.Module:
    for c in find_components(pipe):
        if c.name == component:
            for site in call_sites(c):
                if site.prefix == prefix:
                    return site.module
    raise LookupError(f"{type(pipe).__name__} has no component call site {component!r} {prefix!r} to replay.")


def _as_taken(value: Any, dtype: torch.dtype | None, device: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() and dtype else value.dtype)
    if type(value) in (list, tuple):
        return type(value)(_as_taken(v, None, device) for v in value)
    if type(value) is dict:
        return {k: _as_taken(v, None, device) for k, v in value.items()}
    return value


def _call(module: torch.nn.Module, kept: tuple[tuple, dict], dtypes: dict[str, torch.dtype]) -> Any:
    """``module`` on a copy of ``kept``, each floating argument in the dtype this side's own call took
    it in (A's fp32 latents given to B's fp16 UNet as B's upstream made them) and on the module's device."""
    device = next((p.device for p in module.parameters()), None)
    args, kwargs = detached_copy(kept)
    args = tuple(_as_taken(v, dtypes.get(str(i)), device) for i, v in enumerate(args))
    kwargs = {k: _as_taken(v, dtypes.get(k), device) for k, v in kwargs.items()}
    with torch.no_grad():
        return module(*args, **kwargs)


@contextlib.contextmanager
def _current_timestep(pipe: Any, timestep: Any) -> Iterator[None]:
    """Within the block, ``pipe._current_timestep`` is ``timestep`` (MISSING: left alone)."""
    now = vars(pipe).get("_current_timestep", MISSING)
    if timestep is MISSING or now is MISSING:
        yield
        return
    pipe._current_timestep = timestep
    try:
        yield
    finally:
        pipe._current_timestep = now


def replay(
    pipe: Any,
    change: Any,
    component: str,
    prefix: str,
    kept: tuple[tuple, dict],
    dtypes: dict[str, torch.dtype],
    modules: bool,
    hooks: tuple[Any, Any] = (None, None),
    timestep: Any = MISSING,
) -> tuple[tuple[Fingerprint, ...], list[ModuleReading]]:
    """The output fingerprints of one call site of ``pipe`` (``change`` applied) on ``kept`` inputs,
    and, when ``modules``, each module's readings in the order their calls returned. ``hooks``: the
    ``(cache context, state)`` of the site's stateful hooks as this side's replayed call began; each
    call of the replay (a compiled site's, then the eager one's) runs from them, with ``pipe``'s
    ``_current_timestep`` as it was then (``timestep``; a ``current_timestep_callback`` reads it)."""
    readings: list[ModuleReading] = []
    with applied(pipe, change):
        site = _site_module(pipe, component, prefix)

        def call(module: torch.nn.Module, how: Any) -> Any:
            with hook_state_kept(eager_module(site), *hooks), _current_timestep(pipe, timestep), how:  # put back after
                return _call(module, kept, dtypes)

        compiled = compile_state(site) is not None
        output = fingerprints_of(call(site, cached_graphs_only())) if compiled or not modules else None
        if not modules:
            return output, readings
        original = eager_module(site)
        handles = []

        def hook(name: str):
            def after(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
                ins = tuple(f for t in tensors_in((args, kwargs)) if t.is_floating_point() for f in fingerprints_of(t))
                readings.append(ModuleReading(name, ins, fingerprints_of(out)))

            return after

        try:
            for name, module in original.named_modules():
                if name:
                    qualified = f"{prefix}.{name}" if prefix else name
                    handles.append(module.register_forward_hook(hook(qualified), with_kwargs=True))
            eager_output = fingerprints_of(call(original, eager(original)))
        finally:
            for handle in handles:
                handle.remove()
    return (output if output is not None else eager_output), readings


class ModuleError(NamedTuple):
    """A module's relative error between the two replays: of its inputs and of its output."""

    module: str
    input_error: float
    output_error: float


def module_errors(a: list[ModuleReading], b: list[ModuleReading]) -> list[ModuleError]:
    """Per module call, in the order the calls returned (as far as both replays called the same modules)."""
    found = []
    for x, y in zip(a, b):
        if x.module != y.module:
            break
        found.append(ModuleError(x.module, errors_of(x.inputs, y.inputs), errors_of(x.output, y.output)))
    return found


def drifting_modules(errors: list[ModuleError], tolerance: float) -> list[tuple[ModuleError, bool]]:
    """The module calls whose output drifts beyond ``tolerance``, in order, each with whether it made
    the drift: its inputs agreed and no module inside it drifted (a block that holds a drifting conv
    received the drift from the conv)."""
    drifting = [m for m in errors if m.output_error > tolerance]
    holders = set()
    for m in drifting:
        parts = m.module.split(".")
        holders.update(".".join(parts[:i]) for i in range(1, len(parts)))
        if m.module:  # the component itself (a recorded call's root reading) holds every module
            holders.add("")
    return [(m, m.input_error <= tolerance and m.module not in holders) for m in drifting]
