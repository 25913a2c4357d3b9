"""A private copy of a component for a "what if" replay: its weights and its diffusers hooks, run eagerly,
and nothing shared with the live one.

``copy.deepcopy`` alone is not enough. A diffusers hook replaces the module's ``forward`` with a
closure over the original module and hook, and functions are not copied, so a deep copy of a
hooked module silently runs the original. :func:`isolated_copy` takes the hooks off the copy and
registers the copied hook objects again through diffusers' own ``HookRegistry``, so the copy's
hooks act on the copy (with a copy of their state).

A copy never compiles: it is made of a ``torch.compile`` wrapper's original module, without the
compiled calls of modules compiled in place, and is run eagerly (:func:`copy_note` says so in its
row). Dynamo keeps its compiled graphs per code object, not per module: a copy compiled runs the
user's own functions (the model's ``forward``, a caching hook's ``new_forward``), and each graph it
made was an entry in the user's cache, counted toward their ``recompile_limit`` (FasterCache's
``new_forward`` reached 8 from one ``why()``, and the user's next call compiled again).

The copy's stateful hooks keep the copied state: registering a hook again calls its
``initialize_hook``, which gives FasterCache and PyramidAttentionBroadcast a fresh state (a FasterCache
block that approximates then read an empty cache), so the copied attributes are put back after. A copy
run in another dtype (:func:`cast_copy`) gets its hooks' cached tensors in that dtype too: a float32
residual read by a bfloat16 block failed ("mat1 and mat2 must have the same dtype").

Limits: a copy of a compiled component measures its eager code, not the compiled graphs (a backend
that fuses, as inductor may, can differ in the last bits); the copy's hook state is the live state at
the time of the copy (a caching hook starts from the live cache).
"""

from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import nn

from ...stats import dtype_name
from ...stats.quantized import is_quantized
from ..components.cache_hooks import state_objects, stateful_hooks
from ..components.compiled import compile_state, eager_module

HOOK_GROUPS = {
    "layerwise casting": ("layerwise_casting", "peft_autocast_disable"),
    "group offloading": ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"),
    "caching": ("fbc_", "faster_cache", "mag_cache", "pyramid_attention", "sea_cache", "taylorseer", "text_kv_cache"),
}
"""diffusers hook names per switch of the "hooks off" factor; every other stateful hook is a cache."""

_CONTEXT_FIELDS = ("name", "step_index", "num_inference_steps", "timestep", "sigma")


def context_fields(context: Any) -> dict[str, Any] | None:
    """A diffusers cache context as plain values, for a bundle (None when there is none)."""
    if isinstance(context, str):
        return {"name": context}
    if not isinstance(getattr(context, "name", None), str):
        return None
    values = {key: getattr(context, key, None) for key in _CONTEXT_FIELDS}
    return {k: v for k, v in values.items() if v is None or isinstance(v, (str, int, float))}


def context_from_fields(fields: Any) -> Any:
    """The cache context :func:`context_fields` saved (diffusers' ``CacheContext``, or its name in a
    diffusers whose contexts are names)."""
    if not isinstance(fields, dict) or not isinstance(fields.get("name"), str):
        return None
    try:
        from diffusers.hooks.hooks import CacheContext
    except ImportError:
        return fields["name"]
    return CacheContext(**{k: v for k, v in fields.items() if k in _CONTEXT_FIELDS})


def _registry(module: nn.Module) -> Any:
    return vars(module).get("_diffusers_hook")  # never getattr: nn.Module would look in its buffers


def hook_group(name: str, hook: Any = None) -> str | None:
    """The switch a diffusers hook belongs to: ``layerwise casting``, ``group offloading``,
    ``caching`` (stateful hooks) or None (a hook we leave alone)."""
    for group, prefixes in HOOK_GROUPS.items():
        if any(name.startswith(prefix) for prefix in prefixes):
            return group
    return "caching" if getattr(hook, "_is_stateful", False) else None


def hook_groups(module: nn.Module) -> list[str]:
    """The switches that apply to ``module``'s diffusers hooks, in the order of :data:`HOOK_GROUPS`."""
    found = set()
    for sub in module.modules():
        registry = _registry(sub)
        if registry is not None:
            found.update(hook_group(name, hook) for name, hook in registry.hooks.items() if not passed(hook))
    return [group for group in HOOK_GROUPS if group in found]


