"""Components compiled with ``torch.compile``: how the debugger watches them without adding a
graph break or a recompile, and replays them eagerly to name a module.

Four ways a user compiles a component, each seen on the module itself:

- ``pipe.unet = torch.compile(pipe.unet)``: an ``OptimizedModule`` whose ``_orig_mod`` is the
  model. Hooks on the ``OptimizedModule`` run outside the compiled code.
- ``pipe.unet.compile()``: the module's ``_compiled_call_impl`` runs its hooks *inside* the
  compiled code, so the call site is watched by wrapping that attribute instead
  (:func:`wrap_compiled_call`), which runs eagerly around it.
- ``compile_repeated_blocks()`` (regional): some submodules are compiled in place.
- ``pipe.vae.decode = torch.compile(pipe.vae.decode)`` (a method): the VAE's ``decoder`` is called
  inside the compiled function, where its hooks would be traced (a clock, a host read: a graph
  break each). The call site is watched around that function instead
  (:func:`wrap_compiled_method`), eagerly, with the function's arguments; the ``decoder``'s own are
  found only when a replay or a bundle asks for them (:func:`half_arguments`: the original method
  run eagerly, the ``decoder``'s call that made the fault taken). Set on a VAE's ``torch.compile``
  wrapper (``pipe.vae.decode = torch.compile(pipe.vae.decode)`` after ``pipe.vae = torch.compile(
  pipe.vae)``) it is the same (:func:`compiled_methods`).

Hooks inside a compiled region are either traced into the graph (hooks present at the first
compile) or silently skipped (added later: dynamo does not guard on a submodule's hooks), so
the debugger puts no probe inside one: a compiled component is measured at its call site and in
the step row (its output, every step), and a NaN/Inf there is localised by a replay of the
original module with full probes under ``torch.compiler.set_stance("force_eager")`` (names without
the ``_orig_mod.`` prefix). An fp16 output near overflow is warned of from the abs-max read there
(:meth:`~diffusion_debug.diffusion.call_events.CallEvents.output_overflow`): a VAE's or text encoder's named
at the module inside that made it by the same eager replay (its decoder's ``conv_out``), at the component where
that replay names none (a hook the compiled code skips); a denoiser's at the component (no replay is made for it).

``vae.compile()`` and ``pipe.vae = torch.compile(pipe.vae)`` are none of these: they compile the
VAE's ``forward``, which a pipeline's ``vae.decode`` / ``encode`` do not call (the wrapper hands
``decode`` over from its original), so the VAE is watched as an uncompiled one
(:func:`called_through_halves`; the wrapper's original probed, names without ``_orig_mod.``). Limit:
a VAE so compiled and then called as ``vae(x)`` runs its probes inside the compiled ``forward``.

Limits of a compiled VAE method: the ``decoder``'s arguments a replay gets are the eager
``decode``'s up to its call (its ``post_quant_conv`` run eagerly: a backend that fuses it, as
inductor may, can differ in the last bits from the compiled call's). A tiled or sliced decode
calls it once a tile or slice: the whole decode is run again eagerly to find the call whose output
holds the NaN/Inf (else the largest abs-max), which the replay then names a module in.

>>> import torch
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.linear = torch.nn.Linear(2, 2)
...     def forward(self, x):
...         return self.linear(x)
>>> compiled = torch.compile(Net(), backend="eager")
>>> compile_state(compiled), compile_state(compiled._orig_mod), type(eager_module(compiled)).__name__
('wrapped', None, 'Net')
"""

from __future__ import annotations

import contextlib
from types import FunctionType
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...installed import HAS_SET_STANCE
from ...probes import ModuleReading, probe_call
from ...probes.tracing import compile_wrapper, compiled_in_place, eager_module
from ...stats import read_now, tensors_in
from ..pipeline_patches import MethodPatch
from .structure import ROOT_METHODS

ORIG = "_orig_mod"


def compile_state(module: nn.Module) -> str | None:
    """``"wrapped"`` (``torch.compile(m)``), ``"in_place"`` (``m.compile()``), ``"method"`` (a
    method compiled: ``m.decode = torch.compile(m.decode)``), ``"regional"`` (submodules compiled in
    place) or None. A VAE's own ``vae.compile()`` and its ``torch.compile`` wrapper count for nothing:
    its ``forward`` is compiled, and the pipeline's ``decode`` does not call it
    (:func:`called_through_halves`); a wrapped VAE is what its original is, or ``"method"``."""
    if compile_wrapper(module):
        original = module._orig_mod
        # torch.compile(vae): the wrapper compiles the VAE's forward; a pipeline's vae.decode, looked up
        # through it, is the original's (its own compiled methods, or none)
        if not called_through_halves(original):
            return "wrapped"
        return "method" if compiled_methods(module) else compile_state(original)
    halves = called_through_halves(module)
    if compiled_in_place(module) and not halves:
        return "in_place"
    if compiled_methods(module):
        return "method"
    if any(compiled_in_place(sub) for sub in module.modules() if sub is not module or not halves):
        return "regional"
    return None


