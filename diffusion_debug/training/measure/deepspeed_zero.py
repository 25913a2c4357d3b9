"""DeepSpeed ZeRO (stages 1, 2 and 3): where the engine keeps each watched parameter's gradient and
weight on this rank. After ``engine.backward`` ZeRO holds the reduced gradients in its own
partitioned buffers and leaves ``.grad`` None: stages 1 and 2 keep, on the rank whose flat
partition holds it, a fragment of each parameter's averaged gradient (``param._hp_mapping``);
stage 3 a partition of every parameter (``param.ds_id``; its weight too, ``param.ds_tensor``).
These fragments are this rank's shards, read like FSDP2's: ``shards.ShardNorms`` sums the squares
of their norms over the ranks (a fragment is empty where another rank holds the whole parameter).

Without ZeRO (stage 0) the gradients are read in ``.grad``, as plain ones (``deepspeed_stage0``);
what both say of a step (loss scale, overflow skip, the float32 copies trained: :func:`trained_copies`)
is read through :class:`DeepSpeedSteps`.

DeepSpeed is never imported here: a parameter ZeRO set up says so by its attributes, and an engine
or ZeRO optimizer is recognised by its class once ``deepspeed`` is in ``sys.modules``.

The fragments exist between ``engine.backward`` and ``engine.step`` at a gradient accumulation
boundary, where a raw engine's loop calls the monitor. Accelerate's DeepSpeed plugin runs
``engine.step`` inside ``accelerator.backward``, before the monitor: there (``step_in_backward``)
:meth:`ZeroPartitions.attach` wraps the ZeRO optimizer's ``step`` (an instance attribute, removed
on detach) to keep, on the device, each fragment's norm and largest magnitude just before the
update (:meth:`ZeroPartitions.captured`), and the overflow flag after it.

Limits: construct the debugger after ``deepspeed.initialize`` / ``accelerator.prepare`` (it finds
the partitions on the parameters); with ZeRO's CPU offload the fragments are read on the host,
where they are; stage 3 reads a float32 copy of each partition, so ``zero_gradients`` (policy
``skip``) reaches stages 1 and 2 only, and nothing under Accelerate (the step already ran): the
debugger refuses policy ``skip`` there (:meth:`ZeroPartitions.unzeroable`) before it starts; on
stage 3 the update sketch and weight checks see empty parameters outside forward (not judged). An
engine whose ``managed_gradient_accumulation`` is false (:meth:`DeepSpeedSteps.unmanaged`) has its
gradients whole only inside ``engine.step()``, after the monitor: none is read, which its first call
says (a ``debugger_error``).
The tests run stages 2 and 3 on a raw engine, and stage 2 under Accelerate's plugin through
``launch`` (two CPU processes: the script names gloo to Accelerate, else each process trains
alone); stage 1 and gradient accumulation were checked by hand (and again in session 39: ZeRO-1 and
ZeRO-2, 2 micro-steps, two ranks, norms equal to ``get_global_grad_norm()``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable

import torch

from ...core.instance_methods import StackedOnInstance
from ...probes import ProbeHandle


def _deepspeed_class(path: str) -> type | None:
    """A DeepSpeed class by ``module:name``, only when DeepSpeed was imported (by the user)."""
    module_name, _, name = path.partition(":")
    if "deepspeed" not in sys.modules:
        return None
    module = sys.modules.get(module_name)
    return getattr(module, name, None) if module is not None else None


def is_engine(obj: Any) -> bool:
    """``obj`` is a ``deepspeed.DeepSpeedEngine`` (what ``deepspeed.initialize`` and Accelerate's
    DeepSpeed plugin return as the model)."""
    engine = _deepspeed_class("deepspeed.runtime.engine:DeepSpeedEngine")
    return engine is not None and isinstance(obj, engine)


def engines_among(models: Iterable[Any], accelerator: Any = None) -> list[Any]:
    """The DeepSpeed engines among ``models`` and the Accelerator's prepared models, each once."""
    engines: list[Any] = []
    for candidate in [*models, *(getattr(accelerator, "_models", None) or [])]:
        # the engine watched is also the Accelerator's: once (each optimizer's step is wrapped once)
        if is_engine(candidate) and not any(candidate is e for e in engines):
            engines.append(candidate)
    return engines


