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

import torch
from torch import nn


def compiling() -> bool:
    """Whether the code calling this is being traced by ``torch.compile`` (a constant to dynamo,
    so a branch on it costs the compiled graph nothing)."""
    return torch.compiler.is_compiling()


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it (its hooks run inside compiled code)."""
    return vars(module).get("_compiled_call_impl") is not None
