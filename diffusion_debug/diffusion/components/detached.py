"""What a detached debugger holds of its pipeline's components: each one weakly.

A user keeps a debugger to call ``report()`` later, and goes on with the pipeline: ``pipe.unet =
other`` or ``del pipe.vae`` must let the old module (gigabytes of parameters) go, as it would
without the debugger. A reused debugger keeps what its attach worked out (the call sites, their
hooks' plans, the tree memo, the held components) so that the next attach costs no walk; all of it
holds the components' modules. At detach, :func:`park` puts a weak reference in every place that
holds a component's module itself (a component, a call site, the held components, the call sites'
and localiser's roots, the tree memo's trees (their modules, compiled calls and diffusers hook
registries, which hold their module) and its lists of modules, the static checks' VAE); the
submodules and parameters those places hold go with their component: once a parked module is
collected, the memo's entry of its tree (and of any other that names it), the call sites' plans and
the held check are dropped (the callback of its weak reference: worked out again at the next
attach); the other components' entries stay, parked, so that an unchanged fp16 text encoder is not
read fully again because the VAE was replaced. :func:`revive` puts each module back
at the next attach, in C loops (with :func:`park`, two Python calls a reused debugger's call
whatever the size of the trees); where one is gone it puts None, and the attach finds the component
replaced (``HeldComponents.check``) and watches the pipeline as it is now, as for any component
replaced between two watched calls. The memo is the pipeline's, shared by its debuggers: another
debugger that reads it, or the memo parking itself once no debugger holds it, puts its modules back
first (``TreeMemo.held_weakly``).

>>> import copy, gc, tempfile, weakref
>>> from diffusion_debug import DebugConfig, DiffusionModelDebugger
>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("sd")
>>> dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=tempfile.mkdtemp()))
>>> with dbg:
...     _ = pipe("a cat", num_inference_steps=1, output_type="latent")
>>> unet = weakref.ref(pipe.unet)
>>> pipe.unet = copy.deepcopy(pipe.unet)
>>> _ = gc.collect()
>>> unet() is None, [row["step"] for row in dbg.report().steps]
(True, [0])

Limits: a submodule replaced inside a component while detached (``pipe.vae.decoder = ...``,
a layer swapped by a LoRA fuse) is let go at the next attach, as before; the pipeline itself is
held (the debugger's ``pipe``: ``report()`` describes its components), so a pipeline deleted
while its debugger is kept goes with the debugger.
"""

from __future__ import annotations

import functools
import weakref
from operator import itemgetter, setitem
from typing import Any, Callable

from torch import nn

from ...core.out_of_memory import Watched

_set_attribute = object.__setattr__  # frozen dataclasses (Component, CallSite) too
_SECOND = itemgetter(1)


class Parked:
    """The weak references :func:`park` put in place of the modules, and where each goes back."""

    __slots__ = (
        "objects",
        "names",
        "object_refs",
        "containers",
        "keys",
        "refs",
        "orders",
        "pairs",
        "static",
        "gone",
        "active",
        "memo",
        "__weakref__",
    )
    objects: list[Any]
    """Components and call sites, each with its ``module`` attribute (``names``) and its reference
    (``object_refs``)."""
    containers: list[Any]
    """Dicts and lists, each with the key (``keys``) that holds a module, and its reference (``refs``)."""
    orders: list[tuple[list, int, weakref.ref, int]]
    """``(list, index, object, key)``: a memo tree key's list of modules (its root first) and its list
    of compiled calls and hook registries (the root's own hold it), with the object at ``index``; ``key``:
    the memo's key of the tree (its root's id)."""
    pairs: list[tuple[list, int, str, weakref.ref, int]]
    """``(list, index, name, module, key)``: a ``(name, module)`` pair in a list of the memo's values
    of the tree at ``key``."""
    static: tuple[Any, int | None] | None
    """The static checks whose VAE was parked, and where it is in what they last read."""
    gone: bool
    """A parked component was collected."""
    memo: Any
    """The (shared) tree memo whose lists hold weak references (``orders``, ``pairs``), if any."""
    active: bool
    """Parked: the modules are held weakly (a debugger's one ``Parked``, made once, set at each detach)."""

    def __init__(self) -> None:  # (once a debugger: park fills it at each detach)
        self.active = self.gone = False
        self.orders, self.pairs, self.memo = [], [], None

    def __del__(self) -> None:
        # a debugger dropped while detached: the pipeline's memo (shared) as it was, for the next
        # debugger to find (the memo parks itself once no debugger holds it: structure.TreeMemo)
        if getattr(self, "active", False):
            try:
                revive(self)
            except Exception:  # (at interpreter shutdown: nothing to keep)
                pass
        _HELD.pop(id(self), None)