@contextlib.contextmanager
def hooks_passed(module: nn.Module, group: str) -> Iterator[bool]:
    """Within the block, ``module``'s diffusers hooks of the switch ``group`` pass each call through, on the
    module itself: each hook's ``fn_ref`` (its link in the registry's chain) runs no pre- or post-forward and
    calls the forward it wraps, so no hook reads or writes its state; no copy is made (a 12B transformer's
    would double its memory). Every link is put back after, even when the block raises. Yields False, and
    changes nothing, where a hook of ``group`` holds no ``fn_ref`` (a diffusers without one)."""
    hooks = [
        hook
        for sub in module.modules()
        if (registry := _registry(sub)) is not None
        for name, hook in registry.hooks.items()
        if hook_group(name, hook) == group
    ]
    refs = [vars(hook).get("fn_ref") for hook in hooks]
    if not refs or any(ref is None for ref in refs):
        yield False
        return
    kept = [(ref, vars(ref).copy()) for ref in refs]
    try:
        for ref in refs:
            ref.pre_forward, ref.post_forward = _passed_in, _passed_out
            ref.forward = getattr(ref, "original_forward", None) or ref.forward  # (None: a hook without new_forward)
        yield True
    finally:
        for ref, attributes in kept:
            vars(ref).clear()
            vars(ref).update(attributes)


def passed(hook: Any) -> bool:
    """Whether ``hook`` is passed through now (:func:`hooks_passed`): a copy leaves it off."""
    return getattr(vars(hook).get("fn_ref"), "pre_forward", None) is _passed_in


