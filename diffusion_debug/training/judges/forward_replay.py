"""The module of a trained model that made a NaN/Inf in its own forward, found by replaying that
forward with every module probed, on a step whose loss is non-finite and whose weights and inputs
are finite (a NaN input or weight explains the step itself).

``diffusion-debug launch`` keeps each trained model's first forward under grad of each micro-step
(:class:`KeptForward`: references to its arguments, no copy, and what the replay needs to compute
the same values) until the step's monitor; a healthy step reads none of it. :func:`replay_forwards`
runs the kept calls in order, on the model itself (inside DDP's or ``torch.compile``'s wrapper: no
collective, no compiled code), under ``no_grad``, with the random number generators set to their
state at the original call (dropout draws the same masks) and the autocast the call ran under, and
names the first module in execution order whose output is non-finite while its inputs were finite.
The run does not change: the generators, the buffers a module in training mode updates (BatchNorm's
running statistics) and the gradients are as before (``probes.probe_call``), and no weight is written.

>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
>>> with torch.no_grad():
...     model[1].weight[0, 0] = float("inf")
>>> kept = KeptForward.of("net", model, (torch.ones(1, 2),), {}, [])
>>> replay_forwards([kept])["module"]
'1'

Limits: the script's own hooks on the model's modules run in the replay too (launch's take it for
none of the script's calls: :func:`replaying_forward`); a kept argument changed in place after the
call (its ``_version`` moved) is not replayed (its values are not the call's); the weights are those
at the monitor, the call's own unless an optimizer stepped between (a GAN's other optimizer); random
numbers drawn on a CUDA device other than the current one at the call are not set back; under FSDP
and ZeRO no replay runs (a sharded forward on one rank would hang), nor for a model with a
``SyncBatchNorm`` in training mode under a process group (it gathers from every rank); other
collectives a forward makes itself (tensor parallelism, a mixture of experts' all-to-all) are not
known here; the arguments of each micro-step are held until the step's monitor (with gradient
accumulation, each micro-batch's).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...installed import HAS_SET_STANCE
from ...probes import find_producer, probe_call
from ...probes.tracing import compiled_in_place
from ...stats import ANY_AUTOCAST, cuda_devices

_AUTOCAST_DEVICES = ("cuda", "cpu")


@dataclass
class KeptForward:
    """One forward call of a trained model, kept for a replay: the model (not a wrapper), its
    arguments, the generators' states and autocast at the call, and the versions of its
    floating-point arguments (an in-place change after the call shows there)."""

    name: str
    model: nn.Module
    args: tuple
    kwargs: dict
    tensors: list
    versions: list
    cpu_rng: torch.Tensor
    cuda_rng: tuple[int, torch.Tensor] | None
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def of(cls, name: str, model: nn.Module, args: tuple, kwargs: dict, tensors: list) -> KeptForward:
        """The call ``model(*args, **kwargs)`` now beginning (``tensors``: its floating-point
        arguments, whose versions are read now)."""
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            cuda = (device, torch.cuda.get_rng_state(device))
        autocast: tuple = ()
        if torch._C._is_any_autocast_enabled():  # the user's own autocast (Accelerate's is in the model's forward)
            autocast = tuple(
                (device, torch.get_autocast_dtype(device))
                for device in _AUTOCAST_DEVICES
                if torch.is_autocast_enabled(device)
            )
        return cls(
            name,
            model,
            args,
            kwargs,
            tensors,
            [t._version for t in tensors],
            torch.get_rng_state(),
            cuda,
            autocast,
        )

    def changed(self) -> bool:
        """Whether an argument was changed in place since the call."""
        return any(t._version != v for t, v in zip(self.tensors, self.versions))


def replay_forwards(kept: list[KeptForward]) -> dict[str, Any] | None:
    """Replay ``kept`` in order until one names the module that made a NaN/Inf from finite inputs:
    ``{"component": its model's name, "module": the module's qualified name ("" for the model's own
    code between its modules), "micro_step": which of the model's calls of the step, from 0}``; None
    when none did (each replay stayed finite, or no module made it from finite inputs). A call whose
    arguments changed in place since (``"changed"``), one compiled in place on a torch without
    ``set_stance`` (``"compiled"``), or one whose forward gathers from the other ranks (a training
    ``SyncBatchNorm`` under a process group: ``"collective"``), is skipped: ``{"skipped": [why, ...]}``
    when nothing was named."""
    skipped = []
    kept = list(kept)
    for index, call in enumerate(kept):
        if call.changed():
            skipped.append("changed")
            continue
        if not HAS_SET_STANCE and _compiled_inside(call.model):
            skipped.append("compiled")
            continue
        if _gathers_in_forward(call.model):
            skipped.append("collective")
            continue
        made = find_producer(_replay(call))
        if made is not None:  # the first call to finish with finite inputs and a non-finite output
            micro_step = sum(
                1 for earlier in kept[:index] if earlier.name == call.name
            )  # one kept a model's micro-step
            return {"component": call.name, "module": made.module, "micro_step": micro_step}
    return {"skipped": skipped} if skipped else None


class _Replays(threading.local):
    """The replays running in this thread (a replay runs in its caller's thread)."""

    running = 0


_REPLAYS = _Replays()


def replaying_forward() -> bool:
    """Whether a replay of :func:`replay_forwards` is running in this thread: launch's hooks on the
    model take its call for none of the script's (asked only of a call without grad)."""
    return _REPLAYS.running > 0


def _compiled_inside(model: nn.Module) -> bool:
    """Whether a module of ``model`` was compiled in place (``model.compile()``): before torch 2.6 (no
    ``set_stance``) its replay with hooks would recompile it, so it is not replayed."""
    return any(map(compiled_in_place, model.modules()))


def _gathers_in_forward(model: nn.Module) -> bool:
    """Whether ``model``'s forward holds a collective: a ``SyncBatchNorm`` in training mode under a
    process group gathers every rank's statistics, and a replay on the one rank whose loss is NaN would
    wait there for ranks that never join."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    return any(isinstance(m, nn.SyncBatchNorm) and m.training for m in model.modules())


def _replay(call: KeptForward) -> list:
    devices = cuda_devices((call.args, call.kwargs, list(call.model.parameters())[:1]))
    if call.cuda_rng is not None and call.cuda_rng[0] not in devices:  # set below: put back after, whatever
        devices.append(call.cuda_rng[0])  # the current device is now
    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
        torch.set_rng_state(call.cpu_rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state(call.cuda_rng[1], call.cuda_rng[0])
        if call.autocast and ANY_AUTOCAST():  # one count more: the regions left at count 0
            torch.autocast_increment_nesting()  # (a script's autocast on without a region) cleared its weight cache
            stack.callback(torch.autocast_decrement_nesting)
        for device, dtype in call.autocast:  # the script's cache neither read nor written (keyed by weight alone:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))  # another dtype's raised)
        if HAS_SET_STANCE:  # a module compiled in place (model.compile()) runs its Python: no recompile
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(warnings.catch_warnings())  # the replay's own (a checkpoint's, under no_grad):
        warnings.simplefilter("ignore")  # none of them is the run's
        _REPLAYS.running += 1
        try:
            return probe_call(call.model, call.args, call.kwargs)
        finally:
            _REPLAYS.running -= 1