def dropped_parts(debugger: Any) -> None:
    """``dropped`` of a debugger's :func:`park` (``debugger``: a weak reference to it): the call
    sites' plans hold the OOM targets of the component gone, the held check its VAE's halves, the
    probes kept for the next attach (fp16) the blocks their sentinels watch (the memo's list, strong
    again); the next attach finds it replaced and watches the pipeline as it is."""
    dbg = debugger()
    if dbg is not None:
        dbg._steps.calls._plans.clear()
        dbg._steps.probes._kept.clear()
        dbg._held.check = (None, -1, ([], [], []))


def park(parked: Parked, components: list[Any], held: Any, steps: Any, memo: Any, dropped: Callable[[], None]) -> None:
    """Put a weak reference to each component's module in every place that holds it (see the
    module docstring): ``components`` and the ``held`` components (a ``HeldComponents``: its
    components, halves and check), the call sites, their roots and the localiser's of ``steps`` (a
    ``StepPipeline``), the trees of ``memo`` (a ``TreeMemo``) and the ``(name, module)`` pairs of its
    lists, a ``Watched``'s too, and the static checks' VAE and what they last read. ``dropped()``
    runs once a parked component is collected, after the memo forgot the trees that held it (the
    others stay parked): the caller lets go of what else held its parts."""
    if held.components is not components:  # (the same, or the pipeline's as found since)
        components = [*components, *held.components]
    sites, static, held_list = steps.calls.sites, steps._static, held.check[2][2]
    dicts = (steps.calls.roots, steps.localizer.modules, held.halves)
    parked.objects, parked.names, parked.object_refs = objects, names, object_refs = [], [], []
    parked.containers, parked.keys, parked.refs = containers, keys, weak = [], [], []
    parked.orders, parked.pairs, parked.static, parked.gone, parked.active = [], [], None, False, True
    parked.memo = memo
    refs: dict[int, weakref.ref] = {}
    state = weakref.ref(parked)
    for component in components:
        module = component.module
        if id(module) not in refs and module is not None:
            refs[id(module)] = weakref.ref(module, functools.partial(_collected, state, dropped))
    for component in components:
        if component.module is not None:
            objects.append(component)
            names.append("module")
            object_refs.append(refs[id(component.module)])
    for site in sites:  # a VAE's halves too: what their hooks' plans hold
        module = site.module
        ref = refs.get(id(module))
        if ref is None:
            ref = refs[id(module)] = weakref.ref(module)
        objects.append(site)
        names.append("module")
        object_refs.append(ref)
    for mapping in dicts:
        for key, module in mapping.items():
            if isinstance(module, nn.Module):
                ref = refs.get(id(module))
                if ref is None:
                    ref = refs[id(module)] = weakref.ref(module)
                containers.append(mapping)
                keys.append(key)
                weak.append(ref)
    for index, module in enumerate(held_list):
        if isinstance(module, nn.Module):
            ref = refs.get(id(module))
            if ref is None:
                ref = refs[id(module)] = weakref.ref(module)
            containers.append(held_list)
            keys.append(index)
            weak.append(ref)
    if memo is not None:
        for key, (_, order) in memo._trees.items():
            ref = refs.get(key)
            if ref is not None and order and order[0] is ref():
                parked.orders.append((order, 0, ref, key))  # the tree key's list of modules (the root first)
                hooked = memo._trees[key][0][3]  # a compiled call, a diffusers hook registry: the root's own too
                for index, item in enumerate(hooked):
                    if item is not None and type(item) is not str and type(item) is not object:  # (a name, the end)
                        held = refs.get(id(item))
                        try:
                            parked.orders.append((hooked, index, held or weakref.ref(item), key))
                        except TypeError:  # not weakly referable: held as it is
                            pass
        pairs = parked.pairs
        for key, values in memo._values.items():
            for value in values.values():
                if type(value) is not list or not value:
                    continue
                lists = []  # oom_targets (Watched: its modules), a probe level's (name, module) pairs
                if type(value[0]) is Watched:
                    for watched in value:
                        lists.append(watched.modules)
                else:
                    lists.append(value)
                for found in lists:  # the pairs that hold a parked module: a few among a tree's (C loops a list)
                    try:
                        ids = list(map(id, map(_SECOND, found)))
                    except (TypeError, IndexError, KeyError):  # (an item that is no pair: looked at one by one)
                        ids = None
                    if ids is None:
                        for index, pair in enumerate(found):
                            if type(pair) is tuple and len(pair) == 2 and id(pair[1]) in refs:
                                pairs.append((found, index, pair[0], refs[id(pair[1])], key))
                        continue
                    for hit in refs.keys() & set(ids):
                        index = -1
                        for _ in range(ids.count(hit)):  # (a module in two pairs: each)
                            index = ids.index(hit, index + 1)
                            pair = found[index]
                            if type(pair) is tuple and len(pair) == 2:
                                pairs.append((found, index, pair[0], refs[hit], key))
        for found, index, name, ref, _ in pairs:
            found[index] = (name, ref)
    if static is not None and (vae := static.vae) is not None and id(vae) in refs:
        ref, quiet, at = refs[id(vae)], static.quiet, None
        if quiet is not None:
            for index, read in enumerate(quiet):
                if read is vae:
                    at = index
                    break
        parked.static = (static, at)
        static.vae = ref
        if at is not None:
            static.quiet = (*quiet[:at], ref, *quiet[at + 1 :])
    list(map(_set_attribute, objects, names, object_refs))
    list(map(setitem, containers, keys, weak))
    for found, index, ref, _ in parked.orders:
        found[index] = ref
    _HELD[id(parked)] = list(refs.values())
    if memo is not None and (parked.orders or parked.pairs):  # shared: another debugger puts them back first
        memo.held_weakly = functools.partial(_revive_memo, parked, dropped)  # (strongly: a collected cycle's weak
        # references are cleared before its finalizers, the memo's own parking among them, run)


