"""One pipeline call recorded for a comparison: each component call's output and input
fingerprints and each scheduler step's latents, in execution order; optionally a copy of the
inputs of one chosen call, for a replay on equal inputs, with its stateful diffusers hooks' cache
context and state as it began (a replay runs outside the pipeline's ``cache_context``).

Torch's own hooks on each call site (the component, or the VAE's ``encoder`` / ``decoder``) and a
wrapper on the scheduler's ``step`` for the duration of the call only; nothing stays attached. A site
compiled in place (``module.compile()``) runs its hooks inside its compiled call, where ours were traced
(8 graphs added to the user's cache by one tiny Flux comparison): it is watched around that call instead,
eagerly (:func:`~..components.compiled.wrap_compiled_call`), as the debugger watches it.

Limits: a component called outside its call sites (a VAE's ``post_quant_conv`` before the
decoder) is seen only through the next call site's inputs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...core.instance_methods import MISSING, OnThisInstance
from ...stats import tensors_in
from ..components.cache_hooks import hook_state, stateful_hooks
from ..components.compiled import compiled_in_place, eager_module, wrap_compiled_call
from ..components.inventory import CallSite, call_sites, find_components, is_loop_role
from .fingerprints import Fingerprint, fingerprint

SCHEDULER = "scheduler"


@dataclass
class Event:
    """One component call (``kind == "call"``) or one scheduler step (``kind == "step"``)."""

    kind: str
    component: str
    site: str = ""
    """The call site inside the component (``""``: the component itself; ``decoder`` of a VAE)."""
    step: int | None = None
    timestep: float | None = None
    output: tuple[Fingerprint, ...] = ()
    inputs: dict[str, Fingerprint] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    caches: tuple[str, ...] = ()
    """The classes of the stateful diffusers hooks (caches) on the component's call site."""
    """The dtype of each floating tensor argument, by position (``"0"``) or name."""


def fingerprints_of(obj: Any) -> tuple[Fingerprint, ...]:
    return tuple(fingerprint(t) for t in tensors_in(obj) if t.is_floating_point())


def _input_fingerprints(args: tuple, kwargs: dict) -> dict[str, Fingerprint]:
    named = {str(i): v for i, v in enumerate(args)} | dict(kwargs)
    found = {}
    for name, value in named.items():
        for j, t in enumerate(tensors_in(value)):
            found[name if j == 0 else f"{name}.{j}"] = fingerprint(t)
    return found


