"""The NaN/Inf and overflow probe: what each watched module takes and returns, read with torch's own
hooks, so that the first bad module can be named.

:func:`apply_probes` (or :meth:`Probe.attach`) registers one forward hook on each watched module,
which reads its inputs and its output once the call returned (``.forward`` is never replaced:
accelerate and diffusers both do, and a third system would break them).  The hook queues one
reduction per tensor on the tensors' device (:func:`stats.finite_signal`: the abs-max for
fp16/bf16/fp8, a sum otherwise; with ``signal="absmax"`` the abs-max of every dtype);
:meth:`Probe.collect` brings everything queued to the host in one transfer, as
:class:`~.module_reading.ModuleReading` rows.

Two granularities (:mod:`.watched`):

* ``"sentinel"``: the blocks of a model, one op per tensor: cheap enough to leave on. With
  ``measure_inputs=False, dtypes=OVERFLOW_DTYPES`` it watches only the block outputs that can
  overflow (fp16, fp8): a NaN/Inf in a wider dtype reaches the component's output, which a caller
  checks anyway (the denoiser's sentinel in the diffusion debugger works so). With ``fused=True``
  the abs-maxes are held and taken together, one op for a call's outputs (:mod:`.fused`).
* ``"full"``: every module, inputs and outputs: names the exact producer. The :data:`PASS_THROUGH`
  modules (SiLU, dropout, ...) are not watched, and in a wide dtype their output reads as their
  input did (:meth:`Probe._pass_on`), rather than being reduced again where it is taken. With
  ``fused=True`` (the diffusion debugger's full probes) the fp16/bf16 abs-maxes are held and taken
  together too, a few ops per 256 tensors (or 128 MB) held rather than one per tensor;
  :func:`probe_call`, the replay that localises, reduces each tensor in its hook (an output
  changed in place after its module returned is read as it was, where a held one reads 0).

The readings come in the order modules finish, so the *producer* of a NaN/Inf is the first
reading whose output is non-finite while its inputs were finite: the module that made it, not its
parent (which finishes later) nor the next module (whose input is already bad).

Limits: only tensors passed as arguments (positional or keyword) count as inputs; a NaN made by
functional code inside a parent's ``forward`` between two child modules is attributed to that
parent.  Parameters are not inputs: a module whose weight holds an Inf is a producer.  Inputs are
read after the call: a module that changes its own input in place (``x.mul_(...)`` on an argument,
which autograd forbids while training) is judged on the changed input.  Under ``torch.compile`` a
tensor measured twice (one module's output, the next one's input) is reduced twice (the dedupe
reads a version counter, which a compiler cannot trace).

Long because the three ways the hooks go in (one per module, one process-wide hook armed per call,
the fused sentinel's hooks put in at once) share one queue, one dedupe and one reading format, and
each is the hot path of some caller."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from ..installed import GLOBAL_HOOKS_TAKE_KWARGS
from ..stats import absmax, call_tensors, cuda_devices, dtype_name, is_low_precision, tensors_in, to_host
from .fused import FUSED_DTYPES, HeldAbsmax
from .handles import ForwardHooks, OwnHook, ProbeHandle, register_all
from .kept_buffers import buffers_kept
from .module_reading import ModuleReading
from .tracing import compiling, runs_compiled
from .watched import GRANULARITIES, entry_modules, pass_through_children, probed_modules

SIGNALS = ("finite", "absmax")
"""What a probe reads of each tensor: ``"finite"`` (:func:`stats.finite_signal`, one op that is
non-finite exactly when the tensor is, and the abs-max for fp16/bf16/fp8) or ``"absmax"``
(:func:`stats.absmax` of every dtype: the range a float32 run uses too, as the precision doctor
reads it)."""


@dataclass(frozen=True)
class ProbeConfig:
    """How :func:`apply_probes` watches a model (see :class:`Probe` for each option)."""

    granularity: str = "sentinel"
    measure_inputs: bool = True
    dtypes: tuple[torch.dtype, ...] | None = None
    signal: str = "finite"
    strict: bool = False
    unread: tuple[str, ...] = ()
    armed: bool = False
    """One process-wide hook armed during the model's calls instead of a hook per module
    (:meth:`Probe.attach`): attach costs a handful of hooks, whatever the model's size."""
    fused: bool = False
    """The abs-maxes (fp16, bf16, ``signal="absmax"``) are taken together, one op for all the
    tensors held (:mod:`.fused`; a full probe's inputs too), rather than one op per tensor in each
    hook."""
    autocast: torch.dtype | None = None
    """The dtype a ``torch.autocast`` region computes in (float16): float32 tensors (in ``dtypes``) are
    read as abs-maxes against its largest value, their readings in its name (:meth:`Probe._reducer`)."""

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, not {self.granularity!r}.")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, not {self.signal!r}.")


