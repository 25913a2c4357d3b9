"""A component call kept as it was passed, for a localising replay or a repro bundle (the store of
:class:`~.call_sites.CallSiteHooks`): its lists and dicts copied, the tensors of the component's own state
(a causal-cache VAE's ``feat_cache``, a KV cache) cloned within the step's budget or held with their version,
a plain object of own state kept attribute by attribute; each use makes them again
(:func:`kept_as_passed`). :func:`state_positions` finds where own state is passed by position, and
:func:`_cloned` clones a kept call apart from the latents the scheduler steps
(:meth:`~.call_sites.CallSiteHooks.keep_apart`)."""

from __future__ import annotations

import enum
import inspect
from typing import Any, Callable

import torch
from torch import nn

from . import cache_hooks

STATE_ARGUMENTS = frozenset({"feat_cache", "feat_idx", "past_key_values", "kv_cache", "kv_caches", "cache_params"})
"""Arguments through which a component gets its own state back from its earlier calls (the Wan and
QwenImage VAEs' causal-conv ``feat_cache``, a language model's ``past_key_values``); with the
names a model lists in diffusers' ``_skip_keys``. Never an input the pipeline made."""

REPLACED_STATE = frozenset({"feat_cache", "feat_idx", "kv_caches"})
"""Own state whose entries a call replaces and never writes into (the Wan and QwenImage VAEs' causal
convs: ``feat_cache[idx] = cache_x``, a new tensor; GLM-Image's ``kv_caches``, each write a ``torch.cat``):
a kept call's copy of the list is as it was passed whatever later calls do, so a tensor in it held under
``torch.inference_mode`` (no version counter) is replayed as held. Every other own state may be written
into (FAR's ``kv_cache``): such a tensor refuses a replay (:func:`_used`). Own state passed as a plain object
is replaced too (:data:`WRITTEN_OBJECTS`)."""

WRITTEN_OBJECTS = frozenset({"past_key_values", "cache_params"})
"""Own state passed as a plain object whose tensors a call may write into (transformers' ``StaticCache``:
``index_copy_``). Every other object of own state has its entries replaced, never written into: diffusers'
cache objects (Flux2 Klein KV's, QwenImage 2.1's, Wan-Animate 2's and the SANA-WM refiner's ``kv_cache``,
GLM-Image's ``kv_caches``) only assign their attributes, or append (GLM-Image's ``torch.cat``)."""


