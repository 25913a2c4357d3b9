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
replaced between two watched calls. A reused debugger's places are those of its last detach: where
:func:`park` finds them as :func:`revive` left them (the same objects and lists' items, by identity; no
dict among them or the memo's written since the last park, detached or attached, by their version tags
and lengths as :mod:`.tree_tags` reads them, at each park and revive; each place holding the module it
held), it parks them again as they are, not looked for one by one
(~205 C calls a reused fp16 1-step call to 10); what it kept of them is dropped where a parked
component is collected or another debugger revives the memo. The memo is the pipeline's, shared
by its debuggers: another debugger that reads it, or the memo parking itself once no debugger holds
it, puts its modules back first (``TreeMemo.held_weakly``).

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

Limits: the held check's list is compared by its length (its modules are parked in it) and by the
modules parked in it (a module written over another is seen): a module written in place over an item
of it that is no module (the scheduler, None) between two calls is not parked (only ``HeldComponents``
makes that list); where no tag can be read (no reader, a mapping that is no plain dict) every park
looks, as before. A submodule replaced
inside a component while detached (``pipe.vae.decoder = ...``, a layer swapped by a LoRA fuse) is
let go at the next attach, as before; the pipeline itself is held (the debugger's ``pipe``:
``report()`` describes its components), so a pipeline deleted while its debugger is kept goes with
the debugger.
"""

from __future__ import annotations

import functools
import weakref
from operator import getitem, is_, itemgetter, setitem
from typing import Any, Callable

from torch import nn

from ...core.out_of_memory import Watched
from .tree_tags import READ

_set_attribute = object.__setattr__  # frozen dataclasses (Component, CallSite) too
_FIRST, _SECOND, _THIRD, _FOURTH = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)


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
        "by_id",
        "places",
        "tags",
        "memo_places",
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
    by_id: dict[int, weakref.ref]
    """The weak reference to each module parked, by its id."""
    places: tuple | None
    """What the last park found its places in (compared at each park): found the same at the next, that
    park's ``objects`` and ``containers`` are parked again as they are, not looked for (a reused
    debugger's call)."""
    tags: list[int] | None
    """The version tags and lengths of the dicts among the places (only where each is a plain dict: ``READ``
    takes no other mapping), read as :func:`park` left them (:func:`revive` compares them before it writes: a
    write while detached drops ``places``) and as :func:`revive` put the modules back (the next park compares them)."""
    memo_places: tuple | None
    """What the last park found in the memo: ``(memo, orders, pairs, lists, lengths, dicts, tags, at_orders,
    at_pairs)``, its ``orders`` and ``pairs``, the memo's lists it looked in and their lengths, the memo's
    dicts and their version tags and lengths (park and revive write its lists, not its dicts), and where each
    order and pair is (lists, indexes, weak references: compared in C loops). Found the same at the next
    park (the other places the same too), they are parked again as they are; dropped with a tree gone."""

    def __init__(self) -> None:  # (once a debugger: park fills it at each detach)
        self.active = self.gone = False
        self.orders, self.pairs, self.memo = [], [], None
        self.by_id, self.places, self.tags, self.memo_places = {}, None, None, None

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
    sites, static, check = steps.calls.sites, steps._static, held.check
    dicts = (steps.calls.roots, steps.localizer.modules, held.halves)
    places = (components, held, held.components, check, sites, dropped, *dicts)
    # the places the last park found, as revive left them: the same objects, the lists' items the same ones (by
    # identity: a Component or CallSite is a frozen dataclass, so an equal new one would compare equal), no
    # dict written since (version tags and lengths, as .tree_tags reads them), each object and container
    # holding the module it held (C loops, no Python call a place; inline: at every detach). Not where a
    # parked module was collected since, nor where no tag can be read: looked for one by one, as before.
    was, tags, strong = parked.places, parked.tags, weakref.ref.__call__
    try:
        same = (
            was is not None
            and tags is not None
            and not parked.gone
            and all(map(is_, places, was))
            and [*map(len, (components, held.components, check[2][2], sites))] == was[9]
            and all(map(is_, [*components, *held.components, *sites], was[10]))
            and [*map(READ, dicts), *map(len, dicts)] == tags
            and all(map(is_, map(getattr, parked.objects, parked.names), map(strong, parked.object_refs)))
            and all(map(is_, map(getitem, parked.containers, parked.keys), map(strong, parked.refs)))
        )
    except (KeyError, IndexError, AttributeError):  # (not while the tags are the same: cheap to say)
        same = False
    parked.orders, parked.pairs, parked.static, parked.gone, parked.active = [], [], None, False, True
    parked.memo, parked.tags = memo, None
    if same:  # the last park's places, holding the modules it parked: parked again, not looked for
        refs = parked.by_id
    else:
        refs = _find_places(parked, components, held, sites, dicts, dropped)
        # kept only where every dict's tag can be read (dict_version takes a plain dict alone: a RuntimeError
        # on a ChainMap or a mappingproxy): else looked for at each park
        readable = READ is not None and {*map(type, dicts)} == {dict}
        parked.places = _places_read(places) if readable else None
    memo_same = False  # the memo's places as the last park found them (C loops; its lists hold the modules again)
    if same and parked.memo_places is not None and parked.memo_places[0] is memo:
        _, orders, pairs, lists, lengths, memo_dicts, memo_tags, at_orders, at_pairs = parked.memo_places
        try:
            memo_same = (
                [*map(READ, memo_dicts), *map(len, memo_dicts)] == memo_tags
                and [*map(len, lists)] == lengths
                and all(map(is_, map(getitem, at_orders[0], at_orders[1]), map(strong, at_orders[2])))
                and all(map(is_, map(_SECOND, map(getitem, at_pairs[0], at_pairs[1])), map(strong, at_pairs[2])))
            )
        except (KeyError, IndexError, TypeError):  # (not while the tags are the same: cheap to say)
            memo_same = False
    if memo_same:
        parked.orders, parked.pairs = [*orders], [*pairs]
        for found, index, name, ref, _ in parked.pairs:
            found[index] = (name, ref)
    elif memo is not None:
        scanned: list[list] = []
        for key, (_, order) in memo._trees.items():
            ref = refs.get(key)
            if ref is not None and order and order[0] is ref():
                parked.orders.append((order, 0, ref, key))  # the tree key's list of modules (the root first)
                hooked = memo._trees[key][0][3]  # a compiled call, a diffusers hook registry: the root's own too
                scanned += (order, hooked)
                for index, item in enumerate(hooked):
                    if item is not None and type(item) is not str and type(item) is not object:  # (a name, the end)
                        item_ref = refs.get(id(item))
                        try:
                            parked.orders.append((hooked, index, item_ref or weakref.ref(item), key))
                        except TypeError:  # not weakly referable: held as it is
                            pass
        pairs = parked.pairs
        for key, values in memo._values.items():
            for value in values.values():
                if type(value) is not list or not value:
                    continue
                scanned.append(value)
                lists = []  # oom_targets (Watched: its modules), a probe level's (name, module) pairs
                if type(value[0]) is Watched:
                    for watched in value:
                        lists.append(watched.modules)
                else:
                    lists.append(value)
                scanned += lists
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
        dicts_read = [memo._trees, memo._values, *memo._values.values()]
        parked.memo_places = None
        if READ is not None and {*map(type, dicts_read)} == {dict}:  # (as the places above)
            tags_read = [*map(READ, dicts_read), *map(len, dicts_read)]
            lengths = [*map(len, scanned)]
            at_orders = [[*map(_FIRST, parked.orders)], [*map(_SECOND, parked.orders)], [*map(_THIRD, parked.orders)]]
            at_pairs = [[*map(_FIRST, pairs)], [*map(_SECOND, pairs)], [*map(_FOURTH, pairs)]]
            found_now = (memo, [*parked.orders], [*pairs], scanned, lengths, dicts_read, tags_read)
            parked.memo_places = (*found_now, at_orders, at_pairs)
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
    list(map(_set_attribute, parked.objects, parked.names, parked.object_refs))
    list(map(setitem, parked.containers, parked.keys, parked.refs))
    for found, index, ref, _ in parked.orders:
        found[index] = ref
    _HELD[id(parked)] = list(refs.values())
    if parked.places is not None:  # as this park left them: revive compares them first (a write while detached)
        parked.tags = [*map(READ, dicts), *map(len, dicts)]
    if memo is not None and (parked.orders or parked.pairs):  # shared: another debugger puts them back first
        memo.held_weakly = functools.partial(_revive_memo, parked, dropped)  # (strongly: a collected cycle's weak
        # references are cleared before its finalizers, the memo's own parking among them, run)


