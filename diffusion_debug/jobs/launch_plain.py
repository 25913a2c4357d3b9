"""The seams of ``launch`` (:mod:`.launched`) for a script with no Accelerator (torch.optim, DDP,
FSDP2): its own ``Tensor.backward`` and ``torch.autograd.backward``, whatever their form, which
give the loss (:func:`patch_backward`); the check of this rank's own gradients attached before the
first of them; its models, found through its optimizers (:func:`plain_models`); a GradScaler's
``scale`` and ``step`` (:func:`patch_scaler`: the loss it scaled, and the steps it skips); and
``clip_grad_norm_`` and torch's two-part clip, ``get_total_norm`` then ``clip_grads_with_norm_``
(:func:`patch_clip`: the gradients read before a clip spreads a NaN to all); ``zero_grad`` of an
optimizer or a module (:func:`patch_zero_grad`: a backward whose gradients are dropped before the
step is no loss of it).

The debugger is made as the first forward under grad of an optimizer's model begins
(:meth:`~.launched.LaunchWatch._optimizer_made`), else at the first optimizer step, after step 0's
backward and its gradient reduction, which gives every rank the NaN that one made. So the check
(:func:`~diffusion_debug.training.measure.pre_reduction.attach_before_backward`) attaches before
the first ``backward``, on every DDP model and FSDP2 group alive, without the debugger
(no parameter read: FSDP2's root holds its unsharded ones until backward ends), and the debugger
takes its count (:meth:`EarlyCheck.hand_over`): a NaN made in step 0's backward names the rank
that made it. It lets go (:meth:`EarlyCheck.release`) when launch stops watching or the script
ends. Nothing is changed: each call runs with the script's own arguments.

One seam runs per call: ``Tensor.backward`` calls ``torch.autograd.backward``, and a reentrant
backward (``torch.utils.checkpoint``) calls it again inside the first, in its thread or, on a GPU,
in autograd's; those inner calls are not another loss (another thread's backward meanwhile is one).
What each thread is doing is its own (:class:`ThisThread`), its loss too. Several backwards before
an optimizer step (gradient accumulation, or one backward a loss term) are that step's loss: each
earlier one a micro-step of it (:func:`keep`), their mean the step's loss, as under Accelerate's
``accumulate``. Limits: ``torch.autograd.grad`` gives no loss (no ``.grad`` for an optimizer to
step on), nor does a backward of ``GradientEdge``s.

Long because the seams of a plain script share one per-thread state (:class:`ThisThread`) and the
rule that makes their backwards a step's loss (:func:`keep`, :class:`SetAside`): apart, each would
import the others'.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from typing import Any, Callable

import torch
from torch import nn

MICRO_KEPT = 1024
"""The earlier backwards' losses a thread keeps for its next optimizer step (the latest ones): a
script that backwards and never steps a torch optimizer holds no more."""

GIVEN_GRADIENTS: Any = type("GivenGradients", (), {"__repr__": lambda self: "GIVEN_GRADIENTS"})()
"""The loss of a backward of no scalar (:func:`patch_backward`): its step has gradients and no loss
(the debugger's ``NO_LOSS``) unless another backward of it had one."""

SCALED_KEPT = 16
"""The scaled losses a thread remembers till their ``backward`` (the latest ones): a script that
scales and never backwards holds no more."""

MISSING = object()
"""An attribute the owner had none of in its own ``__dict__`` (:func:`put_back` then deletes ours)."""


def put_back(owner: Any, name: str, ours: Any, original: Any = MISSING) -> None:
    """Put ``original`` back as ``owner.name`` (none: the instance attribute goes) if ``owner.name``
    is still ``ours``; a wrapper someone set over ours since (a user, torch's LR scheduler, another
    library) stays, with ours inside it passing through once launch lets go. Launch lets go in the
    middle of a run when it gives up: putting back what we replaced there would take theirs off."""
    if vars(owner).get(name, MISSING) is not ours:
        return
    if original is MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, original)