def zero_optimizer(obj: Any) -> Any:
    """The ZeRO optimizer inside ``obj`` (an engine, Accelerate's wrapper, the ZeRO optimizer
    itself), or None."""
    return _inner(obj, "deepspeed.runtime.base_optimizer:ZeROOptimizer")


def deepspeed_optimizer(obj: Any) -> Any:
    """DeepSpeed's optimizer inside ``obj``: a ZeRO one, or the mixed-precision wrapper of an engine
    without ZeRO (stage 0: ``FP16_Optimizer``, ``FP16_UnfusedOptimizer``, ``BF16_Optimizer``), or None."""
    return _inner(obj, "deepspeed.runtime.base_optimizer:DeepSpeedOptimizer")


def _inner(obj: Any, path: str) -> Any:
    """The first object of the DeepSpeed class ``path`` down ``obj``'s chain of ``optimizer``s."""
    base = _deepspeed_class(path)
    seen: set[int] = set()
    while obj is not None and id(obj) not in seen and base is not None:
        seen.add(id(obj))
        if isinstance(obj, base):
            return obj
        obj = getattr(obj, "optimizer", None)
    return None


def _stage3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "_z3_optimizer")


def _partitioned(param: torch.Tensor) -> bool:
    return _stage3(param) or hasattr(param, "_hp_mapping")


def step_in_backward(accelerator: Any) -> bool:
    """Accelerate's DeepSpeed plugin is in use: ``accelerator.backward`` runs ``engine.step``."""
    state = getattr(accelerator, "state", None)
    return getattr(state, "deepspeed_plugin", None) is not None


@dataclass
class CapturedGradients:
    """Each fragment's L2 norm and largest magnitude (float32, on the device) just before a ZeRO step."""

    norms: torch.Tensor
    largest: torch.Tensor
    loss_scale: float | None = None
    """fp16's loss scale the fragments were scaled by then (:meth:`ZeroPartitions.loss_scale`)."""
    overflow: bool | None = None
    """Whether that step skipped its update (its optimizer's overflow flag after it; None: unknown)."""