def called_through_halves(module: nn.Module) -> bool:
    """Whether ``module`` is a VAE that a pipeline calls through its methods (``vae.decode`` calls
    its ``decoder``), not its ``forward``: ``vae.compile()``, which compiles the ``forward``, leaves
    them eager, and its ``decoder`` / ``encoder`` are watched as an uncompiled VAE's are."""
    for half, method in HALF_METHODS.items():
        if isinstance(module._modules.get(half), nn.Module) and callable(getattr(type(module), method, None)):
            return True
    return False


def compiled_methods(module: nn.Module) -> dict[str, Callable[..., Any]]:
    """The methods of ``module`` (:data:`~.structure.ROOT_METHODS`) that the user replaced by their
    ``torch.compile``'d selves, by name (``{"decode": vae.decode}``: the original bound method,
    which runs eagerly). A ``torch.compile`` wrapper's are those set on it or on its original
    (``pipe.vae.decode = torch.compile(pipe.vae.decode)`` after ``pipe.vae = torch.compile(pipe.vae)``
    sets it on the wrapper); the wrapper's own ``forward`` (the original's ``__call__``) is none. A
    method is known by its function (the class's own), or by its name."""
    found = {}
    original = module._modules.get(ORIG)  # (compile_wrapper, inline: asked at every attach)
    owners = (module,) if original is None else (module, original)
    for owner in owners:
        state = owner.__dict__
        for name in ROOT_METHODS:  # those the memo's key holds (a 1-step pipeline asks at every attach)
            value = state.get(name)
            method = getattr(value, "_torchdynamo_orig_callable", None) if type(value) is FunctionType else None
            if method is not None and getattr(method, "__self__", None) is owners[-1] and name not in found:
                # the class's own method: diffusers before 0.33 wraps decode / encode without
                # functools.wraps (apply_forward_hook), so its __name__ is "wrapper"
                own = getattr(method, "__func__", None) is getattr(type(owners[-1]), name, None)
                if own or getattr(method, "__name__", None) == name:
                    found[name] = method
    return found


HALF_METHODS = {"decoder": "decode", "encoder": "encode"}
"""The VAE method whose call reaches each half (its call site's prefix)."""


@contextlib.contextmanager
def eager(module: nn.Module) -> Iterator[None]:
    """``module``'s compiled code runs eagerly (the original Python) within the block: a replay with
    hooks. Before torch 2.6 (no ``set_stance``) the modules compiled in place under ``module`` lose
    their compiled call for the block, its ``torch.compile`` wrapper children give their places to
    their originals, and a method compiled on an instance (``vae.decode = torch.compile(...)``, maybe
    wrapped by the debugger's call site) calls its original; the block then puts each back."""
    if HAS_SET_STANCE:
        with torch.compiler.set_stance("force_eager"):
            yield
        return
    methods = _compiled_method_slots(module)
    for holder, name, _, original in methods:
        _put(holder, name, original)
    compiled = [m for m in module.modules() if compiled_in_place(m)]
    calls = [vars(m).pop("_compiled_call_impl") for m in compiled]
    # children that are torch.compile wrappers: their originals take their places for the block
    children = [(m, n, c) for m in module.modules() for n, c in m._modules.items() if c is not None]
    wrapped = [(parent, name, child) for parent, name, child in children if compile_wrapper(child)]
    for parent, name, child in wrapped:
        parent._modules[name] = child._orig_mod
    try:
        yield
    finally:
        for parent, name, child in wrapped:
            parent._modules[name] = child
        for m, call in zip(compiled, calls):
            m._compiled_call_impl = call
        for holder, name, function, _ in methods:
            _put(holder, name, function)


@contextlib.contextmanager
def cached_graphs_only() -> Iterator[None]:
    """Within the block, compiled code runs only where dynamo's cache already holds a graph whose guards
    pass, and runs eagerly (the original Python) everywhere else, compiling nothing: a debugger's replay of
    a live compiled component (``why()``'s as-is row, its caching hooks' links passed through or their
    timestep callbacks answered, a copy in another dtype, which runs the same code) adds no graph to the
    user's compiled functions. Each graph it added was an entry in their cache that counted toward
    dynamo's ``recompile_limit``, past which torch runs the user's own later recompiles eagerly. Before
    torch 2.6 (no ``set_stance``) the block changes nothing."""
    if not HAS_SET_STANCE:
        yield
        return
    with torch.compiler.set_stance("eager_on_recompile"):
        yield