class EarlyCheck:
    """No Accelerator: the check of this rank's gradients attached before the first ``backward``,
    until the debugger takes it over or launch stops watching."""

    def __init__(self) -> None:
        self.check: Any = None
        """The :class:`~diffusion_debug.training.measure.pre_reduction.PreReductionCheck` attached
        (None: none, or let go)."""
        self.tried = False
        """Whether the first ``backward`` came (the check attaches there or never)."""

    def attach(self) -> None:
        """On every DDP model and FSDP2 group alive (found once among the live modules), in
        a run of two ranks or more."""
        from ..training.judges.optimizer_coverage import live_objects
        from ..training.measure.pre_reduction import attach_before_backward

        self.check = attach_before_backward(lambda: live_objects(nn.Module))

    def release(self) -> None:
        """Let go, if attached: no bucket of the script's is read any more (FSDP2's groups get
        their own ``post_backward`` back; DDP's hook forwards to the all-reduce)."""
        check, self.check = self.check, None
        if check is not None:
            check.release()

    def hand_over(self, make_debugger: Callable[[], Any]) -> Any:
        """The debugger ``make_debugger()`` makes, given this check's count so far (released first:
        FSDP2's groups get their own ``post_backward`` back, which the debugger's check wraps). A
        handover that fails closes that debugger (no hook of its left on the script's models), then
        raises: launch gives up."""
        check = self.check
        self.release()
        debugger = make_debugger()
        if check is not None:
            try:
                debugger._carry_pre_reduction(check)  # step 0's count so far: its NaN names the rank that made it
            except BaseException:
                debugger.close()
                raise
        return debugger