def _places_read(places: tuple) -> tuple:
    """:func:`park`'s ``places``, their lists' lengths and their items (the held check's list: its
    length alone, its modules are parked in it), as the next park compares them (the items by identity)."""
    components, held, held_components, check, sites = places[:5]
    return (
        *places,
        [*map(len, (components, held_components, check[2][2], sites))],
        [*components, *held_components, *sites],
    )


def _find_places(
    parked: Parked, components: list[Any], held: Any, sites: list[Any], dicts: tuple, dropped: Callable[[], None]
) -> dict[int, weakref.ref]:
    """Look for each place that holds a component's module, one by one (``parked.objects`` and
    ``parked.containers``, with the weak reference each will hold); returns the weak references by
    module id (``parked.by_id``)."""
    if held.components is not components:  # (the same, or the pipeline's as found since)
        components = [*components, *held.components]
    held_list = held.check[2][2]
    parked.objects, parked.names, parked.object_refs = objects, names, object_refs = [], [], []
    parked.containers, parked.keys, parked.refs = containers, keys, weak = [], [], []
    parked.by_id = refs = {}
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
    items = (*(mapping.items() for mapping in dicts), enumerate(held_list))  # (key, module): an index in the list
    for container, found in zip((*dicts, held_list), items):
        for key, module in found:
            if isinstance(module, nn.Module):
                ref = refs.get(id(module))
                if ref is None:
                    ref = refs[id(module)] = weakref.ref(module)
                containers.append(container)
                keys.append(key)
                weak.append(ref)
    return refs


def revive(parked: Parked) -> bool:
    """Put back every module :func:`park` parked; True when all of them live (the debugger's
    structures are as they were), False when one was collected (None in its places)."""
    parked.active = False
    _HELD.pop(id(parked), None)
    places, tags = parked.places, parked.tags
    if places is not None and tags is not None and [*map(READ, places[6:9]), *map(len, places[6:9])] != tags:
        parked.places = None  # a dict written while detached (the tags as park left them): looked for again
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
    if parked.places is not None and READ is not None and not parked.gone:  # the next park compares them
        dicts = parked.places[6:9]
        parked.tags = [*map(READ, dicts), *map(len, dicts)]
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
    parked.places = parked.memo_places = None  # (they hold the memo's lists, and the held check dropped now)
    parked.memo.held_weakly = None
    dropped()


def _collected(state: "weakref.ref[Parked]", dropped: Callable[[], None], gone: weakref.ref) -> None:
    parked = state()
    if parked is None:
        return
    parked.places = parked.memo_places = None  # (they hold its parts: the held check's dicts, the memo's lists)
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