def _compiled_method_slots(module: nn.Module) -> list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]]:
    """Each method compiled on an instance under ``module`` (:data:`~.structure.ROOT_METHODS`):
    ``(holder, name, compiled function, its original)``, the holder being the instance's
    ``__dict__`` or, where the debugger wraps the method (a call site), its innermost patch (whose
    ``inner`` calls the compiled function)."""
    slots = []
    for owner in module.modules():
        state = owner.__dict__
        for name in ROOT_METHODS:
            holder, value = state, state.get(name)
            while (patch := getattr(value, "__diffusion_debug_patch__", None)) is not None:
                holder, value = patch, patch.previous
            original = getattr(value, "_torchdynamo_orig_callable", None) if type(value) is FunctionType else None
            if original is not None and (holder is state or holder.inner is value):
                slots.append((holder, "inner" if holder is not state else name, value, original))
    return slots


def _put(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


def replay_readings(module: nn.Module, args: tuple, kwargs: dict, prefix: str = "") -> list[ModuleReading]:
    """Run ``module(*args, **kwargs)`` once with full probes; readings named inside the component
    (``prefix`` + name inside ``module``). A compiled module is replayed eagerly, as its original."""
    module = eager_module(module)  # a compiled component: its original module, run eagerly
    with eager(module):
        readings = probe_call(module, args, kwargs)
    if not prefix:
        return readings
    return [r._replace(module=f"{prefix}.{r.module}" if r.module else prefix) for r in readings]


def wrap_compiled_call(
    module: nn.Module,
    pre_hook: Callable[[nn.Module, tuple, dict], Any],
    post_hook: Callable[[nn.Module, tuple, dict, Any], Any],
) -> MethodPatch:
    """Run ``pre_hook`` / ``post_hook`` (forward-hook signatures, with kwargs) eagerly around a
    module compiled in place, as its forward hooks would run around an eager one, without
    touching the compiled code; ``remove()`` puts the compiled call back."""
    return wrap_compiled_method(module, "_compiled_call_impl", module, pre_hook, post_hook)


def wrap_compiled_method(
    owner: nn.Module,
    name: str,
    module: nn.Module,
    pre_hook: Callable[[nn.Module, tuple, dict], Any],
    post_hook: Callable[[nn.Module, tuple, dict, Any], Any],
) -> MethodPatch:
    """Run ``pre_hook`` / ``post_hook`` for ``module`` (a VAE half) eagerly around ``owner.name``,
    a method of its VAE that the user compiled (``vae.decode``), with that method's arguments and
    output; ``remove()`` puts the compiled function back."""

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            pre_hook(module, args, kwargs)
            output = inner(*args, **kwargs)
            post_hook(module, args, kwargs, output)
            return output

        return call

    return MethodPatch(owner, name, make)


def half_arguments(
    method: Callable[..., Any],
    half: nn.Module,
    args: tuple,
    kwargs: dict,
    keep: Callable[[tuple, dict], tuple[tuple, dict]],
) -> tuple[tuple, dict]:
    """The arguments of the call of ``half`` that made ``method``'s output what it was, ``method``
    being a VAE's original ``decode`` called with ``args`` / ``kwargs``: the method run eagerly
    (no grad, the RNG state kept) and each call of ``half`` in it kept as passed (``keep``, when it
    begins); the first whose output holds a NaN/Inf, else the one whose output's abs-max is the
    largest (a near-overflow). A sliced or tiled decode calls ``half`` once a slice or tile, the Wan
    VAE once a frame: the call a replay names a module in is the one that made the fault, wherever
    it lies (one host read for them all). Raises ``LookupError`` when the method does not call it."""
    seen: list[tuple[tuple, dict]] = []
    peaks: list[torch.Tensor] = []

    def begins(module: nn.Module, call_args: tuple, call_kwargs: dict) -> None:
        seen.append(keep(call_args, call_kwargs))

    def ends(module: nn.Module, call_args: tuple, call_kwargs: dict, output: Any) -> None:
        found = tensors_in(output)
        tensor = found[0] if found else None
        if tensor is None or not tensor.is_floating_point() or not tensor.numel():
            peaks.append(torch.zeros((), device=tensor.device if tensor is not None else None))
        else:  # NaN and Inf alike the largest: the first call holding one is the one taken
            peaks.append(tensor.detach().abs().amax().float().nan_to_num(nan=float("inf")))

    handles = [
        half.register_forward_pre_hook(begins, with_kwargs=True, prepend=True),
        half.register_forward_hook(ends, with_kwargs=True),
    ]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            method(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if not seen:
        raise LookupError(f"{getattr(method, '__name__', method)} did not call {type(half).__name__}")
    if len(seen) == 1 or len(peaks) != len(seen):  # one call (or a call that did not return): the first
        return seen[0]
    return seen[read_now(torch.stack([p.to(peaks[0].device) for p in peaks]).argmax())]
