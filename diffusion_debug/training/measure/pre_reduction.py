"""Each rank's own gradients checked for NaN/Inf before DDP's all-reduce spreads them: after the
reduction every rank holds the same NaN, and only this check can tell which rank made it.

DDP: a communication hook that wraps the default all-reduce (``allreduce_hook``). Per bucket it
reads the bucket's local gradients once (``aminmax``) and adds two scalars on the device (three
kernels, no host read, no collective); the step's row carries ``local_nonfinite`` (1.0: some
bucket held NaN/Inf; two more scalar kernels, read with the step's one transfer) and
the step's fixed-size exchange (``ranks.summary``) names the ranks that made it. DDP takes one
hook only: a model that already has one (the user's, Accelerate's ``comm_hook``, DDP's mixed
precision) keeps it, and the check is off for it (:attr:`PreReductionCheck.off`); a hook the
user registers later replaces the default all-reduce inside ours (DDP's own
``register_comm_hook`` would refuse a second one). A copy or a pickle of the model
(``copy.deepcopy``, ``torch.save``) takes nothing of the check and runs as without it: the
hook is kept out of DDP's list of hooks (what a copy takes: its state holds the process group,
which no copy can take) and the model's ``register_comm_hook`` is an ``OnThisInstance``, as is each method
the check wraps on an engine's object (ZeRO's bucket, FSDP2's ``post_backward``, a stage-0 engine's all-reduce).

>>> check = PreReductionCheck.attach([torch.nn.Linear(2, 2)])
>>> check.watching, check.off
(False, [])

FSDP2: each ``fully_shard`` group's unsharded gradients, just before its reduce-scatter (its
``post_backward``, wrapped on the group object): the same count, one ``aminmax`` per parameter.

DeepSpeed ZeRO stages 1, 2 and 3 (:meth:`PreReductionCheck.wrap_zero`): each parameter's gradient
as it enters the engine's reduction bucket; DeepSpeed without ZeRO (stage 0, an engine among the
models: :meth:`PreReductionCheck.wrap_engine`): each ``.grad`` as the engine's all-reduce starts.

Not FSDP1 (``FullyShardedDataParallel``): said in :attr:`PreReductionCheck.off`.

Limits: a DDP hook
registered before the debugger keeps the check off for that model, and so does a world size that
is not a power of two (DDP's default scales by 1/size while copying, a hook divides by size after:
equal only when size is a power of two, so the check never changes a gradient); FSDP2's groups are found
through its private state (a torch that moves them: not checked).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import torch

from ...core.instance_methods import MISSING, OnThisInstance
from ...probes.tracing import eager_module
from .deepspeed_zero import is_engine
from .wrappers import fsdp1_type, unwrap_model

_DDP_TYPES: tuple[type, ...] = ()
try:
    from torch.nn.parallel import DistributedDataParallel

    _DDP_TYPES = (DistributedDataParallel,)
except ImportError:  # pragma: no cover - torch without distributed
    pass


_HOOKED: "weakref.WeakKeyDictionary[Any, _HookState]" = weakref.WeakKeyDictionary()
"""The DDP models that run our comm hook, with its state (DDP keeps a hook: a later debugger takes it over)."""

FSDP1_NOT_CHECKED = (
    "FSDP1's (FullyShardedDataParallel) gradients are not checked before its gradient reduce-scatter: "
    "the rank that made a NaN is not known"
)


class PreReductionCheck:
    """The DDP models' comm hooks of one debugger, and this step's counts so far."""

    def __init__(self) -> None:
        self.spread: torch.Tensor | None = None
        """This step's buckets' (largest - smallest) local value, summed in float64 on the device:
        non-finite when some bucket held NaN/Inf; None: no bucket yet."""
        self.watching = False
        """Some model's reduction is checked."""
        self.active = True
        """False once the debugger is closed: the hook only forwards to the all-reduce."""
        self.off: list[str] = []
        """Why a model's reduction is not checked (one sentence each)."""
        self.failure: Exception | None = None
        """The first error of the check inside a hook (the all-reduce still ran)."""
        self._wrapped: list[tuple[Any, str, Any, Any]] = []
        """``(object, name, our wrapper, its own attribute before or None)`` of each wrap, for :meth:`release`."""

    @classmethod
    def attach(cls, models: Iterable[Any]) -> "PreReductionCheck":
        """The check on every DDP model among ``models`` that has no comm hook yet, and on every
        FSDP2 parameter group inside them."""
        check = cls()
        for model in models:
            if _DDP_TYPES and isinstance(model, _DDP_TYPES):
                check._wrap(model)
            elif is_engine(model) and not model.zero_optimization():
                check.wrap_engine(model)
            elif isinstance(model, torch.nn.Module):
                for group in fsdp_groups(model):
                    check._wrap_fsdp(group)
                if fsdp1_models([model]):
                    check.off.append(FSDP1_NOT_CHECKED)
        return check

    @classmethod
    def of_run(cls, params: Any, models: list[Any], accelerator: Any = None) -> "PreReductionCheck":
        """The check of a run of several processes watching ``models``: on ZeRO's optimizers where its
        partitions hold ``params``' gradients (a ``gradients.TrainableParameters``), else :meth:`attach`'s
        on ``models`` and the accelerator's DDP wrappers of them."""
        if params.partitions is not None:
            check = cls()
            for zero in params.partitions.optimizers:
                check.wrap_zero(zero)
            return check
        return cls.attach(models + [m for m in ddp_models(models, accelerator) if all(m is not w for w in models)])

    @classmethod
    def attach_live(cls, modules: Iterable[Any]) -> "PreReductionCheck":
        """The check on every DDP model among ``modules`` and on the FSDP2 groups each of them holds
        itself (not its children's: ``modules`` is every module alive, ``launch``'s list before the
        debugger is made). Reads no parameter: between forward and backward FSDP2's root holds its
        unsharded ones."""
        check, seen = cls(), set()
        for module in modules:
            if _DDP_TYPES and isinstance(module, _DDP_TYPES):
                check._wrap(module)
            elif isinstance(module, torch.nn.Module):
                for group in _own_fsdp_groups(module):
                    if id(group) not in seen:  # modules sharded together share one group
                        seen.add(id(group))
                        check._wrap_fsdp(group)
        return check

    def carry(self, earlier: "PreReductionCheck") -> None:
        """This step's count so far is ``earlier``'s (released first: a check attached before this
        one, by ``launch`` before step 0's backward, when the debugger is made after it); its failure too."""
        earlier.release()
        if self.watching and self.spread is None and earlier.spread is not None:
            self.spread = earlier.spread
        self.failure = self.failure or earlier.failure

    def wrap_zero(self, zero: Any) -> None:
        """DeepSpeed ZeRO: each parameter's local gradient checked as it goes into the engine's
        reduction bucket (``reduce_independent_p_g_buckets_and_remove_grads``, wrapped on the ZeRO
        optimizer object; the engine's gradient hooks call it through the object). Stages 1 and 2
        read it where the engine does (``get_gradient_for_reduction``), stage 3 in ``.grad`` (the
        whole local gradient until the bucket's reduce-scatter; skipped, as by the engine, while
        ``ds_grad_is_ready`` is False). An optimizer without that method: not checked, said in :attr:`off`."""
        original = getattr(zero, "reduce_independent_p_g_buckets_and_remove_grads", None)
        read = getattr(zero, "get_gradient_for_reduction", None) or _zero3_gradient
        if original is None:
            self.off.append(
                f"DeepSpeed's {type(zero).__name__} is not checked before its gradient reduction (ZeRO's "
                "reduction bucket not found): the rank that made a NaN is not known"
            )
            return

        def reduce_bucket(param: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                try:
                    grad = read(param)
                    if grad is not None:
                        self.add(grad)
                except Exception as error:  # never the user's run: the reduction below still runs
                    self.failure = self.failure or error
            return original(param, *args, **kwargs)

        self._set(zero, "reduce_independent_p_g_buckets_and_remove_grads", reduce_bucket)

    def wrap_engine(self, engine: Any) -> None:
        """DeepSpeed without ZeRO (stage 0): each parameter's local ``.grad`` checked as the engine's
        ``allreduce_gradients`` starts (wrapped on the engine object, whose ``backward`` calls it
        through the object) at a gradient accumulation boundary, where it all-reduces them."""
        original = engine.allreduce_gradients

        def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
            if self.active and engine.is_gradient_accumulation_boundary():
                try:
                    for param in engine.module.parameters():
                        if param.grad is not None:
                            self.add(param.grad)
                except Exception as error:  # never the user's run: the all-reduce below still runs
                    self.failure = self.failure or error
            return original(*args, **kwargs)

        self._set(engine, "allreduce_gradients", allreduce_gradients)

    def _wrap_fsdp(self, group: Any) -> None:
        """FSDP2: the group's unsharded gradients checked just before its reduce-scatter (its
        ``post_backward``, which FSDP2 calls on the group object)."""
        original = group.post_backward

        def post_backward(*args: Any, **kwargs: Any) -> Any:
            if self.active and getattr(group, "reduce_grads", True):
                try:
                    for fsdp_param in group.fsdp_params:
                        if not hasattr(fsdp_param, "_unsharded_param"):
                            continue
                        for grad in (fsdp_param.unsharded_accumulated_grad, fsdp_param.unsharded_param.grad):
                            if grad is not None:
                                self.add(getattr(grad, "_local_tensor", grad))
                except Exception as error:  # never the user's run: the reduce-scatter below still runs
                    self.failure = self.failure or error
            return original(*args, **kwargs)

        self._set(group, "post_backward", post_backward)

    def _set(self, owner: Any, name: str, wrapper: Any) -> None:
        # an OnThisInstance: a copy or pickle of the owner (a stage-0 engine deep-copied) gets its own method,
        # not our closure, which would read the original's gradients and reduce the original's
        own = vars(owner).get(name, MISSING)
        wrapper = OnThisInstance(wrapper, owner=owner, name=name, previous=own)
        self._wrapped.append((owner, name, wrapper, None if own is MISSING else own))
        setattr(owner, name, wrapper)
        self.watching = True

    def release(self) -> None:
        """When the debugger closes: the ZeRO and FSDP2 objects get back what they held (a wrapper
        that someone wrapped again stays, forwarding); DDP's comm hook stays (DDP cannot drop one),
        forwarding to the all-reduce as :attr:`active` is False."""
        self.active = False
        while self._wrapped:
            owner, name, wrapper, own = self._wrapped.pop()
            if vars(owner).get(name) is wrapper:
                if own is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)

    def _wrap(self, ddp: Any) -> None:
        earlier = _HOOKED.get(ddp)
        if earlier is not None:  # an earlier debugger's (DDP keeps it): ours now
            earlier.check = self
            self.watching = True
            return
        hooks = getattr(ddp, "_comm_hooks", None) or []
        if hooks or _builtin_hook(ddp):
            self.off.append(
                f"the DDP model has a communication hook already ({_hook_name(ddp)}), and DDP takes one: "
                "the gradients are not checked before the all-reduce, so the rank that made a NaN is not known"
            )
            return
        size = _world_size(getattr(ddp, "process_group", None))
        if size & (size - 1):  # 3, 6, 12 ranks: 1/size is inexact, and the rounding would change
            self.off.append(
                f"the DDP model runs on {size} ranks, not a power of two: DDP's own all-reduce scales a "
                "gradient by 1/size as it copies it and a communication hook divides by size, which round "
                "differently, so the gradients are not checked before the all-reduce (the rank that made a "
                "NaN is not known) rather than changed"
            )
            return
        state = _HookState(self, getattr(ddp, "process_group", None))
        try:
            ddp.register_comm_hook(state, _checked_allreduce)
        except Exception as error:  # e.g. a built-in hook this torch does not report
            self.off.append(f"the DDP communication hook could not be registered ({error})")
            return
        finally:  # the reducer runs it (DDP lists it before its reducer may refuse it); DDP's list of
            # hooks is what a copy or a pickle of the model takes (our state holds the process group,
            # which neither can take: a copy runs DDP's own all-reduce)
            hooks = getattr(ddp, "_comm_hooks", None) or []
            if hooks and hooks[-1][0] is _checked_allreduce:
                hooks.pop()
        _HOOKED[ddp] = state
        self.watching = True

        def register_comm_hook(user_state: object, hook: Any) -> None:
            """The user's hook, registered after ours: it replaces the default all-reduce inside ours,
            and DDP's list of hooks holds it as without ours (a copy of the model takes it; DDP's
            compiled-autograd reducer runs that list)."""
            ddp._check_comm_hook(hook)
            state.inner = (hook, user_state)
            ddp._comm_hooks.append((hook, user_state))

        # DDP's would refuse a second hook; a copy of the model gets DDP's own (``OnThisInstance``)
        ddp.register_comm_hook = OnThisInstance(register_comm_hook, owner=ddp, name="register_comm_hook")

    def take(self, zero: torch.Tensor) -> torch.Tensor:
        """1.0 when this step's local gradients held NaN/Inf before the all-reduce, else 0.0
        (float64 on ``zero``'s device; NaN: not checked), and the check starts again. No host read."""
        spread = self.spread
        self.spread = None
        if (
            not self.watching or spread is None or self.failure is not None
        ):  # None: no bucket checked since the last step (e.g. a debugger made
            return zero + math.nan  # after a backward, with no earlier check to carry)
        return (~torch.isfinite(spread)).to(device=zero.device, dtype=torch.float64)

    def reset(self) -> None:
        self.spread = None

    def add(self, buffer: torch.Tensor) -> None:
        """One bucket's local gradients, before the all-reduce: its smallest and largest value in
        one pass (``aminmax`` keeps a NaN), their difference added in float64 (a finite bucket's
        cannot overflow there): the sum is finite exactly when every bucket was."""
        low, high = torch.aminmax(buffer)
        if self.spread is None:
            self.spread = torch.zeros((), dtype=torch.float64, device=buffer.device)
        self.spread = self.spread + high - low


