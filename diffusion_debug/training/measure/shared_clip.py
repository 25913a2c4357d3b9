"""The user's ``accelerator.clip_grad_norm_`` given the per-parameter gradient norms that the
monitored step just took, so that a monitored step that clips computes them once, not twice.

A diffusers training script clips every optimizer step (``if accelerator.sync_gradients:
accelerator.clip_grad_norm_(params, args.max_grad_norm)``), after ``monitor_training_step`` (the
order the README shows). torch's clip takes each gradient's L2 norm with ``torch._foreach_norm``
(one kernel per gradient on a CPU, 684 on an SD UNet), as the monitor just did. Where the monitor's
norms are *that* computation on *those* gradients, the clip is made of them: the total norm as
torch makes it (``vector_norm`` of the stacked norms), then torch's own
``clip_grads_with_norm_``. The gradients and the returned norm are then bitwise torch's.

The norms are shared only when each of these holds (else the clip is Accelerate's own, untouched):

* one process with no engine (``distributed_type`` ``NO``; DDP, FSDP, DeepSpeed and XLA clip by
  routes of their own), torch 2.6 or later (``clip_grads_with_norm_``; the floor, 2.5.1, clips as
  before), an L2 clip, and the clipped parameters are the watched ones (the trainable parameters,
  in order; parameters without a gradient left out, as torch leaves them);
* the monitor's norms were ``_foreach_norm`` of the float32 gradients as they are now: every one
  the same tensor (held by weak reference: a gradient set to None is freed as in the plain run) at
  the same version counter (an in-place change since is seen), and not scaled by a GradScaler
  (whose ``unscale_`` moves no version counter: the scaler's stage for the optimizer tells).

The norms are offered from the step after the first monitored step that the clip followed (a script
that never clips pays no call), and only if that clip (Accelerate's own) returned bitwise the total
norm the monitor's norms make: a gradient written between the monitor and the clip through ``.data``
(train_custom_diffusion.py's and textual inversion's ``grads.data[index_grads_to_zero, :] = 0``, at
every step) moves no version counter, but changes that total, and the clip is then Accelerate's own for
the run (:attr:`SharedClip.refused`; no early unscale). A non-finite total (fp16's first overflowing
steps) decides nothing: the next clip compares. With fp16 under a GradScaler, Accelerate's clip first
unscales the gradients, so the monitor's norms (of the scaled gradients, divided by the scale) would
not be the clip's: from then on the monitor unscales its optimizer's gradients itself, with the
GradScaler's own ``unscale_`` (the operation the clip or ``scaler.step`` would run, once a step: the
gradients are the same) and reads their norms; the scaler's ``unscale_`` (wrapped on the instance from
the monitor to its next call for that optimizer: a scaler copied or pickled between steps holds nothing
of the debugger's) then leaves that optimizer out once, whoever calls it: Accelerate's
``unscale_gradients`` in the clip, or the script by hand (``accelerator.scaler.unscale_(optimizer)``
before a clip of its own; a second call raises, as without the debugger); a scaler whose ``unscale_``
the script wrapped itself is not unscaled early (its clip is Accelerate's own). Nor is one where a
``backward`` may follow the monitor before the clip (two losses, each its own ``accelerator.backward``,
the monitor after the first or after each): it would add scaled gradients to unscaled ones, or the clip
would unscale twice (a RuntimeError). That is seen at the first monitored step, which unscales nothing
early: its gradients written between the monitor and the clip, or two gradient-reading monitored steps
before one clip with no ``scaler.update()`` between them, end the early unscale for the run
(:attr:`SharedClip.early_unscale`; the clip is then Accelerate's own). Steps that do not clip (a warm-up,
a clip every N steps) end it only until the next clip, whose step is not checked: the clip after that is,
then shares. Limit: a loop whose steps change shape later (a second ``backward`` only every N
steps) has that step's gradients mixed.
Both methods set on the user's objects are ``core.instance_methods.OnThisInstance``: a pickled
Accelerator (its ``copy.deepcopy`` is itself) gets Accelerate's own clip, bound to the copy, and
nothing of the debugger's. Limits: code between the monitor and the clip that reads the gradients reads
them unscaled already; a ``.data`` write there that the first compared clip did not see (one made only
at some later steps, or one that left that clip's total norm bitwise unchanged: zeroing gradients that
were zero then) moves no version counter, so a later step's clip is made of the norms before the write
(its total norm and scale differ from the unwatched run's; monitoring after such writes keeps the run
and the saving: the README says so); a clip through ``torch.nn.utils.clip_grad_norm_`` itself (no
Accelerator), or under ``launch`` (its own wrapper of the clip comes first), computes its norms as
before.
"""

from __future__ import annotations

