"""A component the user's ``callback_on_step_end`` replaces, hooked before its next call.

``pipe.vae = other`` in the callback of the LAST step is followed by the VAE's decode with nothing
of the debugger's in between (the next ``scheduler.step``, which finds a replacement made after an
earlier step, never comes): :class:`StepEndWatch` is the seam. Armed at each ``scheduler.step`` of a
pipeline call that passed a ``callback_on_step_end`` (read once a run from the call's frame, no
Python call: a call without one pays nothing), it is a torch global forward pre-hook for one module
call: the first after the step, after the callback, in the pipeline call's thread (another
thread's module call meanwhile leaves it armed). It takes itself off there and, only when a
component was replaced, has it hooked at once, before that module's call goes on: the new VAE's
``post_quant_conv`` runs first in its decode, so the ``decoder``, where its call site and probes
are, is watched.

Where that first module call is itself the call site of a replaced component (a new UNet's first
call, the ``decoder`` of a VAE without ``post_quant_conv``: Flux's), torch has read its pre-hooks
before this one ran, so the hooks put on there would run half (the post-hook, not the pre-hook that
keeps the call and starts its clock): the watch runs that module's new pre-hooks itself, with the
call's arguments (its ``kwargs`` read from torch's ``inner`` frame of ``Module._call_impl``, which
passes a global pre-hook ``args`` alone), and its call is watched whole.

Limits: a torch whose module call is not that frame leaves such a call as it was (the denoiser
found at the next ``scheduler.step``, its first call unwatched; a VAE at the next attach); a call
site of a component not replaced (the denoiser of the next step) is left to those paths too, its
pre-hooks read. A component replaced in the step's callback of a pipeline call without
``callback_on_step_end`` (the deprecated ``callback``, a hook) is not seen here.
"""

from __future__ import annotations

import sys
from operator import is_
from threading import get_ident
from types import CodeType
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from .held import HeldComponents
from .inventory import call_sites, find_components

CALLBACK = "callback_on_step_end"
"""The argument of a pipeline's ``__call__`` that arms the watch (read from its frame once a run:
``StepPipeline.on_scheduler_step``, inline)."""


class StepEndWatch:
    """The one-shot seam after a step's callback (see the module docstring). ``owner``: the
    debugger's step pipeline, read as it fires: its :class:`~.held.HeldComponents` (``held``),
    whether the debugger is making its own calls (``busy``: a replay, a preview, which leave it
    armed), its ``calls`` (the call sites it hooks), its ``guards`` (a failure here is recorded)
    and ``run``; ``follow()``: hook the pipeline's components as they are now (the debugger's,
    records each change)."""

    __slots__ = ("pipe", "owner", "follow", "handle", "thread")

    def __init__(self, pipe: Any, owner: Any, follow: Callable[[], None]):
        self.pipe, self.owner, self.follow = pipe, owner, follow
        self.handle: Any = None
        """The global pre-hook's handle while armed (callers test it inline: no call when not armed)."""
        self.thread = 0
        """The thread that armed it (the pipeline's call): another thread's module call meanwhile (a
        served process's other model) is not the call it waits for, and leaves it armed."""

    def arm(self) -> None:
        self.thread = get_ident()
        if self.handle is None:
            self.handle = register_module_forward_pre_hook(self._fire)

    def disarm(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()

    def _fire(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling() or self.owner.busy or get_ident() != self.thread:
            return None  # armed still: the next eager module call of the pipeline's, in its thread
        try:  # inside the user's module call: a failure of ours is recorded, never raised there
            self.disarm()
            held_now: HeldComponents = self.owner.held
            state, size, (dicts, keys, held) = held_now.check
            if state is not None and len(state) == size and all(map(is_, map(dict.get, dicts, keys), held)):
                return None  # nothing replaced: the common case, one call a step
            kwargs = read = None
            if any(site.module is module for c in find_components(self.pipe) for site in call_sites(c)):
                if any(site.module is module for site in self.owner.calls.sites):
                    return None  # watched already, its pre-hooks read: left to the paths that follow
                frame = sys._getframe(1)  # torch's call of this module, whose pre-hooks it has read
                local = frame.f_locals if frame.f_code is _CALL_INNER else {}  # (read once: a C getter)
                if local.get("self") is not module:
                    return None  # not called as the torch this was written for: left as it was
                kwargs, read = local.get("kwargs"), list(module._forward_pre_hooks.values())
            self.follow()
            if read is not None:  # a replaced call site being called: its new pre-hooks run here
                for hook_id, hook in list(module._forward_pre_hooks.items()):
                    if not any(hook is h for h in read):
                        if hook_id in module._forward_pre_hooks_with_kwargs:
                            hook(module, args, kwargs if kwargs is not None else {})
                        else:
                            hook(module, args)
        except Exception as error:
            self.owner.guards.failed("component_replaced", error, self.owner.run.current_step)
        return None


_CALL_INNER = next(
    (c for c in torch.nn.Module._call_impl.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "inner"),
    None,
)
"""The code of the function torch's ``Module._call_impl`` runs a call's hooks and ``forward`` in
(``inner``, torch >= 2.1), whose ``kwargs`` are the call's: a global pre-hook gets ``args`` alone."""