def kept_as_passed(
    args: tuple,
    kwargs: dict,
    budget: list[int] | None = None,
    strict: bool = True,
    state: frozenset[str] = frozenset(),
    positions: dict[int, str] | None = None,
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every list and dict in them (two levels deep) copied, so that what
    the call writes into them (the Wan VAE's ``feat_cache``, filled by its causal convs during the
    call, and its ``feat_idx`` counter) is not seen in the kept call, and a replay on a copy
    never writes into the user's. ``budget`` (as a call is kept): ``[bytes]`` still to clone this
    step; only the tensors under the keyword arguments named in ``state`` (the component's own state,
    :meth:`~.call_sites.CallSiteHooks.own_state`: AnyFlow FAR's ``kv_cache``, rewritten in place by its next
    chunk's cache step), and under the positional ones at ``positions`` (the same parameters passed by
    position, by index: :func:`state_positions`), are cloned, so that one rewritten after the call is seen as it
    was passed; one beyond the budget is held with its version (:class:`_Held`: a use finds it changed
    in place, :func:`_used`). The tensors in every other list or dict are held as passed (no op added a call: a
    ControlNet's residuals). Without (a use: a replay, a bundle): every tensor in them cloned, so a
    replay never writes into the user's; a held one checked (``strict``; else a check of the values
    the call was passed: nothing cloned, a held tensor read as it is now). The top-level tensors are
    the same objects (a tensor changed in place is seen changed: a limit of every kept call, but for
    the latents a scheduler steps: :meth:`~.call_sites.CallSiteHooks.keep_apart`). Own state passed as a plain object
    (GLM-Image's ``kv_caches``) is kept as it was at the call, attributes and all (:class:`_Object`), and
    made anew at each use.

    >>> cache, index = [None, None], [0]
    >>> args, kwargs = kept_as_passed((cache,), {"feat_idx": index})
    >>> cache[0], index[0] = "filled", 2
    >>> args, kwargs
    (([None, None],), {'feat_idx': [0]})
    >>> kv, residuals = {"k": torch.ones(1)}, [torch.ones(1)]
    >>> args, kwargs = kept_as_passed((residuals,), {"kv_cache": kv}, [1 << 20], state=frozenset({"kv_cache"}))
    >>> kv["k"].zero_(), kwargs["kv_cache"]["k"], args[0][0] is residuals[0]
    (tensor([0.]), tensor([1.]), True)
    """
    keep = _as_passed if budget is not None else _keeps(None, strict)
    copied = None
    for i, value in enumerate(args):
        if type(value) in _COPIED:  # kept: cloned at an own state's position (FAR's kv_cache passed by position)
            copied = copied or list(args)
            at = positions.get(i) if positions and budget is not None else None
            copied[i] = _copy(value, 0, _keeps(budget, strict, at in REPLACED_STATE) if at is not None else keep)
        elif type(value) is _Object:  # used: made again
            copied = copied or list(args)
            copied[i] = value.made(_replaced_use(strict) if value.replaced else keep)
        elif positions and budget is not None and i in positions and _plain(value):  # an object of own state
            copied = copied or list(args)
            copied[i] = _object(value, positions[i], budget, strict)
    kept = {}
    for name, value in kwargs.items():
        if type(value) in _COPIED:  # kept: a tensor cloned only in the component's own state
            held = budget is not None and name in state
            kept[name] = _copy(value, 0, _keeps(budget, strict, name in REPLACED_STATE) if held else keep)
        elif type(value) is _Object:  # used: made again
            kept[name] = value.made(_replaced_use(strict) if value.replaced else keep)
        elif budget is not None and name in state and _plain(value):  # kept: GLM-Image's kv_caches, as it is now
            kept[name] = _object(value, name, budget, strict)
        else:
            kept[name] = value
    return (tuple(copied) if copied is not None else args), kept


def _as_passed(value: Any) -> Any:
    return value


def _object(value: Any, name: str, budget: list[int], strict: bool) -> _Object:
    """A kept object of own state: one whose entries are replaced (all but :data:`WRITTEN_OBJECTS`) holds its
    tensors as passed, uncloned (no byte of the step's copies: GLM-Image's and Flux2 Klein's caches at real
    size), each with its version (an inference tensor as it is); one written into, cloned as a list's."""
    if name in WRITTEN_OBJECTS:
        return _Object(value, 0, _keeps(budget, strict))
    kept = _Object(value, 0, _held_replaced)
    kept.replaced = True
    return kept


def _held_replaced(value: Any) -> Any:
    return value if type(value) is _Held or value.is_inference() else _Held(value)


def _replaced_use(strict: bool) -> Callable[[Any], Any]:
    """What a use of a kept object whose entries are replaced makes of its tensors: each as held (a replay's
    store replaces it in the replay's copy, never writes into it), a held one checked (``strict``)."""
    if strict:
        return lambda value: _used(value, clone=False) if type(value) is _Held else value
    return lambda value: value.tensor if type(value) is _Held else value


def _keeps(budget: list[int] | None, strict: bool, replaced: bool = False) -> Callable[[Any], Any]:
    """What becomes of a tensor (or a :class:`_Held` one) in a list or dict of a kept call: kept
    (``budget``, the component's own state): cloned within it, else held (an inference tensor of a
    state whose entries are ``replaced``, :data:`REPLACED_STATE`: as passed, never written into); used
    (no budget): cloned (``strict``, a held one checked) or read as it is now (a check of its values:
    nothing cloned)."""
    if budget is None:
        if strict:
            return lambda value: _used(value) if type(value) is _Held else value.detach().clone()
        return lambda value: value.tensor if type(value) is _Held else value

    def clone(value: Any) -> Any:
        if type(value) is _Held:
            return value
        nbytes = value.numel() * value.element_size()
        if nbytes > budget[0]:
            return value if replaced and value.is_inference() else _Held(value)
        budget[0] -= nbytes
        return value.detach().clone()

    return clone


def _copy(value: Any, depth: int, keep: Callable[[Any], Any]) -> Any:
    if type(value) is dict:
        return {k: _item(v, depth, keep) for k, v in value.items()}
    copied = [_item(v, depth, keep) for v in value]
    return tuple(copied) if type(value) is tuple else copied


def _item(value: Any, depth: int, keep: Callable[[Any], Any]) -> Any:
    if type(value) in _COPIED:
        return _copy(value, depth + 1, keep) if depth < 2 else value
    if isinstance(value, torch.Tensor) or type(value) is _Held:
        return keep(value)
    return value


_COPIED = (list, dict, tuple)  # exact types: a ModelOutput (a dict subclass) is passed as it is


_OBJECT_DEPTH = 4
"""How deep a kept object of own state is copied: GLM-Image's cache -> its layers' list -> a layer -> its lists."""


def _plain(value: Any) -> bool:
    """Whether ``value`` is a plain Python object a kept call copies (as own state): all its attributes in a
    ``__dict__``, of a :func:`plain_class` (any other is passed as it is)."""
    return isinstance(getattr(value, "__dict__", None), dict) and plain_class(type(value))


def plain_class(kind: type) -> bool:
    """Whether ``kind``'s objects may be plain (:func:`_plain`; a bundle's too,
    :func:`~..replay.bundle_objects.own_classes`): not a tensor, a module, a class, an Enum or a callable (an
    attention processor); not a dict, list, tuple or set subclass (FrozenDict, OrderedDict, a ModelOutput: items
    outside the ``__dict__``) nor with ``__slots__`` or a ``__new__`` of its own (an Enum member's, an
    exception's), which a copy made from the ``__dict__`` by a bare ``__new__`` would lose or refuse."""
    if issubclass(kind, (torch.Tensor, nn.Module, type, dict, list, tuple, set, frozenset, enum.Enum)):
        return False
    own = [vars(base) for base in kind.__mro__[:-1]]  # (not object's)
    return not any(names.get("__slots__") or "__new__" in names or "__call__" in names for names in own)


def _snapshot(value: Any, depth: int, keep: Callable[[Any], Any]) -> Any:
    """``value`` (an attribute of a kept object, or an item of one of its lists or dicts) as kept (``keep``: a
    tensor cloned or held; a plain object an :class:`_Object`) or made again for a use (an ``_Object`` made)."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind is _Held:
        return keep(value)
    if kind is _Object:
        return value.made(keep)
    if depth >= _OBJECT_DEPTH:
        return value
    if kind is list or kind is tuple:
        copied = [_snapshot(v, depth + 1, keep) for v in value]
        return copied if kind is list else tuple(copied)
    if kind is dict:
        return {k: _snapshot(v, depth + 1, keep) for k, v in value.items()}
    return _Object(value, depth + 1, keep) if _plain(value) else value


class _Object:
    """A plain object of a kept call's own state, as it was at the call: its attributes (GLM-Image's
    ``GlmImageKVCache``: each layer's ``mode``, ``write``/``read``/``skip``, and its key and value lists),
    its tensors kept as a list's are. Each use makes a new object of its class (:meth:`made`), so a replay
    runs as the call did (a ``read`` call reads the cache, though the pipeline has set ``skip`` since) and
    writes into its copy, never into the user's."""

    __slots__ = ("cls", "attributes", "replaced")

    def __init__(self, value: Any, depth: int, keep: Callable[[Any], Any]) -> None:
        self.cls, self.replaced = type(value), False  # replaced: its tensors held uncloned (:func:`_object`)
        self.attributes = {k: _snapshot(v, depth, keep) for k, v in vars(value).items()}

    def made(self, keep: Callable[[Any], Any]) -> Any:
        made = self.cls.__new__(self.cls)
        vars(made).update({k: _snapshot(v, 0, keep) for k, v in self.attributes.items()})
        return made


class _Held:
    """A tensor in a kept call's list or dict held as passed, not cloned (beyond the step's
    :data:`~.cache_hooks.KEPT_BYTES` of copies: AnyFlow FAR's whole ``kv_cache`` at real size), with
    its version counter then (-1: an inference tensor, which has none)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, -1 if tensor.is_inference() else tensor._version


def _used(held: _Held, clone: bool = True) -> torch.Tensor:
    """A copy of a held tensor for a use of its kept call (a replay writing into it writes into the
    copy; the tensor itself where no replay writes into it, not ``clone``: :func:`_replaced_use`).
    Raises ``RuntimeError`` when it was changed in place since the call: a replay would read other values
    than the call did; and for an inference tensor (made under ``torch.inference_mode``), which has no
    version counter: whether it changed cannot be told, and a replay that read it changed would name no
    module or a wrong one (FAR's cache step rewrites its ``kv_cache`` in place; one whose entries are
    replaced, :data:`REPLACED_STATE`, is never held so). Refused rather than checked by a fingerprint
    taken as the call is kept: that would add a reduction over the whole cache to every call, and one
    cheap enough misses values moved or changed in compensation."""
    tensor = held.tensor
    if held.version == -1:
        raise RuntimeError(  # the point and the fix first: a debugger_error's message keeps 200 characters
            f"an inference_mode cache tensor (over the {cache_hooks.KEPT_BYTES} bytes copied a step) has no version "
            f"counter: a change since the call cannot be seen; replay under torch.no_grad() ({tuple(tensor.shape)})"
        )
    if tensor._version != held.version:
        raise RuntimeError(
            f"a {tuple(tensor.shape)} tensor the call was passed in a list or dict was changed in place since "
            f"(beyond the {cache_hooks.KEPT_BYTES} bytes copied a step): a replay would not read what the call read"
        )
    return tensor.detach().clone() if clone else tensor


def state_positions(forward: Callable[..., Any], state: frozenset[str]) -> dict[int, str]:
    """The positions at which ``forward`` takes the parameters named in ``state`` (a component's own
    state, :meth:`~.call_sites.CallSiteHooks.own_state`) when they are passed by position:
    ``transformer(x, t, kv_cache)`` passes FAR's cache as its third argument. Read from the signature once
    a component (its site's plan), never at a call; empty where the signature cannot be read.

    >>> state_positions(lambda sample, timestep, kv_cache=None, *, scale=1.0: None, frozenset({"kv_cache", "scale"}))
    {2: 'kv_cache'}
    """
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or an object without one
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    found = {}
    for index, parameter in enumerate(parameters):
        if parameter.kind not in positional:  # *args, keyword-only: nothing after is given by position
            break
        if parameter.name in state:
            found[index] = parameter.name
    return found


def _shares(value: Any, storage: int) -> bool:
    return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage


def _cloned(kept: tuple[tuple, dict], storage: int) -> tuple[tuple, dict]:
    """A kept call whose top-level tensors on ``storage`` are cloned."""
    args, kwargs = kept
    args = tuple(v.clone() if _shares(v, storage) else v for v in args)
    return args, {k: v.clone() if _shares(v, storage) else v for k, v in kwargs.items()}