import operator
import weakref
from itertools import repeat
from operator import is_
from typing import Any

import torch

from ...core.instance_methods import OnThisInstance
from .gradients import TrainableParameters
from .optimizer_state import raw_optimizer, scaler_already_unscaled

_VERSION = operator.attrgetter("_version")
_WRAPPED = ("clip_grad_norm_", "unscale_gradients")
"""The Accelerator's methods the clip calls: one set on the instance (launch's, the user's) leaves the clip alone."""


def can_share(accelerator: Any, params: TrainableParameters) -> bool:
    """Whether the clip of ``accelerator`` may be given the monitor's norms (see the module's list)."""
    return (
        accelerator is not None
        and getattr(accelerator, "distributed_type", None) == "NO"
        and getattr(torch.nn.utils, "clip_grads_with_norm_", None) is not None
        and params.partitions is None
        and not params.sharded
        and all(_own_method(accelerator, name) for name in _WRAPPED)  # launch's, or the user's, wrapper
    )


def _own_method(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is its class's method: none on the instance, or the class's own bound to it
    (what a copy of a watched Accelerator holds: :class:`OnThisInstance`)."""
    held = vars(owner).get(name)
    if held is None:
        return True
    return getattr(held, "__self__", None) is owner and getattr(held, "__func__", None) is getattr(
        type(owner), name, 0
    )


class SharedClip:
    """The monitored step's gradient norms, offered to the user's next ``accelerator.clip_grad_norm_``."""

    def __init__(self, params: TrainableParameters, accelerator: Any):
        self.params = params
        self.accelerator = accelerator
        self.attached = False
        self.armed = False
        """A monitored step was followed by the clip: from then on the norms are offered to it, and
        the monitor unscales fp16 gradients itself."""
        self.refused = False
        """The first clip after a monitored step took a total norm other than the monitor's norms make
        (the gradients written between them: a ``.data`` write moves no version counter): the clip is
        Accelerate's own for the run, never wrapped again."""
        self.measured: torch.Tensor | None = None
        """The per-parameter norms (unscaled) of the last monitored step before :attr:`armed`, for the
        clip to compare."""
        self.shared = 0
        """Clips made of the monitor's norms (for tests and benchmarks)."""
        self.early_unscale = True
        """Whether fp16 gradients may be unscaled by the monitor: False once a gradient-reading monitored
        step was followed, before the clip, by a write of the gradients (a second ``backward``: it
        would add scaled gradients to unscaled ones) or by another gradient-reading monitored step of that
        optimizer step (no ``scaler.update()`` between them)."""
        self._norms: torch.Tensor | None = None
        self._grads: list[weakref.ref] | None = None
        self._versions: list[int] | None = None
        self.pending = False
        """A gradient-reading monitored step since the last clip (set by the monitor, also before :attr:`armed`)."""
        self._step_state: Any = None
        """The GradScaler's per-optimizer state at the last monitored step: its ``update`` makes a new one, so
        another one at the next monitored step tells an optimizer step between them (no clip that step), not a
        second ``backward`` before the clip."""
        self._unclipped = False
        """The early unscale ended because an optimizer step came with no clip (not a second ``backward``): the
        next clip gives it back, and the clip after it, its step checked for a second ``backward``, arms."""
        self._pending_versions: list | None = None
        """The gradients' versions at a monitored step before :attr:`armed`, for the clip to compare."""
        self._unscaled: tuple[Any, Any] | None = None
        """(scaler, torch optimizer) whose gradients the monitor unscaled this step."""
        self._original_clip: Any = None
        self._patched: OnThisInstance | None = None
        """What ``accelerator.clip_grad_norm_`` holds while attached."""
        self._unscale_patch: OnThisInstance | None = None
        """What the scaler's ``unscale_`` holds from the monitor's unscale to the step's next."""

    # -- lifecycle ------------------------------------------------------------------------------
    def attach(self) -> bool:
        """Wrap the Accelerator's clip where it may share; returns whether it is wrapped."""
        if self.attached or self.refused or not can_share(self.accelerator, self.params):
            return self.attached
        accelerator = self.accelerator
        self._original_clip = accelerator.clip_grad_norm_
        self._patched = OnThisInstance(self._clip_grad_norm_, owner=accelerator, name="clip_grad_norm_")
        accelerator.clip_grad_norm_ = self._patched
        self.attached = True
        return True

    def detach(self) -> None:
        """Accelerate's own methods again (a wrapper set over ours since stays, ours passing through); the
        scaler's one-shot ``unscale_`` wrapper stays until the step's next ``unscale_`` where fp16 gradients
        were unscaled by the monitor and not yet by the clip (else the clip would unscale them twice: it raises)."""
        if not self.attached:
            return
        self.attached = self.armed = False
        if vars(self.accelerator).get("clip_grad_norm_") is self._patched:
            del self.accelerator.clip_grad_norm_
        self._patched = None
        if self._unscaled is not None and _stage(*self._unscaled) != "UNSCALED":  # an earlier step's
            self._let_go_of_scaler()
        # else detached between the monitor's unscale and the clip: the scaler's wrapper stays until the step's
        # next unscale_ (the clip's, or scaler.step's at the latest), which it skips once, then removes itself
        self.forget()

    def forget(self) -> None:
        self._norms = self._grads = self._versions = None

    # -- the monitor's side -----------------------------------------------------------------------
    def monitored(self, scaler: Any) -> None:
        """A gradient-reading monitored step under a GradScaler before :attr:`armed` (no norms
        offered): its gradients' versions kept, for the clip to tell whether a ``backward`` came
        between them. The caller then sets :attr:`pending` (also without a scaler, where it calls nothing)."""
        state = getattr(scaler, "_per_optimizer_states", None)  # (no Python call: a clean step's count is pinned)
        if self.pending:  # two before one clip: a backward between them, or an optimizer step with no clip
            self.early_unscale = False  # (the caller calls no more until a clip)
            self._unclipped = state is not self._step_state  # scaler.update() between them: a step not clipped
        else:
            self._pending_versions = _versions(self.params.local_gradients())
        self._step_state = state

    def unscale(self, scaler: Any, optimizer: Any) -> None:
        """fp16, once the clip was seen after a monitored step: unscale ``optimizer``'s gradients now
        (Accelerate's scaler, still to be unscaled this step), so that the norms read next are the clip's."""
        if (
            not self.armed
            or not self.early_unscale
            or optimizer is None
            or scaler is not getattr(self.accelerator, "scaler", None)
        ):
            return
        if self._unscaled is not None:  # an earlier step's, that no unscale_ came to
            self._let_go_of_scaler()
        raw = raw_optimizer(optimizer)
        if _stage(scaler, raw) != "READY" or "unscale_" in vars(scaler):  # (a wrapper of the script's own)
            return
        scaler.unscale_(raw)
        self._unscaled = (scaler, raw)
        patch = self._unscale_patch  # the step's next unscale_ of it: a no-op, once (made once a scaler)
        if patch is None or patch.owner() is not scaler:
            patch = self._unscale_patch = OnThisInstance(self._scaler_unscale_, owner=scaler, name="unscale_")
        scaler.unscale_ = patch

    def offer(self, norms: torch.Tensor, grads: list, scaler: Any, optimizer: Any) -> None:
        """The step's per-parameter norms (``gradients.grad_norms`` of ``grads``), kept for the clip when they are
        ``_foreach_norm`` of the float32 gradients themselves (one kind, none None, none sparse) and,
        under ``scaler``, unscaled already (its ``unscale_`` moves no version counter: told by its stage)."""
        state = getattr(scaler, "_per_optimizer_states", None)
        if self.pending and state is self._step_state:  # two before one clip: a backward between them
            self.early_unscale = False
        self._step_state = state
        self.pending = True  # a monitored step: the clip that follows it keeps the sharing armed
        if scaler is not None and not scaler_already_unscaled(scaler, optimizer):
            self.forget()
            return
        params = self.params
        zero = params.one_kind_zero()
        if (
            not self.attached
            or zero is None
            or zero.dtype != torch.float32
            or norms.dtype != torch.float32
            or params.sparse_gradients
            or any(map(is_, grads, repeat(None)))
        ):
            self.forget()
            return
        self._norms = norms
        self._grads = list(map(weakref.ref, grads))
        self._versions = list(map(_VERSION, grads))

    # -- the user's side --------------------------------------------------------------------------
    def _scaler_unscale_(self, optimizer: Any) -> None:
        """The GradScaler's ``unscale_``, a no-op for the optimizer the monitor unscaled this step, once
        (Accelerate's clip, or the script's own call: without the debugger it would unscale them there)."""
        scaler, raw = self._unscaled
        # (Accelerate hands it the torch optimizer: no unwrapping call then)
        mine = optimizer is raw or raw_optimizer(optimizer) is raw
        unscaled = _stage(scaler, raw) == "UNSCALED"
        if mine or not unscaled:  # once (a second call raises, as without the debugger), or a step since
            self._let_go_of_scaler()
            if mine and unscaled:
                return
        scaler.unscale_(optimizer)

    def _let_go_of_scaler(self) -> None:
        """The scaler's own ``unscale_`` again: the wrapper lives from the monitor to the step's next
        ``unscale_`` (a GradScaler pickled or copied between steps holds nothing of the debugger's)."""
        scaler, self._unscaled = self._unscaled[0], None
        if vars(scaler).get("unscale_") is self._unscale_patch:
            del scaler.unscale_

    def _clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """``Accelerator.clip_grad_norm_`` on one process: unscale, then torch's clip; made of the
        monitor's norms where they are the clip's (the module's list), else torch's own."""
        norms, refs, versions = self._norms, self._grads, self._versions
        self.forget()  # one clip a monitored step
        if self.pending:  # the clip follows the monitor
            if not self.armed:
                return self._first_clip(parameters, max_norm, norm_type)
            self.pending = False
        original = self._original_clip
        if norms is None or isinstance(parameters, torch.Tensor) or float(norm_type) != 2.0:
            return original(parameters, max_norm, norm_type=norm_type)
        parameters = list(parameters)
        grads = self.params.local_gradients()
        if not all(map(is_, map(_call, refs), grads)):  # another step's gradients
            return original(parameters, max_norm, norm_type=norm_type)
        if not _the_watched(parameters, self.params.params):
            return original(parameters, max_norm, norm_type=norm_type)
        self.accelerator.unscale_gradients()  # as Accelerate's clip does (a no-op for what the monitor unscaled:
        # the scaler's unscale_, wrapped)
        if list(map(_VERSION, grads)) != versions:  # changed since the monitor read them (first fp16 step: unscaled)
            self.early_unscale = False
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        with torch.no_grad():
            total = torch.linalg.vector_norm(norms, 2.0)  # torch's total: the norm of the stacked norms
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        self.shared += 1
        return total

    def _first_clip(self, parameters: Any, max_norm: float, norm_type: float) -> Any:
        """The first clip after a monitored step: Accelerate's own, its total norm compared with the one
        the monitor's norms make. Equal (bitwise: the same ``_foreach_norm`` of the same float32
        gradients, fp16's divided by the GradScaler's power-of-two scale, which the clip's unscale
        multiplies out exactly): from the next step the norms are offered. Not equal (a ``.data`` write
        between the monitor and the clip, other parameters, another norm, gradients not float32): the
        clip is Accelerate's own for the run. Not finite (fp16's first steps overflow): the next clip decides."""
        written, self._pending_versions = self._pending_versions, None
        measured, self.measured, self.pending = self.measured, None, False
        if self._unclipped:  # the early unscale ended by steps with no clip: this clip's step was not checked for
            self.early_unscale, self._unclipped = True, False  # a second backward; the next one is, then arms
            return self._original_clip(parameters, max_norm, norm_type=norm_type)
        grads = self.params.local_gradients()
        if written is not None and _versions(grads) != written:
            self.early_unscale = False  # a backward (or a write) between the monitor and the clip
        if measured is not None and any(map(is_, grads, repeat(None))):  # (an unused branch, a frozen part)
            # torch's clip leaves them out (the monitor counts them 0): a 0 among the norms moves the sum's order
            measured = measured[[i for i, grad in enumerate(grads) if grad is not None]]
        total = self._original_clip(parameters, max_norm, norm_type=norm_type)
        if isinstance(total, torch.Tensor) and not bool(torch.isfinite(total)):
            return total
        if not self._made_of(measured, total, norm_type):
            self.refused, self.early_unscale = True, False
            self.detach()
            return total
        self.armed = True
        return total

    @staticmethod
    def _made_of(measured: torch.Tensor | None, total: Any, norm_type: float) -> bool:
        """Whether ``total`` (the clip's) is bitwise the L2 norm of the monitor's norms ``measured``."""
        if measured is None or not isinstance(total, torch.Tensor) or float(norm_type) != 2.0:
            return False
        if measured.dtype != total.dtype or measured.shape != (len(measured),):
            return False
        with torch.no_grad():
            return torch.equal(torch.linalg.vector_norm(measured.to(total.device), 2.0), total)


_call = operator.methodcaller("__call__")
"""A weak reference's target, as ``map`` calls it: a loop in C, no Python frame per gradient."""


def _versions(grads: list) -> list:
    """Each gradient's version counter (None: no gradient)."""
    return [None if grad is None else grad._version for grad in grads]


def _the_watched(parameters: list, watched: list) -> bool:
    """Whether ``parameters`` are the watched ones in order (those without a gradient left out)."""
    if len(parameters) == len(watched) and all(map(is_, parameters, watched)):
        return True
    with_grads = [p for p in parameters if p.grad is not None]
    return len(with_grads) == len(watched) and all(map(is_, with_grads, watched))


def _stage(scaler: Any, optimizer: Any) -> str | None:
    """The GradScaler's stage for ``optimizer`` this step (``READY``, ``UNSCALED``, ``STEPPED``)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    stage = state.get("stage") if state else None
    return getattr(stage, "name", None) if stage is not None else "READY"
