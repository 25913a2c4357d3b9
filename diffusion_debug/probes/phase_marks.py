"""Where a training step is: a module's training forward began, and backward reached its output.

>>> import torch
>>> model = torch.nn.Linear(2, 1)
>>> seen = []
>>> with apply_phase_marks(model, lambda: seen.append("forward"), lambda: seen.append("backward")):
...     model(torch.ones(1, 2)).sum().backward()
...     with torch.no_grad():
...         _ = model(torch.ones(1, 2))  # no training forward: not marked
>>> seen
['forward', 'backward']

``on_forward`` runs before each forward with gradients enabled while the module is in training
mode; ``on_backward`` when the gradient of that forward's first output tensor that requires a
gradient is computed, i.e. when backward reaches the module (a tensor hook on the output: no node
is added to the graph and the gradient is returned unchanged). ``on_error(error)``, if given, runs when
an error raised inside a training forward leaves the module (its forward hook is then ``always_call``,
run by torch from its own ``except`` block; the error goes on unchanged): a rank whose forward raised
is not in that forward any more, while the others may wait in its collectives::

    >>> def bad_batch(module, args):
    ...     raise ValueError("a bad batch")
    >>> errors = []
    >>> with apply_phase_marks(model, lambda: None, lambda: None, on_error=errors.append):
    ...     with model.register_forward_pre_hook(bad_batch):
    ...         model(torch.ones(1, 2))
    Traceback (most recent call last):
    ...
    ValueError: a bad batch
    >>> errors
    [ValueError('a bad batch')]

Limits: the callbacks are Python (they mark a position for the liveness side channel), so they are
skipped while ``torch.compile`` traces the module (:func:`~.tracing.compiling`): attach to the
outermost module (the one ``accelerator.prepare`` returned, or the ``torch.compile`` wrapper),
whose hooks run eagerly around a compiled forward. An output without a tensor that requires a
gradient gets no backward mark. A forward autograd runs in backward (a checkpoint's recompute,
which non-reentrant checkpointing stops with an error of torch's) is neither marked nor ``on_error``'s.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..stats import tensors_in
from .call_args import raised_here
from .handles import ProbeHandle, register_all
from .tracing import compiling, in_backward


def apply_phase_marks(
    modules: nn.Module | Iterable[nn.Module],
    on_forward: Callable[[], None],
    on_backward: Callable[[], None],
    on_error: Callable[[Exception], None] | None = None,
) -> ProbeHandle:
    """A forward pre-hook and a forward hook on ``modules`` (one, or each of several watched models)
    calling the marks (see above)."""

    def before(mod: nn.Module, args: Any) -> None:
        if mod.training and torch.is_grad_enabled() and not compiling() and not in_backward():
            on_forward()

    def after(mod: nn.Module, args: Any, output: Any) -> None:
        if not (mod.training and torch.is_grad_enabled()) or compiling():
            return
        if on_error is not None and (error := sys.exc_info()[1]) is not None:
            if in_backward(error) or raised_here(mod, raised, (Exception,)):
                return  # a checkpoint's recompute stopped in backward, or the forward raised: no output
        first = next((t for t in tensors_in(output) if t.requires_grad), None)
        if first is not None:
            first.register_hook(_backward_mark(on_backward))

    def raised(mod: nn.Module, error: BaseException) -> None:
        assert on_error is not None and isinstance(error, Exception)
        on_error(error)

    def register():
        for module in [modules] if isinstance(modules, nn.Module) else modules:
            # first of the hooks: FSDP2's own (registered by fully_shard) all-gather the parameters
            # before forward and, from a hook on the output, before backward; a rank waiting there
            # must be marked already
            yield module.register_forward_pre_hook(before, prepend=True)
            yield module.register_forward_hook(after, prepend=True, always_call=on_error is not None)

    return register_all(register)


def _backward_mark(on_backward: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    def mark(grad: torch.Tensor) -> None:
        on_backward()  # returns None: the gradient goes on unchanged

    return mark