class DeepSpeedSteps:
    """DeepSpeed's word on a step, as the step row reads it (``TrainableParameters.deepspeed``): its
    fp16 loss scale (:meth:`loss_scale`), its overflow skip (:meth:`step_skipped`), the float32 copies
    its optimizer trains (:meth:`trained`). Where the engine's ``step`` runs inside
    ``accelerator.backward`` (Accelerate's DeepSpeed plugin: :attr:`capture`), :meth:`attach` wraps
    that ``step`` (:meth:`_stepping`: an instance attribute, removed on detach) to keep, on the
    device, each gradient's norm and largest magnitude just before the update (:meth:`captured`),
    and the overflow flag after it (:meth:`captured_skip`). ``ZeroPartitions`` (ZeRO's fragments)
    and ``deepspeed_stage0.EngineWithoutZero`` (``.grad``) say where the gradients are.

    Several engines (a UNet's and a text encoder's, each stepped in its own backward, which then
    zeroes its gradients): each engine's step keeps its own parameters' (:func:`_owners`), the
    monitor reads them together (:meth:`_current`); the step's skip is any engine's. Several
    debuggers on one engine each wrap its ``step`` and remove only their own (:class:`_StepWrap`)."""

    params: list[torch.Tensor]
    engines: list[Any]
    optimizers: list[Any]
    capture: bool
    _empty: torch.Tensor
    holds_scale = True
    """The gradients hold :meth:`loss_scale` (False: DeepSpeed's fp16 engine without ZeRO never scaled
    the loss, ``deepspeed_fp16_scale``: read as they are, the scale kept in the row)."""

    def _start(self) -> None:
        self._kept: list[CapturedGradients | Exception | None] = []
        """Each wrapped step's keeping since the monitor last read (None: it has not stepped since)."""
        self._owned: list[list[int] | None] = []
        """The watched parameters each wrapped step keeps (None: all of them, one engine)."""
        self._flags: list[Any] = []
        self._combined: CapturedGradients | None = None
        """What the monitor read of the steps since the one before (None: a step has kept since)."""
        self._monitored: CapturedGradients | None = None
        """The last monitored step's: its overflow is the one judged at close (:meth:`last_skip`)."""
        self._previous: CapturedGradients | None = None
        """The monitored step before it: its overflow is judged a step later (:meth:`captured_skip`)."""

    def _step_gradients(self, owned: list[int] | None) -> list[torch.Tensor]:
        """The gradients of the watched parameters at ``owned`` (None: all) as the step about to run
        applies them (empty: none)."""
        raise NotImplementedError

    def _live_scale(self, optimizer: Any) -> float | None:
        """fp16's loss scale that the gradients hold now (None: none)."""
        raise NotImplementedError

    def loss_scale(self, optimizer: Any) -> float | None:
        """fp16's loss scale the step's gradients hold (of ``optimizer``, else of the engine's)."""
        raise NotImplementedError

    def step_skipped(self, optimizer: Any) -> bool | None:
        """Whether the last ``step()`` skipped its update for non-finite gradients (None: unknown)."""
        raise NotImplementedError

    def at_boundary(self) -> bool:
        """A raw engine's loop (between ``engine.backward`` and ``engine.step``) is at a gradient accumulation
        boundary: the engine has reduced the step's gradients (ZeRO into its fragments; without ZeRO, stage 0,
        all-reduced ``.grad``) and its ``step`` steps the optimizer. Off it, a micro-step (no engine: True). Read
        from the engines with an optimizer only: one without (stage 0 keeps it, :meth:`EngineWithoutZero.find`)
        is never stepped, so under ``gradient_accumulation_steps > 1`` never reaches its boundary."""
        engines = [e for e in self.engines if getattr(e, "optimizer", None) is not None]
        return all(bool(e.is_gradient_accumulation_boundary()) for e in engines)

    def unmanaged(self) -> bool:
        """An engine's ``managed_gradient_accumulation`` is false (DeepSpeed 0.19 on): the loop owns the boundary,
        which exists only inside ``engine.step()``, where the engine also reduces (stage 0 and 1) or finalizes
        (stage 2: its fragments raise until then) the gradients; the monitor, called before it, reads none."""
        return any(not getattr(e, "managed_gradient_accumulation", lambda: True)() for e in self.engines)

    def steps_taken(self) -> tuple[int, ...]:
        """Each engine's ``global_steps``: it counts every optimizer step the engine took, those its
        overflow check skipped too (a report tells by it whether the last monitored step's has run)."""
        return tuple(int(getattr(engine, "global_steps", 0)) for engine in self.engines)

    def trained(self, optimizers: Iterable[Any]) -> tuple[set[int], list[torch.Tensor]]:
        """:func:`trained_copies` of the DeepSpeed optimizers among ``optimizers`` and the engines'."""
        return trained_copies([*optimizers, *self.optimizers])

    def unzeroable(self) -> str | None:
        """Why ``gradients.zero_gradients`` (policy ``skip``) cannot reach the gradients that the
        engine's next step applies (``signatures.check_policy``); None where it can."""
        if self.capture:
            return (
                "Accelerate's DeepSpeed plugin runs the optimizer step inside accelerator.backward, before "
                "monitor_training_step, so the step's gradients are applied already"
            )
        return None

    def _stepping(self) -> list[tuple[Any, Any, Any]]:
        """``(engine, the object whose step is wrapped, the optimizer whose overflow flag it sets)``."""
        raise NotImplementedError

    def attach(self) -> ProbeHandle:
        """With :attr:`capture`: the engines' step keeps the gradients' norms first (:meth:`_stepping`)."""
        if not self.capture:
            return ProbeHandle()
        stepping = self._stepping()
        self._owned = _owners(self.params, [engine for engine, _, _ in stepping])
        self._flags = [flag for _, _, flag in stepping]
        if len(self._kept) != len(stepping):  # attached again (resumed): what was kept stays read, as before
            self._kept = [None] * len(stepping)
        wraps = [
            _StepWrap(wrapped, partial(self._keep, i), partial(self._stepped, i), flag)
            for i, (_, wrapped, flag) in enumerate(stepping)
        ]
        return ProbeHandle(wraps)

    @torch.no_grad()
    def _keep(self, i: int) -> None:
        """Never raises into the user's step: a failure is raised where the monitor reads it."""
        self._combined = None
        try:
            gradients = self._step_gradients(self._owned[i])
            scale = self._live_scale(self._flags[i])  # the step may lower it (an overflow): the one they hold now
            if not gradients:  # an engine none of whose parameters are watched
                self._kept[i] = CapturedGradients(self._empty.float(), self._empty.float(), scale)
                return
            zero = gradients[0].new_zeros(())  # an empty gradient has no largest magnitude: 0
            gradients = [g if g.numel() else zero for g in gradients]
            norms = torch._foreach_norm(gradients, 2, dtype=torch.float32)
            largest = torch._foreach_norm(gradients, math.inf)  # non-finite exactly where a NaN/Inf is
            self._kept[i] = CapturedGradients(torch.stack(norms), torch.stack([v.float() for v in largest]), scale)
        except Exception as error:
            self._kept[i] = error

    def _stepped(self, i: int, overflow: Any) -> None:
        kept = self._kept[i]
        if isinstance(kept, CapturedGradients):
            kept.overflow = bool(overflow)

    def _current(self) -> CapturedGradients:
        """What the steps since the last monitor kept (the engines' together), now the monitored step's."""
        if self._combined is None:
            kept = self._kept
            for failed in kept:
                if isinstance(failed, Exception):
                    raise failed
            if all(k is None for k in kept):
                raise RuntimeError("no DeepSpeed step has run since the debugger was attached")
            self._combined = kept[0] if len(kept) == 1 else _combine(len(self.params), self._owned, kept)
            self._kept = [None] * len(kept)  # an engine that does not step again: its gradients read 0
        if self._combined is not self._monitored:
            self._previous, self._monitored = self._monitored, self._combined
        return self._combined

    def captured(self) -> CapturedGradients | None:
        """What the steps since the last monitor kept (:attr:`capture`), else None: read the live gradients."""
        return self._current() if self.capture else None

    def captured_skip(self) -> bool | None:
        """With :attr:`capture`, whether the monitored step before this one skipped its update (the
        monitor judges it a step later, as a raw engine's, whose step comes after the monitor)."""
        try:
            self._current()
        except Exception:  # the step's measure fails on it
            return None
        return self._previous.overflow if self._previous is not None else None

    def last_skip(self, optimizer: Any) -> bool | None:
        """At close, whether the last monitored step skipped its update: with :attr:`capture`, the
        flag its step (which ran before that monitor) left, not a later step's (a backward after the
        last monitor); else :meth:`step_skipped`'s."""
        if self.capture:
            return self._monitored.overflow if self._monitored is not None else None
        return self.step_skipped(optimizer)

    def captured_scale(self) -> float | None:
        """With :attr:`capture`, fp16's loss scale kept before the step that ran in backward."""
        try:
            return self._current().loss_scale
        except Exception:  # the step's measure fails on it
            return None


