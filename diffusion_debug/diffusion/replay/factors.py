"""The factors a "why" replay changes, one at a time, on the call where a NaN/Inf was made.

Each :class:`Factor` turns the origin call (:class:`OriginCall`) into a :class:`Variant`: the module
to call, its arguments and the contexts to call it in. A factor that changes the module works on an
:func:`~diffusion_debug.diffusion.replay.copies.isolated_copy`; one that does not (SDPA math kernel,
eager instead of compiled, other inputs) calls the live module inside contexts that leave it as it
was. ``rank`` orders the fixes from the smallest change (one adapter off) to the largest (another
dtype for the whole component, every adapter off); the inputs are a diagnosis, never a fix.

>>> [f.name for f in (dtype_factor("float32", vae=True), inputs_factor())]
['vae upcast (float32)', 'finite inputs']

Limits: VAE tiling and slicing live in ``vae.decode``, not in the decoder call a bundle holds, so
they are not replayed; the default attention processor replaces only processors that are not
diffusers' own (an extension's); a model attending through a diffusers attention backend other than
the native one (``set_attention_backend``, or the active one) is replayed with the native backend in
place of the SDPA math kernel, which that dispatch does not use; a backend entered with diffusers'
``attention_backend`` context is gone when ``why()`` runs after the call; the adapters are peft's
(diffusers' LoRA backend).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ...stats import dtype_name, map_tensors
from ..components.autocast import AutocastState
from ..components.compiled import compile_state, eager, eager_module
from .copies import cast_copy, copy_note, hook_groups, isolated_copy


@dataclass
class OriginCall:
    """The component call a NaN/Inf came from: the live component and the call's arguments."""

    component: str
    module: nn.Module
    """The live component (a ``torch.compile`` wrapper stays one)."""
    prefix: str
    """The called module inside the component (``"decoder"`` for a VAE decode, ``""`` otherwise)."""
    args: tuple
    kwargs: dict
    vae: bool = False
    context: Any = None
    """The diffusers cache context the call ran in (a component with caching hooks)."""
    unhooked: dict[str, nn.Module] = field(default_factory=dict)
    """The component as loaded before a diffusers switch was applied to it, per switch (its
    full-precision weights before layerwise casting stored them in fp8), when known."""
    autocast: AutocastState = ()
    """The autocast regions the call ran under (a bundle's ``autocast``), entered again by every replay."""


@dataclass
class Variant:
    """What one replay calls: ``module`` (the component, live or a copy), in ``contexts``."""

    module: nn.Module
    args: tuple
    kwargs: dict
    contexts: list[Callable[[], ContextManager[Any]]] = field(default_factory=list)
    live: bool = True
    """True when the live module is called, False for a copy (the note says what it lacks)."""
    note: str = ""
    autocast: tuple[tuple[str, torch.dtype | None], ...] | None = None
    """The autocast it runs under in place of the call's (a device type's dtype None: closed); None: the call's."""


@dataclass(frozen=True)
class Factor:
    name: str
    """The table's label (``float32``, ``LoRA 'b' off``)."""
    change: str
    """The change as a person would make it, for the sentence (``run {component} in float32``)."""
    rank: int
    build: Callable[[OriginCall], Variant]


def target(module: nn.Module, prefix: str) -> nn.Module:
    """The module one call runs: the component, or its ``prefix`` submodule (of the original of a
    compiled wrapper)."""
    return eager_module(module).get_submodule(prefix) if prefix else module


def parameter_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype ``module`` computes in: its first floating parameter's that is not a one-byte
    storage dtype (fp8 weights of layerwise casting compute in another)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point() and p.dtype.itemsize > 1), None)


# -- dtype ---------------------------------------------------------------------------------------


def dtype_factor(name: str, *, vae: bool = False) -> Factor:
    dtype = getattr(torch, name)

    def build(call: OriginCall) -> Variant:
        was = parameter_dtype(call.module)
        copied = cast_copy(isolated_copy(call.module), dtype)

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.dtype == was else t

        return Variant(copied, map_tensors(call.args, cast), map_tensors(call.kwargs, cast), live=False)

    if vae and name == "float32":
        change = "upcast the VAE to float32 for the decode (force_upcast where the pipeline reads it, SDXL's)"
        return Factor("vae upcast (float32)", change, 50, build)  # (a bundle's call: its pipeline class not known)
    return Factor(name, "run {component} in " + name, 50 if name == "float32" else 60, build)


def autocast_factor(dtype: torch.dtype | None) -> Factor:
    """The call's autocast regions to ``dtype`` (bfloat16: float32's range, so no float16 overflow), or closed
    (None: the component computes in its weights' dtype)."""

    def build(call: OriginCall) -> Variant:
        state = tuple((device, dtype) for device, _ in call.autocast)
        return Variant(call.module, call.args, call.kwargs, autocast=state)

    if dtype is None:
        return Factor("outside autocast", "run {component} outside torch.autocast", 55, build)
    change = "autocast to bfloat16 (torch.autocast(..., dtype=torch.bfloat16))"
    return Factor("autocast to bfloat16", change, 45, build)