def detached_copy(value: Any) -> Any:
    """``value`` with every tensor cloned and every list, tuple and dict copied (other objects shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return type(value)(detached_copy(v) for v in value)
    if type(value) is dict:
        return {k: detached_copy(v) for k, v in value.items()}
    return value


def _timestep(scheduler: Any, step: int) -> float | None:
    timesteps = getattr(scheduler, "timesteps", None)
    if isinstance(timesteps, torch.Tensor) and step < timesteps.numel():
        return float(timesteps.reshape(-1)[step])
    return None


class Recording:
    """The events of one pipeline call (see :func:`record_call`)."""

    def __init__(self, keep: int | None = None):
        self.events: list[Event] = []
        self.keep = keep
        self.kept: tuple[tuple, dict] | None = None
        self.kept_hooks: tuple[Any, Any] = (None, None)
        """``(cache context, state)`` of the kept call's stateful hooks as it began (:func:`hook_state`,
        every tensor held: one call's), for its replay; ``(None, None)`` for a call without such hooks."""
        self.kept_timestep: Any = MISSING
        """The pipeline's ``_current_timestep`` as the kept call began (a caching hook's
        ``current_timestep_callback`` reads ``pipe.current_timestep``; None once the call ended)."""
        self.steps_done = 0
        self.scheduler: Any = None
        self._open: dict[int, list[Event]] = {}
        self.dtypes: set[torch.dtype] = set()

    def _before(self, site: CallSite, pipe: Any) -> Callable:
        caches = tuple(sorted({type(hook).__name__ for hook in stateful_hooks(site.module)}))

        def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
            loop = is_loop_role(site.role)
            step = self.steps_done if loop else None
            timestep = _timestep(self.scheduler, self.steps_done) if loop else None
            event = Event(
                "call", site.component, site.prefix, step, timestep, inputs=_input_fingerprints(args, kwargs)
            )
            event.caches = caches
            named = {str(i): v for i, v in enumerate(args)} | kwargs
            event.dtypes = {
                k: v.dtype for k, v in named.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
            }
            if len(self.events) == self.keep:
                self.kept = detached_copy((args, kwargs))
                if caches:
                    self.kept_hooks = hook_state(eager_module(site.module))
                    self.kept_timestep = vars(pipe).get("_current_timestep", MISSING)
            self.events.append(event)
            self._open.setdefault(id(module), []).append(event)  # filled when the call returns

        return before

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        open_calls = self._open.get(id(module))
        if open_calls:
            open_calls.pop().output = fingerprints_of(output)

    def _step(self, original: Callable) -> Callable:
        def step(model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(model_output, timestep, sample, *args, **kwargs)
            latents = getattr(out, "prev_sample", None)
            if latents is None and isinstance(out, tuple) and out:
                latents = out[0]
            t = float(timestep.reshape(-1)[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
            self.events.append(Event("step", SCHEDULER, "", self.steps_done, t, fingerprints_of(latents)))
            self.steps_done += 1
            return out

        return step

    @contextlib.contextmanager
    def attached(self, pipe: Any) -> Iterator[None]:
        """The hooks and the scheduler wrapper on ``pipe``, for one call."""
        handles = []
        scheduler = getattr(pipe, "scheduler", None)
        own_step = "step" in vars(scheduler) if scheduler is not None else False
        saved = vars(scheduler).get("step") if own_step else None
        try:
            for component in find_components(pipe):
                self.dtypes.update(p.dtype for p in component.module.parameters() if p.is_floating_point())
                for site in call_sites(component):
                    if compiled_in_place(site.module):  # around its compiled call: never traced into the user's graph
                        handles.append(wrap_compiled_call(site.module, self._before(site, pipe), self._after))
                        continue
                    handles.append(site.module.register_forward_pre_hook(self._before(site, pipe), with_kwargs=True))
                    handles.append(site.module.register_forward_hook(self._after, with_kwargs=True))
            if scheduler is not None and callable(getattr(scheduler, "step", None)):
                self.scheduler = scheduler
                # a copy of the scheduler made in the call (LTX-2's audio scheduler) steps itself, unrecorded
                step, previous = self._step(scheduler.step), saved if own_step else MISSING
                scheduler.step = OnThisInstance(step, owner=scheduler, name="step", previous=previous)
            yield
        finally:
            for handle in handles:
                handle.remove()
            if scheduler is not None:
                if own_step:
                    scheduler.step = saved
                else:
                    vars(scheduler).pop("step", None)


@contextlib.contextmanager
def applied(pipe: Any, change: Any) -> Iterator[dict]:
    """``change`` applied to ``pipe`` for the block: a dict of call arguments (yielded), or a callable
    that changes the pipeline and returns the callable that undoes it (called on the way out)."""
    if change is None or isinstance(change, dict):
        yield dict(change or {})
        return
    undo = change(pipe)
    try:
        yield {}
    finally:
        if callable(undo):
            undo()


def record_call(pipe: Any, change: Any, call_kwargs: dict, seed: int, keep: int | None = None) -> Recording:
    """One call of ``pipe`` with ``change`` applied and a fresh generator from ``seed``, recorded."""
    recording = Recording(keep)
    with applied(pipe, change) as overrides, recording.attached(pipe):
        generator = torch.Generator().manual_seed(seed)
        pipe(**{**call_kwargs, **overrides, "generator": generator})
    return recording