class _HookState:
    """What the comm hook is given: the check, DDP's process group, and the all-reduce it wraps."""

    def __init__(self, check: PreReductionCheck, process_group: Any):
        self.check = check
        self.process_group = process_group
        self.inner: tuple[Any, object] | None = None
        """A hook the user registered after ours, with its state (None: the default all-reduce)."""


def _checked_allreduce(state, bucket):  # DDP checks these annotations: none (strings would fail)
    """The check of ``bucket``'s local gradients, then the all-reduce (the user's hook, if given)."""
    check = state.check
    if check.active:
        try:
            check.add(bucket.buffer())
        except Exception as error:  # never the user's run: the all-reduce below still runs
            check.failure = check.failure or error
    if state.inner is not None:
        hook, user_state = state.inner
        return hook(user_state, bucket)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(state.process_group, bucket)


def _zero3_gradient(param: Any) -> torch.Tensor | None:
    """ZeRO-3: the parameter's local gradient as the engine adds it to its bucket (None: not yet,
    a transient gradient the engine leaves for a later call)."""
    if not getattr(param, "ds_grad_is_ready", True) or param.grad is None or param.grad.numel() == 0:
        return None
    return param.grad


def _world_size(process_group: Any) -> int:
    import torch.distributed as dist

    try:
        return int(dist.get_world_size(process_group))
    except Exception:  # no process group: DDP cannot run, nothing to keep
        return 1