def _passed_in(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    return args, kwargs


def _passed_out(module: nn.Module, output: Any) -> Any:
    return output


def layerwise_casting(module: nn.Module) -> dict[str, str] | None:
    """``{"storage_dtype", "compute_dtype"}`` of the first layerwise-casting hook in ``module`` (None
    without one): what a replay on weights loaded again must apply to reproduce the run."""
    for sub in module.modules():
        registry = _registry(sub)
        for name, hook in registry.hooks.items() if registry is not None else ():
            storage, compute = getattr(hook, "storage_dtype", None), getattr(hook, "compute_dtype", None)
            if hook_group(name, hook) == "layerwise casting" and isinstance(storage, torch.dtype):
                return {"storage_dtype": dtype_name(storage), "compute_dtype": dtype_name(compute)}
    return None


def _rewire_hooks(copied: nn.Module, drop: str | None) -> None:
    """Register each copied diffusers hook again on the copied module it belongs to, except those
    of the switch ``drop``: a layerwise-cast layer then holds its weights in the compute dtype."""
    for sub in copied.modules():
        registry = _registry(sub)
        if registry is None:
            continue
        hooks = [(name, registry.hooks[name]) for name in registry._hook_order]
        vars(sub).pop("forward", None)  # the copied closure that calls the original module
        registry.hooks, registry._hook_order, registry._fn_refs = {}, [], []
        registry._module_ref = sub
        for name, hook in hooks:
            if passed(hook):  # passed through on the original (hooks_passed): not on the copy either
                continue
            if drop is None or hook_group(name, hook) != drop:
                copied_state = dict(vars(hook)) if getattr(hook, "_is_stateful", False) else {}
                registry.register_hook(hook, name)  # (initialize_hook: a fresh state for some)
                vars(hook).update((k, v) for k, v in copied_state.items() if k != "fn_ref")
            elif isinstance(getattr(hook, "compute_dtype", None), torch.dtype):
                _cast_own(sub, hook.compute_dtype)


def _cast_own(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating parameters and buffers (not its submodules') to ``dtype``."""
    for value in module._parameters.values():
        if value is not None and value.is_floating_point():
            value.data = value.data.to(dtype)
    for key, value in list(module._buffers.items()):
        if value is not None and value.is_floating_point():
            module._buffers[key] = value.to(dtype)


def cast_hook_state(module: nn.Module, was: torch.dtype, dtype: torch.dtype) -> None:
    """Each tensor in ``was`` that ``module``'s stateful hooks' states hold (their attributes, and the
    tuples, lists, dicts and deques in them) cast to ``dtype``, in place: for a private copy run in
    ``dtype`` (a ``why()`` replay), whose hooks' cache would otherwise feed a ``was`` tensor to a
    ``dtype`` layer. The hooks' own attributes (their configuration: MagCache's ratios) are left as
    they are. Never on a live component: its containers are changed in place."""
    seen: set[int] = set()
    for hook in stateful_hooks(module):
        for obj in state_objects(hook)[1:]:  # (the first is the hook itself)
            for name, value in list(vars(obj).items()):
                vars(obj)[name] = _cast(value, was, dtype, seen)


def _cast(value: Any, was: torch.dtype, dtype: torch.dtype, seen: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == was else value
    if type(value) is tuple:
        return tuple(_cast(v, was, dtype, seen) for v in value)
    if not isinstance(value, (dict, list, collections.deque)) or id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in list(value.items()):
            value[key] = _cast(item, was, dtype, seen)
    else:
        items = [_cast(item, was, dtype, seen) for item in value]
        value.clear()
        value.extend(items)
    return value


def cast_copy(copied: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Run a copy in ``dtype``: its weights cast, except those a layerwise-casting hook keeps in
    their storage dtype (that hook then computes in ``dtype``), and its stateful hooks' cached tensors
    that are in the dtype it computed in (not FasterCache's complex frequency deltas)."""
    was = next((p.dtype for p in copied.parameters() if p.is_floating_point() and p.dtype.itemsize > 1), None)
    if was is not None:
        cast_hook_state(copied, was, dtype)
    for sub in copied.modules():
        registry = _registry(sub)
        hooks = registry.hooks.items() if registry is not None else ()
        casting = [hook for name, hook in hooks if hook_group(name, hook) == "layerwise casting"]
        for hook in casting:
            if isinstance(getattr(hook, "compute_dtype", None), torch.dtype):
                hook.compute_dtype = dtype
        if not casting:
            _cast_own(sub, dtype)
    return copied


def isolated_copy(component: nn.Module, *, drop_hooks: str | None = None) -> nn.Module:
    """A deep copy of ``component`` whose diffusers hooks act on the copy, without those of the
    switch ``drop_hooks`` (see :func:`hook_group`) nor those passed through (:func:`hooks_passed`); of a
    ``torch.compile`` wrapper, a copy of its original module; of a module compiled in place or regionally,
    without its compiled calls: the copy runs eagerly (run it in :func:`~..components.compiled.eager`, for
    a ``torch.compile`` wrapper among its children or a function compiled inside). Raises a ``RuntimeError``
    that names the quantized weights a copy of them fails on (GGUF's and quanto's refuse ``copy.deepcopy``;
    the floor's diffusers, 0.32.2, copies a GGUF weight without its ``quant_type``)."""
    original = eager_module(component)
    try:
        copied = copy.deepcopy(original)
    except Exception as error:
        stored = next((type(p).__name__ for p in original.parameters() if is_quantized(p)), None)
        if stored is None:
            raise
        raise RuntimeError(
            f"its quantized weights ({stored}) cannot be copied to replay it: {type(error).__name__}: {error}"
        ) from error
    for before, after in zip(original.parameters(), copied.parameters()):
        if is_quantized(before) and getattr(after, "quant_type", None) != getattr(before, "quant_type", None):
            raise RuntimeError(
                f"its quantized weights ({type(before).__name__}) cannot be copied to replay it: "
                f"the copy lost their quant_type ({before.quant_type!r})"
            )
    if any(_registry(sub) is not None for sub in copied.modules()):
        _rewire_hooks(copied, drop_hooks)
    for sub in copied.modules():  # a compiled call of the original module: never run by the copy
        vars(sub).pop("_compiled_call_impl", None)
    return copied  # (never a wrapper: compiled, it would add graphs to the user's cache of the same code)


def copy_note(component: nn.Module) -> str:
    """What a copy of ``component`` does not reproduce: "" when it is exact. A compiled component's copy
    runs eagerly (:func:`isolated_copy`): its row measures the eager code, and says so."""
    state = compile_state(component)
    if state in _COMPILED_AS:
        return f"the copy runs eagerly ({_COMPILED_AS[state]}: compiling a copy would add graphs to its cache)"
    return ""


_COMPILED_AS = {
    "wrapped": "compiled with torch.compile",
    "in_place": "compiled in place",
    "regional": "compiled regionally",
}