def _owners(params: list[torch.Tensor], engines: list[Any]) -> list[list[int] | None]:
    """The positions in ``params`` each engine's step keeps: its own parameters (one engine: all of
    them, None); a parameter no engine holds, at the last engine's step (read then, as before)."""
    if len(engines) < 2:
        return [None] * len(engines)
    held = [{id(p) for p in engine.parameters()} for engine in engines]
    owned: list[list[int] | None] = [[] for _ in engines]
    for j, param in enumerate(params):
        owned[next((i for i, ids in enumerate(held) if id(param) in ids), len(engines) - 1)].append(j)
    return owned


def _combine(
    count: int, owned: list[list[int] | None], kept: list[CapturedGradients | Exception | None]
) -> CapturedGradients:
    """Several engines' keepings as one step's: each parameter's from its engine's step (0 where that
    engine has not stepped since), rescaled to the first loss scale (each engine's fp16 scale is its
    own), skipped where any engine skipped."""
    steps = [(index, k) for index, k in zip(owned, kept) if isinstance(k, CapturedGradients)]
    device = steps[0][1].norms.device
    scale = next((k.loss_scale for _, k in steps if k.loss_scale is not None), None)
    norms, largest = torch.zeros(count, device=device), torch.zeros(count, device=device)
    for index, k in steps:
        if index:
            at, ratio = torch.tensor(index, device=device), (scale or 1.0) / (k.loss_scale or 1.0)
            norms[at], largest[at] = k.norms.to(device) * ratio, k.largest.to(device) * ratio
    flags = [k.overflow for _, k in steps if k.overflow is not None]
    return CapturedGradients(norms, largest, scale, any(flags) if flags else None)