def revive(parked: Parked) -> bool:
    """Put back every module :func:`park` parked; True when all of them live (the debugger's
    structures are as they were), False when one was collected (None in its places)."""
    parked.active = False
    _HELD.pop(id(parked), None)
    list(map(_set_attribute, parked.objects, parked.names, map(weakref.ref.__call__, parked.object_refs)))
    list(map(setitem, parked.containers, parked.keys, map(weakref.ref.__call__, parked.refs)))
    if parked.orders or parked.pairs:
        for found, index, ref, _ in parked.orders:
            found[index] = ref()
        for found, index, name, ref, _ in parked.pairs:
            found[index] = (name, ref())
        parked.orders, parked.pairs = [], []
        parked.memo.held_weakly = None
    if parked.static is not None:
        static, at = parked.static
        static.vae = vae = static.vae()
        if at is not None:
            quiet = static.quiet
            static.quiet = None if vae is None else (*quiet[:at], vae, *quiet[at + 1 :])
    return not parked.gone


_HELD: dict[int, list[weakref.ref]] = {}
"""Per parked debugger (by id, while parked): its weak references. Held here, not by the debugger
alone: a debugger dropped while detached is collected in a cycle, and the garbage collector
clears the weak references of a cycle before its finalizers run, :meth:`Parked.__del__` (which
puts the memo's modules back for the next debugger) among them."""


def _revive_memo(parked: Parked, dropped: Callable[[], None]) -> None:
    """The memo's part of :func:`revive` (another debugger of the pipeline reads it, or it parks
    itself): the parking debugger's own places stay weak. Its call sites' plans share the memo's
    lists (a component's OOM targets), strong again from here: dropped (``dropped()``, worked out
    again at its next attach), so that a component the other debugger lets go is not kept by them."""
    for found, index, ref, _ in parked.orders:
        found[index] = ref()
    for found, index, name, ref, _ in parked.pairs:
        found[index] = (name, ref())
    parked.orders, parked.pairs = [], []
    parked.memo.held_weakly = None
    dropped()


def _collected(state: "weakref.ref[Parked]", dropped: Callable[[], None], gone: weakref.ref) -> None:
    parked = state()
    if parked is None:
        return
    # the memo's trees still parked by this debugger (its lists hold the weak references) that hold the
    # parts of the one gone: forgotten, worked out again; the others stay parked as they are (emptying the
    # whole memo read an unchanged fp16 text encoder fully again). Put back already (another debugger
    # reads it, perhaps in its attach or call now), it holds its modules strongly: that debugger's, left alone.
    keys = {entry[3] for entry in parked.orders if entry[2] is gone}
    keys.update(entry[4] for entry in parked.pairs if entry[3] is gone)
    if keys:
        parked.orders = [entry for entry in parked.orders if entry[3] not in keys]
        parked.pairs = [entry for entry in parked.pairs if entry[4] not in keys]
        parked.memo.forget(keys)
        if not parked.orders and not parked.pairs:
            parked.memo.held_weakly = None
    if not parked.gone:
        parked.gone = True
        dropped()