def patch_backward(watch: Any) -> Callable[[], None]:
    """Wrap ``Tensor.backward`` and ``torch.autograd.backward`` for ``watch`` (a ``LaunchWatch``):
    a backward outside ``Accelerator.backward`` attaches ``watch.early`` before the first one and
    gives this thread's loss after it (:func:`_loss_of`; :func:`keep` where an earlier backward's
    waits for the same step), unless launch gave up or the script ended (``watch.failed``): then a
    wrapper left inside someone else's (:func:`put_back`) calls torch's own and records nothing.
    Each thread's backward is its own (the inner calls of one, and a reentrant backward inside
    another's graph on any thread, are not another loss). After each, the trained model's next
    forward is another micro-batch's: ``watch.inputs`` counts its inputs too.

    Whatever its form, a backward of a scalar is a loss (of the step read at the next optimizer
    step; several before it are that step's micro-steps): ``loss.backward()`` and
    ``torch.autograd.backward(loss)`` keep ``loss``; several scalars at once
    (``torch.autograd.backward([loss_a, loss_b])``, each given a weight or not) keep their sum, each
    times its weight, in float32 on the first one's device, so that a NaN or Inf in any of them is the
    step's ``nonfinite_loss``. A tensor of more than one value given its gradient (a pipeline stage's
    ``torch.autograd.backward(outputs, grad_tensors)``, ``out.backward(gradient=g)``) is no loss: the
    sum of outputs times gradients means nothing as one. A backward of no scalar keeps
    :data:`GIVEN_GRADIENTS`: its step is read, its gradients judged (a NaN named where backward
    made it), with no loss unless another backward of the step had one; so does a backward that
    reached no watched parameter (an EMA model's loss, a frozen branch's: it trains nothing the
    step steps, and its NaN changes no watched weight), in whichever order it comes, once the
    optimizers are known (:meth:`~.launched.LaunchWatch.reaches_watched`, asked only of a backward
    that moved the gradient of no optimizer's first parameter). Returns the undo, which
    launch calls when it gives up as well as at the end."""
    tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward
    graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)

    def observed(tensors: Any, grads: Any, run: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        state = watch.thread
        if state.inside or watch.failed or tensors is None or state.loss_from_accelerator or graph_task() != -1:
            return run(*args, **kwargs)
        if not watch.early.tried:
            watch.early.tried = True
            if watch.accelerator is None and watch.debugger is None:
                watch.early.attach()
        if state.loss is not None:  # an earlier backward's loss waits for the step: were its gradients set to None?
            watch.dropped_by_hand(state)
        held, graph = [], tensors  # the marks' gradients before it: one that moves none may reach no watched one
        for param in watch.marks:
            grad = param.grad
            held.append(None if grad is None else (weakref.ref(grad), grad._version))
        state.inside = True
        try:
            result = run(*args, **kwargs)
        finally:
            state.inside = False
        if not watch.failed:  # launch gave up meanwhile (another thread): nothing kept
            if grads is None and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                for i, pair in enumerate(state.scaled or ()):  # GradScaler.scale(loss): the loss is loss
                    if pair[0]() is tensors:
                        tensors = pair[1]
                        del state.scaled[i]  # by place: a weak reference compares by its tensor's ==
                        break
                loss = tensors.detach()
            else:
                loss = _loss_of(tensors, grads, state)
            inputs = watch.inputs  # this backward's inputs are its own; the next forward's another micro-batch's
            inputs.end_backward()
            marked, moved = [], False  # the marks a gradient zeroed in place by hand before the next backward moves
            for param, before in zip(watch.marks, held):
                grad = param.grad
                marked.append(None if grad is None else (weakref.ref(grad), grad._version))
                if grad is not None and (before is None or before[0]() is not grad or before[1] != grad._version):
                    moved = True
            state.marked = marked if marked else None
            if marked and not moved and loss is not None and not watch.reaches_watched(graph):
                loss = GIVEN_GRADIENTS  # an EMA model's or a frozen branch's: no loss of the step
            if state.loss is None:  # the step's first backward: no call of ours
                state.loss = loss
            elif loss is not None:
                keep(state, loss, inputs)
        return result

    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return observed(tensor, args[0] if args else kwargs.get("gradient"), tensor_backward, (tensor, *args), kwargs)

    def autograd(*args: Any, **kwargs: Any) -> Any:
        tensors = args[0] if args else kwargs.get("tensors")
        grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
        return observed(tensors, grads, autograd_backward, args, kwargs)

    torch.Tensor.backward = backward
    torch.autograd.backward = autograd

    def undo() -> None:
        put_back(torch.Tensor, "backward", backward, tensor_backward)
        put_back(torch.autograd, "backward", autograd, autograd_backward)

    return undo


def _loss_of(tensors: Any, grads: Any, state: Any) -> torch.Tensor | None:
    """The loss of a backward of ``tensors`` (a tensor, or a list or tuple of them) given ``grads``
    (None, or one for each: None for a scalar's 1): one scalar given no gradient is itself;
    otherwise the sum of each scalar times its gradient, in float32 on the first scalar's device
    (detached; a NaN or Inf in any of them is one in the sum); a tensor of more than one value (given
    its gradient: a pipeline stage's outputs) is left out, and a backward of no scalar is
    :data:`GIVEN_GRADIENTS`. A tensor that ``GradScaler.scale`` returned in this thread, which no
    backward took yet (``state.scaled``), counts as the loss it scaled. None: tensors of a kind this
    does not know (``GradientEdge``, an iterator the backward used up)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    grads = [grads] if grads is None or isinstance(grads, torch.Tensor) else grads
    grads = list(grads) if len(grads) == len(tensors) else [None] * len(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    scaled, terms = state.scaled or (), []
    for tensor, grad in zip(tensors, grads):
        for i, pair in enumerate(scaled):
            if pair[0]() is tensor:
                tensor = pair[1]
                del state.scaled[i]
                break
        if tensor.numel() == 1:
            terms.append((tensor, grad))
    if not terms:
        return GIVEN_GRADIENTS
    if len(terms) == 1 and terms[0][1] is None:
        return terms[0][0].detach()  # [loss]: the loss as it is
    device = terms[0][0].device
    total = None
    for tensor, grad in terms:
        value = tensor.detach().float()  # a half-precision product could overflow where the loss does not
        term = (value if grad is None else value * grad.detach()).sum().to(device)
        total = term if total is None else total + term
    return total


def keep(state: Any, loss: torch.Tensor, inputs: Any = None) -> None:
    """``loss`` is this thread's (``state``, a :class:`ThisThread`) latest backward's, for its next
    optimizer step; the one kept before it, which no step read yet, is a micro-step of that step
    (``state.micro``: gradient accumulation, ``loss = loss / k; loss.backward()`` k times a step, or a
    backward for each loss term), so that the step's loss is the mean of every backward it steps on
    and a NaN in an earlier one is the step's NaN loss, not only NaN gradients. Where a ``zero_grad``,
    or ``p.grad = None`` or ``p.grad.zero_()`` by hand, dropped every gradient of the backwards kept so far
    (``state.dropped``, :func:`patch_zero_grad`, :meth:`~.launched.LaunchWatch.dropped_by_hand`),
    ``loss`` is the first of the step: no step steps on theirs, and their inputs' counts (``inputs``,
    an :class:`~.launch_inputs.InputWatch`, its last backward's closed) go with them. Where it
    dropped those of some parameters only (``state.dropped_params``: a GAN's discriminator's
    ``zero_grad`` after the generator's backward), they are set aside (:class:`SetAside`) for the
    optimizer step that steps on the others (:meth:`SetAside.counts_for`). A backward with no loss
    (:data:`GIVEN_GRADIENTS`) is no micro-step."""
    earlier, state.loss = state.loss, loss
    dropped, state.dropped_params = state.dropped_params, None
    if state.dropped:  # the script dropped their gradients before any step read them
        state.dropped, state.micro = False, None
        if inputs is not None:
            inputs.take_earlier()
    elif loss is GIVEN_GRADIENTS:  # no loss: the step's is still the one kept
        state.loss = earlier
    elif earlier is not None and earlier is not GIVEN_GRADIENTS:
        if dropped:  # some parameters' gradients dropped: for the optimizer that steps on the others
            held = [*(state.micro or ()), earlier]
            state.micro = None
            aside = state.aside
            if aside is None or not aside.losses:
                state.aside = SetAside(deque(held, maxlen=MICRO_KEPT), set(dropped), [])
            else:  # a second set-aside (several partial drops): theirs too, dropped alike from here on
                aside.losses.extend(held)
                aside.dropped &= dropped
            if inputs is not None:
                state.aside.inputs += inputs.take_earlier()
            return
        if state.micro is None:
            state.micro = deque(maxlen=MICRO_KEPT)
        state.micro.append(earlier)


class SetAside:
    """Losses whose gradients a partial drop left to another optimizer's step (:func:`keep`): a GAN's
    ``loss_g.backward(); opt_d.zero_grad(); loss_d.backward(); opt_d.step(); opt_g.step()`` leaves
    ``loss_g``'s gradients to ``opt_g``: ``opt_d``'s step is ``loss_d``'s, ``opt_g``'s ``loss_g``'s."""

    def __init__(self, losses: deque, dropped: set[int], inputs: list) -> None:
        self.losses = losses
        self.dropped = dropped
        """The parameters (by id) whose gradients of these losses were dropped since."""
        self.inputs = inputs
        """Their backwards' input counts (``InputWatch.closed``'s segments)."""

    def counts_for(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps on these losses' gradients: some trainable parameter of its
        kept them."""
        groups = getattr(optimizer, "param_groups", None) or ()
        return any(p.requires_grad and id(p) not in self.dropped for group in groups for p in group["params"])


class ThisThread(threading.local):
    """What one thread of the script is doing, for launch's seams: another thread's backward,
    ``GradScaler.scale`` or ``Accelerator.backward`` meanwhile is its own (read as attributes, with
    the class's defaults in a new thread: no Python call on the script's path)."""

    inside = False
    """Inside a backward that :func:`patch_backward` observes: its inner calls are not another loss."""
    loss_from_accelerator = False
    """This thread's loss comes from ``Accelerator.backward`` or DeepSpeed's engine (set at their first
    call): the backward they run, of the loss they scaled, is not the loss."""
    scaled: deque | None = None
    """This thread's ``GradScaler.scale(loss)`` calls outside Accelerate whose ``backward`` did not come
    yet (the last :data:`SCALED_KEPT`): what each returned (a weak reference), and ``loss`` detached
    (the loss its ``backward`` is of); one backward of several scaled losses maps each back."""
    scaler: Any = None
    """The GradScaler of this thread's last ``scale(loss)`` outside Accelerate (a read at the clip judges by it)."""
    loss: torch.Tensor | None = None
    """This thread's last ``backward``'s loss, until a step reads it (then None: another optimizer
    stepping on the same gradients is part of that step)."""
    micro: deque | None = None
    """The losses of this thread's earlier backwards since its last step (:func:`keep`), oldest first."""
    dropped = False
    """A ``zero_grad`` dropped every gradient of this thread's backwards kept so far
    (:func:`patch_zero_grad`), or the script set them to None: its next backward's loss is the step's first."""
    dropped_params: set[int] | None = None
    """The trainable parameters (by id) whose gradients of this thread's backwards kept so far were
    dropped, where only some were (:func:`keep` sets those backwards aside)."""
    aside: SetAside | None = None
    """Losses set aside for another optimizer's step (:class:`SetAside`)."""
    engine_stepped = False
    """DeepSpeed's engine wrapper watched this thread's last ``Accelerator.backward``, its step too."""
    marked: list | None = None
    """After this thread's last ``backward``: the gradient of each of ``LaunchWatch.marks`` (a weak
    reference and its ``_version``; None: it had none), which a gradient zeroed or replaced by hand
    before the next backward changes (:meth:`~.launched.LaunchWatch.dropped_by_hand`). None: no mark
    (no optimizer known yet)."""


def patch_zero_grad(watch: Any) -> Callable[[], None]:
    """Wrap ``torch.optim.Optimizer.zero_grad`` and ``nn.Module.zero_grad`` for ``watch``: gradients
    dropped before any optimizer stepped on them (a validation or probing backward, then
    ``optimizer.zero_grad()``, then the step's own backward) are no loss of that step. A
    ``zero_grad`` that dropped every gradient the watched models hold (:meth:`~.launched.LaunchWatch.drops`;
    a submodule's, or a GAN's discriminator's, drops only some) while this thread holds a loss no
    step read marks it dropped (``watch.thread.dropped``); its next backward
    then starts the step's loss again (:func:`keep`), while a step before any backward reads it as
    before (a probe, zeroed, then stepped on, is the step's loss). Accelerate's own optimizer
    zeroes its inner one only where it syncs: ``accumulate``'s micro-steps are kept; a loop zeroing
    after its step holds no loss then. The common call, with no loss held, reads two attributes.
    Gradients set to None or zeroed in place by hand (``p.grad = None``, ``p.grad.zero_()``) are seen
    at the next backward (:meth:`~.launched.LaunchWatch.dropped_by_hand`). Returns the undo."""
    optimizer_zero, module_zero = torch.optim.Optimizer.zero_grad, nn.Module.zero_grad

    def mark(owner: Any) -> None:
        state = watch.thread
        if not (watch.failed or state.inside):
            watch.zeroed(state, owner)

    @functools.wraps(optimizer_zero)  # Accelerate reads its signature (set_to_none)
    def optimizer_zero_grad(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        result = optimizer_zero(optimizer, *args, **kwargs)
        if watch.thread.loss is not None or watch.thread.aside is not None:
            mark(optimizer)
        return result

    @functools.wraps(module_zero)
    def module_zero_grad(module: Any, *args: Any, **kwargs: Any) -> Any:
        result = module_zero(module, *args, **kwargs)
        if watch.thread.loss is not None or watch.thread.aside is not None:
            mark(module)
        return result

    torch.optim.Optimizer.zero_grad = optimizer_zero_grad
    nn.Module.zero_grad = module_zero_grad

    def undo() -> None:
        put_back(torch.optim.Optimizer, "zero_grad", optimizer_zero_grad, optimizer_zero)
        put_back(nn.Module, "zero_grad", module_zero_grad, module_zero)

    return undo


def patch_scaler(watch: Any) -> Callable[[], None]:
    """Wrap ``GradScaler.scale`` and ``GradScaler.step`` (torch's, which ``torch.cuda.amp``'s and
    Accelerate's inherit) for ``watch``: ``scale(loss)`` on a scalar (or on a list of them) outside
    ``Accelerator.backward`` is remembered (this thread's ``watch.thread.scaled``, each scaled loss
    until its ``backward``, several in one too), so that its ``backward`` keeps ``loss``, not
    ``loss`` times the scale (which changes as the scaler grows it or backs off: a spike that is none);
    ``step`` reads the step before the scaler steps, or skips it (no optimizer step, no step pre-hook
    then), with the scaler, which judges the skip. A subclass with a ``scale`` of its own (FSDP1's
    ``ShardedGradScaler``) has it wrapped too: those alive now, and those made while launch watches
    (``__init_subclass__``). Returns the undo."""
    from torch.amp.grad_scaler import GradScaler

    own = vars(GradScaler)
    step = GradScaler.step
    own_step, own_init_subclass = own.get("step", MISSING), own.get("__init_subclass__", MISSING)
    undo_scales: list[Callable[[], None]] = []

    def wrap_scale(cls: type) -> None:
        """Wrap the ``scale`` that ``cls`` defines itself (none: it inherits a wrapped one)."""
        scale = vars(cls).get("scale")
        if scale is None:
            return

        def watched_scale(scaler: Any, outputs: Any) -> Any:
            result = scale(scaler, outputs)
            state = watch.thread
            if watch.failed or state.loss_from_accelerator:
                return result
            pairs = [(outputs, result)] if isinstance(outputs, torch.Tensor) else None
            if isinstance(outputs, (list, tuple)) and isinstance(result, (list, tuple)):
                pairs = [(o, r) for o, r in zip(outputs, result) if isinstance(o, torch.Tensor)]  # scale([a, b])
            if pairs:
                state.scaler = scaler  # for a read at the clip (patch_clip), before the scaler's step
                if state.scaled is None:
                    state.scaled = deque(maxlen=SCALED_KEPT)
                # held without its graph: a scaled loss the script never backwards frees its activations
                state.scaled.extend((weakref.ref(r), o.detach()) for o, r in pairs if o.numel() == 1)
            return result

        cls.scale = watched_scale
        undo_scales.append(lambda: put_back(cls, "scale", watched_scale, scale))

    def watched_step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not watch.failed:
            watch._plain_step(optimizer, scaler=scaler)
        return step(scaler, optimizer, *args, **kwargs)

    def init_subclass(cls: type, **kwargs: Any) -> None:
        if own_init_subclass is MISSING:
            super(GradScaler, cls).__init_subclass__(**kwargs)
        else:
            own_init_subclass.__get__(None, cls)(**kwargs)
        if not watch.failed:
            wrap_scale(cls)

    classes, found = [GradScaler], 0
    while found < len(classes):  # every subclass alive, once (a diamond reaches one twice)
        classes += [c for c in type.__subclasses__(classes[found]) if c not in classes]
        found += 1
    for cls in classes:
        wrap_scale(cls)
    GradScaler.step = watched_step
    GradScaler.__init_subclass__ = ours_init = classmethod(init_subclass)

    def undo() -> None:
        put_back(GradScaler, "__init_subclass__", ours_init, own_init_subclass)
        put_back(GradScaler, "step", watched_step, own_step)
        while undo_scales:
            undo_scales.pop()()

    return undo


def patch_clip(watch: Any) -> Callable[[], None]:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` for ``watch``: a clip of a watched optimizer's
    parameters after a ``backward`` (plain, or a prepared script's that skips
    ``Accelerator.clip_grad_norm_``) reads the step there, before the clip, as launch's wrapper of
    ``Accelerator.clip_grad_norm_`` does:
    clipping by a NaN norm makes every gradient NaN, and read at the optimizer step they named the
    first that backward reached (``conv_out``), not where backward made the NaN. A step's first clip
    reads it, step 0's too (before any optimizer stepped: the optimizer holding the parameters is
    found there). A script's ``from torch.nn.utils import clip_grad_norm_ as clip`` binds this one
    (launch installs before the script's first line); a name bound before launch installed (a
    ``sitecustomize``, a ``.pth`` import) is torch's own, and its step is read at the optimizer step,
    after the clip. torch's two-part clip (2.6 on), ``get_total_norm`` of the gradients then
    ``clip_grads_with_norm_(parameters, max_norm, total_norm)``, is read the same way at
    ``clip_grads_with_norm_``, before it scales the gradients (``get_total_norm`` changes nothing and is
    given gradients, not the parameters whose optimizer the read needs). Returns the undo."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    def read(parameters: Any, max_norm: Any) -> Any:
        """The step read before a clip of ``parameters`` (a list of them where they were an iterable,
        which the clip then gets)."""
        if watch.failed or watch.thread.loss is None:
            return parameters
        accelerator = watch.accelerator
        # Accelerate's: a whole step's gradients (its own clip, calling this one, read them already);
        # a raw DeepSpeed engine's loss (no Accelerator) is read at its step
        if accelerator is not None:
            complete = accelerator.sync_gradients
        else:
            complete = not watch.thread.loss_from_accelerator
        # no optimizer known yet: step 0 of a plain script, whose optimizer the read finds
        if complete and (watch.optimizers or (accelerator is None and watch.debugger is None)):
            parameters = parameters if isinstance(parameters, torch.Tensor) else list(parameters)
            watch._plain_clip(parameters, max_norm)
        return parameters

    undo: list[Callable[[], None]] = []

    def wrap(name: str, clip: Any) -> None:
        def watched(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            return clip(read(parameters, max_norm), max_norm, *args, **kwargs)

        for owner in (clip_grad, utils):  # torch 2.13 has clip_grads_with_norm_ in utils alone
            if getattr(owner, name, None) is clip:
                setattr(owner, name, watched)
                undo.append(lambda owner=owner: put_back(owner, name, watched, clip))

    wrap("clip_grad_norm_", clip_grad.clip_grad_norm_)
    if hasattr(utils, "clip_grads_with_norm_"):  # torch 2.6 on
        wrap("clip_grads_with_norm_", utils.clip_grads_with_norm_)

    def undo_all() -> None:
        while undo:
            undo.pop()()

    return undo_all


def _model_of(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module | None:
    """The smallest of ``modules`` holding every parameter the optimizer steps; of several holding
    the same ones, the outermost: a DDP wrapper (the debugger checks each rank's gradients on its
    all-reduce, which the inner module does not know of), what ``torch.compile`` returned (the script
    may hold only that: ``model = torch.compile(model)``), the script's model around its one part
    that holds them all (not that part: its names and its arguments are not the model's); never a
    container with no ``forward`` (an ``nn.ModuleDict`` or ``nn.ModuleList`` holding the model for a
    checkpoint: no call of it is ever made) over a module it holds."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best: tuple[int, nn.Module] | None = None
    for module in modules:
        params = {id(p) for p in module.parameters()}
        if wanted <= params and (
            best is None or len(params) < best[0] or (len(params) == best[0] and _outer(module, best[1]))
        ):
            best = (len(params), module)
    return best[1] if best else None


def _outer(module: nn.Module, best: nn.Module) -> bool:
    """Of two modules holding the same parameters, whether ``module`` is the trained model over ``best``."""
    if _container(module):
        return False
    return _container(best) or (module is not best and any(m is best for m in module.modules()))


def _container(module: nn.Module) -> bool:
    """A module with no ``forward`` (ModuleDict, ModuleList): never called (torch.compile's sets its own)."""
    return getattr(module.forward, "__func__", None) is nn.Module.forward


def model_of(optimizer: torch.optim.Optimizer) -> nn.Module | None:
    """The live model that holds every parameter ``optimizer`` steps (:func:`plain_models`' choice), or None."""
    from ..training.judges.optimizer_coverage import live_objects

    return _model_of(optimizer, live_objects(nn.Module))


def plain_models(first: torch.optim.Optimizer) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The models of the live torch optimizers that train something, and those optimizers (``first``
    first; no model when no module holds its parameters): a GAN's generator and discriminator. A
    model inside another one found is left out, the other holds it (searched once, through the
    live optimizers and modules that launch notes as the script makes them)."""
    from ..training.judges.optimizer_coverage import live_objects

    modules = live_objects(nn.Module)
    model = _model_of(first, modules)
    if model is None:
        return [], []
    models, optimizers = [model], [first]
    for optimizer in live_objects(torch.optim.Optimizer):
        groups = getattr(optimizer, "param_groups", ())  # none: half-built (its __init__ raised), kept alive
        if optimizer is first or not any(p.requires_grad for g in groups for p in g["params"]):
            continue
        other = _model_of(optimizer, modules)
        if other is None:
            continue
        optimizers.append(optimizer)
        held = {id(p) for p in other.parameters()}
        if held <= {id(p) for m in models for p in m.parameters()}:
            continue  # inside a model found already
        models = [m for m in models if not {id(p) for p in m.parameters()} <= held] + [other]
    return models, optimizers


def holds_unwatched(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> bool:
    watched = {id(p) for m in models for p in m.parameters()}
    return any(p.requires_grad and id(p) not in watched for g in optimizer.param_groups for p in g["params"])