class ZeroPartitions(DeepSpeedSteps):
    """This rank's fragments of the watched parameters' gradients and weights under ZeRO."""

    def __init__(self, params: list[torch.Tensor], engines: list[Any], capture: bool = False):
        self.params = params
        self.engines = engines
        self.optimizers = [o for o in (zero_optimizer(e) for e in engines) if o is not None]
        """The ZeRO optimizers of the engines found (to read their overflow skip)."""
        self.capture = capture and bool(self.optimizers)
        """The step runs before the monitor (Accelerate's plugin): read what :meth:`attach` kept."""
        self._empty = torch.zeros(0, dtype=params[0].dtype, device=params[0].device)
        self._start()

    def _stepping(self) -> list[tuple[Any, Any, Any]]:
        """Each engine's ZeRO optimizer's ``step``, which sets its own overflow flag."""
        return [(e, z, z) for e in self.engines if (z := zero_optimizer(e)) is not None]

    def _step_gradients(self, owned: list[int] | None) -> list[torch.Tensor]:
        params = self.params if owned is None else [self.params[j] for j in owned]
        return [self._gradient(p) for p in params]

    @classmethod
    def find(cls, params: list[torch.Tensor], models: Iterable[Any], accelerator: Any = None) -> ZeroPartitions | None:
        """The partitions when ZeRO set up every trainable parameter (after ``deepspeed.initialize``),
        else None. ``models``: the watched models (an engine among them gives its optimizer)."""
        if "deepspeed" not in sys.modules or not params or not all(_partitioned(p) for p in params):
            return None
        return cls(params, engines_among(models, accelerator), capture=step_in_backward(accelerator))

    def unzeroable(self) -> str | None:
        """:meth:`DeepSpeedSteps.unzeroable`, and ZeRO-3's copies (stages 1 and 2 on a raw engine: None)."""
        if self.capture:
            return super().unzeroable()
        if any(_stage3(p) for p in self.params):
            return (
                "DeepSpeed ZeRO-3 lends the debugger a float32 copy of each gradient partition, not the one it applies"
            )
        return None

    def gradients(self) -> list[torch.Tensor | None]:
        """Each parameter's gradient fragment on this rank (empty where another rank holds it;
        None after the step, with :attr:`capture`)."""
        if self.capture:
            return [None] * len(self.params)
        return [self._gradient(p) for p in self.params]

    def _gradient(self, param: torch.Tensor) -> torch.Tensor:
        if _stage3(param):
            grad = param._z3_optimizer.get_local_fp32_grad_for_param(param)
            return self._empty if grad is None else grad
        mapping = param._hp_mapping
        if mapping is None:
            return self._empty
        return mapping.get_lp_grad_fragment(param._index_in_param_group)

    def weights(self) -> list[torch.Tensor]:
        """Each parameter's weight fragment on this rank, matching :meth:`gradients` (stages 1 and 2
        keep whole weights on every rank: the fragment of the same elements)."""
        out = []
        for p in self.params:
            if _stage3(p):
                out.append(p.ds_tensor.detach())
            elif p._hp_mapping is None:
                out.append(self._empty)
            else:
                address = p._hp_mapping.lp_fragment_address
                out.append(p.detach().reshape(-1).narrow(0, address.start, address.numel))
        return out

    def step_skipped(self, optimizer: Any) -> bool | None:
        """Whether ZeRO's last ``step()`` skipped the update for non-finite gradients (its overflow
        check: "OVERFLOW! Skipping step"): of the optimizer passed, else of the engine's. With
        :attr:`capture`, the step before the one just taken (the monitor judges it a step later,
        as a raw engine's, whose step comes after the monitor)."""
        if self.capture:
            return self.captured_skip()
        found = zero_optimizer(optimizer)
        for candidate in [found] if found is not None else self.optimizers:
            flag = getattr(candidate, "overflow", None)
            if isinstance(flag, bool):
                return flag
        return None

    def loss_scale(self, optimizer: Any) -> float | None:
        """fp16's loss scale (DeepSpeed's dynamic or static loss scaler) that the gradient fragments
        hold until the step unscales them, of the optimizer passed, else of the engine's; None where
        none is applied (bf16 and fp32: a scale of 1). With :attr:`capture`, the one kept before
        the step that ran in backward. Read like a GradScaler's: the norms are divided by it, and
        a NaN/Inf under it is an overflow the loss scaler skips (info), not an error."""
        if self.capture:
            return self.captured_scale()
        return self._live_scale(optimizer)

    def _live_scale(self, optimizer: Any) -> float | None:
        found = zero_optimizer(optimizer)
        for zero in [found] if found is not None else self.optimizers:
            if not (getattr(zero, "dynamic_loss_scale", False) or getattr(zero, "custom_loss_scaler", False)):
                scale = getattr(getattr(zero, "loss_scaler", None), "cur_scale", 1.0)  # a static one: fp16's
            else:
                scale = getattr(zero, "loss_scale", None)
            try:
                scale = float(scale)
            except (TypeError, ValueError):
                return None
            return scale if scale != 1.0 and math.isfinite(scale) and scale > 0 else None
        return None


