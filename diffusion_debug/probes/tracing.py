"""What a hook may do depends on who runs it: Python (eager), or ``torch.compile`` tracing it.

A traced hook body becomes part of the graph: tensor code is fine, and so is appending to a list
(dynamo replays the mutation after the graph). A clock, a Python counter read back, a tensor's
``_version``, a profiler range or a host read is not: it breaks the graph, fails under
``fullgraph=True``, or is frozen at its traced value. So the hooks of this layer hold tensor code
and list appends only, and what else a technique needs (the probe's dedupe of a tensor it has
already measured, a profiler range) is taken only when :func:`compiling` is false; the time of a
call is taken around it, by the caller (``diffusion/components/call_sites.py``), never inside compiled code.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def compiling() -> bool:
    """Whether the code calling this is being traced by ``torch.compile`` (a constant to dynamo,
    so a branch on it costs the compiled graph nothing).

    ``torch.compiler.is_compiling()`` in one Python call fewer (it asks ``torch.jit.is_scripting()``,
    a second call, at every hook): dynamo makes ``is_dynamo_compiling()`` the constant True, so the
    flag after it is never read in a trace (a guard on it would recompile); in eager code the flag
    is what ``is_compiling()`` returns (True while ``torch.export`` traces in Python). Spelled
    inline where a hook asks it (``DiffusionModelDebugger._is_busy``)."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it (its hooks run inside compiled code)."""
    return vars(module).get("_compiled_call_impl") is not None


def compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(m)`` returns (its original is ``._orig_mod``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def eager_module(module: nn.Module) -> nn.Module:
    """The original module of a ``torch.compile`` wrapper (the module itself otherwise)."""
    return module._orig_mod if compile_wrapper(module) else module


def runs_compiled(model: nn.Module, modules: Iterable[nn.Module | None]) -> bool:
    """Whether compiled code runs part of ``model``: it is a ``torch.compile`` wrapper, or it or one
    of ``modules`` (its modules, or those a probe watches; None: gone) was compiled in place."""
    if compile_wrapper(model) or compiled_in_place(model):
        return True
    for m in modules:  # a loop, not any() of a generator: no frame a module (every module, at each attach)
        if m is not None and vars(m).get("_compiled_call_impl") is not None:  # compiled_in_place(m)
            return True
    return False
