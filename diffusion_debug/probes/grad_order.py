"""The order in which backward accumulates the gradients of parameters: which of several
non-finite gradients came first.

With a finite loss, a NaN made in the backward of a module reaches that module's gradients and
every gradient upstream of it (earlier in forward order): the first of them that backward
accumulated (:meth:`BackwardOrder.first`, the last of them in forward order) is where backward
made it; the first in forward order (:meth:`BackwardOrder.first_in_forward`) is the far end.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> order = BackwardOrder(model.parameters())
>>> with apply_grad_order(order):
...     model(torch.ones(1, 2)).sum().backward()
>>> order.first([0, 3])  # backward reaches the last layer first
3

Limits: one post-accumulate-grad hook per parameter, a list append (nothing a compiled backward
must trace but the append); a parameter whose gradient is never accumulated is not in the order.
The training debugger keeps the hooks on until one backward has reached every parameter, then
takes them off and records again every ``ORDER_REFRESH`` monitored steps: an order that changes
from step to step (data-dependent branches, experts) is read as it was at the last recording.
A backward that accumulated parameters straight from a compiled graph (torch.compile's AOTAutograd
node, :func:`accumulates_compiled`) accumulates them all at once, in an order of its own (on the tiny
SD UNet under ``aot_eager``, ``time_embedding.linear_1`` first): that order is not used
(:attr:`BackwardOrder.compiled`), as if none had been recorded.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch

from .handles import ProbeHandle, register_all


class BackwardOrder:
    """The order of the last backward, as indices into ``params`` (registration order).

    :meth:`attach` is :func:`apply_grad_order` keeping the one handle (attaching again while
    attached does nothing); :meth:`remove` takes the hooks off (idempotent; attach again after).
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = list(params)
        # The last backward's order: a bounded deque, so nothing grows if no monitor call clears it.
        self.order: deque[int] = deque(maxlen=max(1, len(self.params)))
        self._handle: ProbeHandle | None = None
        self.compiled = False
        """The recorded backward accumulated parameters from a compiled graph
        (:func:`accumulates_compiled`, set by the caller): :meth:`first` and :meth:`used` ignore its order."""

    def used(self, flagged: list[int]) -> bool:
        """Whether :meth:`first` names one of ``flagged`` by the recorded backward (not by registration)."""
        wanted = set(flagged)
        return not self.compiled and any(i in wanted for i in self.order)

    def attach(self) -> "BackwardOrder":
        if self._handle is None or not self._handle.attached:
            self._handle = apply_grad_order(self)
        return self

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()

    def first(self, flagged: list[int]) -> int | None:
        """The flagged parameter whose gradient was accumulated first in the last backward: the last
        of them in forward order, where a NaN made in backward under a finite loss started
        (registration order, reversed, when no backward was recorded: the last registered).

        Each parameter is placed by its last entry, as :meth:`first_in_forward` reads it: the window
        holds one entry a parameter, so where a backward reaches fewer (a trainable parameter it
        skips) it starts with the tail of the backward before, the parameters nearest the input,
        which are the last backward's far end, not the first it reached."""
        place = {i: at for at, i in enumerate(self.order)} if not self.compiled else {}  # each one's last entry
        reached = [i for i in flagged if i in place]
        if reached:
            return min(reached, key=place.__getitem__)
        return max(flagged) if flagged else None

    def first_in_forward(self, flagged: list[int]) -> int | None:
        """The flagged parameter whose gradient was accumulated *last* in the last backward:
        backward runs the graph in reverse, so this is the first of them in forward order
        (registration order when no backward was recorded)."""
        wanted = set(flagged) if not self.compiled else set()
        for i in reversed(self.order):
            if i in wanted:
                return i
        return min(flagged) if flagged else None


def accumulates_compiled(loss: object) -> bool:
    """Whether the backward graph behind ``loss`` accumulates a parameter's gradient straight from a
    compiled graph's node (torch.compile's, AOTAutograd's ``CompiledFunctionBackward``): one walk of
    the graph's nodes (about 1 ms on the tiny SD UNet's 953), each once; False for a loss with none."""
    root = getattr(loss, "grad_fn", None)
    seen, stack = {root}, [root] if root is not None else []
    while stack:
        node = stack.pop()
        compiled = "CompiledFunction" in node.name()
        for child, _ in node.next_functions:
            if child is None or child in seen:
                continue
            if compiled and child.name() == "torch::autograd::AccumulateGrad":
                return True
            seen.add(child)
            stack.append(child)
    return False


def apply_grad_order(order: BackwardOrder) -> ProbeHandle:
    """One post-accumulate-grad hook per parameter of ``order`` that requires grad, recording into it (one
    frozen since, ``requires_grad_(False)`` mid-run, gets none: torch refuses it, and it accumulates nothing);
    the handle's ``state`` is ``order``."""
    append = order.order.append

    def register():
        for i, p in enumerate(order.params):
            if p.requires_grad:
                yield p.register_post_accumulate_grad_hook(lambda _p, i=i: append(i))

    return register_all(register, state=order)