_COPIES = (
    ("single_partition_of_fp32_groups", "bit16_groups"),  # ZeRO 1 and 2
    ("fp32_partitioned_groups_flat", "fp16_groups"),  # ZeRO 3
    ("fp32_groups_flat_partition", "bf16_groups"),  # BF16_Optimizer
    ("fp32_groups_flat", "fp16_groups"),  # FP16_Optimizer: one flat copy a group
    ("fp32_groups", "fp16_groups"),  # FP16_UnfusedOptimizer: a copy of each parameter
)
"""DeepSpeed optimizers' ``(float32 copies its torch optimizer trains, the model parameters they
stand for)`` attributes, each a list by parameter group."""


def trained_copies(optimizers: Iterable[Any]) -> tuple[set[int], list[torch.Tensor]]:
    """The float32 copies (by ``id``: flat partitions under ZeRO, flat groups or per-parameter
    copies without it) that the DeepSpeed optimizers among ``optimizers`` hand to their torch
    optimizer, and the model parameters they stand for; nothing without DeepSpeed."""
    flat: set[int] = set()
    trained: list[torch.Tensor] = []
    for found in (deepspeed_optimizer(o) for o in optimizers):
        if found is None:
            continue
        for copies, _ in _COPIES:
            for copy in getattr(found, copies, None) or []:
                flat.update(id(t) for t in (copy if isinstance(copy, (list, tuple)) else [copy]))
        for groups in dict.fromkeys(groups for _, groups in _COPIES):
            trained += [p for group in getattr(found, groups, None) or [] for p in group]
    return flat, trained


class _StepWrap(StackedOnInstance):
    """``zero.step`` that calls ``before()`` first and ``after(overflow)`` last (``flag``'s
    ``overflow``, else ``zero``'s), removed alone among several debuggers' wrappers of that ``step``."""

    def __init__(self, zero: Any, before: Any, after: Any, flag: Any = None):
        self.before, self.after, self.flag = before, after, zero if flag is None else flag
        super().__init__(zero, "step")

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.original(*args, **kwargs)
        self.before()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.after(getattr(self.flag, "overflow", False))
