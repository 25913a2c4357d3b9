"""What ``diffusion-debug launch`` sees reach the trained model, counted where the script makes it,
so that a bad batch or a frozen model's NaN is named without an ``inputs=batch`` edit:

- the batches of each DataLoader the script prepared, as ``batch["pixel_values"]``;
- the calls of the frozen models that feed the trained one (a text encoder, a VAE's encoder: the
  modules the script holds that it does not train): their floating-point arguments as inputs, and
  their outputs, ``text_encoder(...)["last_hidden_state"]``, counted only when the call's
  inputs were finite, so that a non-zero count says that model made the NaN;
- the trained model's own arguments at its first forward under grad, as ``unet(sample)``.

Each is a NaN/Inf count that stays on the device (one reduction per floating-point tensor, no host
read); they reach the host with the step's one transfer as the step's ``inputs=``
(:class:`~diffusion_debug.training.measure.loss.CountedInputs`, in the order they were made), and
the first non-zero one is the step's ``nonfinite_input``: the batch (component ``input``) or the
frozen model that made it (its name).

A micro-step's inputs run from its batch (or the previous monitored call) to the trained model's
first forward under grad: data flows into the trained model there, and a frozen model called after
it (in the loss) does not feed it. Each ``backward``'s counts are its own: one whose gradients the
script drops before the step (a probe's) takes them with it. The trained model called without grad
(validation) starts the current ones again: a validation image's NaN (an fp16 VAE decode) is not
the next step's input.

Limits: frozen models are found by the names the script gives them (the local variables of the
frames that call ``prepare`` and the optimizer's first step, innermost first), so a model kept only
in an object's attribute is not checked; a VAE is checked through its direct children (a script
calls ``vae.encode``, not ``vae(...)``); a DataLoader the script iterates without preparing it is
seen only through the trained model's arguments; a model called compiled (``torch.compile(model)``,
``model.compile()``) runs its hooks inside the compiled code, where they count nothing (any Python
they ran there would break the graph, or fall back to eager, and change the numbers the script gets):
a trained model's arguments, and a frozen model's call, are counted at what ``torch.compile``
returned, when the script holds it in a variable (its hooks run before the compiled code), not where
the script holds only the model it compiled. Under ``model.compile()`` (no wrapper: torch compiles the
model's ``_call_impl``, a frame dynamo skips, and traces each hook it calls as a frame of its own) the
trained model's hook runs eagerly (:func:`~diffusion_debug.probes.tracing.eager_frame`), its arguments
counted, and so do a frozen model's (a text encoder or VAE compiled where it is), its call counted as
its uncompiled twin's. A model compiled after it
was watched (after ``accelerator.prepare``) is seen as ``torch.compile`` makes the wrapper
(:meth:`InputWatch.compiled`): its hooks move to the wrapper before its first call, and launch's
debugger watches the wrapper (:meth:`InputWatch.compiled_as`), so nothing is hooked after dynamo traced
it (a recompile) and nothing on DDP (whose Python dynamo would trace: a graph break).

Long because :class:`InputWatch` is the one state its hooks read and change (the micro-step's counts,
the models watched, the wrappers ``torch.compile`` made around them), and each way a script compiles a
model (a wrapper after or before ``prepare``, ``model.compile()``, a copy to validate) is a case of it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..probes import copies
from ..probes.tracing import compile_callback, compile_wrapper, compiling, eager_frame, eager_module, run_eagerly
from ..stats import read_now, walk_tensors
from ..stats.quantized import parameter_values
from .launch_plain import MISSING, put_back

if TYPE_CHECKING:
    from ..training.measure.loss import CountedInputs


KEPT_FORWARDS = 64
"""The most trained-model calls a step keeps for a replay (its micro-steps'; bounded as the record is)."""


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """NaN/Inf count of ``t``, a device scalar (fp8 has no reduction kernels: read as float32)."""
    t = t.detach()
    if t.element_size() == 1:
        t = t.float()
    return torch.isfinite(t).logical_not().sum()


_FORWARD_REPLAY = __name__.rpartition(".jobs.")[0] + ".training.judges.forward_replay"


def _replaying() -> bool:
    """Whether launch's replay of a NaN step's forward is running (its calls are none of the script's);
    read where the training debugger loaded it, so that this module loads no training code itself."""
    replay = sys.modules.get(_FORWARD_REPLAY)
    return replay is not None and replay.replaying_forward()


def _path(prefix: str, keys: tuple[Any, ...]) -> str:
    return prefix + "".join(f"[{key!r}]".replace("'", '"') for key in keys)


def _torch_own(module: nn.Module) -> bool:
    """One of torch's own module classes (DDP, ``nn.Sequential``): hooked, dynamo traces its Python."""
    return type(module).__module__.startswith(("torch.nn.", "torch.ao."))


def _countable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and not t.is_meta and t.layout is torch.strided


class InputWatch:
    """The counts of the micro-step in progress, and the hooks that make them (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: dict[str, torch.Tensor] = {}
        self.producers: dict[str, tuple[str, str, Callable[[], tuple[str, int] | None]]] = {}
        self.open = True
        """Before the trained models' first forward of the micro-step: a frozen call feeds them."""
        self.ran: set[int] = set()
        """The trained models whose arguments the micro-step counted (each model's first forward);
        emptied, with :attr:`open` set, after each plain ``backward`` (``launch_plain``): the next
        forward is another micro-batch's, counted too (the counts add up until the step takes them)."""
        self.closed: list[tuple[dict, dict]] = []
        """The counts (and producers) of each ``backward`` since the step's last take, oldest first,
        closed at its end (:meth:`end_backward`): a backward whose gradients the script drops takes
        its own counts with it (:meth:`take_earlier`), the others join the step's (:meth:`take`)."""
        self.forwards: list = []
        """The trained models' calls counted since the step's last take (:class:`KeptForward`), held for a
        replay that names the module that made a NaN loss; the step takes them with its counts."""
        self.error: BaseException | None = None
        """The first error of a hook: the watch stops there, and the run goes on."""
        self.fresh = True
        """No trained model has made a training call yet: one compiled after that (a copy to validate,
        say) keeps its hook, its training calls counted (:meth:`compiled`)."""
        self.first_training_call: Callable[[], None] | None = None
        """Called once, as a trained model's first forward under grad begins (launch makes its debugger
        there: an out-of-memory error in step 0's forward is then step 0's); None once called."""
        self._inside: set[int] = set()
        self._handles: list[Any] = []
        self._holding = False
        """Whether it holds :mod:`~diffusion_debug.probes.copies`' patch (its hooks left out of copies)."""
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._trained: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """By trained model watched: its name and the handle of its pre-hook (moved to a wrapper made later)."""
        self._compile_seam: Any = None
        self._frozen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """By frozen model watched: its root's two hooks, their handles (moved to a wrapper made later)."""
        self._wrappers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """By trained model: a weak reference to what ``torch.compile`` made around it after it was watched."""
        self._undecided: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """By wrapper made before the first training call: the trained model inside it, which keeps its own
        hook till that call says which of the two trains (:meth:`_settle`)."""
        self._unsettled = False
        """Whether :attr:`_undecided` holds a wrapper (a flag: no Python call of its ``__len__`` a step)."""
        self._inner: weakref.WeakSet = weakref.WeakSet()
        """The models inside a watched wrapper (DDP's, ``torch.compile``'s) whose call without grad is inference."""
        self._loaders: weakref.WeakSet = weakref.WeakSet()
        self._classes: dict[type, tuple[Any, Callable]] = {}
        """By DataLoader class patched: its own ``__iter__`` (``MISSING``: inherited), and ours."""
        self._signatures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._weights: dict[str, Callable[[], tuple[str, int] | None]] = {}
        """By frozen model: what reads its first non-finite weight (on the step that names it)."""

    # -- what is watched -------------------------------------------------------------------------
    def watch_trained(self, model: nn.Module, name: str, compiled: nn.Module | None = None) -> None:
        """The trained model's arguments at its first forward under grad of each micro-step. A call
        without grad (validation: a pipeline runs the model under ``no_grad``, the unwrapped one
        under DDP) is inference: what the frozen models made for it, or make after it (the VAE's
        decode), is not a training input, so the micro-step's counts start again at its training call.
        ``model`` may be what ``torch.compile`` returned for a trained model: its hooks run before the
        compiled code (the trained model's own, inside it, count nothing), its arguments named by the
        trained model's ``forward``; the model inside it (inside DDP too) called eagerly without grad
        is inference as well (validation on ``accelerator.unwrap_model(model)``), unless it is one of
        torch's own classes (``nn.Sequential``)."""
        if model in self._watched:
            return
        self._watched.add(model)
        if self._compile_seam is None:  # torch.compile(model) made after this: see compiled()
            from torch.nn.modules.module import register_module_module_registration_hook

            self._compile_seam = register_module_module_registration_hook(self._registered)
            self._handles.append(self._compile_seam)
        if compiled is None and compile_wrapper(model):
            compiled = model._orig_mod  # (given while torch.compile makes the wrapper: it is not set yet)
        wrapper = compiled is not None
        inner = compiled if wrapper else model
        inner = getattr(inner, "module", inner)
        named = eager_module(inner)  # DDP around torch.compile's: its model's names

        def before(module: nn.Module, args: tuple, kwargs: dict, eager: bool = False) -> None:
            # compiling(), inline: a Python call here is a frame dynamo traces under module.compile()
            if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
                return  # a compiled model's: no break or recompile of ours (counts nothing)
            if module.__dict__.get("_compiled_call_impl") is not None:  # module.compile(): eager_frame
                if not eager:
                    run_eagerly(lambda: before(module, args, kwargs, True))
                    return
            elif compile_callback is not None and compile_callback() is not None:
                return  # run eagerly inside another's compiled call (a wrapper's model): as compiled code
            if not torch.is_grad_enabled():
                if not _replaying():  # (launch's replay of a NaN step's forward is no call of the script's)
                    self._inference()
            elif id(module) not in self.ran and self.error is None:
                if self._unsettled:
                    self._settle(module)
                if self.first_training_call is not None:
                    first, self.first_training_call = self.first_training_call, None
                    first()
                self._guarded(lambda: self._arguments(name, named, args, kwargs, trained=True))
                self.ran.add(id(module))
                self.open = self.fresh = False

        handle = model.register_forward_pre_hook(eager_frame(before), with_kwargs=True)
        self._keep(handle)
        self._trained[model] = (name, handle)
        # once (a wrapper's DDP is watched too, or the model inside it itself); not torch's own module class
        # inside a wrapper: a hook makes dynamo compile its forward when DDP calls it (trace_rules), not the script
        if (
            inner is not model
            and not (wrapper and _torch_own(inner))
            and inner not in self._inner
            and inner not in self._watched
        ):
            self._inner.add(inner)
            self._keep(inner.register_forward_pre_hook(self._inner_before, with_kwargs=True))

    def _keep(self, *handles: Any) -> None:
        """Hooks of ours on the script's modules, removed by :meth:`remove` and left out of every copy
        of them (an EMA copy; ``torch.save(model)``: a hook here is a local function, which cannot be
        pickled, and its ``self`` is this watch, which counts the trained model's calls)."""
        for handle in handles:
            self._handles.append(copies.mark(handle))
        if not self._holding:
            self._holding = True
            copies.hold()

    def _inner_before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not compiling() and not torch.is_grad_enabled() and not _replaying():
            self._inference()

    def _registered(self, module: nn.Module, name: str, child: Any) -> None:
        if (
            name == "_orig_mod"
            and not compiling()
            and self.error is None
            and type(module).__name__ == "OptimizedModule"
        ):
            self._guarded(lambda: self.compiled(module, child))

    def compiled(self, wrapper: nn.Module, model: nn.Module) -> None:
        """``torch.compile`` made ``wrapper`` around a trained model watched already (the script compiles
        after ``accelerator.prepare``), as it makes it, before its first call: the model's pre-hook moves
        to the wrapper, whose hooks run before the compiled code (:meth:`watch_trained`), so launch's first
        training call (the debugger made, its hooks registered) comes there, before dynamo traces the
        model: no recompile, and no hook left on DDP (dynamo would trace its Python: a graph break). The
        model itself keeps one that tells inference (validation on it, eagerly), unless it is torch's own.
        A model of the script's own class keeps its pre-hook till the first training call: a wrapper made
        to validate before step 0, the model trained uncompiled, took it, and no training call was counted
        (:meth:`_settle`). A frozen model watched already: its root's hooks move to the wrapper (its call
        counted there, before the compiled code), its children's stay (``vae.encode`` runs eagerly); no
        hook is added later."""
        if not self.fresh and model in self._trained:  # compiled once training began (a copy to validate): as it is
            return
        found = self._trained.pop(model, None)
        if found is None:
            hooks = self._frozen.pop(model, None)
            if hooks is not None:  # its root's hooks move to the wrapper (its children's stay: vae.encode)
                enter, leave, *handles = hooks
                for handle in handles:
                    handle.remove()
                self._watched.add(wrapper)
                self._keep(wrapper.register_forward_pre_hook(enter, with_kwargs=True))
                self._keep(wrapper.register_forward_hook(leave, with_kwargs=True, always_call=True))
            return
        name, handle = found
        self._wrappers[model] = weakref.ref(wrapper)
        if _torch_own(model):  # DDP, nn.Sequential: a hook of theirs is traced in the wrapper's code
            handle.remove()
        else:  # its hook stays till the first training call says which of the two trains (_settle)
            self._trained[model] = found
            self._undecided[wrapper] = model
            self._unsettled = True
        self.watch_trained(wrapper, name, model)
        if model not in self._trained:
            self._inner_only(model)

    def _inner_only(self, model: nn.Module) -> None:
        """``model``, inside a watched wrapper, keeps the hook that tells inference (unless it is torch's own)."""
        if not _torch_own(model) and model not in self._inner:
            self._inner.add(model)
            self._keep(model.register_forward_pre_hook(self._inner_before, with_kwargs=True))

    def _settle(self, module: nn.Module) -> None:
        """The first training call of ``module``, a trained model compiled before it (:meth:`compiled`)
        or that wrapper: it trains through the wrapper (its own hook goes, before dynamo traces it: the
        wrapper's counts), or trains itself, and the wrapper is a copy to validate (the debugger watches
        the model). Another model's call (a text encoder trained too, called first) says nothing of it."""
        pairs = list(self._undecided.items())
        for wrapper, model in pairs:
            if module is not wrapper and module is not model:
                continue
            found = self._trained.get(model)
            if module is wrapper and found is not None:
                del self._trained[model]
                found[1].remove()
                self._inner_only(model)
            else:
                self._wrappers.pop(model, None)
            for other, of in pairs:  # the model's other wrappers too (compiled twice): settled with it
                if of is model:
                    self._undecided.pop(other, None)
        self._unsettled = bool(self._undecided)

    def compiled_as(self, model: nn.Module) -> nn.Module:
        """What the script compiled ``model`` into after it was watched (:meth:`compiled`), else ``model``:
        the debugger watches that, whose hooks run before the compiled code (on DDP, a hook of the
        debugger's would make dynamo trace DDP's Python: a graph break the plain run does not have)."""
        ref = self._wrappers.get(model)
        wrapper = ref() if ref is not None else None
        return model if wrapper is None else wrapper

    def watch_frozen(self, model: nn.Module, name: str) -> None:
        """A frozen model's calls (its root's, else its direct children's: ``vae.encode``). ``model`` may be
        what ``torch.compile`` returned: its call is counted at it, before and after the compiled code, and
        the calls of its model's children (``vae.encode`` runs eagerly), named as in that model."""
        if model in self._watched:
            return
        self._watched.add(model)
        root = id(model)
        inner = eager_module(model)
        self._weights[name] = functools.partial(first_nonfinite_weight, weakref.ref(inner))

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # compiling(), inline: a Python call here is a frame dynamo traces under module.compile()
            if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
                return
            if module.__dict__.get("_compiled_call_impl") is None and compile_callback is not None:
                if compile_callback() is not None:
                    return  # run eagerly inside another's compiled call: as compiled code
            self._inside.add(root)  # (module.compile(): eager_frame, no Python call made)

        def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any, eager: bool = False) -> None:
            if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
                return
            if module.__dict__.get("_compiled_call_impl") is not None:  # module.compile(): eager_frame
                if not eager:
                    run_eagerly(lambda: leave(module, args, kwargs, output, True))
                    return
            elif compile_callback is not None and compile_callback() is not None:
                return  # run eagerly inside another's compiled call: as compiled code
            self._inside.discard(root)
            if self.open and self.error is None:
                self._guarded(lambda: self._frozen_call(name, "", inner, args, kwargs, output))

        handles = (
            model.register_forward_pre_hook(eager_frame(enter), with_kwargs=True),
            model.register_forward_hook(eager_frame(leave), with_kwargs=True, always_call=True),
        )
        self._keep(*handles)
        self._frozen[model] = (enter, leave, *handles)
        for child_name, child in inner.named_children():

            def child_call(module: nn.Module, args: tuple, kwargs: dict, output: Any, child_name=child_name) -> None:
                if not compiling() and root not in self._inside and self.open and self.error is None:
                    self._guarded(lambda: self._frozen_call(name, child_name, module, args, kwargs, output))

            self._keep(child.register_forward_hook(child_call, with_kwargs=True))

    def watch_loader(self, loader: Any) -> None:
        """Each batch a prepared DataLoader yields starts a micro-step's inputs."""
        self._guarded(lambda: self._watch_loader(loader))

    def _watch_loader(self, loader: Any) -> None:
        kind = type(loader)
        if not callable(getattr(kind, "__iter__", None)) or self.error is not None:
            return
        self._loaders.add(loader)
        if kind in self._classes:
            return
        original = kind.__iter__
        watch = self

        def __iter__(self: Any) -> Any:
            for batch in original(self):
                if self in watch._loaders and watch.error is None:
                    watch._guarded(lambda: watch._batch(batch))
                yield batch

        self._classes[kind] = (vars(kind).get("__iter__", MISSING), __iter__)  # MISSING: inherited
        kind.__iter__ = __iter__

    def remove(self) -> None:
        """Every hook and ``__iter__`` put back (an inherited one: ours deleted; one the script set over
        ours stays, ours inside it passing through); an iteration already running counts nothing more."""
        while self._handles:
            handle = self._handles.pop()
            handle.remove()
            copies.unmark(handle)
        if self._holding:
            self._holding = False
            copies.release()
        self._compile_seam = None
        self._loaders.clear()
        for kind, (own, ours) in self._classes.items():
            put_back(kind, "__iter__", ours, own)
        self._classes.clear()

    # -- the step --------------------------------------------------------------------------------
    def end_backward(self) -> None:
        """A ``backward`` ended: what was counted since the last one is its own (:attr:`closed`), and
        the next forward is another micro-batch's, counted too."""
        if self.counts:
            self.closed.append((self.counts, self.producers))
            self.counts, self.producers = {}, {}
        self.ran.clear()
        self.open = True

    def take_earlier(self) -> list[tuple[dict, dict]]:
        """The counts of the backwards before the last one, taken out of the step's: their gradients
        were dropped (given back to no step) or set aside for another optimizer's step."""
        earlier, self.closed = self.closed[:-1], self.closed[-1:]
        return earlier

    def take(self, earlier: list[tuple[dict, dict]] = (), *, own: bool = True) -> CountedInputs | None:
        """The counts of the step that ends, ``earlier`` ones (backwards set aside before it) first,
        added up by path (None: nothing was counted); a new step's begin (``own=False``: only
        ``earlier``'s are given, the step's own wait for its own optimizer step)."""
        from ..training.measure.loss import CountedInputs  # the training debugger loads with the first step

        segments = [*earlier, *self.closed, (self.counts, self.producers)] if own else list(earlier)
        forwards = self.forwards if own else []
        if own:
            self._begin()
        counts: dict[str, torch.Tensor] = {}
        producers: dict[str, tuple] = {}
        for segment, made in segments:
            for path, count in segment.items():
                previous = counts.get(path)
                counts[path] = count if previous is None or previous.device != count.device else previous + count
            producers.update(made)
        return CountedInputs(counts, producers, forwards) if (counts or forwards) and self.error is None else None

    def _begin(self) -> None:
        self.counts, self.producers, self.open, self.forwards = {}, {}, True, []
        self.closed = []
        self.ran.clear()

    def _inference(self) -> None:
        """The trained model ran without grad: forget what fed it, record no frozen call until the
        next batch or step (its training call's arguments are still counted)."""
        self.counts, self.producers, self.open = {}, {}, False
        self.ran.clear()

    def _batch(self, batch: Any) -> None:
        """A batch begins a micro-batch's counts (the backwards' before it stay the step's)."""
        self.counts, self.producers, self.open = {}, {}, True
        self.ran.clear()
        for keys, t in walk_tensors(batch):
            if _countable(t):
                self._add(_path("batch", keys), _nonfinite(t))

    def _arguments(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, trained: bool = False
    ) -> list[torch.Tensor]:
        """Count the floating-point arguments of a call, ``name(argument)``; their counts. A trained
        model's (``trained``) are marked so in :attr:`producers` (``TRAINED_ARGUMENT``)."""
        if trained:  # as take(): the training debugger loads with the first step
            from ..training.judges.forward_replay import KeptForward
            from ..training.measure.loss import TRAINED_ARGUMENT
        found, tensors = [], []
        for argument, value in self._named(module, args, kwargs):
            for keys, t in walk_tensors(value):
                if _countable(t):
                    count = _nonfinite(t)
                    path = _path(f"{name}({argument})", keys)
                    self._add(path, count)
                    found.append(count)
                    tensors.append(t)
                    if trained:
                        self.producers[path] = TRAINED_ARGUMENT
        if trained and len(self.forwards) < KEPT_FORWARDS:  # replayed only on a step whose loss is NaN/Inf
            self.forwards.append(KeptForward.of(name, module, args, kwargs, tensors))
        return found

    def _frozen_call(self, name: str, child: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        prefix = f"{name}.{child}" if child else name
        inputs = self._arguments(prefix, module, args, kwargs)
        finite_inputs = torch.stack(inputs).sum() == 0 if inputs else None
        for keys, t in walk_tensors(output):
            if _countable(t):
                count = _nonfinite(t)
                if finite_inputs is not None:  # made here only when what it took was finite
                    count = count * finite_inputs
                path = _path(f"{prefix}(...)", keys)
                self._add(path, count)
                self.producers[path] = (name, child, self._weights.get(name))

    def _add(self, path: str, count: torch.Tensor) -> None:
        previous = self.counts.get(path)
        self.counts[path] = count if previous is None or previous.device != count.device else previous + count

    def _named(self, module: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
        """A call's arguments by the names of its ``forward`` (by position where they cannot be bound)."""
        signature = self._signatures.get(module)
        if signature is None:
            try:
                signature = inspect.signature(module.forward)
            except (TypeError, ValueError):
                signature = False
            self._signatures[module] = signature
        if signature:
            try:
                return list(signature.bind_partial(*args, **kwargs).arguments.items())
            except TypeError:
                pass
        return [(str(i), v) for i, v in enumerate(args)] + list(kwargs.items())

    def _guarded(self, work: Callable[[], Any]) -> None:
        try:
            work()
        except Exception as error:  # never break the script: stop watching inputs, say so later
            self.error = error
            self.counts, self.producers = {}, {}


def first_nonfinite_weight(model: weakref.ref) -> tuple[str, int] | None:
    """The first parameter (or buffer) of a frozen model that holds NaN/Inf, with its count: one
    host read, made on the step whose inputs it explains. A quantized weight (a text encoder in
    torchao int8, GGUF, bitsandbytes or quanto) is counted in the values its layer computes with."""
    module = model()
    if module is None:
        return None
    names: list[str] = []
    counts: list[torch.Tensor] = []
    for name, t in itertools.chain(parameter_values(module), module.named_buffers()):
        if _countable(t):  # (each counted as reached: a quantized weight is held dequantized until the next)
            names.append(name)
            counts.append(_nonfinite(t).to(counts[0].device) if counts else _nonfinite(t))
    if not names:
        return None
    found = read_now(torch.stack(counts))
    return next(((name, int(count)) for name, count in zip(names, found) if count), None)


_LIBRARIES = ("diffusion_debug", "accelerate", "torch", "diffusers", "transformers", "peft")


def script_modules() -> dict[int, tuple[str, nn.Module]]:
    """The modules the script holds in local variables, ``{id: (name, module)}``: the frames of the
    script's own code that lead to this call, innermost first (a module in two frames keeps its
    inner name), up to the frame ``runpy`` runs the script from; libraries' frames are passed over."""
    found: dict[int, tuple[str, nn.Module]] = {}
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module == "runpy":
            break
        if module.split(".")[0] not in _LIBRARIES:
            for name, value in list(frame.f_locals.items()):
                if isinstance(value, nn.Module) and id(value) not in found and not name.startswith("_"):
                    found[id(value)] = (name, value)
        frame = frame.f_back
    return found


def frozen_models(trained: list[nn.Module], held: dict[int, tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of ``held`` that are frozen: they hold parameters, none that requires grad (a
    model the script will still prepare for training does), and share none with a trained model
    (a trained model's part, or a wrapper around one, does)."""
    trained_parameters = {id(p) for model in trained for p in model.parameters()}
    out = []
    for name, module in held.values():
        parameters = list(module.parameters())
        if not parameters or any(p.requires_grad for p in parameters):
            continue
        if trained_parameters.isdisjoint(id(p) for p in parameters):
            out.append((name, module))
    return out
