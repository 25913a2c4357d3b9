"""DiffusionModelDebugger: watch every denoising step of a diffusers pipeline.

>>> import torch
>>> from diffusion_debug import DebugConfig
>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("sd")
>>> import tempfile
>>> dbg = DiffusionModelDebugger(pipe, DebugConfig(level="basic", output_dir=tempfile.mkdtemp()))
>>> with dbg:
...     _ = pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
>>> [row["step"] for row in dbg.report().steps]
[0, 1]

This file holds the API, the lifecycle and the policy; each choice is stated by the code that makes
it (the map is the package docstring). Long because the lifecycle follows what users do to the
pipeline between and inside watched calls (components replaced, schedulers swapped, a detached
debugger kept: its modules held weakly, ``components.detached``), each seam a few lines here.
``components`` finds each ``nn.Module`` component and its role and probes its calls;
``pipeline_patches`` wraps ``scheduler.step``, ``set_timesteps`` and ``encode_prompt`` for the
watched instances only (a copy runs unwatched); ``steps`` turns each event into values
(``step_values``: one transfer to the host, read a step late unless the policy must act on the step
itself), a row and findings (``localize`` and ``origins``: who made a NaN/Inf); every anomaly goes
through one :class:`~diffusion_debug.core.AnomalySink`.
A Modular Diffusers ``ModularPipeline`` is watched alike; the collections of its
``ComponentsManager`` that share a component are recorded (event ``shared_components``). A
``ComponentsManager`` itself is watched in every pipeline that calls its components; the schedulers
it holds (``add``, ``load_components``: those found at each attach) are watched as a pipeline's, so a
pipeline stepping one has its steps' rows and a run a call; where it holds none (or the pipeline steps
one it does not hold), call by call: no per-step row, and every call of one attach is run 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import sys
import warnings
import weakref
from collections.abc import Mapping
from operator import attrgetter, is_
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..config import DebugConfig, resolve_config
from ..core import AnomalySink, DebugReport, Lifecycle, apply_policy, check_policy, open_run, release
from ..core.out_of_memory import OutOfMemoryWatch, Watched
from ..errors import DiffusionDebugError
from ..probes import ProbeHandle, copies
from ..record import Anomaly
from ..report.server import start_live_server
from . import origins
from . import pipeline_patches as patches
from . import step_values as rows
from .components.cache_hooks import HeldStates, reset_as_a_call_ends, states_left
from .components.call_memory import oom_targets
from .components.component_probes import ANY_AUTOCAST
from .components.detached import Parked, dropped_parts, park, revive
from .components.held import HeldComponents
from .components.inventory import (
    Component,
    analyze_pipeline,
    component_dtypes,
    find_components,
    manager_schedulers,
    no_denoiser_note,
    shared_collections,
    validate_pipeline,
    watchable_kind,
)
from .components.structure import TreeMemo, shared_memo
from .determinism import global_rng_drawn
from .replay.copies import layerwise_casting
from .reporting import build_report, debug_summary
from .signatures import check_monitor_arguments, check_no_pipeline_argument
from .steps import StepPipeline

logger = logging.getLogger("diffusion_debug")
_PIPELINE = Watched("", "pipeline", phase="pipeline call", in_loop=False)  # an OOM outside every component
_MODULE = attrgetter("module")

COMPILED_NOTE = (
    "compiled: measured at the call site and in the step row, no probe inside the compiled code; "
    "a NaN/Inf is localised by an eager replay of the original module; an fp16 output near overflow is warned of "
    "at its step, the module that made it not named"
)
RUNS_MADE: dict[Path, list[Any]] = {}
"""The runs this process's debuggers opened, by output folder: ``[how many, the last run directory]``
(``diffusion-debug launch`` names them after its training run: :func:`~.jobs.launched.pipeline_runs`)."""


class DiffusionModelDebugger(Lifecycle):
    """Watches a diffusers pipeline: per-step record, NaN/Inf producer, overflow risk, previews.

    ``with dbg: pipe(...)`` attaches on enter and detaches on exit (also on an exception);
    ``dbg.attach()`` returns a handle whose ``remove()`` detaches; a later ``attach()`` watches
    again. Nothing is written before the pipeline and config are validated. ``events.jsonl`` stays
    open (and the ``serve_port`` server runs) until :meth:`close` or the debugger's collection.

    Limits: a debugger sees only its own pipeline's calls (a pipeline sharing its components,
    ``from_pipe`` or ``Pipeline(**pipe.components)``, runs unseen); the step index counts
    ``scheduler.step`` calls (Heun counts two per denoising step); a component or scheduler replaced between
    two watched calls is followed from the next attach (event ``component_replaced``), a ``pipe.scheduler``
    replaced while attached from the next denoiser call, a component replaced between two calls of one attach
    from the next call's ``set_timesteps`` (before its first call: a ``torch.compile`` wrapper traces none of
    our hooks), a denoiser replaced in ``callback_on_step_end`` from its first call (``components.step_end``),
    else from its second (the first step that ran no watched denoiser call finds it; its first call is measured
    from ``scheduler.step``'s arguments; one swapped with the scheduler in one callback that the step-end seam
    missed runs unwatched to the VAE's call, which records both, and is hooked from the pipeline's next call;
    another module component replaced while attached (the VAE) from the next ``scheduler.step`` or, in
    ``callback_on_step_end``, the next module call after it (the last step's: before the decode), from the next
    attach where neither follows); after 8 denoiser calls without a scheduler step each further call is checked
    on its own (at the run's step, None before any schedule was set); when the denoiser is called several times
    per step every output is checked, the last one measured in the row; ``debug_timeout`` does not interrupt a
    replay; where a block-level overflow was localised is kept across pipeline runs until
    :meth:`clear_debug_history`; a call that raised, caught while attached, is ended (what it held settled as
    its own) at the next event of ours or ``report()``; the first call under an attach reads an fp16 VAE or text
    encoder not yet read fully with full probes, the next calls with its paced sentinel (probed again at the call's
    end, or as the next run begins where no call end is seen: a Modular Diffusers pipeline).
    """

    def __init__(self, pipe: Any, config: DebugConfig | Mapping[str, Any] | None = None):
        cfg = resolve_config(config)
        check_policy(cfg, _PipelinePolicy, "DiffusionModelDebugger")
        validate_pipeline(pipe)
        self.pipe = pipe
        self._kind = watchable_kind(pipe)  # the class is fixed: asked once
        self._is_manager = self._kind == "manager"  # asked at every hook call
        self._frames = origins.PipelineFrame(pipe)
        self.config = cfg
        self._parked = Parked()  # detached (active): the modules held weakly (components.detached)
        self._components: list[Component] = find_components(pipe)
        self._held = HeldComponents(pipe, self._components)  # checked at every attach: one replaced is followed
        # serve_port: bound before the run directory is made, so a port in use creates nothing
        self._server = start_live_server(cfg, self, {"/debug/summary": DiffusionModelDebugger.get_summary})
        try:  # whatever fails from here gives back the run's stream and the server
            self.record = open_run(cfg, kind="diffusion")  # creates the run directory: after validation
            made = RUNS_MADE.setdefault(self.record.run_dir.parent, [0, None])
            made[0], made[1] = made[0] + 1, self.record.run_dir
            # copies of the components leave our hooks out from now to close (probes.copies): held for the
            # debugger's life, not an attach's, so a reused debugger's call puts no patch in or out
            copies.hold()
            self._finalizer = weakref.finalize(
                self, release, self.record.close, self._server and self._server.stop, copies.release
            )
            self.sink = AnomalySink(self.record, cfg, logger)
            self._steps = StepPipeline(pipe, self._components, cfg, self.record, self.sink)
            self._steps.follow_scheduler = self._follow_scheduler  # a pipe.scheduler replaced while attached
            self._steps.follow_components = self._follow_components  # a pipe.unet replaced while attached
            # (a ComponentsManager's none: no pipeline frame is looked for, its encoder calls are read together)
            self._steps.held, self._steps.frames = self._held, None if self._is_manager else self._frames
            self._frames.returned = self._steps.probes.reset  # what another pipeline's call inside its call queued
            # what attach finds in the module trees, reused while they are unchanged (one walk per
            # attach), and by every debugger of this pipeline (one made per call finds it worked out)
            self._trees = shared_memo(pipe)
            # no hooks of its own: an OOM in a component call is seen by the call sites' (2 a call, not 4);
            # one in the debugger's own call (a preview, a replay) is its guard's ``debugger_error``
            self._oom = OutOfMemoryWatch(
                self.sink,
                targets=None,
                step=lambda steps=self._steps: steps.run.step,
                fallback=_PIPELINE,
                own=lambda steps=self._steps: steps.busy,
            )
            self._rehook = False  # components replaced in the call, found inside a component's call: hooked at its end
            self._dropped = functools.partial(dropped_parts, weakref.ref(self))  # (no cycle through the debugger)
            self._removers: list[Any] = []  # hook handles and patches, each with remove(), undone in reverse
            # the callbacks every attach hands on, made once: the call sites keep their hooks' plans
            # while these are the same (a reused debugger attaches at every call)
            # the events the policy acts after: each reads the sink's queue as it ends (no wrapper's call)
            self._steps.on_errors = self._apply_policy
            self._steps.probe_again = self._probe_again  # at a run's start where no call end came (Modular Diffusers)
            self._steps.follow_trees = self._follow_trees
            self._dtypes: dict[str, str | None] = {}  # the components' dtypes as last probed
            self._on_call_output = self._steps.on_call_output
            self._on_step = self._steps.on_scheduler_step
            self._on_encode_prompt = self._steps.on_encode_prompt
            self._busy = self._is_busy
            self._patches = patches.PipelinePatches(  # made at the first attach, put back at each later one
                pipe,
                busy=self._busy,
                on_step=self._on_step,
                on_set_timesteps=self._steps.on_set_timesteps,
                on_encode_prompt=self._on_encode_prompt,
                on_safety_checker=self._steps.on_safety_checker,  # warnings only: the policy has nothing to act on
                on_call_end=self._call_ends,
                made=self._steps.localizer.made,
            )
            self._manager_patches: dict[int, patches.PipelinePatches] = {}  # a ComponentsManager's, per scheduler
        except BaseException:
            release(self._finalizer or (self._server and self._server.stop))
            raise

    @property
    def components(self) -> list[Component]:
        """The watched components; detached, those still alive of them (their modules held weakly
        until the next attach: ``components.detached``)."""
        if not self._parked.active:
            return self._components
        alive = []
        for c in self._components:
            module = c.module() if isinstance(c.module, weakref.ref) else c.module
            if module is not None:
                alive.append(Component(c.name, c.role, module, c.guided))
        return alive

    @property
    def denoiser(self) -> Component | None:
        """The component that drives the per-step row (None for a pipeline without one)."""
        components = self.components
        return components[0] if components and components[0].role == "denoiser" else None

    @property
    def _run(self) -> rows.RunState:
        return self._steps.run

    # -- lifecycle ----------------------------------------------------------------------------
    def _register(self, *, hooks_only: bool = False) -> None:
        """Attach; ``hooks_only``: the components' probes and call sites alone (put on again for a
        component replaced while attached, :meth:`_follow_components`)."""
        if not hooks_only:
            if self._parked.active:  # the modules held weakly since the last detach: held again
                revive(self._parked)  # (one gone: the held check was dropped with it, and fails below)
            state, size, (dicts, keys, held) = self._held.check  # no Python call while nothing is replaced
            if state is None or len(state) != size or not all(map(is_, map(dict.get, dicts, keys), held)):
                with self._steps.guard("component_replaced"):  # a failure is recorded; the call runs
                    self._follow_replaced()
        steps, trees = self._steps, self._trees
        components = self._components
        trees.refresh([*map(_MODULE, components)])  # (no comprehension's frame: at every attach)
        self._dtypes = dtypes = component_dtypes(components, trees)
        self._removers.append(steps.probes.attach(components, trees, computed_in(components, dtypes, trees)))
        self._removers.append(
            steps.calls.register(
                busy=self._busy,
                failed=steps.guards.failed_now,
                on_start=steps.on_call_start,
                on_output=self._on_call_output,
                memo=trees,
                oom=self._oom,
                oom_targets=oom_targets(self._components, trees),
            )
        )
        if hooks_only:
            return
        steps.attached_at = steps.runs
        self._removers += self._patches.apply()  # made at the first attach, put back at each later one
        if self._is_manager:  # the schedulers it holds: whichever pipeline steps one, a step row, a run each call
            self._removers += self._patch_manager_schedulers()
        roles = {}
        for c in self._components:
            roles[c.name] = c.role
        self.record.add_event("attach", flush=False, components=list(roles), roles=roles, probes=self.config.probes)
        # Modular Diffusers' ComponentsManager (none in a DiffusionPipeline: no call asked at each attach)
        if self._kind != "pipeline" and (shared := shared_collections(self.pipe, self._components)):
            self.record.add_event("shared_components", collections=shared)
        if steps.probes.compiled:
            self.record.add_event("compiled_components", components=steps.probes.compiled, note=COMPILED_NOTE)
        if self._components[0].role != "denoiser":  # (self.denoiser is None)
            scheduler = getattr(self.pipe, "scheduler", None)
            stepped = type(scheduler).__name__ if callable(getattr(scheduler, "step", None)) else None
            note = no_denoiser_note(type(self.pipe).__name__, stepped)
            logger.warning("diffusion-debug: %s", note)
            self.record.add_event("no_denoiser", note=note)
        steps.static_checks(dtypes)

    def _follow_replaced(self) -> None:
        """Watch the pipeline's components as they are now: one replaced since the last attach
        (``pipe.unet = other``, ``pipe.vae.decoder = ...``, a new scheduler) is hooked from this
        attach on, each change recorded (event ``component_replaced``); the old module was let go
        of at the last detach, with every hook of ours."""
        self._held, changes = self._held.compared(self.pipe)
        self._steps.held = self._held
        if not changes:
            return
        self._components = self._held.components
        self._steps.use_components(self._components)
        for change in changes:
            self.record.add_event("component_replaced", flush=False, **change)
            logger.info("diffusion-debug: %(component)s %(change)s (%(was)s -> %(now)s)", change)

    def _follow_components(self, step: int | None, *, now: bool = True, ahead: bool = False) -> None:
        """Watch a module component replaced while attached (``pipe.unet = other`` in a
        ``callback_on_step_end``), found by the first step (``step``) that ran no watched denoiser
        call: its calls are hooked from its next one on (its first is measured in that step's row, from
        ``scheduler.step``'s arguments), every component's probes and call sites taken off and put on
        again as an attach does, each change recorded (event ``component_replaced``,
        ``while_attached``). A step the denoiser sat out with nothing replaced costs the check alone.
        ``now`` False (asked from the VAE's call, the denoiser swapped with the scheduler in one
        callback: no step of theirs was seen): the changes are recorded now, the hooks put on again
        as the pipeline's call ends (none taken off inside a component's call). ``ahead``: found after
        the step's callback, before any call of theirs (``components.step_end``): none ran unwatched."""
        state, size, (dicts, keys, held) = self._held.check
        if state is not None and len(state) == size and all(map(is_, map(dict.get, dicts, keys), held)):
            if self._rehook and now:  # found at the VAE in a pipeline whose call end is not ours: hooked here
                self._rehook_now()
            return
        with self._steps.guard("component_replaced"):
            self._held, changes = self._held.compared(self.pipe)
            self._steps.held = self._held
            if all(change["component"] == "scheduler" for change in changes):
                return  # a scheduler swapped: followed as it is (scheduler_replaced), held from now on
            steps, scheduler = self._steps, self._steps.scheduler  # a scheduler swapped: followed as it is
            self._components = self._held.components
            steps.use_components(self._components)
            steps.scheduler = scheduler
            for change in changes:
                if change["component"] != "scheduler":
                    self.record.add_event("component_replaced", step=step, while_attached=True, **change)
                    if change["component"] in steps.experts and not ahead:  # its call at ``step`` ran unhooked
                        steps.localizer.first_unwatched[change["component"]] = step
                    logger.info(
                        "diffusion-debug: %(component)s %(change)s while attached (%(was)s -> %(now)s)", change
                    )
            if not now:  # their steps ran unwatched: a NaN the VAE receives came from them
                names = [change["component"] for change in changes if change["component"] != "scheduler"]
                steps.localizer.unwatched_since = (["scheduler", *names], step)
                self._rehook = True
                return
            self._rehook_now()

    def _rehook_now(self) -> None:
        """Every component's probes and call sites taken off and put on again (as they are now)."""
        self._rehook = False
        with self._steps.guard("component_replaced"):
            hooks, rest = self._removers[:2], self._removers[2:]  # the probes' and the call sites' (_register's first)
            self._removers = []
            ProbeHandle(hooks).remove()
            try:
                self._register(hooks_only=True)
            finally:
                self._removers += rest

    def _probe_again(self) -> None:
        """The components' probes taken off and put on again, as the next attach would put them: a component
        called once per image whose first call was read with full probes (its checks and any replay done with
        the call) has its sentinel from the next call of this attach on (one attach around a serving loop read
        every call fully). Asked as a pipeline call ends (no component's call under way) or, where none is seen (a
        Modular Diffusers pipeline), as the next run begins: before its first component call, or in the pre-hooks of
        the call that begins it, whose probe starts again before the call's forward runs (read after)."""
        steps, components, trees = self._steps, self._components, self._trees
        with steps.guard("probe_levels"):
            handle, self._removers[0] = self._removers[0], ProbeHandle()  # the probes' (_register's first)
            handle.remove()
            steps.probes.drop_probes()
            self._dtypes = dtypes = component_dtypes(components, trees)
            self._removers[0] = steps.probes.attach(components, trees, computed_in(components, dtypes, trees))

    def _follow_trees(self, calling: str | None) -> None:
        """Asked as each run after an attach's first begins (a serving loop under one attach): a component whose
        module tree changed since it was hooked (``fuse_qkv_projections``' ``to_qkv``, a LoRA loaded,
        ``unet.compile()``) or whose dtype did (``pipe.to(torch.float16)``: an fp32 UNet is not probed) is hooked as
        the next attach would: probes and call sites now, or, where the run begins in a component's call
        (``calling``), its probes now and every hook again as the call ends. One walk of the trees a run, as an
        attach pays; none for a debugger attached around each call."""
        components, trees = self._components, self._trees
        with self._steps.guard("probe_levels"):
            changed = trees.refresh([*map(_MODULE, components)])
            if not changed and component_dtypes(components, trees) == self._dtypes:
                probes = self._steps.probes  # autocast entered or left since: probed as under it (or not) now
                if (ANY_AUTOCAST() or probes.autocast) and probes.autocast_changed():
                    self._probe_again()
                return
            # every hook taken off first, then put on in an attach's order: probes put on alone, under the call
            # sites' hooks, read a root with forward hooks by a hook of its own (a full probe: 4 more a tiny SD)
            if calling is None:
                self._rehook_now()  # (a module compiled in place: its call sites' hooks made for a compiled call)
            else:
                self._probe_again()
                self._rehook = True  # (one already due is kept)

    def _follow_scheduler(self, scheduler: Any) -> None:
        """Watch ``scheduler``, put on the pipeline while attached, as the attached one is (its
        ``step`` and ``set_timesteps`` wrapped, through the same callbacks) until detach, once however
        often it comes back; it is the one held from then on: the next attach finds no change to
        record again."""
        self._held.scheduler = scheduler
        for patch in self._removers:  # one swapped back (a stage's scheduler, then the first again): wrapped already
            if isinstance(patch, patches.MethodPatch) and patch.owner is scheduler and patch.name == "step":
                return
        holder = SimpleNamespace(scheduler=scheduler)  # the pipeline's scheduler alone: nothing else patched twice
        self._removers += patches.patch_pipeline(
            holder,
            busy=self._busy,
            on_step=self._on_step,
            on_set_timesteps=self._steps.on_set_timesteps,
            on_encode_prompt=self._on_encode_prompt,
        )

    def _patch_manager_schedulers(self) -> list[patches.MethodPatch]:
        """Each scheduler the ComponentsManager holds now, patched as a pipeline's (``PipelinePatches`` over a
        holder of it, made once, put back at each later attach): its ``set_timesteps`` and ``step`` begin runs and
        record rows as a pipeline's do, read from it (``StepPipeline.holder``, set as it runs)."""
        made, self._manager_patches = self._manager_patches, {}
        steps, found = self._steps, []
        for scheduler in manager_schedulers(self.pipe):
            kept = made.get(id(scheduler))
            if kept is None or kept.pipe.scheduler is not scheduler:
                holder = SimpleNamespace(scheduler=scheduler)

                def on_step(*args, holder=holder):
                    steps.holder = holder
                    steps.on_scheduler_step(*args)

                def on_set_timesteps(args, kwargs, holder=holder):
                    steps.holder = holder
                    steps.on_set_timesteps(args, kwargs)

                kept = patches.PipelinePatches(
                    holder,
                    busy=self._busy,
                    on_step=on_step,
                    on_set_timesteps=on_set_timesteps,
                    on_encode_prompt=self._on_encode_prompt,
                )
            self._manager_patches[id(scheduler)] = kept
            found += kept.apply()
        return found

    def _call_ends(self) -> None:
        if self._steps.pending is not None:  # the last step, read late, is read before the call returns
            self._steps.flush()
        if self._steps.unread is not None:  # an encoder's findings no call of the loop settled: as they were made
            self._steps.settle_unread(None)
            self._apply_policy()
        if self._rehook:  # a denoiser replaced in the call, found at the VAE: hooked for the next call
            self._rehook_now()
        if self._steps.probes.reading_fully and self._steps.probes.fully_read():  # a first call's full read, done
            self._probe_again()
        if self._steps.step_end.handle is not None:  # armed at the last step, no module called since
            self._steps.step_end.disarm()
        # the call drew from torch's global generator: one aten.equal of two CPU tensors a call given a generator of
        # its own, none otherwise (no Python call, no host read of a device value; .numpy().tobytes() would be a
        # host read by count_host_transfers' count)
        run = self._steps.run
        if run.rng_state is not None and run.stepped:
            if not torch.equal(run.rng_state, torch.default_generator.get_state()):
                self._global_rng_drawn()
        self._steps.ended_run = self._steps.runs  # a call that raises later and begins no run is not this one
        if self._steps.localizer.made.pending:  # a NaN/Inf maker's call: its locals (latents, images) not held past it
            self._steps.localizer.made.settle(ending=True)
        self._frames.frame = None  # (forget()) the call's frame, and its locals, are not held past it

    def _global_rng_drawn(self) -> None:
        """A call that moved torch's global generator: flagged when it was given ``generator=``
        (:func:`~.determinism.global_rng_drawn`), read from its frame."""
        with self._steps.guard("nondeterministic"):
            frame = self._frames.frame
            if frame is not None:
                found = global_rng_drawn(frame.f_locals.get("generator"))
                self._steps.emit([(anomaly, ("nondeterministic", "global_rng")) for anomaly in found])

    def _unregister(self) -> None:
        hooked, self._frames.frame = self._frames.frame, None  # (forget(), with no call: at every detach)
        self._rehook = False  # the next attach hooks the components as they are
        failed = None  # what the call left read; a failure of ours: recorded (raised if strict) once unhooked
        try:
            if self._steps.pending is not None:  # the last step still on its way to the host
                self._steps.flush()
            self._steps.check_unfinished_step()  # a call that raised between the denoiser and scheduler.step
            if (raised := sys.exc_info()[1]) is not None:  # detached as an exception propagates (a with, a finally)
                self._steps.check_raised_call(raised, hooked)  # a NaN/Inf input the pipeline raised on, unreceived
            self._steps.sample_call_memory()
            if self.sink.errors:  # recorded: the call they belong to has ended, no policy acts on them later
                self.sink.take_errors()
            if self._steps.localizer.made.pending:  # no method's frame (nor its locals) held past detach
                self._steps.localizer.made.settle(drop_running=True)
        except BaseException as error:  # (an interrupt too: raised as it is, the hooks removed first)
            failed = error
        removers, self._removers = self._removers, []
        try:
            self._steps.probes.drop_probes()
            self._steps.end_step()
            self._steps.run.last_row = None
        finally:
            ProbeHandle(removers).remove()  # the last added first, every one even when one fails
        if not self._parked.active:  # the modules held weakly until the next attach (components.detached)
            park(self._parked, self._components, self._held, self._steps, self._trees, self._dropped)
        if failed is not None:
            with self.sink.guard("detach"):
                raise failed

    def detach(self) -> None:
        """Remove every hook and wrapper this debugger added; idempotent; ``attach()`` watches again."""
        if self._handle is not None:  # (self.attached)
            super().detach()
            self.record.add_event("detach")

    def close(self) -> None:
        """Detach (if attached) and close ``events.jsonl``; idempotent and final.

        ``report()`` and ``report().save()`` still work afterwards (the events already streamed
        stay in the file; later ones are kept in memory only).  Leaving a ``with dbg:`` block
        only detaches, so the debugger can be entered again; call ``close()`` when done with it.
        """
        super().close()
        self._trees.keep_only(c.module for c in find_components(self.pipe))  # a component replaced: let go
        self._finalizer()

    def _is_busy(self) -> bool:
        """The debugger's own calls, and another pipeline's run of a shared component, go unseen."""
        # never traced: no hook of ours runs inside compiled code (probes.tracing.compiling(), inline:
        # dynamo makes is_dynamo_compiling() the constant True, so the flag is never read in a trace)
        if torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag:
            return False
        if self._steps.busy:
            return True
        if self._is_manager:  # a ComponentsManager is watched in every pipeline that calls its components
            return False
        # the pipeline's own call, found as PipelineFrame.runs_another_pipeline first looks (its frame,
        # kept, still on the stack: the same walk from the same frame), spelled inline at every hook;
        # a pipeline's __call__ above it (a sub-pipeline's, or another's that a callback calls) is read
        frames = self._frames
        frame = frames.frame
        if frame is not None:
            current, parts, inner, codes = sys._getframe(), frames.parts, False, origins.PIPELINE_CODE
            for _ in range(origins.MAX_DEPTH):
                if current is frame:
                    return frames.walk() if inner or frames.inside else False
                code = current.f_code
                if code.co_name == "__call__" and codes.get(code, True) and (id(current), code) not in parts:
                    inner = True
                current = current.f_back
                if current is None:
                    break
            self._steps.end_unseen_call(frame)  # not on this stack: its call ended unseen (raised), or runs on
        return frames.runs_another_pipeline()

    def _apply_policy(self) -> None:
        if errors := self.sink.take_errors():
            try:
                apply_policy(self.config, _PipelinePolicy(self), errors)
            except DiffusionDebugError as error:  # raised out of the call: what it held let go at the raise
                if self._steps.frames is not None and self._steps.frames.frame is not None:
                    modules = [c.module for c in self.components]
                    try:  # what the call left, for why(): tried apart, a failed save never skips the reset
                        left = states_left(modules)
                        self._steps.calls.raised_states = self._steps.calls.raised_states or left
                    except Exception as failure:
                        with contextlib.suppress(Exception):  # (strict would raise it: the raise goes first)
                            self._steps.guards.failed("raised_state", failure, None)
                    try:  # a reset that fails (a user's hook) never takes the policy's error's place
                        reset_as_a_call_ends(self.pipe, modules)  # as its end would
                    except Exception as failure:
                        with contextlib.suppress(Exception):
                            self._steps.guards.failed("cache_reset", failure, None)
                self._steps.end_raising_call(error)
                raise

    # -- public -----------------------------------------------------------------------------------
    def monitor_diffusion_step(self, step: int, latents: torch.Tensor, timestep: Any = None) -> dict[str, Any]:
        """Record one step of a custom denoising loop; returns the step row.

        Call it after ``scheduler.step`` with the new latents.  If the debugger is attached, the
        denoiser output and probe readings since the last step are included.

        When to use it: in a hand-written loop whose scheduler is not ``pipe.scheduler`` (or that
        never calls a scheduler), or to record latents without attaching.  While attached,
        ``pipe.scheduler.step`` records every step by itself: a call right after it (e.g. from
        ``callback_on_step_end``) records nothing more and returns the row already recorded.
        """
        check_monitor_arguments(step, latents)  # (pipe, step, latents): one TypeError
        if self.attached and (self._steps.pending is not None or self._run.last_row is not None):
            return self._steps.flush() or self._run.last_row  # scheduler.step just recorded this step
        parked = self._parked.active  # detached: the modules held again for the record's call
        if parked and not revive(self._parked):
            with self._steps.guard("component_replaced"):  # one gone: the pipeline's as they are now
                self._follow_replaced()
        try:
            return self._monitor_step(step, latents, timestep)
        finally:
            if parked:
                park(self._parked, self._components, self._held, self._steps, self._trees, self._dropped)

    def _monitor_step(self, step: int, latents: torch.Tensor, timestep: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"step": step}
        with self._steps.guard("monitor_diffusion_step"):
            if isinstance(timestep, numbers.Real):  # numpy's numbers too
                timestep = torch.tensor(float(timestep))
            timestep = timestep if isinstance(timestep, torch.Tensor) else None
            inputs = rows.StepInputs(timestep, latents, denoiser_output=None, batch=latents.shape[0])
            row = self._steps.record_step(int(step), self._run.with_outputs(inputs), now=True)
        self._apply_policy()
        return row

    def analyze_diffusion_pipeline(self, *misused: Any) -> dict[str, Any]:
        """Per component: class, parameters (total, trainable), dtype(s), device(s), bytes; the
        pipeline's ``total_parameters``; the scheduler's class and key config. Takes no argument
        (a pipeline passed is a TypeError naming the right call)."""
        check_no_pipeline_argument(misused)
        return analyze_pipeline(self.pipe)

    def get_summary(self) -> dict[str, Any]:
        """Counts and the first error, for a terminal or a log line (the name both debuggers share)."""
        steps, total = self._steps, self.analyze_diffusion_pipeline()["total_parameters"]
        steps.end_unseen_call(self._frames.frame, let_go=True)  # a call that raised while attached: its own
        steps.flush()
        return debug_summary(
            self.record, self.pipe, self.attached, steps.runs, steps.calls.runtime, steps.bundles, total
        )

    def get_debug_summary(self) -> dict[str, Any]:
        """The old name of :meth:`get_summary` (a DeprecationWarning, then the same dict)."""
        warnings.warn(
            "DiffusionModelDebugger.get_debug_summary() is now get_summary().", DeprecationWarning, stacklevel=2
        )
        return self.get_summary()

    def clear_debug_history(self) -> None:
        """Forget steps, anomalies, previews, timings, where overflows were localised and which
        components were read once with full probes (the files already written stay)."""
        steps = self._steps
        steps.pending, steps.schedule_set, steps.unread, steps.encoded = None, None, None, []  # (not yet read)
        self.record.clear()
        self.sink.clear()
        steps.previews.clear()
        steps.calls.runtime.clear()
        steps.bundles.clear()
        steps.calls.bundled_placement, steps.calls.raised_states = (), HeldStates()  # its registries hold the denoiser
        steps.calls.bundled_state = HeldStates()
        steps.call_memory.clear()
        steps.localizer.clear()
        steps.probes.reset()
        steps.probes.forget_reads()
        steps.new_run_state()

    def report(self) -> DebugReport:
        """The record so far, with components and previews, ready to ``save()``."""
        self._steps.end_unseen_call(self._frames.frame, let_go=True)  # a call that raised while attached: its own
        self._steps.flush()
        return build_report(
            self.record,
            self.pipe,
            self._components,
            runs=self._steps.runs,
            runtime=self._steps.calls.runtime,
            bundles=self._steps.bundles,
            files=self._steps.previews.files(),
            placement=self._steps.calls.bundled_placement,
            raised_states=functools.partial(_raised_states, weakref.ref(self._steps.calls)),
            began_states=functools.partial(_bundled_states, weakref.ref(self._steps.calls)),
        )


def _raised_states(calls: Callable[[], Any]) -> HeldStates:
    """The caches a call ended by policy ``raise`` left (``CallSites.raised_states``), while the
    debugger's call sites live: a report holds them through a weak reference (each state lives while its
    component does, the call sites' while their debugger does)."""
    held = calls()
    return HeldStates() if held is None else held.raised_states


def _bundled_states(calls: Callable[[], Any]) -> HeldStates:
    """The bundled call's hooks' state as it began (``CallSites.bundled_state``), held as :func:`_raised_states`."""
    held = calls()
    return HeldStates() if held is None else held.bundled_state


class _PipelinePolicy:
    """What ``core.POLICY_TABLE`` acts through for a pipeline (a :class:`~diffusion_debug.core.PolicyTarget`),
    kept off the user's debugger as training keeps it in ``StepPolicy``; made for each decision, so
    it holds the debugger no longer than that. It has no ``skip_step``: a pipeline has no optimizer
    step, so ``check_policy`` refuses policy ``skip`` when the debugger is created."""

    def __init__(self, debugger: DiffusionModelDebugger):
        self._debugger = debugger

    def save_run(self) -> Path:
        return self._debugger.report().save()

    def agree(self) -> None:
        return None  # one process

    def stop(self, anomaly: Anomaly) -> str | None:
        dbg = self._debugger
        if not patches.can_interrupt(dbg.pipe):
            return f" ({type(dbg.pipe).__name__} has no interrupt flag, so policy 'stop' raises)"
        dbg._removers.append(patches.AttributePatch(dbg.pipe, "_interrupt", True))  # detach restores it
        dbg.record.add_event("policy_stop", kind=anomaly.kind, step=anomaly.step)
        return None


def computed_in(components: list[Component], dtypes: dict[str, str | None], trees: TreeMemo) -> dict[str, str | None]:
    """Each component's dtype as its activations have it, which its probe level follows
    (:func:`~.components.component_probes.probe_levels`): ``dtypes`` (its parameters'), except where
    diffusers' layerwise casting stores the weights in fp8 and computes in another dtype (bf16:
    no overflow to watch, so no sentinel whose hooks would read bf16 block outputs it skips)."""
    computed, current = dict(dtypes), trees.current
    for c in components:
        values = current.get(id(c.module), {})  # (trees.get, with no call when kept: at every attach)
        if "layerwise_casting" in values:
            casting = values["layerwise_casting"]
        else:
            casting = values["layerwise_casting"] = layerwise_casting(c.module)
        if casting is not None and casting.get("compute_dtype"):
            computed[c.name] = casting["compute_dtype"]
    return computed
