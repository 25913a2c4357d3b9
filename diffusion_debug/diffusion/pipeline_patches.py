"""Wrappers for ``scheduler.step``, ``scheduler.set_timesteps`` and ``pipe.encode_prompt``, and
what the debugger reads from those calls.

A wrapper is bound to the instance it watches at call time (:class:`MethodPatch`): a method of the
class runs through a dispatcher set on the class while one of its instances is watched, which runs
the wrapper for that instance only; ``vars(owner)`` is left alone. So a deep copy (``LTX2Pipeline``
deep-copies its scheduler for the audio), a pickled copy or another scheduler of the class runs its
own method, unwatched, except that a patch made with ``copies`` is called back with another
instance's calls of the method (``_COPIES``: the debugger counts a copy's step where the pipeline
steps copies only, SkyReels-V2's diffusion forcing; the normal call pays nothing for it);
:meth:`MethodPatch.remove` puts back the class as it was when its last instance is let go. An
instance attribute the user had is wrapped in place, and its copies are copies of what it held.
Several debuggers may patch one pipeline: their patches are removed correctly in any order.
``functools.wraps`` keeps ``inspect.signature`` right: diffusers inspects ``scheduler.step`` and
``scheduler.set_timesteps`` to decide which arguments to pass. A debugger reused with ``with dbg:``
keeps its patches (:class:`PipelinePatches`): removed at each detach, so between two attaches the
classes and instances are exactly as they were, and put back as they were made at the next attach
(:func:`reapply`), not made again.

The wrappers call back with plain values (the call's arguments and output); the callbacks own
the measuring. Long because each wrapped call's reader (``read_scheduler_step``, the prompt
texts of ``encode_prompt``) parses the arguments its wrapper passes, and belongs beside it; and
the patches are removed correctly in any order, through chains and per-class dispatchers.

Limits: these patches stay on the scheduler they were made for (a scheduler replaced while
attached is followed by the debugger, which patches the new one: ``_follow_scheduler``); a
class whose method someone else replaces while one of its instances is watched keeps their method.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..probes import ProbeHandle
from ..stats import plain_tensor
from .components.inventory import TOKENIZER_FOR_ENCODER
from .step_values import StepInputs

_MISSING = object()
_LOCK = threading.RLock()
"""Held while a patch changes the class-level registries (``_DISPATCHERS``, ``_CHAINS``, ``_COPIES``) and
the class it patches: two threads attaching and detaching debuggers of pipelines whose schedulers share a
class left a dispatcher on it (re-entrant: a chain collected inside a patch's change drops itself)."""
DECLINED = object()
"""What a patch's ``copies`` returns for a call it does not take (another pipeline's: the next patch is asked)."""
_wraps = functools.update_wrapper
"""``functools.wraps(original)(wrapper)`` as one call, not two (a reused debugger patches at every
attach, three wrappers a patch)."""


class MethodPatch:
    """Replace what ``owner.name`` calls by ``make(inner)`` until :meth:`remove`.

    The wrapper is bound to its owner at call time, never copied with it:

    - a method the owner's class defines (``scheduler.step``: nothing in ``vars(owner)``) is
      patched through a dispatcher set on ``type(owner)`` while any of its instances is watched;
      the dispatcher runs the wrappers kept for the instance it is called on (by ``id``, while the
      patch holds the owner) and the class's method for any other instance. A deep copy, a pickled
      copy (LTX-2 deep-copies its scheduler for the audio) or another instance of the class runs
      its own method, unwatched, and ``vars(owner)`` is never touched;
    - an instance attribute (a user's own, ``_compiled_call_impl``) is replaced by a callable whose
      deep copy and pickle are those of what it replaced.

    Patches of one attribute (several debuggers on one pipeline) form a chain: each wrapper calls
    ``self.inner``, what it replaced. :meth:`remove` on the outermost patch puts back what it
    replaced; on one further in, it unlinks itself (the patch outside it now calls what it called),
    so any order of removal leaves the attribute (and the class) as it was and a removed patch
    never calls back. A patch that cannot be found in the chain (someone else wrapped over it)
    stays a pass-through.
    """

    def __init__(
        self,
        owner: Any,
        name: str,
        make: Callable[[Callable[..., Any]], Callable[..., Any]],
        copies: Callable[[Any, Any, tuple, dict], Any] | None = None,
    ):
        with _LOCK:
            self.owner = owner
            self.name = name
            self.previous = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            """The instance attribute replaced (``_MISSING``: none, the class's method showed through)."""
            self.active = True
            cls = type(owner)
            found = _class_attribute(cls, name) if self.previous is _MISSING else None
            entry = _DISPATCHERS.get((cls, name))
            if entry is not None and found is entry[0]:  # another instance of the class is watched
                found = found.__diffusion_debug_dispatch__
            self._dispatch_key = (cls, name) if isinstance(found, types.FunctionType) and _settable(cls) else None
            """``(class, name)`` when patched through the class's dispatcher, None for an instance attribute."""
            self._found = found
            """The class's method the dispatcher falls back to (:func:`reapply`: unchanged, the patch is put back)."""
            self._dispatcher: Any = None
            """The dispatcher last set for this patch, set again by :func:`reapply` (the same closure)."""
            self._chain: _Chain | None = None
            self.copies = copies if self._dispatch_key is not None else None
            self._ref = weakref.ref(self)
            """Called as ``copies(instance, method, args, kwargs)`` for another instance of the class (a deep copy of
            the owner), the last active patch with ``copies`` first (``_COPIES``): returns the call's result, or
            :data:`DECLINED` without calling (the next one is asked, the class's method runs when none takes it)."""
            if self._dispatch_key is not None:
                chain = self._chain = _chain_of((id(owner), cls, name)) or _Chain()
                function = _unwrapped(found)
                self.inner = chain[-1].wrapper if chain else found.__get__(owner, cls)
                original: Any = types.MethodType(function, owner)  # what wraps it: the method's own signature
            else:
                self.inner = original = getattr(owner, name)
            """What the wrapper calls: the method replaced, or what the chain now puts in its place."""

            def forward(*args: Any, **kwargs: Any) -> Any:
                return self.inner(*args, **kwargs)

            self.made = made = make(_wraps(forward, original))
            """The wrapper ``make`` made; a dispatcher calls it directly (a patch in a chain is active)."""

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not self.active:  # removed but still referenced (a bound copy, a foreign wrapper)
                    return self.inner(*args, **kwargs)
                return made(*args, **kwargs)

            self.wrapper = _wraps(wrapper, original)
            self.wrapper.__diffusion_debug_patch__ = self  # type: ignore[attr-defined]
            if self._dispatch_key is not None:
                self._dispatcher = _install_dispatcher(cls, name, found)
                self._chain.append(self)
                key = (id(owner), cls, name)
                _CHAINS[key] = weakref.ref(self._chain, functools.partial(_drop_chain, key))
                if copies is not None:
                    _COPIES.setdefault(self._dispatch_key, []).append(self._ref)
            else:
                object.__setattr__(owner, name, _InstanceWrapper(self))

    def remove(self) -> None:
        """Take this wrapper out of ``owner.name``, whatever the order of removal; idempotent."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            if self._dispatch_key is not None:
                cls, name = self._dispatch_key
                key, chain = (id(self.owner), cls, name), self._chain
                copied = _COPIES.get((cls, name))
                if copied is not None and self._ref in copied:
                    copied.remove(self._ref)
                    if not copied:
                        del _COPIES[(cls, name)]
                if chain is not None and self in chain:
                    position = chain.index(self)
                    if position + 1 < len(chain):  # the patch outside this one now calls what this one called
                        chain[position + 1].inner = self.inner
                    chain.remove(self)
                ref = _CHAINS.get(key)
                if not chain and ref is not None and ref() is chain:
                    del _CHAINS[key]
                entry = _DISPATCHERS.get((cls, name))  # one user fewer of the class's dispatcher
                if entry is not None:
                    entry[2] -= 1
                    if entry[2] <= 0:
                        del _DISPATCHERS[(cls, name)]
                        if cls.__dict__.get(name) is entry[0]:  # not replaced since: put back what the class held
                            if entry[1] is _MISSING:
                                delattr(cls, name)
                            else:
                                setattr(cls, name, entry[1])
                return
            current = vars(self.owner).get(self.name, _MISSING)
            if getattr(current, "__diffusion_debug_patch__", None) is self:  # the outermost: put back what it replaced
                _put_back(self.owner, self.name, self.previous)
                return
            outer = _patch_of(current)
            while outer is not None:  # find the patch that replaced this one, and link it past this one
                if getattr(outer.previous, "__diffusion_debug_patch__", None) is self:
                    outer.previous, outer.inner = self.previous, self.inner
                    return
                outer = _patch_of(outer.previous)


class _InstanceWrapper:
    """What an instance attribute is replaced by: calls the patch; ``copy.deepcopy`` and ``pickle``
    see what it replaced (a copy of a watched object is a copy of the unwatched one)."""

    def __init__(self, patch: MethodPatch):
        self.__diffusion_debug_patch__ = patch
        functools.update_wrapper(self, patch.wrapper)  # name, doc, __wrapped__: inspect.signature stays right

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__diffusion_debug_patch__.wrapper(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        patch = self.__diffusion_debug_patch__
        if patch.previous is not _MISSING:
            return copy.deepcopy(patch.previous, memo)
        twin = memo.get(id(patch.owner))  # a class attribute that is no plain function: the copy's own
        return self if twin is None else inspect.getattr_static(type(twin), patch.name).__get__(twin, type(twin))

    def __reduce_ex__(self, protocol: Any) -> Any:
        patch = self.__diffusion_debug_patch__
        if patch.previous is _MISSING:
            return getattr, (patch.owner, patch.name)  # the unpickled owner's own
        return operator.getitem, ((patch.previous,), 0)  # pickles what it replaced


class _Chain(list):
    """The patches of one watched ``(owner, name)``, innermost first; held by its patches, so a
    debugger collected without detaching lets its pipeline go."""


_CHAINS: "dict[tuple[int, type, str], weakref.ref[_Chain]]" = {}
"""Per watched ``(id(owner), class, name)``: its chain, weakly (each patch holds its owner, so the id
is its own); a dict of references, which a dispatcher reads with no Python call."""


def _chain_of(key: tuple[int, type, str]) -> "_Chain | None":
    ref = _CHAINS.get(key)
    return ref() if ref is not None else None


_DISPATCHERS: dict[tuple[type, str], list[Any]] = {}
"""Per patched ``(class, name)``: ``[dispatcher, what the class's own dict held, patches using it]``."""

_COPIES: "dict[tuple[type, str], list[weakref.ref[MethodPatch]]]" = {}
"""Per patched ``(class, name)``: the active patches made with ``copies``, weakly (a debugger dropped while
attached lets its pipeline go), each asked in turn, the last first, to take another instance's call (a
dispatcher's fallback reads it; the watched instance's call never does)."""


def _drop_chain(
    key: tuple,
    ref: "weakref.ref[_Chain]",
    chains: dict = _CHAINS,
    dispatchers: dict = _DISPATCHERS,
    copies: dict = _COPIES,
    lock: Any = _LOCK,
) -> None:
    """A chain collected (its patches were, without a detach: a debugger dropped while attached).
    When no watched instance of the class is left, the class gets back what it held, as the last
    detach would have done (module globals as defaults: this may run at shutdown)."""
    with lock:
        if chains.get(key) is ref:
            del chains[key]
        _, cls, name = key
        copied = copies.get((cls, name))
        if copied is not None:  # the collected patches' (dead) references
            copied[:] = [r for r in copied if r() is not None]
            if not copied:
                del copies[(cls, name)]
        entry = dispatchers.get((cls, name))
        if entry is None or any(k[1] is cls and k[2] == name and r() for k, r in list(chains.items())):
            return  # an active patch is in its chain, which it holds: none is left when no chain is
        del dispatchers[(cls, name)]  # MethodPatch.remove's last user, spelled there inline (each detach's path)
        if cls.__dict__.get(name) is entry[0]:  # not replaced since
            if entry[1] is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, entry[1])


def _class_attribute(cls: type, name: str) -> Any:
    """``inspect.getattr_static(cls, name, None)`` in a tenth of its calls (none of the metaclass's)."""
    for klass in cls.__mro__:  # a loop: a generator costs a frame a class (None when no class has it)
        if name in klass.__dict__:
            return klass.__dict__[name]


def _settable(cls: type) -> bool:
    return bool(cls.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE: a class statement's, attributes settable


def _unwrapped(function: Any) -> Any:
    """The class's own function under the dispatchers of this module (a base class's dispatcher
    that a subclass inherits)."""
    while getattr(function, "__diffusion_debug_dispatch__", None) is not None:
        function = function.__diffusion_debug_dispatch__
    return function


def _install_dispatcher(cls: type, name: str, found: Any) -> Any:
    """Set (or count one more user of) the dispatcher of ``cls.name`` over ``found``; returns it."""
    entry = _DISPATCHERS.get((cls, name))
    if entry is not None and cls.__dict__.get(name) is entry[0]:
        entry[2] += 1
        return entry[0]
    # none yet, or someone replaced the class's method (and our dispatcher) while watched: the new
    # dispatcher counts the patches still using the old one, so none of them is dropped at the first removal
    users = entry[2] if entry is not None else 0
    key = (cls, name)
    if entry is not None:  # each watched instance's innermost patch now calls their method, not the one it found
        for (_, klass, method), ref in list(_CHAINS.items()):
            chain = ref()
            if chain and klass is cls and method == name:
                chain[0].inner = found.__get__(chain[0].owner, cls)

    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        ref = _CHAINS.get((id(self), cls, name))
        chain = ref() if ref is not None else None
        # only the class's current dispatcher runs the chain: an older one that someone's wrapper of
        # the class's method still calls (the chain's innermost patch calls that wrapper) is the method
        if chain and chain[-1].owner is self and key in _DISPATCHERS and _DISPATCHERS[key][0] is dispatch:
            return chain[-1].made(*args, **kwargs)
        copied = _COPIES.get(key) if not chain else None
        if copied:  # another instance, a copy: the class's own method, called back to the last patch that takes it
            for ref in reversed(copied):
                patch = ref()
                if patch is not None:
                    result = patch.copies(self, found, args, kwargs)
                    if result is not DECLINED:
                        return result
        return found(self, *args, **kwargs)  # another instance, a copy: the class's own method

    dispatcher = _wraps(dispatch, found)
    dispatcher.__diffusion_debug_dispatch__ = found  # type: ignore[attr-defined]
    # what ``inspect.signature`` finds through ``__wrapped__``, read once per function: diffusers asks
    # it of ``scheduler.step`` at every call (``prepare_extra_step_kwargs``), which then unwraps nothing
    signature = _FUNCTION_SIGNATURES.get(found)
    if signature is None:
        try:
            signature = _FUNCTION_SIGNATURES[found] = inspect.signature(found)
        except (TypeError, ValueError):  # none to find: found through ``__wrapped__`` as before
            signature = None
    if signature is not None:
        dispatcher.__signature__ = signature  # type: ignore[attr-defined]
    _DISPATCHERS[(cls, name)] = [dispatcher, cls.__dict__.get(name, _MISSING), users + 1]
    setattr(cls, name, dispatcher)
    return dispatcher


def reapply(patches: list[MethodPatch]) -> bool:
    """Put back ``patches`` (each removed, none since replaced) as they were made, and True; False
    (none put back) when one cannot be: an instance attribute's, one whose owner now holds the
    name itself, or whose class now shows another method. A reused debugger attaches at every
    call: its five patches made anew each time were ~70 Python calls an attach, this is seven.
    What a patch holds is what a new one would (its wrapper and what it wraps are its own; what
    it calls is the chain's outermost wrapper or the class's method, found here again), so a
    patch put back behaves as a new one would, and its removal at detach puts the class back."""
    with _LOCK:
        for patch in patches:
            key = patch._dispatch_key
            if key is None or patch.active or type(patch.owner) is not key[0]:
                return False
            cls, name = key
            state = getattr(patch.owner, "__dict__", None)
            if state is not None and name in state:
                return False
            now: Any = None
            for klass in cls.__mro__:  # _class_attribute without its call
                if name in klass.__dict__:
                    now = klass.__dict__[name]
                    break
            entry = _DISPATCHERS.get(key)
            if entry is not None and now is entry[0]:  # another instance of the class is watched
                now = now.__diffusion_debug_dispatch__
            if now is not patch._found:
                return False
        for patch in patches:
            cls, name = patch._dispatch_key
            key = (id(patch.owner), cls, name)
            ref = _CHAINS.get(key)
            chain = ref() if ref is not None else None
            if chain is None:
                chain = _Chain()
                _CHAINS[key] = weakref.ref(chain, functools.partial(_drop_chain, key))
            patch._chain = chain
            patch.inner = chain[-1].wrapper if chain else patch._found.__get__(patch.owner, cls)
            entry = _DISPATCHERS.get((cls, name))
            if entry is not None and cls.__dict__.get(name) is entry[0]:
                entry[2] += 1
            else:  # _install_dispatcher's, with the dispatcher this patch set before (over the same method)
                made = patch._dispatcher
                _DISPATCHERS[(cls, name)] = [made, cls.__dict__.get(name, _MISSING), (entry[2] if entry else 0) + 1]
                setattr(cls, name, made)
            chain.append(patch)
            patch.active = True
            if patch.copies is not None:
                _COPIES.setdefault((cls, name), []).append(patch._ref)
        return True


def _patch_of(value: Any) -> "MethodPatch | None":
    patch = getattr(value, "__diffusion_debug_patch__", None) if value is not _MISSING else None
    return patch if isinstance(patch, MethodPatch) and patch.active else None


class AttributePatch:
    """Set ``owner.name = value`` (bypassing ``__setattr__``) until :meth:`remove` puts back the
    instance attribute as it was (or deletes it). Used for ``pipe._interrupt`` (policy ``stop``).

    Patches of one attribute stack: removing one that a later patch covers hands what it replaced
    to that later patch, so any order of removal ends with the attribute as it was first. The
    stacks hold their patches weakly (:data:`_ATTRIBUTE_STACKS`): a debugger dropped while
    attached lets its pipeline go (what its patch set stays, as its other patches' calls do)."""

    def __init__(self, owner: Any, name: str, value: Any):
        self.owner, self.name = owner, name
        self.previous = vars(owner).get(name, _MISSING)
        object.__setattr__(owner, name, value)
        self.active = True
        key = (id(owner), name)
        self._ref = weakref.ref(self, functools.partial(_drop_attribute_patch, key))
        _ATTRIBUTE_STACKS.setdefault(key, []).append(self._ref)

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        key = (id(self.owner), self.name)
        stack = [patch for patch in map(_DEREFERENCE, _ATTRIBUTE_STACKS.get(key, ())) if patch is not None]
        position = stack.index(self) if self in stack else len(stack) - 1
        if position + 1 < len(stack):  # covered by a later patch: it will put back what this one replaced
            stack[position + 1].previous = self.previous
        else:
            _put_back(self.owner, self.name, self.previous)
        _drop_attribute_patch(key, self._ref)


_ATTRIBUTE_STACKS: "dict[tuple[int, str], list[weakref.ref[AttributePatch]]]" = {}
"""Per patched ``(id(owner), name)``: its patches (:class:`AttributePatch`), first made first, weakly (each
holds its owner while it lives, so the id is its own)."""
_DEREFERENCE = weakref.ref.__call__


def _drop_attribute_patch(
    key: tuple[int, str], ref: "weakref.ref[AttributePatch]", stacks: dict = _ATTRIBUTE_STACKS
) -> None:
    """``ref``'s patch out of its stack (removed, or collected: a debugger dropped while attached),
    with the references of collected ones; the stack out when empty (module globals as defaults: this
    may run at shutdown)."""
    stack = stacks.get(key)
    if stack is None:
        return
    stack[:] = [r for r in stack if r is not ref and r() is not None]
    if not stack:
        del stacks[key]


def _put_back(owner: Any, name: str, previous: Any) -> None:
    if previous is _MISSING:
        if vars(owner).get(name, _MISSING) is not _MISSING:
            object.__delattr__(owner, name)
    else:
        object.__setattr__(owner, name, previous)


_SIGNATURES: "weakref.WeakKeyDictionary[Any, inspect.Signature]" = weakref.WeakKeyDictionary()
_FUNCTION_SIGNATURES: "weakref.WeakKeyDictionary[Any, inspect.Signature]" = weakref.WeakKeyDictionary()
"""A class's method's own signature (``self`` first), per function: its dispatcher's ``__signature__``."""


def _signature(method: Any) -> inspect.Signature:
    """``inspect.signature(method)``, kept per function (a debugger reused with ``with`` patches
    ``encode_prompt`` at every attach): what ``method`` wraps (``__wrapped__``, as ``inspect``
    follows it) is a bound method, whose signature is its function's without ``self``."""
    inner = inspect.unwrap(method, stop=lambda f: hasattr(f, "__signature__"))
    function = getattr(inner, "__func__", None)
    if not inspect.ismethod(inner) or not inspect.isfunction(function) or hasattr(inner, "__signature__"):
        return inspect.signature(method)
    found = _SIGNATURES.get(function)
    if found is None:
        found = _SIGNATURES[function] = inspect.signature(method)
    return found


def can_interrupt(pipe: Any) -> bool:
    """Whether the pipeline's denoising loop reads an ``interrupt`` flag (policy ``stop``)."""
    return isinstance(getattr(type(pipe), "interrupt", None), property)


def patch_pipeline(
    pipe: Any,
    *,
    busy: Callable[[], bool],
    on_step: Callable[..., None],
    on_set_timesteps: Callable[[tuple, dict], None],
    on_encode_prompt: Callable[[inspect.Signature, tuple, dict], None],
    on_safety_checker: Callable[[Any], None] | None = None,
    on_call_end: Callable[[], None] | None = None,
    made: Any = None,
) -> list[MethodPatch]:
    """Wrap the pipeline's scheduler, prompt encoder, ``run_safety_checker`` (called back with
    its ``has_nsfw_concept``) and ``maybe_free_model_hooks``, which diffusers' pipelines call as
    their ``__call__`` ends (``on_call_end``, before it: still inside the call's no_grad or
    inference_mode and its offload hooks); every callback is skipped while ``busy()`` (the
    debugger's own replays and previews). ``made`` (a ``MadeNonfinite``): a NaN/Inf maker's frame kept
    (``made.pending``) is settled as ``encode_prompt`` returns, read if it was that call's (the user's own, an
    end of ours: its locals not held until the next run). ``on_step`` is also called with a fifth argument, the
    instance, for another instance of the scheduler's class stepped (a deep copy: whether it counts
    is the debugger's to say). Returns the patches to remove."""
    patches: list[MethodPatch] = []
    try:
        scheduler = getattr(pipe, "scheduler", None)
        if scheduler is not None and callable(getattr(scheduler, "step", None)):
            # a scheduler without ``step_index`` (DDIM) is read without diffusers' ``__getattr__`` (its
            # Python call and its error's text, at every step): its own dict, where it would say the same
            index_read = not _config_getattr(type(scheduler)) or hasattr(type(scheduler), "step_index")

            def wrap_step(original):
                def step(*args, **kwargs):
                    if busy():
                        return original(*args, **kwargs)
                    if index_read:
                        index_before = getattr(scheduler, "step_index", None)
                    else:  # (ConfigMixin.__getattr__: the instance's dict, else a config key, else None)
                        state = scheduler.__dict__
                        index_before = state.get(
                            "step_index", state.get("_internal_dict", _NO_CONFIG).get("step_index")
                        )
                    output = original(*args, **kwargs)
                    on_step(args, kwargs, output, index_before)
                    return output

                return step

            def step_copy(instance, method, args, kwargs):  # a deep copy's step (SkyReels-V2 DF steps one a frame)
                if busy():  # another pipeline's call (sharing the scheduler's class), the debugger's own
                    return DECLINED
                if index_read:  # (read as the pipeline's own scheduler's is: the copy is of its class)
                    index_before = getattr(instance, "step_index", None)
                else:
                    state = instance.__dict__
                    index_before = state.get("step_index", state.get("_internal_dict", _NO_CONFIG).get("step_index"))
                output = method(instance, *args, **kwargs)
                on_step(args, kwargs, output, index_before, instance)  # (the debugger decides whether it counts)
                return output

            def wrap_set_timesteps(original):
                def set_timesteps(*args, **kwargs):
                    result = original(*args, **kwargs)
                    if not busy():
                        on_set_timesteps(args, kwargs)
                    return result

                return set_timesteps

            patches.append(MethodPatch(scheduler, "step", wrap_step, step_copy))
            if callable(getattr(scheduler, "set_timesteps", None)):
                patches.append(MethodPatch(scheduler, "set_timesteps", wrap_set_timesteps))
        if callable(getattr(pipe, "encode_prompt", None)):

            def wrap_encode_prompt(original):
                signature = _signature(original)

                def encode_prompt(*args, **kwargs):
                    if busy():
                        return original(*args, **kwargs)
                    on_encode_prompt(signature, args, kwargs)
                    result = original(*args, **kwargs)
                    if made is not None and made.pending:  # (an attribute read a call: no Python call)
                        made.settle()
                    return result

                return encode_prompt

            patches.append(MethodPatch(pipe, "encode_prompt", wrap_encode_prompt))
        if on_safety_checker is not None and callable(getattr(pipe, "run_safety_checker", None)):

            def wrap_safety_checker(original):
                def run_safety_checker(*args, **kwargs):
                    result = original(*args, **kwargs)
                    if not busy() and isinstance(result, tuple) and len(result) == 2:
                        on_safety_checker(result[1])  # (image, has_nsfw_concept)
                    return result

                return run_safety_checker

            patches.append(MethodPatch(pipe, "run_safety_checker", wrap_safety_checker))
        if on_call_end is not None and callable(getattr(pipe, "maybe_free_model_hooks", None)):

            def wrap_call_end(original):
                def maybe_free_model_hooks(*args, **kwargs):
                    if not busy():
                        on_call_end()
                    return original(*args, **kwargs)

                return maybe_free_model_hooks

            patches.append(MethodPatch(pipe, "maybe_free_model_hooks", wrap_call_end))
    except BaseException:
        ProbeHandle(patches).remove()
        raise
    return patches


class PipelinePatches:
    """:func:`patch_pipeline`'s patches for one debugger, made at its first attach and put back
    (:func:`reapply`) at each later one while the pipeline holds the same scheduler and no patched
    method has changed; made anew otherwise. :meth:`remove` takes them all off (detach): between
    two attaches the pipeline, its scheduler and their classes are exactly as they were."""

    def __init__(self, pipe: Any, **callbacks: Any):
        self.pipe, self.callbacks = pipe, callbacks
        self.patches: list[MethodPatch] = []
        self.scheduler: Any = _MISSING

    def apply(self) -> list[MethodPatch]:
        """Patch the pipeline; returns the patches (each one's ``remove()``, or :meth:`remove`, undoes
        it), as :func:`patch_pipeline` does: a debugger lists them with its other removers."""
        scheduler = getattr(self.pipe, "scheduler", None)
        if scheduler is not self.scheduler or not self.patches or not reapply(self.patches):
            self.patches = []  # what the last ones held is let go of, whatever patch_pipeline raises
            self.patches = patch_pipeline(self.pipe, **self.callbacks)
            self.scheduler = scheduler
        return list(self.patches)

    def remove(self) -> None:
        """Remove every patch, the last made first, each one even when one fails; idempotent."""
        failure: BaseException | None = None
        for patch in reversed(self.patches):
            try:
                patch.remove()
            except BaseException as error:  # the rest first, even on an interrupt
                failure = failure or error
        if failure is not None:
            self.patches = []  # made anew at the next attach
            raise failure


# -- what the wrapped calls say ----------------------------------------------------------------------


def read_scheduler_step(
    scheduler: Any, args: tuple, kwargs: dict, output: Any, index_before: int | None, outputs: list = ()
) -> StepInputs:
    """What a step is measured from, read from ``scheduler.step(*args, **kwargs)`` and its
    ``output``: the one place the call's arguments are parsed. ``outputs``: the step's denoiser
    outputs seen by the hooks (:meth:`~.step_values.RunState.with_outputs`), where there are some:
    the last is ``denoiser_output``, the ones before it ``earlier_outputs``."""
    model_output = kwargs.get("model_output", args[0] if len(args) > 0 else None)
    timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
    sample = kwargs.get("sample", args[2] if len(args) > 2 else None)
    if isinstance(output, tuple):
        prev = output[0]
        x0 = output[1] if len(output) > 1 and isinstance(output[1], torch.Tensor) else None
    else:
        prev = getattr(output, "prev_sample", None)
        x0 = getattr(output, "pred_original_sample", None)
    if type(model_output) is not torch.Tensor or type(sample) is not torch.Tensor or type(prev) is not torch.Tensor:
        # a tensor subclass of the denoiser's (a compiled GGUF model's GGUFParameter): read as a tensor
        model_output, sample, prev, x0 = [
            plain_tensor(t) if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor else t
            for t in (model_output, sample, prev, x0)
        ]
    kind = type(scheduler)
    config_getattr = _CONFIG_GETATTR.get(kind)
    if config_getattr is None:
        config_getattr = _config_getattr(kind)
    if config_getattr:  # diffusers' __getattr__ (a Python call and an error's text) not asked for a missing name
        state = scheduler.__dict__
        config = state.get("_internal_dict", _NO_CONFIG)
        if hasattr(kind, "step_index"):  # a property (Euler's): asked
            index = getattr(scheduler, "step_index", None)
        else:
            index = state.get("step_index", config.get("step_index"))
        if hasattr(kind, "sigmas"):
            sigmas = getattr(scheduler, "sigmas", None)
        else:
            sigmas = state.get("sigmas", config.get("sigmas"))
    else:
        index = getattr(scheduler, "step_index", None)
        sigmas = getattr(scheduler, "sigmas", None)
    index = index - 1 if index is not None else index_before
    sigma = sigma_next = None
    if isinstance(sigmas, torch.Tensor) and index is not None and 0 <= index < len(sigmas):
        sigma = sigmas[index]
        sigma_next = sigmas[index + 1] if index + 1 < len(sigmas) else None
        if type(scheduler).__name__ == "KDPM2DiscreteScheduler":  # its midpoint (not the ancestral one's)
            sigma, sigma_next = _kdpm2_midpoint(scheduler, index, sigma, sigma_next)
    if outputs:
        denoiser_output, earlier = outputs[-1], tuple(outputs[:-1])
    else:
        denoiser_output, earlier = model_output if isinstance(model_output, torch.Tensor) else None, ()
    return StepInputs(
        timestep=timestep,
        latents=prev if isinstance(prev, torch.Tensor) else sample,
        denoiser_output=denoiser_output,
        earlier_outputs=earlier,
        pred_original_sample=x0,
        batch=sample.shape[0] if isinstance(sample, torch.Tensor) else None,
        sigma=sigma,
        sigma_next=sigma_next,
        sample=sample,
        scheduler_model_output=model_output,
    )


_NO_CONFIG: dict[str, Any] = {}
_CONFIG_GETATTR: dict[type, bool] = {}
"""Per scheduler class: whether a name it lacks is looked for by diffusers' ``ConfigMixin.__getattr__``."""


def _config_getattr(kind: type) -> bool:
    """Whether ``kind``'s missing attributes go to diffusers' ``ConfigMixin.__getattr__``, which
    gives a config key of that name (deprecated) and else raises: read as it would read (the
    instance's dict, then its ``_internal_dict``) with no Python call. Kept per class."""
    found = getattr(kind, "__getattr__", None)
    config = getattr(found, "__qualname__", None) == "ConfigMixin.__getattr__" and "__dict__" in dir(kind)
    _CONFIG_GETATTR[kind] = config
    return config


def _kdpm2_midpoint(scheduler: Any, index: int, sigma: Any, sigma_next: Any) -> tuple[Any, Any]:
    """KDPM2's step ``index`` as it ran: its first-order step lands on the interpolated sigma
    (``sigmas_interpol[index + 1]``), not on the next one, and its second-order step runs the model
    there (``sigmas_interpol[index]``, the timestep it was given), the next sigma being right."""
    interpol = getattr(scheduler, "sigmas_interpol", None)
    if not isinstance(interpol, torch.Tensor) or index + 1 >= len(interpol):
        return sigma, sigma_next
    if scheduler.state_in_first_order:  # after the step: the one that ran was the second-order one
        return interpol[index], sigma_next
    return sigma, interpol[index + 1]


def read_set_timesteps(scheduler: Any, args: tuple, kwargs: dict) -> tuple[int | None, Any, Any]:
    """``(num_inference_steps, first timestep, init_noise_sigma)`` after a ``set_timesteps``
    call (the step count is the length of the timesteps set when the call did not give it). The
    first timestep is a 0-d tensor (a view, unread: a scheduler keeps its timesteps on the
    pipeline's device, where a read is a sync), None without timesteps; ``init_noise_sigma`` as
    the scheduler gives it (a number, or a tensor: unread too). ``step_values.Schedule`` reads
    them with the run's first step."""
    steps = kwargs.get("num_inference_steps", args[0] if args else None)
    timesteps = getattr(scheduler, "timesteps", None)
    if not isinstance(steps, int):
        steps = len(timesteps) if timesteps is not None else None
    first = timesteps[0] if timesteps is not None and len(timesteps) else None
    return steps, first, getattr(scheduler, "init_noise_sigma", 1.0)


@dataclass(frozen=True)
class PromptText:
    """One prompt text as one tokenizer of the pipeline will see it."""

    encoder: str
    tokenizer_name: str
    tokenizer: Any
    role: str
    """``prompt`` or ``negative_prompt``."""
    index: int
    text: str
    max_length: int


def call_values(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in: ``bind_partial`` and ``apply_defaults``
    without their ~50 Python calls (``encode_prompt`` is bound on every watched call). Keywords
    that ``**kwargs`` takes are found under their own names.

    >>> def f(prompt, device=None, *, negative_prompt=None, **kwargs): ...
    >>> values = call_values(inspect.signature(f), ("a cat",), {"prompt_2": "a dog"})
    >>> values["prompt"], values["device"], values["negative_prompt"], values["prompt_2"]
    ('a cat', None, None, 'a dog')
    """
    kept = _BINDERS.get(id(signature))
    if kept is None or kept[0] is not signature:
        parameters = signature.parameters.values()
        positional = None
        if all(p.kind is not inspect.Parameter.VAR_POSITIONAL for p in parameters):
            names = [p.name for p in parameters if p.kind in _POSITIONAL]
            positional = (names, {p.name: p.default for p in parameters if _has_default(p)})
        if len(_BINDERS) >= _MAX_BINDERS:  # a signature not kept by _signature is new at every attach
            _BINDERS.clear()
        kept = _BINDERS[id(signature)] = (signature, positional)
    if kept[1] is None or len(args) > len(kept[1][0]):  # *args, or more than it takes: the long way
        bound = signature.bind_partial(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments
    names, defaults = kept[1]
    values = dict(defaults)
    values.update(zip(names, args))
    values.update(kwargs)
    return values


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BINDERS: dict[int, tuple[inspect.Signature, Any]] = {}
"""Per signature (kept alive with it): its positional names and defaults, None for ``*args``."""
_MAX_BINDERS = 64


def _has_default(parameter: inspect.Parameter) -> bool:
    return parameter.default is not parameter.empty and parameter.kind is not inspect.Parameter.VAR_KEYWORD


def prompt_texts(pipe: Any, signature: inspect.Signature, args: tuple, kwargs: dict) -> Iterator[PromptText]:
    """Every prompt text of an ``encode_prompt`` call, per tokenizer (``prompt_2`` for the second
    one, else ``prompt``); T5 tokenizers use the call's ``max_sequence_length``."""
    values = call_values(signature, args, kwargs)
    kind = type(pipe)
    config_getattr = _CONFIG_GETATTR.get(kind)
    if config_getattr is None:
        config_getattr = _config_getattr(kind)
    state = pipe.__dict__ if config_getattr else None
    for encoder, tokenizer_name in TOKENIZER_FOR_ENCODER.items():
        if state is not None and not hasattr(kind, tokenizer_name):  # a tokenizer the pipeline lacks: no
            # ConfigMixin.__getattr__ (a Python call and its error's text), read as it reads
            tokenizer = state.get(tokenizer_name, state.get("_internal_dict", _NO_CONFIG).get(tokenizer_name))
        else:
            tokenizer = getattr(pipe, tokenizer_name, None)
        if tokenizer is None:
            continue
        suffix = tokenizer_name.removeprefix("tokenizer")
        max_length = getattr(tokenizer, "model_max_length", None)
        if "T5" in type(tokenizer).__name__ and isinstance(values.get("max_sequence_length"), int):
            max_length = values["max_sequence_length"]
        if not isinstance(max_length, int) or max_length > 1_000_000:
            continue
        for role in ("prompt", "negative_prompt"):
            texts = values.get(f"{role}{suffix}") or values.get(role)
            if texts is None:
                continue
            for index, text in enumerate([texts] if isinstance(texts, str) else list(texts)):
                if isinstance(text, str):
                    yield PromptText(encoder, tokenizer_name, tokenizer, role, index, text, max_length)
