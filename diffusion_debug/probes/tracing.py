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

from typing import Any, Callable, Iterable

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


_graph_task: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def in_backward(error: BaseException | None = None) -> bool:
    """Whether autograd's backward runs the code calling this (a forward called there is a checkpoint's
    recompute, not the step's forward; non-reentrant checkpointing stops it with torch's
    ``_StopRecomputationError`` once it has what it needs). Without torch's graph task id (a private
    name), whether ``error`` is that one."""
    if _graph_task is not None:
        return _graph_task() != -1
    return error is not None and type(error).__name__ == "_StopRecomputationError"


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


compile_callback: Callable[[], Any] | None = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
"""dynamo's frame callback now (a C function: no frame dynamo would trace; torch 2.6 on, else None): not
None in Python that runs inside a compiled call (a hook of :func:`eager_frame` run eagerly there)."""


def eager_frame(function: Callable) -> Callable:
    """``function`` (a hook) marked for dynamo to run as Python when it meets it as a frame of its own:
    under ``module.compile()`` torch compiles ``Module._call_impl``, a frame dynamo skips, so each hook
    it calls is a frame dynamo traces, where :func:`compiling` is the constant True and the hook counts
    nothing; marked, it runs eagerly, the functions it calls still traced as frames of their own (a
    Python call there, even :func:`compiling`, is one: see :func:`run_eagerly` and
    :data:`compile_callback`). Inlined into a traced frame it is traced as before. Not on a torch with
    no such mark or no :data:`compile_callback` (private APIs): ``function`` is as it was, its hook
    counting nothing there. Returns ``function``."""
    frames = torch._C._dynamo.eval_frame
    if compile_callback is not None and hasattr(frames, "set_code_exec_strategy"):
        try:
            action = frames._FrameAction
            frames.set_code_exec_strategy(function.__code__, frames._FrameExecStrategy(action.SKIP, action.DEFAULT))
        except Exception:  # never the user's run: the hook is as it was
            pass
    return function


_EAGER: list[Callable] = []


def run_eagerly(work: Callable[[], Any]) -> Any:
    """``work()`` with dynamo off, for a hook of :func:`eager_frame` called under ``module.compile()``
    (dynamo is imported there): the Python it calls is not traced as frames of their own."""
    if not _EAGER:
        import torch._dynamo

        _EAGER.append(torch._dynamo.disable(lambda work: work(), recursive=True))
    return _EAGER[0](work)
