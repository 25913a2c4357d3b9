"""Forward pre-hook / hook on each component call site: time, memory, and the arguments of the
current call (kept for a localising replay or a repro bundle, dropped when the step ends). The
per-module probes inside each component are :mod:`.component_probes`' (re-exported here).

A call site is the component itself, or the VAE's ``encoder`` / ``decoder`` (see
:func:`~diffusion_debug.diffusion.components.inventory.call_sites`). Torch's own hooks only; ``forward`` is
never replaced.

An out-of-memory error raised in a call is seen by the same two hooks (the post-hook is
``always_call``: :class:`~diffusion_debug.probes.CallArgsConfig`'s ``on_error``) and recorded by the
debugger's :class:`~diffusion_debug.core.out_of_memory.OutOfMemoryWatch`, which then hooks nothing
itself: a component call runs 2 hooks, not 4.

Limits: ``cuda_synchronize`` makes the times exact at the cost of two syncs per call; without it
a CUDA call's time is its launch time. The device a call runs on is found once at attach and then
followed from the call's outputs (offloading moves a component between calls), so no call walks
the parameters.

Long because the kept calls' bookkeeping lives with the hooks that keep them: kept at the call (the
store itself, how a call is kept as passed and made again for a use, is :mod:`.kept_calls`'), held
while the site is called again in the step, cloned apart from the latents the scheduler steps
(:meth:`CallSiteHooks.keep_apart`), given back for a replay and dropped as the step ends.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import nn

from ...config import DebugConfig
from ...core.out_of_memory import OutOfMemoryWatch, Watched
from ...memory import call_peak_mb, cuda_peak_mb, memory_sample
from ...probes import (
    CallArgsConfig,
    ModuleReading,
    ProbeHandle,
    call_hooks,
    forward_hooks,
)
from ...stats import tensors_in
from . import cache_hooks
from .autocast import AutocastState, autocast_as, autocast_state
from .cache_hooks import (
    FoundHooks,
    HeldStates,
    Placement,
    found_hooks,
    held_apart,
    hook_placement,
    hook_registries,
    hook_state,
    hook_state_kept,
    placed_for_the_call,
    placement_kept,
    stateful_hooks,
)
from .compiled import (
    HALF_METHODS,
    compiled_methods,
    eager_module,
    half_arguments,
    replay_readings,
    wrap_compiled_call,
    wrap_compiled_method,
)
from .component_probes import (  # noqa: F401 (re-exported)
    ANY_AUTOCAST,
    ComponentProbes,
    inner_blocks,
    probe_levels,
    unread_modules,
)
from .inventory import CallSite, Component, call_sites
from .kept_calls import (  # noqa: F401 (the store's names, re-exported)
    REPLACED_STATE,
    STATE_ARGUMENTS,
    WRITTEN_OBJECTS,
    _cloned,
    kept_as_passed,
    plain_class,
    state_positions,
)
from .structure import TreeMemo

Guard = Callable[[str], ContextManager[None]]
"""``guard(where)``: a measurement that fails is recorded and the run goes on."""
Failed = Callable[[str, Exception], None]
"""``failed(where, error)``: a measurement that failed (in a hook's ``try``, which costs no Python
call where a ``with`` guard costs two) is recorded and the run goes on, or ``error`` is raised
again (:meth:`~diffusion_debug.diffusion.run_guard.RunGuards.failed_now`)."""


def first_parameter(module: nn.Module) -> torch.Tensor | None:
    """``module``'s first parameter, as ``module.parameters()`` orders them (None without
    parameters): its own, then each child's in turn, read from the modules' dicts (``parameters()``
    is a chain of generators through the tree). The call sites read a call's device from it at
    every attach (kept in the :class:`TreeMemo` while the tree is the same: a ``.to()`` moves the
    same parameter object).

    >>> first_parameter(nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(1, 1, device="meta")))).device.type
    'meta'
    """
    stack: list[Any] = [module]
    while stack:
        state = stack.pop().__dict__
        for parameter in state["_parameters"].values():
            if parameter is not None:
                return parameter
        children = state["_modules"]
        if children:
            stack += reversed(children.values())  # a child registered as None: skipped below
        while stack and stack[-1] is None:
            stack.pop()
    return None


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor of ``obj`` in :func:`~diffusion_debug.stats.tensors_in`'s order; a tensor,
    a tuple or list, or a dict (a diffusers or transformers output) that starts with one is read
    without the walk."""
    if isinstance(obj, torch.Tensor):
        return obj
    kind = type(obj)
    if kind is tuple or kind is list:
        if obj and isinstance(obj[0], torch.Tensor):
            return obj[0]
    elif isinstance(obj, dict) and obj:  # an output's fields in order, unset ones left out
        first = next(iter(obj.values()))
        if isinstance(first, torch.Tensor):
            return first
    found = tensors_in(obj)
    return found[0] if found else None