def _builtin_hook(ddp: Any) -> bool:
    """Whether DDP reports a comm hook (a built-in one is not in ``_comm_hooks``)."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:
        return False
    return bool(data.get("comm_hook"))


def _hook_name(ddp: Any) -> str:
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if hooks:
        hook = hooks[0][0]
        return getattr(hook, "__qualname__", repr(hook))
    try:
        return str(ddp._get_ddp_logging_data().get("comm_hook"))
    except Exception:
        return "unknown"


def attach_before_backward(find_modules: Callable[[], Iterable[Any]]) -> PreReductionCheck | None:
    """The check on every DDP model and FSDP2 group of ``find_modules()`` (:meth:`~PreReductionCheck.attach_live`)
    in a distributed run of two ranks or more, else None (None too when nothing is found, or on an
    error: the caller's ``backward`` runs on, unchecked)."""
    check = None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        check = PreReductionCheck.attach_live(find_modules())
        if check.watching:
            return check
    except Exception:
        pass
    if check is not None:
        check.release()
    return None


REDUCTIONS = {
    "ddp": "the gradient all-reduce",
    "fsdp2": "the gradient reduce-scatter",
    "fsdp1": "FSDP1's (FullyShardedDataParallel) gradient reduce-scatter",
    "zero": "DeepSpeed ZeRO's gradient reduction",
    "deepspeed": "DeepSpeed's gradient all-reduce",
}
"""The collective that reduces the gradients, by :func:`engine_of`."""


def engine_of(params: Any, models: Iterable[Any] = (), accelerator: Any = None) -> str:
    """The engine that reduces ``params``' gradients (a ``gradients.TrainableParameters``):
    ``zero`` (DeepSpeed ZeRO's partitions), ``deepspeed`` (a DeepSpeed engine without ZeRO, whose
    ``allreduce_gradients`` reduces them), ``fsdp2`` (sharded ``DTensor`` parameters), ``fsdp1``
    (an FSDP1 ``FullyShardedDataParallel`` unit in ``models``, or the accelerator's wrapper of one),
    ``ddp`` (a DDP wrapper among ``models`` or the accelerator's), else "" (none known).

    >>> class Params: partitions, sharded = None, False
    >>> engine_of(Params(), [torch.nn.Linear(2, 2)])
    ''
    """
    if params.partitions is not None:
        return "zero"
    if getattr(params, "deepspeed", None) is not None:  # its steps found without partitions: stage 0
        return "deepspeed"
    if params.sharded:
        return "fsdp2"
    models = list(models)
    if fsdp1_models(models, accelerator):
        return "fsdp1"
    return "ddp" if ddp_models(models, accelerator) else ""


def fsdp1_models(models: Iterable[Any], accelerator: Any = None) -> bool:
    """Whether some of ``models`` holds an FSDP1 unit, or the accelerator's prepared FSDP1 wrapper
    wraps one of them (Accelerate's FSDP plugin; FSDP1 not imported here: without it, none)."""
    fsdp = fsdp1_type()
    if fsdp is None:
        return False
    models = list(models)
    if any(isinstance(m, fsdp) for model in models for m in model.modules()):
        return True
    prepared = getattr(accelerator, "_models", None) or []
    return any(isinstance(w, fsdp) and any(unwrap_model(w) is m for m in models) for w in prepared)


def ddp_models(models: Iterable[Any], accelerator: Any = None) -> list[Any]:
    """The DDP wrappers of ``models``: a model that is one, or ``torch.compile``'s wrapper of one (DDP
    compiled whole: launch watches that of a model compiled after ``accelerator.prepare``), or the
    accelerator's prepared wrapper whose ``module`` is a watched model."""
    models = [eager_module(m) for m in models]
    found = [m for m in models if _DDP_TYPES and isinstance(m, _DDP_TYPES)]
    prepared = getattr(accelerator, "_models", None) or []
    for wrapper in prepared:
        if _DDP_TYPES and isinstance(wrapper, _DDP_TYPES) and any(wrapper.module is m for m in models):
            if all(wrapper is not f for f in found):
                found.append(wrapper)
    return found


def fsdp_groups(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``model``'s ``fully_shard`` modules (private API: torch 2.5
    holds one per module, later ones a list; none found: [])."""
    return [group for module in model.modules() for group in _own_fsdp_groups(module)]


def _own_fsdp_groups(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``module``'s own ``fully_shard`` (none: [])."""
    getter = getattr(module, "_get_fsdp_state", None)
    if getter is None:
        return []
    try:
        state = getter()
        found = getattr(state, "_fsdp_param_groups", None)
        found = list(found) if found is not None else [state._fsdp_param_group]
    except Exception:
        return []
    return [g for g in found if g is not None and hasattr(g, "post_backward") and hasattr(g, "fsdp_params")]