# -- attention -----------------------------------------------------------------------------------


def _sdpa_math() -> ContextManager[Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def sdpa_math_factor() -> Factor:
    def build(call: OriginCall) -> Variant:
        return Variant(call.module, call.args, call.kwargs, [_sdpa_math])

    return Factor("SDPA math kernel", "use the SDPA math kernel (torch.nn.attention.sdpa_kernel)", 20, build)


def custom_processors(module: nn.Module) -> dict[str, Any]:
    """Attention processors of ``module`` that are not diffusers' own (an extension's), by name."""
    processors = getattr(eager_module(module), "attn_processors", None)
    if not isinstance(processors, dict):
        return {}
    return {k: p for k, p in processors.items() if not type(p).__module__.startswith("diffusers.")}


def processor_factor() -> Factor:
    def build(call: OriginCall) -> Variant:
        from diffusers.models.attention_processor import AttnProcessor2_0

        copied = isolated_copy(call.module)
        original = eager_module(copied)
        processors = dict(original.attn_processors)
        processors.update({name: AttnProcessor2_0() for name in custom_processors(original)})
        original.set_attn_processor(processors)
        return Variant(copied, call.args, call.kwargs, live=False)

    return Factor("default attention processor", "use diffusers' AttnProcessor2_0", 10, build)


_ABSENT = object()
"""An attribute a processor did not hold itself (its class's was read)."""


def _dispatching_processors(module: nn.Module) -> list[Any]:
    """The attention processors of ``module`` that call diffusers' attention dispatch (they carry an
    ``_attention_backend``: None for the active backend, else the one ``set_attention_backend`` gave
    them), each once (a processor may be shared)."""
    found: dict[int, Any] = {}
    for sub in eager_module(module).modules():
        processor = getattr(sub, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            found.setdefault(id(processor), processor)
    return list(found.values())


def other_attention_backend(module: nn.Module) -> bool:
    """Whether ``module`` attends through a diffusers attention backend other than the native one
    (``set_attention_backend("flash" | "sage" | "flex" | ...)`` on it, or the active backend of the
    process) that diffusers' dispatch would use."""
    processors = _dispatching_processors(module)
    if not processors:
        return False
    try:  # a diffusers whose dispatch is laid out otherwise: no such factor, rather than no why()
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        native = AttentionBackendName.NATIVE
        active = getattr(_AttentionBackendRegistry, "_active_backend", native)
    except ImportError:
        return False
    return any((p._attention_backend or active) != native for p in processors)


@contextlib.contextmanager
def _native_attention(module: nn.Module):
    """``module``'s dispatching processors and the active backend set to the native one, each put back
    as it was (an instance attribute ``set_attention_backend`` added, or none: the class's; a slot's
    value for a processor without ``__dict__``); only the processors it set are put back."""
    from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend

    kept: list[tuple[Any, Any]] = []
    try:
        for processor in _dispatching_processors(module):
            own = getattr(processor, "__dict__", None)
            was = own.get("_attention_backend", _ABSENT) if own is not None else processor._attention_backend
            processor._attention_backend = AttentionBackendName.NATIVE
            kept.append((processor, was))
        with attention_backend(AttentionBackendName.NATIVE):
            yield
    finally:
        for processor, was in kept:
            if was is _ABSENT:
                del processor._attention_backend
            else:
                processor._attention_backend = was


def native_backend_factor(component: str) -> Factor:
    def build(call: OriginCall) -> Variant:
        return Variant(call.module, call.args, call.kwargs, [lambda: _native_attention(call.module)])

    change = f"use diffusers' native attention backend (pipe.{component}.set_attention_backend('native'))"
    return Factor("native attention backend", change, 20, build)


# -- compiled, hooks, adapters --------------------------------------------------------------------


def eager_factor() -> Factor:
    def build(call: OriginCall) -> Variant:
        module = eager_module(call.module)
        return Variant(module, call.args, call.kwargs, [lambda: eager(module)])

    return Factor("eager (not compiled)", "run {component} without torch.compile", 40, build)


def hooks_off_factor(group: str) -> Factor:
    def build(call: OriginCall) -> Variant:
        before = call.unhooked.get(group)
        copied = isolated_copy(before) if before is not None else isolated_copy(call.module, drop_hooks=group)
        return Variant(copied, call.args, call.kwargs, live=False)

    return Factor(f"{group} off", f"turn off diffusers' {group} hooks", 30, build)


def tuner_layers(module: nn.Module) -> list[nn.Module]:
    """peft's adapter layers in ``module`` (none without peft)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in eager_module(module).modules() if isinstance(m, BaseTunerLayer)]


def active_adapters(module: nn.Module) -> list[str]:
    """The adapters that act in ``module``'s forward, in the order first seen."""
    names: list[str] = []
    for layer in tuner_layers(module):
        if not layer.disable_adapters:
            names += [a for a in layer.active_adapters if a not in names]
    return names


def adapters_off_factor(name: str | None, *, rank: int) -> Factor:
    """``name`` None: every adapter off; else that adapter alone."""

    def build(call: OriginCall) -> Variant:
        copied = isolated_copy(call.module)
        for layer in tuner_layers(copied):
            kept = [a for a in layer.active_adapters if name is not None and a != name]
            if kept:
                layer.set_adapter(kept)
            else:
                layer.enable_adapters(False)
        return Variant(copied, call.args, call.kwargs, live=False)

    if name is None:
        return Factor("adapters off", "disable the LoRA adapters (disable_adapters)", rank, build)
    return Factor(f"LoRA {name!r} off", f"disable the LoRA adapter {name!r}", rank, build)


# -- inputs --------------------------------------------------------------------------------------


def _same_statistics(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Finite values drawn with the mean and std of ``t``'s finite values (0 and 1 when it has none)."""
    values = t.detach().float()
    finite = values[values.isfinite()]
    mean = float(finite.mean()) if finite.numel() else 0.0
    std = float(finite.std()) if finite.numel() > 1 else 1.0
    noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
    return (noise * std + mean).to(device=t.device, dtype=t.dtype)


def floating_inputs(call: OriginCall) -> list[tuple[str, torch.Tensor]]:
    """The call's floating tensor arguments, named as the call names them (``args.0``, ``sample``)."""
    found = [(f"args.{i}", a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [(k, v) for k, v in found if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()]


def nonfinite_inputs(call: OriginCall) -> list[str]:
    return [name for name, t in floating_inputs(call) if not bool(t.isfinite().all())]


def inputs_factor() -> Factor:
    def build(call: OriginCall) -> Variant:
        named = floating_inputs(call)
        chosen = nonfinite_inputs(call) or [named[0][0]]  # else the sample: its values or the module?
        generator = torch.Generator().manual_seed(0)
        args, kwargs = list(call.args), dict(call.kwargs)
        for name in chosen:
            if name.startswith("args."):
                index = int(name.split(".")[1])
                args[index] = _same_statistics(args[index], generator)
            else:
                kwargs[name] = _same_statistics(kwargs[name], generator)
        return Variant(call.module, tuple(args), kwargs, note="replaced: " + ", ".join(chosen))

    return Factor("finite inputs", "replace the inputs by finite values of the same statistics", 100, build)


def factors_for(call: OriginCall) -> list[Factor]:
    """Every factor that applies to ``call``'s component, smallest change first."""
    found: list[Factor] = []
    adapters = active_adapters(call.module)
    if len(adapters) > 1:
        found += [adapters_off_factor(name, rank=0) for name in adapters]
    if custom_processors(call.module):
        found.append(processor_factor())
    if other_attention_backend(target(call.module, call.prefix)):
        found.append(native_backend_factor(call.component))
    elif any("Attention" in type(m).__name__ for m in target(call.module, call.prefix).modules()):
        found.append(sdpa_math_factor())
    groups = hook_groups(eager_module(call.module))
    found += [hooks_off_factor(group) for group in groups + [g for g in call.unhooked if g not in groups]]
    if compile_state(call.module) is not None:
        found.append(eager_factor())
    if call.autocast:  # what autocast computes in, which the weights' dtype does not change
        found.append(autocast_factor(None))
        if any(dtype != torch.bfloat16 for _, dtype in call.autocast):
            found.append(autocast_factor(torch.bfloat16))
    dtype = parameter_dtype(call.module)
    for name in ("float32", "bfloat16"):
        if dtype is not None and dtype_name(dtype) != name:
            found.append(dtype_factor(name, vae=call.vae))
    if adapters:
        found.append(adapters_off_factor(None, rank=70 if len(adapters) > 1 else 0))
    if floating_inputs(call):
        found.append(inputs_factor())
    return sorted(found, key=lambda f: f.rank)


def variant_note(call: OriginCall, variant: Variant) -> str:
    """What the variant's replay does not reproduce, with its own note."""
    parts = [variant.note, "" if variant.live else copy_note(call.module)]
    return "; ".join(p for p in parts if p)


@contextlib.contextmanager
def entered(contexts: list[Callable[[], ContextManager[Any]]]):
    with contextlib.ExitStack() as stack:
        for make in contexts:
            stack.enter_context(make())
        yield