def read_output(output: Any) -> torch.Tensor | None:
    """The tensor of a call's output that a pipeline reads: a language model's (last) hidden states,
    which pipelines take as the prompt embedding, not its vocabulary logits, which they discard.
    Which hidden state a pipeline takes is not known at the call (SDXL takes CLIP's penultimate): a
    NaN/Inf in this one while an earlier one is finite is settled later
    (:meth:`~diffusion_debug.diffusion.call_events.CallEvents.hold_unread`)."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        hidden = getattr(output, "hidden_states", None)
        if isinstance(hidden, (tuple, list)) and hidden and isinstance(hidden[-1], torch.Tensor):
            return hidden[-1]
    return first_tensor(output)


_HALF = object()
"""Marks a kept call of a VAE half watched around its VAE's compiled method once it holds the half's
own arguments: ``(_HALF, (args, kwargs), strict, method's call)``, ``strict`` as they were made
(:meth:`CallSiteHooks.kept_call`) and the method's call kept as passed, to make them again strictly."""

_UNKEPT = object()
"""Stands for a call whose keep failed (an OOM cloning its arguments), as kept and then held, so that the
site's held calls stay in step with its outputs: no replay or bundle of it, nor of another call in its place."""

_OPEN_CALLS = 8
"""Calls of one call site open at once that are timed: a module calling itself deeper than this
loses its outermost calls' times; a start an interrupted call left behind is dropped in time."""


def new_runtime() -> dict[str, Any]:
    return {"calls": 0, "total_time_s": 0.0, "peak_memory_mb": None}


class CallSiteHooks:
    """Timing, peak memory and kept arguments for every call site of a pipeline.

    ``runtime`` (per component: calls, total_time_s, peak_memory_mb) lives for the debugger's
    life; ``kept`` (per ``(component, prefix)``: the current call's ``(args, kwargs)``) and
    ``earlier`` (the site's calls before it, ``held_calls`` in all: a denoiser called for the
    conditional and the unconditional pass apart, as Wan 2.2 and true CFG do, is replayed on the
    call that made a NaN/Inf) only until :meth:`drop_calls`.
    """

    def __init__(self, components: list[Component], config: DebugConfig, *, held_calls: int = 1):
        self.sites = [site for component in components for site in call_sites(component)]
        self.roots = {component.name: component.module for component in components}
        self.keep_calls = config.localize or config.repro_bundle  # for a replay or a bundle
        self.held_calls = held_calls
        self.synchronize = config.cuda_synchronize
        self.track_memory = config.memory_tracking
        self._plans: dict[tuple[str, str], tuple] = {}
        """Per site, as :meth:`register` last made them: its callbacks, OOM target and statefulness,
        then the device its hooks read (updated at each attach), their :class:`CallArgsConfig` and
        the hooks made of it (:func:`~diffusion_debug.probes.call_hooks`)."""
        self.runtime: dict[str, dict[str, Any]] = {}
        self.kept: dict[tuple[str, str], tuple[tuple, dict]] = {}
        self.contexts: dict[tuple[str, str], Any] = {}
        """The diffusers cache context each kept call ran in, with its stateful hooks' state as the call
        began (:func:`~.cache_hooks.hook_state`; sites with stateful hooks only), its tensors held up to
        :data:`~.cache_hooks.KEPT_BYTES` in all for the step (the rest by weak reference); a guided
        denoiser's (:attr:`guided`) with the hooks its registries held (:func:`~.cache_hooks.hook_placement`)."""
        self.guided = {c.name for c in components if c.guided}
        """The denoisers on whose layers a guider places hooks for some calls (PAG, SkipLayerGuidance)."""
        self._registries: dict[int, list[Any]] = {}
        """Per guided denoiser called since the last attach, its diffusers hook registries as found by
        the first of its calls that found a hook placed (each call walks its modules until then: the
        guider makes its registries at its first guided call); the detach forgets them. Limit: a
        registry made after that (another diffusers hook placed first) is seen at the next attach."""
        self._budget = [cache_hooks.KEPT_BYTES]
        """``[bytes]`` of cache tensors the step's saved hook states may still hold."""
        self._copies = [cache_hooks.KEPT_BYTES]
        """``[bytes]`` of the tensors in lists and dicts the step's kept calls may still clone
        (:func:`kept_as_passed`)."""
        self._found: dict[int, FoundHooks] = {}
        """Per stateful module called since the last attach, its hooks as found
        (:func:`~.cache_hooks.found_hooks`): a call checks them, the detach forgets them."""
        self.released = 0
        """The bytes of cache tensors the last replay ran without (:meth:`replay_kept`)."""
        self.bundled_placement: Placement = ()
        """The hooks each registry held as the bundled call began (:meth:`bundle_context`), for ``report.why()``."""
        self.bundled_state = HeldStates()
        """The bundled call's stateful hooks' state as it began (:meth:`bundle_context`), by component module,
        for ``report.why()``: a replay from the state the call left (a raise's, or a reset at its end) is
        not that call (a PyramidAttentionBroadcast counter moved on: the attention computed, not taken). Held
        while its component lives (:class:`~.cache_hooks.HeldStates`): a component the user replaced is let go."""
        self.raised_states = HeldStates()
        """The caches a call ended by policy ``raise`` left, by component module, before their reset
        (:func:`~.cache_hooks.states_left`): ``report.why()`` replays from them (the first raise's);
        held as :attr:`bundled_state`."""
        self.earlier: dict[tuple[str, str], list[tuple[tuple[tuple, dict], Any]]] = {}
        """Per site, its calls of the step before the kept one, oldest first, with their contexts."""
        self.stateful: set[str] = set()
        """The components whose calls run diffusers' stateful hooks (caches), as found at attach."""
        self.through: dict[tuple[str, str], Callable[..., Any]] = {}
        """Per VAE half watched around its VAE's compiled method (``vae.decode = torch.compile(...)``),
        as found at attach: the original method, whose arguments its kept calls hold until
        :meth:`kept_call` turns them into the half's (:func:`~.compiled.half_arguments`)."""
        self._started: dict[int, list[float]] = {}
        """Per module being called, when its calls still open began (the last is the innermost);
        at most :data:`_OPEN_CALLS`, the oldest dropped first: a call stopped by a KeyboardInterrupt
        (no post-hook runs) leaves its start behind, and a run that never steps is not reset."""
        self._peaks: dict[int, list[float]] = {}
        """Per module being called, the process's CUDA peak (MB) when its call began (as bounded)."""
        self.denoiser_memory: tuple[torch.device | None, dict[str, Any]] | None = None
        """The memory sample taken as the last denoiser call ended (with the call's device), for the
        step row (:meth:`take_denoiser_memory`)."""
        self.autocast: AutocastState = ()
        """The autocast regions open as the run began (:meth:`new_run`), which its kept calls ran under: a replay
        enters them again (:meth:`replay_kept`, a bundle's ``autocast``); one read a run, not a call."""

    def use_components(self, components: list[Component]) -> None:
        """Watch ``components`` from the next :meth:`register` on (a component replaced on the
        pipeline): a site whose module changed gets its hooks' plan made again; ``runtime`` stays."""
        sites = [site for component in components for site in call_sites(component)]
        before = {(site.component, site.prefix): site for site in self.sites}
        now = {(site.component, site.prefix): site for site in sites}
        for key in [key for key in self._plans if now.get(key) != before.get(key)]:
            del self._plans[key]
        self.sites, self.roots = sites, {component.name: component.module for component in components}
        self.guided = {c.name for c in components if c.guided}
        self.stateful = set()  # found again at the next attach

    def register(
        self,
        *,
        busy: Callable[[], bool],
        failed: Failed,
        on_start: Callable[[CallSite, tuple, dict], None],
        on_output: Callable[[CallSite, Any, torch.Tensor | None], None],
        memo: TreeMemo | None = None,
        oom: OutOfMemoryWatch | None = None,
        oom_targets: Sequence[Watched] = (),
    ) -> ProbeHandle:
        """Hook every site; returns the one handle that removes them all. ``on_start(site, args, kwargs)``
        runs before a call, ``on_output(site, output, first output tensor)`` after it (neither while
        ``busy()``). ``memo``: what is found of the module trees is reused while they are unchanged.
        ``oom``: records an OOM raised in a call of a site among ``oom_targets`` (by the module its
        calls begin at; a component compiled in place or regionally is none of them)."""
        memo = memo or TreeMemo()
        current = memo.current
        watched: dict[int, Watched] = {}
        if oom is not None:
            for t in oom_targets:  # (a loop: no comprehension's frame, at every attach)
                if t.modules:
                    watched[id(t.modules[0][1])] = t
        callbacks = (busy, failed, on_start, on_output, oom)
        self.stateful = stateful_now = set()  # as found now: a cache hook removed since counts no more
        self._found = {}  # a hook registry made since on a module that had none: found at the call
        self._registries = {}
        self.through = {}
        eager: list[tuple[nn.Module, CallArgsConfig, tuple]] = []
        added: list[Any] = []  # a loop, not a generator through register_all: no frame a resume
        try:
            for site in self.sites:
                key, target = (site.component, site.prefix), watched.get(id(site.module))
                values, what = current.get(id(self.roots[site.component]), {}), ("stateful", site.prefix)
                if what in values:  # (memo.get spelled out: no Python call a site when kept)
                    stateful = values[what]
                else:
                    stateful = values[what] = bool(stateful_hooks(site.module))  # its context is kept
                first = ("first_parameter", site.prefix)  # the device read from it now
                if first not in values:
                    values[first] = first_parameter(site.module)
                parameter = values[first]
                device = parameter.device if parameter is not None else None
                if stateful:
                    stateful_now.add(site.component)
                guided = site.component in self.guided and not site.prefix  # its calls keep the guider's hooks
                in_place = (
                    site.module.__dict__.get("_compiled_call_impl") is not None
                )  # compiled_in_place(site.module)
                method = None  # vae.decode = torch.compile(vae.decode): the half is called in it, with its arguments
                if not in_place and site.prefix in HALF_METHODS:
                    method = compiled_methods(root := self.roots[site.component]).get(HALF_METHODS[site.prefix])
                at = ("state_positions", site.prefix, method is None)  # the own state's positions in what is called
                if at not in values:  # (memo.get spelled out, as above)
                    called = eager_module(site.module).forward if method is None else method
                    values[at] = state_positions(called, self.own_state(site.component))
                positions = values[at]
                # the last attach's callbacks while they are the same (a reused debugger's are): each
                # attach of a 1-step call made them again
                plan = self._plans.get(key)
                keeps = (stateful, guided, positions)
                if plan is None or plan[0] != callbacks or plan[1] is not target or plan[2] != keeps:
                    where, held = {"device": device}, oom if target is not None else None
                    config = CallArgsConfig(
                        before=self._before(site, where, failed, on_start, keeps, held),
                        after=self._after(site, where, failed, on_output),
                        skip=busy,
                        on_error=oom.reporter(target) if oom is not None and target is not None else None,
                    )
                    plan = self._plans[key] = (callbacks, target, keeps, where, config, call_hooks(config))
                else:
                    plan[3]["device"] = device
                if in_place:  # its hooks would run inside the compiled code
                    added.append(wrap_compiled_call(site.module, *plan[5]))
                elif method is not None:
                    self.through[key] = method
                    # set on the component (a torch.compile wrapper's own), else on the original VAE
                    name = HALF_METHODS[site.prefix]  # (not method.__name__: "wrapper" before diffusers 0.33)
                    owner = root if name in root.__dict__ else method.__self__
                    added.append(wrap_compiled_method(owner, name, site.module, *plan[5]))
                else:
                    eager.append((site.module, plan[4], plan[5]))
            added += forward_hooks(eager)  # every eager site's hooks in one go (a reused debugger's every call)
        except BaseException:  # what was added goes before the error does
            ProbeHandle(added).remove()
            raise
        # the stateful modules' hooks found and a guided denoiser's registries hold their modules: let go at
        # detach, as the components are (a transformer the user replaces after the run is collected)
        return ProbeHandle(added, on_remove=self._forget_hooks if self.guided or stateful_now else None)

    def _forget_hooks(self) -> None:
        self._found.clear()
        self._registries.clear()

    def _before(
        self,
        site: CallSite,
        where: dict[str, Any],
        failed: Failed,
        on_start,
        keeps: tuple[bool, bool, dict[int, str]],
        oom: OutOfMemoryWatch | None,
    ):
        """``keeps``: whether the site's calls run stateful hooks, whether a guider places hooks for them, and
        the positions of the component's own state among their arguments (:func:`state_positions`)."""
        key, state = (site.component, site.prefix), self.own_state(site.component)
        stateful, guided, positions = keeps

        def before(module, args, kwargs):
            if oom is not None and oom.last is not None:  # an OOM recorded earlier: let go of its frames
                oom.forget_done()
            try:
                on_start(site, args, kwargs)
                if self.keep_calls:  # as passed: not what the call writes into its lists
                    try:
                        if key in self.kept:  # a second call in the step (the unconditional pass)
                            held = self.earlier.setdefault(key, [])
                            held.append((self.kept.pop(key), self.contexts.pop(key, None)))
                            if len(held) >= self.held_calls:  # the oldest goes (a slice from a negative start
                                del held[0]  # would cut a short list's front: only 4 of 8 were held)
                        self.kept[key] = kept_as_passed(args, kwargs, self._copies, state=state, positions=positions)
                        if stateful:  # its replay starts where the call did
                            found = self._found[id(module)] = found_hooks(module, self._found.get(id(module)))
                            self.contexts[key] = hook_state(module, found, self._budget)
                        if guided:  # and runs with the hooks the guider placed for it
                            registries = self._registries.get(id(module))
                            if registries is None:  # walked until a call finds a hook placed (the guider's)
                                registries = hook_registries(module)
                                if any(registry.hooks for registry in registries):
                                    self._registries[id(module)] = registries
                            context = self.contexts[key] if stateful else (None, None)
                            self.contexts[key] = (*context, hook_placement(registries))
                    except Exception as error:  # (an OOM cloning): this call unkept, its timing still taken
                        self.kept[key] = _UNKEPT
                        self.contexts.pop(key, None)
                        failed("keep_call", error)
                device = where["device"]
                if device is not None and device.type == "cuda":
                    if self.synchronize:
                        torch.cuda.synchronize(device)
                    if self.track_memory:  # never reset: the user's own peak counter must stay theirs
                        peaks = self._peaks.setdefault(id(module), [])
                        if len(peaks) >= _OPEN_CALLS:  # (see _started)
                            del peaks[0]
                        peaks.append(cuda_peak_mb(device))
                started = self._started.setdefault(id(module), [])
                if len(started) >= _OPEN_CALLS:  # a call stopped by a BaseException left its start here
                    del started[0]
                started.append(time.perf_counter())
            except Exception as error:
                failed("timing", error)

        return before

    def _after(self, site: CallSite, where: dict[str, Any], failed: Failed, on_output):
        component, denoiser = site.component, site.role == "denoiser"

        def after(module, args, kwargs, output):
            tensor = None
            try:
                tensor = read_output(output)
                if tensor is not None:
                    where["device"] = tensor.device
                # the call's time, count and peak memory (spelled here: no Python call a component call)
                device = where["device"]
                if self.synchronize and device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                stack = self._started.get(id(module))
                started = stack.pop() if stack else None
                entry = self.runtime.get(component) or self.runtime.setdefault(component, new_runtime())
                entry["calls"] += 1
                if started is not None:
                    entry["total_time_s"] += time.perf_counter() - started
                if self.track_memory:
                    sample = memory_sample(device)
                    before = self._peaks.get(id(module))  # a CUDA call's peak as it began; without it, call_peak_mb's
                    peak = (
                        call_peak_mb(sample, before.pop()) if before else sample.get("cuda_peak_mb", sample["rss_mb"])
                    )
                    entry["peak_memory_mb"] = max(entry["peak_memory_mb"] or 0.0, peak)
                    if denoiser:
                        self.denoiser_memory = (device, sample)
            except Exception as error:
                failed("timing", error)
            on_output(site, output, tensor)

        return after

    def take_denoiser_memory(self, device: torch.device | None) -> dict[str, Any] | None:
        """The memory sample taken as the step's last denoiser call ended, if one ended since the
        last step and ran on ``device`` (else None: the caller samples), handed over once. The step
        row takes it in place of a sample of its own (one read of the CUDA allocator fewer a
        step): what the loop allocates between the call's end and the scheduler step is the
        guidance's and the scheduler's latents-sized tensors (the call's activations are freed
        by then), and the peak is the process's, which the call set."""
        taken, self.denoiser_memory = self.denoiser_memory, None
        if taken is not None and taken[0] == device:
            return taken[1]
        return None

    # -- kept calls ---------------------------------------------------------------------------------
    def site_for(self, component: str, module: str) -> CallSite | None:
        """The site with a kept call whose module tree holds ``module`` of ``component``."""
        for site in self.sites:
            inside = site.prefix == "" or module == site.prefix or module.startswith(site.prefix + ".")
            if site.component == component and inside and _kept(self.kept, site):
                return site
        return None

    def replay_kept(self, site: CallSite, quiet: ContextManager[None]) -> list[ModuleReading]:
        """The kept call of ``site`` run again with full probes (:func:`replay_readings`), within
        ``quiet`` (the debugger's own call), in the call's cache context and from the state its
        stateful hooks had as it began (a cache that skipped or computed a block in the call does so
        again), every stateful hook's state put back after it. :attr:`released`: the bytes of cache
        tensors the call replaced that were not kept (:data:`~.cache_hooks.KEPT_BYTES`), None in the
        replay; a replay that fails without them says so."""
        args, kwargs = self.kept_call(site)
        context, state, *placed = self.contexts.get((site.component, site.prefix)) or (None, None)
        self.released = 0
        placement = placed[0] if placed else ()  # a guided call's: the guider's hooks put back
        with (
            quiet,
            autocast_as(self.autocast),  # (a step read after the user's `with torch.autocast` closed)
            placement_kept(placement),
            hook_state_kept(site.module, context, state) as self.released,
        ):
            try:
                return replay_readings(site.module, args, kwargs, site.prefix)
            except Exception as error:
                if not self.released:
                    raise
                raise RuntimeError(
                    f"the replay ran without the {self.released} bytes of cache tensors the call replaced "
                    f"(beyond the {cache_hooks.KEPT_BYTES} bytes kept a step): {error!r}"
                ) from error

    def kept_call(self, site: CallSite, strict: bool = True) -> tuple[tuple, dict]:
        """The kept call of ``site``, its lists and dicts (and the tensors in them) copied again at each
        use: a replay fills a causal-cache VAE's ``feat_cache`` and moves its ``feat_idx``, and a cache
        step's writes into its ``kv_cache``, which the next replay (an overflow after a NaN) or the repro
        bundle must see as the call was passed. Raises ``RuntimeError`` where a tensor held uncloned
        (beyond the step's bytes of copies) was changed in place since (:func:`_used`), unless not ``strict``
        (a check of the arguments' values: it is read as it is now). A half watched around its VAE's compiled
        method gets the half's own arguments, made once from the method's call (:func:`~.compiled.half_arguments`)
        and made again for a strict use where a check made them (from the tensors as they were then, unchecked)."""
        key = (site.component, site.prefix)
        method, kept = self.through.get(key), self.kept[key]
        if method is not None and (kept[0] is not _HALF or (strict and not kept[2])):  # the half's, once
            passed = kept if kept[0] is not _HALF else kept[3]
            made = half_arguments(method, site.module, *kept_as_passed(*passed, strict=strict), kept_as_passed)
            self.kept[key] = kept = (_HALF, made, strict, passed)
        return kept_as_passed(*(kept[1] if kept[0] is _HALF else kept), strict=strict)

    def own_state(self, component: str) -> frozenset[str]:
        """The names of the arguments through which ``component`` gets its own state back
        (:data:`STATE_ARGUMENTS` and the names its diffusers class lists in ``_skip_keys``)."""
        skip = getattr(self.roots.get(component), "_skip_keys", None)
        return STATE_ARGUMENTS | frozenset(k for k in skip or () if isinstance(k, str))

    def bundle_context(self, site: CallSite, component: nn.Module) -> dict[str, Any]:
        """What a bundle of the kept call of ``site`` holds for a why replay: the diffusers cache context
        it ran in (None: none, or no stateful hook), the hooks a guider placed for it only, by module
        (:func:`~.cache_hooks.placed_for_the_call`), and the run's :attr:`autocast`; the placement itself is kept as
        :attr:`bundled_placement` and the hooks' state as :attr:`bundled_state` (hooks are no file's content)
        until the next bundle (the state while ``component`` lives)."""
        context, state, *placed = self.contexts.get((site.component, site.prefix)) or (None, None)
        self.bundled_placement = placed[0] if placed else ()
        self.bundled_state = HeldStates()
        if state is not None:  # held apart from the component: it is let go as the user lets go of it
            self.bundled_state[component] = held_apart(state)
        named = placed_for_the_call(self.bundled_placement, eager_module(component))
        return {"cache_context": context, "guider_hooks": named, "autocast": self.autocast}

    def keep_apart(self, latents: torch.Tensor) -> None:
        """The kept calls' tensor arguments that share the storage of ``latents`` (the ``sample`` the
        scheduler steps) cloned, so
        that a replay sees them as they were passed: Kandinsky 5 gives its transformer ``latents``
        itself (``latents.to(dtype)``, no copy) and then writes the step's output into it in place
        (``latents[..., :c] = scheduler.step(...)``); a replay after that saw the next latents, and
        blamed the pipeline's code for the NaN/Inf its transformer had made. One copy of the latents a
        step where a call was given them uncopied (Flux's packed latents too), none otherwise."""
        storage = latents.untyped_storage().data_ptr()  # (loops, no helper: a call a step where none shares it)
        for key, kept in self.kept.items():
            if kept is not _UNKEPT and kept[0] is not _HALF:
                for value in (*kept[0], *kept[1].values()):
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
                        self.kept[key] = _cloned(kept, storage)
                        break
        for held in self.earlier.values():
            for index, (kept, context) in enumerate(held):
                if kept is _UNKEPT or kept[0] is _HALF:  # a half's, made from its VAE's method call: as above
                    continue
                for value in (*kept[0], *kept[1].values()):
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
                        held[index] = (_cloned(kept, storage), context)
                        break

    def drop_call(self, component: str, prefix: str) -> None:
        self.kept.pop((component, prefix), None)
        self.contexts.pop((component, prefix), None)
        self.earlier.pop((component, prefix), None)

    def drop_calls(self) -> None:
        """Forget every kept call (the step ended): no activation is held across steps."""
        self.kept, self.contexts, self.earlier = {}, {}, {}
        self.denoiser_memory, self._budget, self._copies = None, [cache_hooks.KEPT_BYTES], [cache_hooks.KEPT_BYTES]

    def take_calls(self) -> tuple[dict, dict, dict]:
        """The step's kept calls (their cache contexts, and each site's earlier calls), handed
        over: the step whose values are read a step later keeps them until then; the hooks start
        afresh."""
        taken = (self.kept, self.contexts, self.earlier)
        self.kept, self.contexts, self.earlier = {}, {}, {}
        self._budget, self._copies = [cache_hooks.KEPT_BYTES], [cache_hooks.KEPT_BYTES]
        return taken

    @contextlib.contextmanager
    def calls_of(self, taken: tuple[dict, dict, dict], component: str | None = None, back: int = 0) -> Iterator[None]:
        """Within the block, the kept calls are ``taken`` (an earlier step's, from :meth:`take_calls`);
        ``component``'s own (its site ``""``) is its call ``back`` calls before the last of the step
        (0: the last; the call whose output held the step's first NaN/Inf), where still held: else none."""
        now = (self.kept, self.contexts, self.earlier)
        kept, contexts, earlier = taken
        held = earlier.get((component, ""), [])
        if back > 0:  # (a held call whose keep failed is :data:`_UNKEPT`: none, not the call before it)
            key, (call, context) = (component, ""), held[-back] if back <= len(held) else (_UNKEPT, None)
            kept, contexts = {**kept, key: call}, {**contexts, key: context}
            if context is None:
                contexts.pop(key)
        self.kept, self.contexts, self.earlier = kept, contexts, earlier
        try:
            yield
        finally:
            self.kept, self.contexts, self.earlier = now

    def new_run(self) -> None:
        self.kept, self.contexts, self.earlier, self._started, self._peaks = {}, {}, {}, {}, {}
        self.autocast = autocast_state()  # (one C call where none is open)
        self.denoiser_memory, self._budget, self._copies = None, [cache_hooks.KEPT_BYTES], [cache_hooks.KEPT_BYTES]


def kept_arguments(
    calls: CallSiteHooks, component: str, prefix: str | None = None
) -> tuple[nn.Module, tuple, dict] | None:
    """``(module, args, kwargs)`` of ``component``'s kept call at the site ``prefix`` (the VAE's
    ``decoder``; None: its first site with a kept call); None when none is kept. A VAE whose
    ``encoder`` call is still kept when its ``decoder`` is checked is read at the decoder; for a check of
    the values it was passed (a tensor held beyond the step's copies read as it is now), not a replay."""
    for site in calls.sites:
        if prefix is not None and site.prefix != prefix:
            continue
        if site.component == component and _kept(calls.kept, site):
            return (site.module, *calls.kept_call(site, strict=False))
    return None


def _kept(kept: dict[tuple[str, str], Any], site: CallSite) -> bool:
    return kept.get((site.component, site.prefix), _UNKEPT) is not _UNKEPT