class Probe:
    """Watches the inputs and outputs of named modules; readings stay on device until
    :meth:`collect`.

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> probe = Probe(model, "full")
    >>> with probe.attach():
    ...     _ = model(torch.ones(1, 2))
    >>> [r.module for r in probe.collect()]  # the ReLU cannot make NaN/Inf: not watched
    ['0', '2', '']

    The probe holds its model weakly and adds no attribute to any module.  A failure inside a
    hook is kept in :attr:`errors` and the forward goes on, unless ``strict``: then it is raised
    from the hook, handed first to :attr:`on_raise` where one is set (the debugger's sink records
    it once and marks it as its own), else kept in :attr:`errors` too.
    """

    def __init__(
        self,
        model: nn.Module,
        granularity: str = "sentinel",
        *,
        modules: list[tuple[str, nn.Module]] | None = None,
        measure_inputs: bool = True,
        dtypes: tuple[torch.dtype, ...] | None = None,
        signal: str = "finite",
        strict: bool = False,
        unread: tuple[str, ...] = (),
        fused: bool = False,
        autocast: torch.dtype | None = None,
    ):
        self.config = ProbeConfig(
            granularity, measure_inputs, dtypes, signal, strict, unread, fused=fused, autocast=autocast
        )
        self._model = weakref.ref(model)
        self.granularity = granularity
        if modules is None:
            modules = probed_modules(model, granularity)
        inside = tuple(f"{name}." for name in unread)
        modules = [(n, m) for n, m in modules if n not in unread and not n.startswith(inside)]
        self._unread_modules = [weakref.ref(model.get_submodule(name)) for name in unread]
        """Modules whose outputs the caller never reads (a language model's vocabulary logits): their
        outputs are measured nowhere, also not where an enclosing module returns them."""
        self._unread_ids: dict[int, weakref.ref] = {}
        self.module_names = [name for name, _ in modules]
        self._modules = [weakref.ref(m) for _, m in modules]
        # the pass-through modules a full probe does not watch, whose outputs read as their inputs (_pass_on)
        self._passing = [weakref.ref(m) for m in pass_through_children(modules)] if granularity == "full" else []
        self._shared_passing: set[int] = set()
        """Those of them placed under more than one module: one instance shared, maybe with other
        models too (:meth:`_register_passing`)."""
        if self._passing:
            placed: dict[int, int] = {}
            for _, module in modules:
                for child in module._modules.values():
                    placed[id(child)] = placed.get(id(child), 0) + 1
            self._shared_passing = {id(m) for ref in self._passing if placed[id(m := ref())] > 1}
        self.measure_inputs = measure_inputs
        self.dtypes = dtypes
        """Measure only tensors of these dtypes (``None``: every floating tensor). A sentinel that
        only looks for overflow watches the dtypes that can overflow (fp16, fp8): a NaN or Inf in
        a wider dtype reaches the component's output, which is checked anyway."""
        self.signal = signal
        self.autocast = autocast
        """:attr:`ProbeConfig.autocast` (fixed for the probe's life: its dtype names are decided once)."""
        self.strict = strict
        self.errors: list[tuple[str, str]] = []
        self.on_raise: Callable[[str, Exception], None] | None = None
        """``strict``: ``on_raise(where, error)`` before a hook's own error is raised, ``where``
        being :attr:`label` and the module's name (set by the owner; asked only on that error)."""
        self.label = ""
        self._values: list[torch.Tensor] = []
        """The values reduced in the hooks (0-d); value ``k``'s index is ``~k`` (negative), a held
        abs-max's its slot (:class:`~.fused.HeldAbsmax`, from 0): one int names either (:meth:`take`)."""
        # per finished call, five items in a row (no tuple kept per call: _measure): name, dtype,
        # input value indices, output value indices (an int for one), input dtype; calls are
        # numbered when taken, so that a hook holds no counter
        self._calls: list = []
        self._seen: dict[tuple[int, int], tuple[weakref.ref, int]] = {}  # tensor -> its value index
        self._kinds: dict[torch.dtype, tuple[Callable, str, bool, bool, int] | None] = {}  # _reducer, per dtype
        self._kinds_for = (signal, dtypes)
        """The ``signal`` and ``dtypes`` :attr:`_kinds` were decided with (both public: a caller may
        change them between two reads; the kinds are decided again then, at attach or take)."""
        self._held = HeldAbsmax() if fused else None
        """``fused``: the outputs whose abs-maxes are taken together at :meth:`take` (:mod:`.fused`)."""
        self._output_hooks: list[OwnHook] | None = None
        """:meth:`_attach_outputs`' hooks, made at its first attach."""
        self._eager: bool | None = None
        """Whether the calls since :meth:`take` run eagerly, asked once (:meth:`_read_output`)."""

    # -- hooks -------------------------------------------------------------------------
    def _reducer(
        self, dtype: torch.dtype
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], str, bool, bool, int] | None:
        """How a tensor of ``dtype`` is read, decided once per dtype: ``(reduction, dtype name,
        wide, held, bytes an element)`` (``wide``: a sum whose finiteness alone counts; ``held``:
        an abs-max taken with the others, :mod:`.fused`), ``None`` when not measured."""
        kinds = self._kinds
        if dtype not in kinds:
            size = dtype.itemsize
            if not dtype.is_floating_point or (self.dtypes is not None and dtype not in self.dtypes):
                kinds[dtype] = None
            elif dtype is torch.float32 and self.autocast is not None:
                # under float16 autocast a float32 stream (a residual add of a float32 input and a float16
                # matmul: CLIP's, Sana's blocks) is cast to float16 by the next matmul: its room is float16's
                held = self._held is not None
                kinds[dtype] = (absmax, dtype_name(self.autocast), False, held, size)
            elif self.signal == "absmax" or is_low_precision(dtype):
                held = self._held is not None and dtype in FUSED_DTYPES
                kinds[dtype] = (absmax, dtype_name(dtype), False, held, size)
            else:
                kinds[dtype] = (_sum_signal, dtype_name(dtype), True, False, size)
        return kinds[dtype]

    def _measure(self, found: Any, dedupe: bool | None) -> tuple[int | tuple[int, ...], str | None]:
        """Queue the signal of every floating tensor in ``found`` (a sequence of tensors); return
        their value indices (one index alone as an int: no tuple kept per reading) and the first
        one's dtype.  Each tensor is measured once (a module's input is usually the previous
        module's output), remembered by identity and version counter (when ``dedupe``, which the
        caller knows: the call runs eagerly; ``None``: the compiler is asked once a tensor is to be
        measured), so an in-place change is measured again, and never past its flush (a held abs-max,
        :meth:`~.fused.HeldAbsmax.slot_of`) nor strongly (a weak reference), so no activation is kept
        alive. Several values are combined on the host after the transfer, not with more device
        work here."""
        indices, dtype = [], None
        kinds, unread, held, values = self._kinds, self._unread_ids, self._held, self._values
        for tensor in found:
            kind = kinds.get(tensor.dtype, _UNKNOWN)
            if kind is _UNKNOWN:
                kind = self._reducer(tensor.dtype)
            if kind is None or not tensor.numel() or tensor.is_meta or tensor.layout is not _STRIDED:
                continue
            if unread and (ref := unread.get(id(tensor))) is not None and ref() is tensor:
                continue
            if dedupe is None:  # asked once a tensor is to be measured
                dedupe = not compiling()
            if dtype is None:
                dtype = kind[1]
            if not dedupe:  # traced: no version counter, nothing held
                indices.append(~len(values))
                values.append(kind[0](tensor))
            elif kind[3] and not tensor.requires_grad:  # an abs-max taken with the others at the flush
                position = held.positions.get(id(tensor))  # held.slot_of(tensor), spelled out
                if (
                    position is not None
                    and held.tensors[position] is tensor
                    and held.versions[position] == tensor._version
                ):
                    indices.append(held.base + position)
                else:
                    indices.append(held.add(tensor))
            else:
                indices.append(self._keyed(tensor, kind))
        return (indices[0] if len(indices) == 1 else tuple(indices)), dtype

    def _keyed(self, tensor: torch.Tensor, kind: tuple) -> int:
        """The value index of ``tensor`` (eager), remembered weakly by identity and version counter:
        a sum, an fp8 abs-max, or an abs-max held as a detached alias (it requires grad), which
        :meth:`~.fused.HeldAbsmax.slot_of` cannot find. An inference tensor has no version counter:
        measured each time."""
        values = self._values
        key = None if tensor.is_inference() else (id(tensor), tensor._version)
        if key is not None:
            seen = self._seen.get(key)
            if seen is not None and seen[0]() is tensor:
                return seen[1]
        if kind[3]:
            index = self._held.add(tensor)
        else:
            index = ~len(values)
            values.append(kind[0](tensor))
        if key is not None:
            self._seen[key] = (weakref.ref(tensor), index)
        return index

    def _make_hook(self, name: str):
        # one forward hook reads the inputs and the output: a pre-hook as well would double the
        # hooks torch runs per module call, their Python cost being most of a full probe's overhead
        read = self._read

        def post_hook(module, args, kwargs, output):
            read(name, args, kwargs, output)

        return post_hook

    def _reader(self, names: dict[int, str], passing: set[int], eager: list) -> Callable:
        """The process-wide forward hook (``with_kwargs``) of an armed call, which reads the module
        calls in it: ``names``, each watched module's id -> its name; ``passing``, the ids of the
        pass-through modules (:meth:`_pass_on`); ``eager``, a one-item list: whether the call in
        progress runs eagerly, asked once at its start. (A hook of a module's own, :meth:`_make_hook`,
        stays a plain call of :meth:`_read`: under ``torch.compile`` each module's closure of this
        one code object would be a recompile.)

        A call whose arguments are plain tensors (None and flags aside) and whose output is one, or
        a tuple of them, all of a dtype whose abs-max is held (fp16, bf16 under a fused full probe:
        every call of an fp16 UNet's but its up blocks'), is held here: what :meth:`_measure` does
        for each tensor, spelled out in this one frame (a full probe runs it 13,000 times an
        SD1.5-shaped 20-step call; the hook, :meth:`_read`, :func:`~..stats.call_tensors` and two
        :meth:`_measure` were five frames). Anything else goes to :meth:`_read`, which finds what
        was held here again. A pass-through module's output is passed on only when it is of a wide
        dtype (an fp16 one is measured where it is taken: no call)."""
        get, read, pass_on, fail = names.get, self._read, self._pass_on, self._fail
        held = self._held if self.measure_inputs else None
        probe = self

        def hook(module, args, kwargs, output):
            here = get(id(module))
            if here is None:
                if id(module) in passing and type(output) is _TENSOR:
                    kind = probe._kinds.get(output.dtype)  # (pass_on needs the input's kind, the same)
                    if kind is not None and kind[2]:
                        pass_on(module, args, kwargs, output, eager[0])
                return
            try:
                if held is None or not eager[0] or probe._unread_ids:
                    read(here, args, kwargs, output, eager[0])
                    return
                found = args
                if kwargs:  # (None and flags are no tensors: is_causal, return_dict; a loop: no frame)
                    found = [*args]
                    for value in kwargs.values():
                        if value is not None and value.__class__ is not bool:
                            found.append(value)
                inputs = len(found)
                if output.__class__ is _TENSOR:
                    found = (*found, output)
                elif output.__class__ is tuple:
                    found = (*found, *output)
                else:
                    read(here, args, kwargs, output, eager[0])
                    return
                kinds = probe._kinds
                positions, tensors, versions = held.positions, held.tensors, held.versions
                indices = []
                for t in found:
                    kind = kinds.get(t.dtype) if t.__class__ is _TENSOR else None
                    if kind is None or not kind[3]:
                        read(here, args, kwargs, output, eager[0])  # (what is held is found again)
                        return
                    key = id(t)
                    position = positions.get(key)  # held.slot_of(t), then held.add(t)
                    if position is not None and tensors[position] is t and versions[position] == t._version:
                        indices.append(held.base + position)
                        continue
                    size = t.numel()
                    if not size or t.requires_grad or t.is_inference() or t.layout is not _STRIDED or t.is_meta:
                        read(here, args, kwargs, output, eager[0])
                        return
                    position = len(tensors)
                    indices.append(held.base + position)
                    positions[key] = position
                    tensors.append(t)
                    versions.append(t._version)
                    held.size += size * kind[4]
                    if held.size >= held.limit or position + 1 >= held.most:
                        held.flush()  # (new lists)
                        positions, tensors, versions = held.positions, held.tensors, held.versions
                i, o = indices[:inputs], indices[inputs:]
                probe._calls.extend(
                    (
                        here,
                        kinds[found[inputs].dtype][1] if o else None,
                        i[0] if len(i) == 1 else tuple(i),
                        o[0] if len(o) == 1 else tuple(o),
                        kinds[found[0].dtype][1] if i else None,
                    )
                )
            except Exception as error:  # never break the forward we watch
                fail(here, error)

        return hook

    def _read(self, name: str, args: tuple, kwargs: dict, output: Any, eager: bool | None = None) -> None:
        """Read one module call. ``eager``: whether it runs eagerly, when the caller knows (an
        armed call, asked once at its start; :meth:`_read_output`'s batch); ``None``: asked here,
        once per hook (a hook on its own module may be traced in one call and not the next)."""
        # the measures work on detached tensors: no grad mode needed, even while training
        try:
            if eager is None and self.measure_inputs:
                # a version counter is nothing a compiler can trace; a sentinel that reads only the
                # outputs asks only when one is to be measured (an fp32 block's: never)
                eager = not compiling()
            inputs, in_dtype = (), None
            if self.measure_inputs:  # one tensor passed alone (most calls) needs no walk
                alone = not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor)
                inputs, in_dtype = self._measure(args if alone else call_tensors(args, kwargs), eager)
            found = (output,) if isinstance(output, torch.Tensor) else tensors_in(output)
            outputs, dtype = self._measure(found, eager)
            self._calls.extend((name, dtype, inputs, outputs, in_dtype))
        except Exception as error:  # never break the forward we watch
            self._fail(name, error)

    def _fail(self, name: str, error: Exception) -> None:
        if self.strict and self.on_raise is not None:
            self.on_raise(f"{self.label}{name}", error)  # recorded once, by the owner, then raised
            raise error
        self.errors.append((name, f"{type(error).__name__}: {error}"))
        if self.strict:
            raise error

    def _pass_on(self, module: nn.Module, args: tuple, kwargs: dict, output: Any, eager: bool | None = None) -> None:
        """After a :data:`~.watched.KEEPS_NONFINITE` module (SiLU, dropout, ...): its output reads as
        its input did when that was measured in a wide dtype (finite exactly when the input was),
        instead of being reduced again where it is taken (a ResNet block's convolutions take a
        SiLU's output); an abs-max (fp16, bf16, fp8, ``signal="absmax"``) differs: measured.
        ``eager``: as :meth:`_read` takes it (an armed call knows it)."""
        try:
            x = args[0] if len(args) == 1 and not kwargs else None
            if eager is None:
                eager = not compiling()
            if not eager or not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
                return  # (a version counter is nothing a compiler traces)
            kind = self._kinds.get(x.dtype)  # an inference tensor has no version counter to key it by
            if kind is None or not kind[2] or output.dtype != x.dtype or x.is_inference() or output.is_inference():
                return
            seen = self._seen.get((id(x), x._version))
            if seen is not None and seen[0]() is x:
                self._seen[(id(output), output._version)] = (weakref.ref(output), seen[1])
        except Exception as error:  # never break the forward we watch
            self._fail(type(module).__name__, error)

    # -- public ------------------------------------------------------------------------
    def attach(self, *, armed: bool = False) -> ProbeHandle:
        """Register the hooks; the returned handle removes exactly them (its ``state`` is this probe).

        ``armed=True``: instead of one hook on every watched module, a hook on the model and on
        each module it calls directly arms one process-wide forward hook (torch's
        ``register_module_forward_hook``) for the length of their calls, which reads the watched
        modules among the modules called. Attach and detach then cost a handful of hooks whatever
        the model's size (a 1-step pipeline attaches at every call), the calls the same. Limit: a
        watched module called from outside those calls (not under the model nor one of its
        children) is not read; no module of the diffusers and transformers models is so. A module
        that has forward hooks of its own at attach gets a hook of its own (registered after theirs,
        it reads the output they return; the process-wide hook runs before a module's hooks).
        Hooks per module: a model that runs compiled code (a trace could not arm, nor keep one hook),
        and every model before torch 2.6 (whose global hook takes no keyword arguments)."""
        model = self._model()
        if self._kinds_for != (self.signal, self.dtypes):
            self._kinds, self._kinds_for = {}, (self.signal, self.dtypes)
        armed = armed and GLOBAL_HOOKS_TAKE_KWARGS and model is not None
        arming = entry_modules(model) if armed else []  # the hooks that arm
        if arming and not runs_compiled(model, [*arming, *[ref() for ref in self._modules]]):
            return self._attach_armed(arming)
        if not armed and (outputs := self.output_hooks(unread=True)) is not None:
            return self._attach_outputs(outputs)

        def register():
            for name, ref in zip(self.module_names, self._modules):
                module = ref()
                if module is None:
                    continue
                yield module.register_forward_hook(self._make_hook(name), with_kwargs=True)
            passing = [module for ref in self._passing if (module := ref()) is not None]
            yield from self._register_passing(model, passing)
            yield from self._register_unread()

        return register_all(register, state=self)

    def _register_passing(self, model: nn.Module | None, passing: list[nn.Module]) -> Iterator[Any]:
        """The pass-through modules' hooks (:meth:`_pass_on`). One placed under several modules is
        one instance shared, maybe with other models: diffusers before 0.33 hands every
        ``get_activation("silu")`` one ``nn.SiLU`` (the UNet's resnets and ``conv_act``, the VAE's
        resnets alike), whose calls from the UNet ran a VAE full probe's hook too (26 a tiny SD step,
        7 Python calls each). Such a module's hook is in for the length of each call of the model's
        entry modules (:func:`~.watched.entry_modules`), the outermost, and taken off as it ends: two
        hooks an entry call; any other's from attach to detach. Limit: a module shared but placed once
        in this model keeps its hook from attach (runs it at the other models' calls)."""
        shared = [module for module in passing if id(module) in self._shared_passing]
        ids = {id(module) for module in shared}
        entries = [] if not shared or model is None else [m for m in entry_modules(model) if id(m) not in ids]
        if not entries or runs_compiled(model, [*entries, *shared]):  # (hooks put in inside compiled code
            shared = []  # would break its graph: at attach, as the others)
        for module in passing:
            if not shared or id(module) not in self._shared_passing:
                yield module.register_forward_hook(self._pass_on, with_kwargs=True)
        if not shared:
            return
        pairs = [(module, self._pass_on) for module in shared]
        live: list[ForwardHooks] = []
        depth = [0]

        def enter(module: nn.Module, args: tuple) -> None:
            if compiling():  # (compiled around the model since: _pass_on reads nothing in a trace)
                return
            if not depth[0]:
                live.append(ForwardHooks(pairs, with_kwargs=True))
            depth[0] += 1

        def leave(module: nn.Module, args: tuple, output: Any) -> None:
            if compiling() or not depth[0]:
                return
            depth[0] -= 1
            if not depth[0] and live:
                live.pop().remove()

        def off() -> None:  # (detached inside a call)
            depth[0] = 0
            while live:
                live.pop().remove()

        yield ForwardHooks([(m, leave) for m in entries], pre_hooks=[(m, enter) for m in entries], always_call=True)
        yield ProbeHandle(on_remove=off)

    def output_hooks(self, *, unread: bool = False) -> Iterator[tuple[nn.Module | None, OwnHook]] | None:
        """The ``(module, hook)`` pairs of a sentinel that reads block outputs only, taken together
        (``fused``, ``measure_inputs=False``: the diffusion debugger's default on fp16 components),
        which :meth:`attach` (not armed) puts in by one :class:`~.handles.ForwardHooks`, or a caller
        that puts several probes' pairs in by one (a 1-step pipeline call attaches and detaches them
        at every call). Each hook reads its block's output with :meth:`_read_output`; a module gone
        is None in its pair (skipped by ``ForwardHooks``). None for any other probe, and for one
        with modules whose outputs are unread (a text encoder's vocabulary head: hooks of their own)
        unless ``unread``: :meth:`attach` it then."""
        if self._kinds_for != (self.signal, self.dtypes):
            self._kinds, self._kinds_for = {}, (self.signal, self.dtypes)
        if self._held is None or self.measure_inputs or self._passing or (self._unread_modules and not unread):
            return None
        hooks = self._output_hooks
        if hooks is None:  # made once: a reused probe (a debugger's next attach) puts the same ones in
            read = self._read_output
            hooks = self._output_hooks = [OwnHook(read, name) for name in self.module_names]
        # each module from its weak reference without a comprehension's frame
        return zip(map(_DEREFERENCE, self._modules), hooks)

    def _attach_outputs(self, outputs: Iterator[tuple[nn.Module | None, OwnHook]]) -> ProbeHandle:
        """:meth:`output_hooks`' ``outputs`` put in by one :class:`~.handles.ForwardHooks`, with
        the hooks that mark the unread modules' outputs."""
        added = ForwardHooks(outputs)
        if not self._unread_modules:
            return ProbeHandle([added], state=self)

        def register():
            yield added
            yield from self._register_unread()

        try:
            return register_all(register, state=self)
        except BaseException:
            added.remove()
            raise

    def _read_output(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        """A hook of :meth:`_attach_outputs`: a block's output that is one tensor of a dtype whose
        abs-max is held (nearly every call) is held here, as :meth:`_measure` would hold it, without
        its walk, and so is a tuple of them (:meth:`_hold_tuple`); anything else (another dtype, a
        call being traced) is read by :meth:`_read`.

        Whether the call is being traced is asked once per batch (until :meth:`take`), not once per
        block: a component is compiled as a whole or not at all within one call. Limit: a block
        compiled in place under an eager model (regional compilation, which the diffusion debugger
        leaves unprobed at attach) after an eager block's hook asked would be read here as eager."""
        try:
            if output.__class__ is tuple:
                if len(output) == 1:  # (an attention block's return_dict=False)
                    output = output[0]
                elif self._hold_tuple(name, output):  # a down block's hidden states and residuals
                    return
            kind = self._kinds.get(output.dtype) if output.__class__ is _TENSOR else None
            eager = self._eager
            if eager is None:  # (a version counter is nothing a compiler traces)
                eager = self._eager = not (torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag)
            if (
                kind is None
                or not kind[3]
                or not eager
                or self._unread_ids
                or not (size := output.numel())
                or output.layout is not _STRIDED
                or output.is_meta
                or output.is_inference()
                or output.requires_grad
            ):
                self._read(name, args, {}, output, eager)
                return
            held = self._held  # held.slot_of(output) and held.add(output), spelled out: no call a block
            tensors, version = held.tensors, output._version
            position = held.positions.get(id(output))
            if position is not None and tensors[position] is output and held.versions[position] == version:
                index = held.base + position
            else:  # (a plain tensor with a version counter: no detach, no inference flag)
                position = len(tensors)
                held.positions[id(output)] = position
                tensors.append(output)
                held.versions.append(version)
                held.size += size * kind[4]
                index = held.base + position
                if held.size >= held.limit or position + 1 >= held.most:
                    held.flush()
            self._calls.extend((name, kind[1], (), index, None))
        except Exception as error:  # never break the forward we watch
            self._fail(name, error)

    def _hold_tuple(self, name: str, output: tuple) -> bool:
        """:meth:`_read_output`'s tuple of tensors, or of tuples of tensors (a UNet down block's
        hidden states and residuals, the last of which is the hidden states again), all of a dtype
        whose abs-max is held: held as :meth:`_measure` holds the tensors that
        :func:`~..stats.tensors_in` finds (in that order, one slot a distinct tensor), in this one
        frame rather than four and one a tensor added; False (nothing recorded) for anything else,
        which :meth:`_read` then reads (finding again what was held here)."""
        eager = self._eager
        if eager is None:  # (a version counter is nothing a compiler traces)
            eager = self._eager = not (torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag)
        if not eager or self._unread_ids:
            return False
        flat: list[torch.Tensor] = []
        for item in output:  # loops, not comprehensions: no frame of their own
            if item.__class__ is _TENSOR:
                flat.append(item)
            elif item.__class__ is tuple:
                for inner in item:
                    if inner.__class__ is not _TENSOR:
                        return False
                    flat.append(inner)
            else:
                return False
        kinds = self._kinds
        for t in flat:
            kind = kinds.get(t.dtype)
            if (
                kind is None
                or not kind[3]
                or not t.numel()
                or t.layout is not _STRIDED
                or t.is_meta
                or t.is_inference()
                or t.requires_grad
            ):
                return False
        if not flat:
            return False
        held, indices = self._held, []
        for t in flat:  # held.slot_of(t), then held.add(t), spelled out
            tensors, version = held.tensors, t._version
            position = held.positions.get(id(t))
            if position is not None and tensors[position] is t and held.versions[position] == version:
                indices.append(held.base + position)
                continue
            position = len(tensors)
            held.positions[id(t)] = position
            tensors.append(t)
            held.versions.append(version)
            held.size += t.numel() * kinds[t.dtype][4]
            indices.append(held.base + position)
            if held.size >= held.limit or position + 1 >= held.most:
                held.flush()  # (new lists)
        outputs = indices[0] if len(indices) == 1 else tuple(indices)
        self._calls.extend((name, kinds[flat[0].dtype][1], (), outputs, None))
        return True

    def _register_unread(self):
        for ref in self._unread_modules:
            if (module := ref()) is not None:
                yield module.register_forward_hook(self._mark_unread)

    def _attach_armed(self, arming: list[nn.Module]) -> ProbeHandle:
        names: dict[int, str] = {}
        hooked: list[tuple[str, nn.Module]] = []
        for name, ref in zip(self.module_names, self._modules):
            if (module := ref()) is None:
                continue
            if module._forward_hooks:  # its hooks may change its output, and run after the global one:
                hooked.append((name, module))  # read after them, by a hook of its own
            else:
                names.setdefault(id(module), name)  # a shared module under its first name
        passing = {id(m) for ref in self._passing if (m := ref()) is not None and not m._forward_hooks}
        hooked_passing = [m for ref in self._passing if (m := ref()) is not None and m._forward_hooks]
        armed: list[Any] = []  # the process-wide hook while a call is in progress
        depth = [0]  # calls in progress (the model's and its children's nest)
        eager = [True]  # whether the call in progress runs eagerly: asked once, at its start
        dispatch = self._reader(names, passing, eager)

        def arm(module, args):
            depth[0] += 1
            if depth[0] == 1:
                eager[0] = not compiling()
                armed.append(register_module_forward_hook(dispatch, with_kwargs=True))

        def disarm(module, args, output):  # always_call: also when the call raised
            depth[0] = max(depth[0] - 1, 0)
            if depth[0] == 0:
                while armed:
                    _remove_global(armed.pop())

        def release():
            depth[0] = 0
            while armed:
                _remove_global(armed.pop())

        def register():
            for name, module in hooked:
                yield module.register_forward_hook(self._make_hook(name), with_kwargs=True)
            for module in hooked_passing:  # after its own hooks, as a watched module's reading
                yield module.register_forward_hook(self._pass_on, with_kwargs=True)
            for module in arming:
                yield module.register_forward_pre_hook(arm)
                yield module.register_forward_hook(disarm, always_call=True)
            yield from self._register_unread()

        return register_all(register, on_remove=release, state=self)

    def _mark_unread(self, module, args, output) -> None:
        if not compiling():  # an id table is nothing a compiler traces: compiled, the output is measured
            for tensor in tensors_in(output):
                self._unread_ids[id(tensor)] = weakref.ref(tensor)

    @property
    def pending(self) -> int:
        """Number of module calls finished with something measured and not yet collected."""
        calls = self._calls
        if self.dtypes is None:
            return len(calls) // 5
        return len(calls) // 5 - list(zip(calls[2::5], calls[3::5])).count(_NOTHING)  # (counted in C)

    def hold(self, tensor: torch.Tensor) -> int | None:
        """Hold ``tensor`` (a component call's output) with the outputs this probe holds, so that
        :meth:`take`'s flush reduces it with them: its abs-max at the slot returned (from 0, in the
        flushed tensors joined), with no op of its own. None (nothing held) for a probe that holds
        nothing (not ``fused``) or a tensor the fused reduction does not take as it is (another
        dtype, empty, meta, not strided: fp8 has no reduction kernels). Its value is the one
        :func:`~.stats.absmax` gives (the largest \\|value\\| in its dtype, NaN before Inf)."""
        held = self._held
        if (
            held is None
            or type(tensor) is not torch.Tensor
            or tensor.dtype not in FUSED_DTYPES
            or not tensor.numel()
            or tensor.layout is not torch.strided
            or tensor.is_meta
        ):
            return None
        slot = held.slot_of(tensor) if not tensor.is_inference() else None  # the last module's output
        return held.add(tensor) if slot is None else slot

    def take(self) -> tuple[list[torch.Tensor], Callable[[list[list[float]]], list[ModuleReading]]]:
        """Hand over the queued device values and a function that turns their host copies (one
        list of floats a value, in order, as :func:`stats.to_host` gives them) into readings, and
        start afresh: for bringing them to the host with other values in one transfer.
        :meth:`collect` is ``take`` plus that transfer. The values are the held abs-maxes, one 1-d
        tensor a flush (:class:`~.fused.HeldAbsmax`), then the values reduced in the hooks (0-d)."""
        held_now = self._held
        if not self._calls and not self._values and (held_now is None or not (held_now.tensors or held_now.flushed)):
            # nothing queued (a component not called since the last take, as at most steps): no
            # flush, and no readings to build (reset()'s rest; with nothing held, its base is 0)
            self._seen, self._unread_ids, self._eager = {}, {}, None
            if self._kinds_for != (self.signal, self.dtypes):
                self._kinds, self._kinds_for = {}, (self.signal, self.dtypes)
            return [], _no_readings
        flushed = held_now.take() if held_now is not None else []  # (which empties it)
        values, calls, signal, keep_empty = flushed + self._values, self._calls, self.signal, self.dtypes is None
        held = len(flushed)
        self._values, self._calls, self._seen, self._unread_ids, self._eager = [], [], {}, {}, None  # reset()'s rest
        if self._kinds_for != (signal, self.dtypes):
            self._kinds, self._kinds_for = {}, (signal, self.dtypes)

        def readings(rows: list[list[float]]) -> list[ModuleReading]:
            # one list of values, indexed as the hooks index them: a held slot i (from 0) at i, a
            # value ~k (negative) from the end, the values reduced in the hooks being put in reversed
            host: list[float] = []
            for row in rows[:held]:  # loops, not comprehensions: no frame of their own, at every take
                host += row
            for row in reversed(rows[held:]):
                host.append(row[0])
            # each call that has a reading, numbered per module in finishing order (a call with
            # nothing watched, dtype-filtered, counts, unread; each module called once, as a UNet's
            # are in one call: all 0, no count kept); one tensor (most calls) needs no combining,
            # and a reading is built as the tuple it is (every field given), in a comprehension
            names = calls[::5]
            numbers = repeat(0) if len(set(names)) == len(names) else _call_numbers(names)
            return [
                _new_tuple(
                    ModuleReading,
                    (
                        name,
                        call,
                        dtype,
                        host[i] if i.__class__ is int else (_combine(host, i) if i else None),
                        host[o] if o.__class__ is int else (_combine(host, o) if o else None),
                        in_dtype,
                        signal,
                    ),
                )
                for name, call, dtype, i, o, in_dtype in zip(
                    names, numbers, calls[1::5], calls[2::5], calls[3::5], calls[4::5]
                )
                if keep_empty or i != () or o != ()
            ]

        return values, readings

    def collect(self) -> list[ModuleReading]:
        """Bring every queued value to the host (one transfer per device) and return the readings
        in the order the calls finished; then start afresh."""
        values, readings = self.take()
        return readings(to_host(values))

    def reset(self) -> None:
        """Drop whatever is queued (the activations it measured were never kept). Several probes,
        most of them holding nothing: :func:`reset_probes`."""
        if self._kinds_for != (self.signal, self.dtypes):
            self._kinds, self._kinds_for = {}, (self.signal, self.dtypes)
        self._values, self._calls, self._seen, self._unread_ids = [], [], {}, {}
        self._eager = None  # (_kinds, a function of the dtype and the probe's own settings, is kept)
        if self._held is not None:
            self._held.clear()


def reset_probes(probes: Iterable[Probe], but: Probe | None = None) -> None:
    """:meth:`Probe.reset` for each of ``probes`` (but ``but``) that holds anything, in one Python
    call: a reused debugger resets every probe at each detach and at each pipeline run's start,
    when nearly all of them hold nothing (a 1-step pipeline call does both at every call)."""
    for probe in probes:
        held = probe._held
        if probe is not but and (
            probe._calls
            or probe._values
            or probe._seen
            or probe._unread_ids
            or probe._eager is not None
            or (held is not None and (held.tensors or held.flushed or held.base))
            or probe._kinds_for != (probe.signal, probe.dtypes)
        ):
            probe.reset()


def probes_holding(probes: dict[str, Probe]) -> list[str]:
    """The names of ``probes`` whose :meth:`Probe.take` has anything to hand over or reset (or an
    error kept), in one Python call: a denoising step takes every component's probe, when nearly all
    of them hold nothing (a take then is three Python calls, and one more to read it)."""
    names = []
    for name, probe in probes.items():  # a loop: no Python call a probe
        held = probe._held
        if (
            probe._calls
            or probe._values
            or probe.errors
            or probe._seen
            or probe._unread_ids
            or probe._eager is not None
            or (held is not None and (held.tensors or held.flushed))
        ):
            names.append(name)
    return names


_DEREFERENCE = weakref.ref.__call__
"""``ref()`` as a function ``map`` calls in C (no Python frame a reference)."""


def _no_readings(rows: list[list[float]]) -> list[ModuleReading]:
    """What :meth:`Probe.take` hands over to read when nothing was queued."""
    return []


def apply_probes(
    module: nn.Module, config: ProbeConfig, *, modules: list[tuple[str, nn.Module]] | None = None
) -> ProbeHandle:
    """Probe ``module`` as ``config`` says; the handle's ``state`` is the :class:`Probe`, whose
    :meth:`~Probe.collect` or :meth:`~Probe.take` gives the readings. ``modules``: the
    :func:`probed_modules` of ``module``, when the caller already has them.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).half()
    >>> with apply_probes(model, ProbeConfig("full")) as handle:
    ...     _ = model(torch.full((1, 2), 2.0, dtype=torch.float16))
    >>> [(r.module, r.input_absmax, r.dtype) for r in handle.state.collect()]
    [('', 2.0, 'float16')]
    """
    probe = Probe(
        module,
        config.granularity,
        measure_inputs=config.measure_inputs,
        dtypes=config.dtypes,
        signal=config.signal,
        strict=config.strict,
        unread=config.unread,
        modules=modules,
        fused=config.fused,
        autocast=config.autocast,
    )
    return probe.attach(armed=config.armed)


def probe_call(module: nn.Module, args: tuple, kwargs: dict) -> list[ModuleReading]:
    """Run ``module(*args, **kwargs)`` once with every module probed (``"full"``) and return the
    readings: under ``torch.no_grad()``, with the torch RNG state (CPU and the CUDA devices the
    call may draw on) and the buffers a module in training mode changes (:func:`buffers_kept`)
    restored around it, so the run it is taken from does not change."""
    devices = cuda_devices((args, kwargs, list(module.parameters())[:1]))
    with torch.random.fork_rng(devices=devices), torch.no_grad(), buffers_kept(module):
        with apply_probes(module, ProbeConfig("full")) as handle:
            module(*args, **kwargs)
    return handle.state.collect()


_new_tuple = tuple.__new__
_MODULE = itemgetter(0)  # a reading's module
_NOTHING = ((), ())  # a call's input and output value indices when nothing of it was measured
_UNKNOWN = object()  # a dtype the probe has not decided on yet (_reducer)
_STRIDED = torch.strided
_TENSOR = torch.Tensor


def _sum_signal(t: torch.Tensor) -> torch.Tensor:
    """:func:`stats.finite_signal` of a float32/float64 tensor the probe found measurable, without
    its checks again."""
    return (t.detach() if t.requires_grad else t).sum(dtype=torch.float32)


def _call_numbers(names: list[str]) -> list[int]:
    """Each call's number among its module's calls (0 for the first), in order."""
    counts: dict[str, int] = {}
    numbers = []
    for name in names:
        counts[name] = call = counts.get(name, -1) + 1
        numbers.append(call)
    return numbers


def readings_by_call(readings: list[ModuleReading], marks: list[int]) -> list[list[ModuleReading]]:
    """The readings of one :meth:`Probe.take` that spans several calls of its model, cut at
    ``marks`` (:attr:`Probe.pending` as each call ended): one list a call, each module's calls
    numbered from 0 within it, as a take after each call would have numbered them.

    >>> r = lambda module, call: ModuleReading(module, call, "float16", None, 1.0)
    >>> [[(x.module, x.call) for x in part] for part in readings_by_call([r("a", 0), r("a", 1), r("b", 0)], [1, 3])]
    [[('a', 0)], [('a', 0), ('b', 0)]]
    """
    if len(marks) == 1:
        return [readings[: marks[0]]]
    parts, start = [], 0
    for end in marks:
        part = readings[start:end]
        for reading in part:  # a loop, not any() over a generator: no frame a reading
            if reading.call:  # a module called in an earlier part too: numbered again from 0
                renumbered = []
                for x, n in zip(part, _call_numbers(list(map(_MODULE, part)))):  # (loops: no frame a reading)
                    renumbered.append(_new_tuple(ModuleReading, (x[0], n, *x[2:])))
                part = renumbered
                break
        parts.append(part)
        start = end
    return parts


def _combine(host: list[float], indices: tuple[int, ...]) -> float | None:
    """One value for several tensors: NaN if any is NaN, else the largest magnitude (so a
    -inf sum still reads as non-finite)."""
    if not indices:
        return None
    if len(indices) == 1:
        return host[indices[0]]
    largest = 0.0
    for i in indices:
        value = host[i]
        if value != value:
            return math.nan
        largest = max(largest, abs(value))
    return largest


def _remove_global(handle: Any) -> None:
    handle.remove()
    # torch's handle of a global hook forgets its with_kwargs flag (it removes only the always_call
    # one): drop it too, or every armed call would leave an entry behind
    getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {}).pop(handle.id, None)
