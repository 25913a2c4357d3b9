"""A pipeline run as values, one hook event at a time: what the debugger's hooks and wrappers call, and what turns
each event into a recorded row and emitted anomalies.

A denoising step, from ``scheduler.step`` (its arguments parsed once: :func:`.pipeline_patches.read_scheduler_step`):
inputs (with the step's denoiser output and guidance batch) -> a copy of the latents for the preview (made into one at
the report) -> every statistic and probe reading in one transfer (``step_values.measure_step``) -> the row -> what the
step's readings call for, decided once (``checks.step_plan``: the components to check and the kept call a replay
takes; nothing on a clean step, which stops there with its latents' warnings at most) -> the step's findings in one
pass (``Localizer.step_findings``: each checked component's replays decided at once by ``replay.decide``, then run,
naming the module or, through ``origins``, the input, callback or code that made a NaN/Inf, within the step's kept
calls; then the latents' divergence) -> the sink, once per finding, and a repro bundle for the run's first error
-> whether the denoiser's sentinel reads the next step (``ComponentProbes.pace``: a NaN/Inf is found at every step's
output; a near-overflow may be warned some steps late).

A text encoder or VAE call goes the same way, on its own (:mod:`.call_events`, the half of the pipeline a component
call makes happen). Nothing here acts on the policy: the debugger does, after each event. Limits: the step index
counts ``scheduler.step`` calls since ``set_timesteps`` (Heun counts two a denoising step).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from operator import is_
from typing import Any, Callable, Iterator

import torch

from ..config import DebugConfig
from ..core import AnomalySink
from ..memory import memory_sample
from ..record import Anomaly, RunRecord
from . import checks, guidance, origins, setup_checks
from . import pipeline_patches as patches
from . import step_values as rows
from .blackouts import safety_blackout
from .call_events import CallEvents
from .components.call_memory import CallMemoryGrowth
from .components.call_sites import ANY_AUTOCAST, CallSiteHooks, ComponentProbes
from .components.inventory import Component, preview_decoder
from .components.step_end import CALLBACK, StepEndWatch
from .localize import Finding, Localizer
from .previews import Previews, decode_first_image
from .replay.bundle import save_anomaly_bundle
from .run_guard import RunGuards

logger = logging.getLogger("diffusion_debug")


class StepPipeline(CallEvents):
    """The per-run state and the per-event pipeline of one :class:`DiffusionModelDebugger`
    (the call sites' events are :class:`~.call_events.CallEvents`')."""

    def __init__(
        self, pipe: Any, components: list[Component], config: DebugConfig, record: RunRecord, sink: AnomalySink
    ):
        self.pipe, self.components, self.config = pipe, components, config
        self.record, self.sink = record, sink
        self.guards = RunGuards(sink, self)
        self.guard: Callable[[str], contextlib.AbstractContextManager[None]] = self.guards.__getitem__
        """The guard of ``where`` (:class:`~.run_guard.RunGuard`), found by the dict's own lookup; the paths every
        call takes use ``try`` and :meth:`~.run_guard.RunGuards.failed` (no Python call)."""
        self.denoiser = components[0] if components and components[0].role == "denoiser" else None
        self.experts = [c.name for c in components if c.role == "denoiser"]
        """Every denoiser-role component: a step is checked on the one that ran it (Wan 2.2's two experts)."""
        self.calls = CallSiteHooks(components, config, held_calls=rows.MAX_HELD_OUTPUTS)
        self._plans = {}
        self.encoded: list[tuple] = []  # the encoder calls held unread (CallEvents.hold_encoded)
        self.probes = ComponentProbes(config, on_error=self._probe_error)
        self.localizer = Localizer(
            {c.name: c.module for c in components},
            config,
            record,
            self.calls,
            guards=self.guards,
            quiet=self.quiet,
            levels=self.probes.levels,  # the same dict, updated at every attach
        )
        self.localizer.new_run(origins.RunInputs(pipe))
        self.previews = Previews(config.preview_vae_every)
        self.decoder = preview_decoder(components)
        """The component whose ``decode`` makes the VAE previews (the VAE role's), found once."""
        self.busy = False  # the debugger's own calls (replays, VAE previews) are not watched
        self.run = rows.RunState()
        self.pending: _Pending | None = None
        """The step whose values are still on their way to the host (read at the next step)."""
        self.schedule_set: rows.Schedule | None = None
        """What ``set_timesteps`` made, unread until the run's first step (:meth:`write_schedule`)."""
        self.runs = 0
        self.attached_at = 0
        """``runs`` as the debugger last attached: each later run of the attach checks its trees (follow_trees)."""
        self.follow_trees: Callable[[str | None], None] | None = None
        """The debugger's: components probed again where a tree or dtype changed since (``fuse_qkv_projections``)."""
        self.bundles: list[str] = []
        self.call_memory = CallMemoryGrowth(config.memory_growth_mb)
        self._static = setup_checks.StaticChecks(pipe, components)
        self.scheduler = getattr(pipe, "scheduler", None)
        """The scheduler whose steps are watched (``pipe.scheduler`` as last seen; None: none to follow)."""
        self.holder: Any = pipe  # whose .scheduler a step is read from (a ComponentsManager's: the debugger's)
        self.follow_scheduler: Callable[[Any], None] | None = None
        """``follow_scheduler(scheduler)``: the debugger watches ``scheduler``'s steps from now until
        it detaches (a ``pipe.scheduler`` replaced while attached, :meth:`scheduler_replaced`)."""
        self.held: Any = None
        """The debugger's :class:`~.components.held.HeldComponents` (its ``check`` read at every step)."""
        self.follow_components: Callable[..., None] | None = None
        """``follow_components(step, now=True, ahead=False)``: the debugger hooks the pipeline's components as now,
        where one was replaced while attached (asked as a step that ran no watched denoiser call is checked; ``now``
        False: from the VAE's call, hooked again as the call ends; ``ahead``: before any of their calls, step_end)."""
        self.on_errors: Callable[[], None] | None = None
        """Called as an event the policy acts after (a component call's output, ``scheduler.step``, ``encode_prompt``)
        ends with errors in the sink's queue (the debugger's policy); read in place, no Python call while empty."""
        self.inputs_call: int | None = None
        """The pipeline call (``frames.call``) whose arguments the run's inputs were taken from (None: none kept)."""
        self.frames: origins.PipelineFrame | None = None
        """The debugger's, whose ``frame`` (the pipeline call's) tells whether a step-end callback was passed."""
        self.step_end = StepEndWatch(pipe, self, lambda: self.follow_components(self.run.current_step, ahead=True))
        """Armed at each step of a call with a ``callback_on_step_end``: a component it replaced is hooked at the
        next module call (after the last step: before the VAE's decode)."""

    # -- plumbing -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def quiet(self, component: str) -> Iterator[None]:
        """The debugger's own call of ``component``: unseen by the hooks, forgotten by its probe."""
        busy, self.busy = self.busy, True  # one inside another: busy until the outer one ends
        try:
            yield
        finally:
            self.busy = busy
            self.probes.reset(component)

    def emit(self, findings: list[Finding], *, once: bool = False) -> None:
        """Hand each finding to the sink; the run's first error (not folded) gets a repro bundle. An anomaly
        found in a run carries the run's number (``details["run"]``): one step of two runs is two places."""
        for anomaly, key in findings:
            if self.runs and not once:
                anomaly.details.setdefault("run", self.runs)
            if self.sink.emit(anomaly, key, once=once) and anomaly.severity == "error":
                self._maybe_bundle(anomaly)
                self.localizer.made.remember(anomaly, self.localizer.inputs.passed)  # for a later call given it back

    def begin_run_if_needed(self, calling: str | None = None) -> None:
        """``calling``: the component whose call begins the run (its probe has begun measuring it). Its test (a
        run stepped, or none yet) is read first by the events that call it at every pipeline call (no call if none)."""
        if self.run.stepped or self.runs == 0:
            if self.pending is not None or self.encoded:  # the run before's last step (or encoder calls)
                self.flush()
            if self.runs and self.probes.reading_fully and self.probe_again and self.probes.fully_read():
                self.probe_again()  # no call end seen: before this run's first component call (or at its pre-hook)
            elif self.runs > self.attached_at and self.follow_trees is not None:
                self.follow_trees(calling)  # a later run of one attach: a tree, dtype or autocast changed: as now
            elif (ANY_AUTOCAST() or self.probes.autocast) and self.probe_again and self.probes.autocast_changed():
                self.probe_again()  # attached before the user's `with torch.autocast(...)`: probed as under it
            self.sample_call_memory()
            self.runs += 1
            frames, inputs = self.frames, self.localizer.inputs
            call = frames.call if frames is not None and frames.frame is not None else None
            same_call = call is not None and call == self.inputs_call and inputs.passed is not None
            if same_call:
                # a second run in one call (FreeInit denoises its latents again): the user's arguments as its first
                # run took them, not the frame's locals the loop reassigned since (its latents are not an input),
                # and whether its last step's latents were finite (the callback rule's: the next pass starts from them)
                ended = (self.runs - 1, self.run.step - 1) if self.run.stepped else None  # (run.step: the next)
                left = origins.latents_left(frames.frame)  # (what its last step-end callback left)
                kept = origins.RunInputs(self.pipe, inputs.passed, inputs.latents_finite, ended, left, inputs.dirtied)
                self.new_run_state(kept, same_call=True)
            else:
                self.new_run_state(origins.RunInputs.capture(self.pipe))
            self.inputs_call = call
            if self.probes.probes:  # what another pipeline sharing a component left queued
                self.probes.reset(but=calling)
            if not same_call:  # repeats fold within one pipeline call (FreeInit's passes: as one loop's steps)
                self.sink.new_window()
            self.record.add_event("run_start", flush=False, run=self.runs)  # with the first step's row

    def sample_call_memory(self) -> None:
        """The memory the last pipeline call left (as the next begins, at detach): ``memory_growth``."""
        if self.call_memory.sampled != self.runs:
            try:
                found = self.call_memory.after_call(self.runs, memory_sample())
                if found is not None:
                    self.emit([(found, None)])
            except Exception as error:
                self.guards.failed("memory_growth", error, self.run.step if self.run.stepped else None)

    def new_run_state(self, inputs: origins.RunInputs | None = None, *, same_call: bool = False) -> None:
        self.run = run = rows.RunState()
        # the global-RNG check's 5 KB copy, but for a run begun in a call given no generator of its own (none, or the
        # global one: determinism.global_rng_drawn flags it never, so nothing is copied or compared as it ends)
        passed = inputs.passed if inputs is not None else None  # (empty: begun outside a call, encode_prompt's)
        if not passed or ((given := passed.get("generator")) is not None and given is not torch.default_generator):
            run.rng_state = torch.default_generator.get_state()
        self.encoded = []  # (read before a run begins: forgotten only by clear_debug_history)
        self.calls.new_run()
        self.localizer.new_run(inputs or origins.RunInputs(self.pipe), same_call=same_call)  # inputs read when needed
        if self.probes.pace.paced:  # whether the run's step 0 and once-per-image calls are read by their sentinels
            self.probes.pace.at(0)

    def end_step(self) -> None:
        self.calls.drop_calls()
        self.run.end_step()
        if self.step_end.handle is not None:  # (a step, detach): armed only after a step's scheduler.step
            self.step_end.disarm()

    def use_components(self, components: list[Component]) -> None:
        """Watch ``components`` from now on (one replaced on the pipeline since the last attach, the scheduler too):
        what lives for the debugger's life (runtimes, runs, bundles) stays; each site's plan is made again from its
        role at its next call; the static checks read the components (the VAE) as they are now."""
        self.components = components
        self.denoiser = components[0] if components and components[0].role == "denoiser" else None
        self.experts = [c.name for c in components if c.role == "denoiser"]
        self.decoder = preview_decoder(components)
        self.calls.use_components(components)
        self.localizer.use_modules({c.name: c.module for c in components})
        self._plans.clear()
        self._static = setup_checks.StaticChecks(self.pipe, components)
        self.scheduler = getattr(self.pipe, "scheduler", None)

    # -- pipeline events ----------------------------------------------------------------------------
    def static_checks(self, dtypes: dict[str, str]) -> None:
        try:
            if found := self._static.findings(dtypes):  # an empty list handed on costs a call
                self.emit(found, once=True)
        except Exception as error:
            self.guards.failed("static_checks", error, self.run.step if self.run.stepped else None)

    def on_set_timesteps(self, args: tuple, kwargs: dict) -> None:
        run = self.run  # the guards' step is the one the run was at as the event began
        if self.encoded:  # the prompt's encoder calls, read as its schedule is set (before the denoiser runs)
            self.read_encoded()
        if self.follow_components is not None:  # a component replaced since the last call of this attach: hooked
            state, size, (dicts, keys, held) = self.held.check  # before its first call (pipe.unet = torch.compile(
            if state is not None and (len(state) != size or not all(map(is_, map(dict.get, dicts, keys), held))):
                self.follow_components(None, ahead=True)  # pipe.unet): our hooks on the original, traced, break it)
        try:
            if run.stepped or self.runs == 0:  # (begin_run_if_needed's test, read here: no call when none begins)
                self.begin_run_if_needed()
            if self.schedule_set is not None:  # set again before a step ran: the one before read now
                self.write_schedule(self.schedule_set.read(), None)
            steps, first, sigma0 = patches.read_set_timesteps(scheduler := self.holder.scheduler, args, kwargs)
            shape = getattr(getattr(scheduler, "__dict__", {}).get("timesteps"), "shape", None) or (0,)  # (no len())
            self.run.step, self.run.scheduled, self.run.last_step = 0, True, shape[0] - 1
            custom = kwargs.get("timesteps") is not None or kwargs.get("sigmas") is not None  # no spacing picked them
            last = None if custom else setup_checks.schedule_end(scheduler)
            self.schedule_set = rows.Schedule(steps, first, last, sigma0, custom)  # read with the first step
            self.run.mark = time.perf_counter()
        except Exception as error:
            self.guards.failed("set_timesteps", error, run.step if run.stepped else None)

    def on_encode_prompt(self, signature: Any, args: tuple, kwargs: dict) -> None:
        run = self.run
        in_callback = run.step_callback and self.ended_run != self.runs  # a swap in it: at the next step, its first
        state, size, (dicts, keys, held) = self.held.check  # an encoder replaced since the last call of this attach
        if state is not None and (len(state) != size or not all(map(is_, map(dict.get, dicts, keys), held))):
            self.follow_components(run.current_step if in_callback else None, ahead=True)  # (an IP-Adapter loaded)
        try:  # no run begins in a step's callback of the run's call (prompt switching: the loop's embeddings)
            if (run.stepped or self.runs == 0) and not in_callback:
                self.begin_run_if_needed()  # (its test read here: no call when none begins)
            if found := setup_checks.truncated_prompts(patches.prompt_texts(self.pipe, signature, args, kwargs)):
                self.emit(found)
        except Exception as error:
            self.guards.failed("prompt_truncated", error, run.step if run.stepped else None)
        if self.sink.errors and self.on_errors is not None:
            self.on_errors()

    def on_safety_checker(self, has_nsfw_concept: Any) -> None:
        try:
            if found := safety_blackout(has_nsfw_concept):
                self.emit([(anomaly, None) for anomaly in found])
        except Exception as error:
            self.guards.failed("safety_checker", error, self.run.step if self.run.stepped else None)

    def on_scheduler_step(self, args: tuple, kwargs: dict, output: Any, index_before: int | None, of=None) -> None:
        if of is not None and not self.copy_counts():  # a copy of the pipeline's scheduler stepped (SkyReels-V2 DF)
            return
        entered = self.run.step if self.run.stepped else None
        unseen, step = not self.run.denoiser_calls, self.run.step  # no watched denoiser call: one replaced?
        if self.denoiser is not None and self.follow_components is not None:
            # a component replaced in the callback (the VAE): the held check, inline (no Python call when unchanged)
            state, size, (dicts, keys, held) = self.held.check
            if unseen or (
                state is not None and (len(state) != size or not all(map(is_, map(dict.get, dicts, keys), held)))
            ):
                self.follow_components(step)  # before the step is checked: its denoiser output came from the new one
        try:
            # the step's denoiser outputs read with the call's arguments (RunState.with_outputs, no copy)
            inputs = patches.read_scheduler_step(
                self.holder.scheduler if of is None else of, args, kwargs, output, index_before, self.run.outputs
            )
            inputs = guidance.with_cfg_batch(inputs, self.denoiser, self.pipe)
            if self.calls.keep_calls and isinstance(inputs.sample, torch.Tensor):  # (Kandinsky 5 writes the step's
                try:  # output into the latents its kept calls were given; a clone that fails (a full GPU)
                    self.calls.keep_apart(inputs.sample)  # loses no row; inline: no Python call a step)
                except Exception as error:
                    self.guards.failed("keep_apart", error, entered)
            self.run.last_row = None
            self.record_step(step, inputs)
            run = self.run
            run.step = step + 1
            if run.step_callback is None:  # once a run, inline: f_locals is a C getter (components.step_end)
                frame = self.frames.frame if self.frames is not None else None
                local = frame.f_locals if frame is not None else {}
                run.step_callback = local.get(CALLBACK) is not None
                # Python 3.11's copy of the frame's locals (this step's latents): let go, unless a tracer (pdb) runs:
                # it writes it back after its callback, maybe at this step (``p self.scheduler.step(...)``: unbound)
                if type(local) is dict and sys.gettrace() is None:
                    local.clear()
            if run.step_callback:  # the user's callback runs next: what it replaces is hooked after it
                self.step_end.arm()
        except Exception as error:
            self.guards.failed("step", error, entered)
        if self.sink.errors and self.on_errors is not None:
            self.on_errors()

    def scheduler_replaced(self) -> None:
        """``pipe.scheduler`` replaced while attached, seen as the next denoiser call begins (a user's
        ``callback_on_step_end``, a pipeline that swaps schedulers between stages) or, swapped between two calls of one
        attach, as the next run's text encoder call begins (before the pipeline sets its timesteps, which are read as a
        new attach's would be): the new one's steps are recorded from there on, as the attached one's were (its
        ``step``, ``set_timesteps`` wrapped until detach), and the change is recorded (``component_replaced``)."""
        was, now = self.scheduler, self.pipe.scheduler
        self.scheduler = now
        with self.guard("component_replaced"):
            if now is not None and self.follow_scheduler is not None:
                self.follow_scheduler(now)
            names = [None if x is None else type(x).__name__ for x in (was, now)]
            change = dict(component="scheduler", change="replaced", was=names[0], now=names[1])
            self.record.add_event("component_replaced", step=self.run.current_step, while_attached=True, **change)
            logger.info("diffusion-debug: scheduler replaced while attached (%s -> %s)", *names)

    def record_step(self, step: int, inputs: rows.StepInputs, *, now: bool = False) -> dict[str, Any] | None:
        """Queue everything of one step for one transfer; record the row and emit what it shows now, or (deferred:
        policy ``record`` or ``warn``, not ``now``) when the next step is queued, so the loop never waits for the
        device. Returns the row recorded (None while deferred)."""
        run = self.run
        if self.encoded:  # encoder calls with no denoiser call since (a loop of the user's): read first
            self.read_encoded()
        run.stepped, run.monitored = True, run.monitored + 1
        if self.config.max_debug_iterations is not None and run.monitored > self.config.max_debug_iterations:
            self.probes.reset()
            self.end_step()
            return {"step": step, "skipped": "max_debug_iterations"}
        decoder, latents, vae = self.decoder, inputs.latents, getattr(self.decoder, "module", None)  # (None: no VAE)
        if self.config.previews:
            try:
                x0 = inputs.pred_original_sample
                self.previews.add_latents(step, x0 if x0 is not None else latents, vae)
            except Exception as error:
                self.guards.failed("previews", error, run.step)
        deferred = self.defer and not now
        schedule, self.schedule_set = self.schedule_set, None
        queued = rows.queue_step(inputs, self.probes.take_all(), deferred=deferred, schedule=schedule)
        mark = time.perf_counter()
        row = {"time_s": mark - run.mark, "denoiser_calls": run.denoiser_calls, "run": self.runs, "expert": run.expert}
        run.mark = mark
        if self.config.memory_tracking:
            try:  # the sample the step's last denoiser call ended with, else its own
                device = latents.device if isinstance(latents, torch.Tensor) else None
                row["memory"] = self.calls.take_denoiser_memory(device) or memory_sample(device)
            except Exception as error:
                self.guards.failed("memory", error, run.step)
        if self.previews.vae_every and self.previews.wants_vae(step, latents, vae):  # (never due: no call)
            with self.guard("vae_preview"), self.quiet(decoder.name):
                self.previews.add_vae(step, decode_first_image(vae, latents))
        pending = _Pending(step, inputs, queued, row, self.calls.take_calls(), run.makers)
        self.end_step()  # no activation or call argument is held across steps (but by the step read late)
        done = self.flush() if self.pending is not None else None
        if deferred:
            self.pending = pending
        else:
            done = self._finish(pending)
        if self.probes.pace.sampled and step != run.last_step:  # whether the denoiser's sentinel reads the next
            self.probes.pace.at(step + 1)  # step (its hooks in or out); after the schedule's last, none follows
        return done

    @property
    def defer(self) -> bool:
        """Whether steps are read a step late: not when the policy must act on the step itself, nor when a
        component runs diffusers' caching hooks. Their state moves on with every call and a replay cannot rewind
        it: a replay one step late would read the next step's cache (and PyramidAttentionBroadcast the next
        step's timestep), so those runs pay one sync a step."""
        return self.config.policy in ("record", "warn") and not self.calls.stateful

    def flush(self) -> dict[str, Any] | None:
        """Read, record and check the encoder calls held unread, then the step still on its way (if any); its row."""
        if self.encoded:
            self.read_encoded()
        pending, self.pending = self.pending, None
        row = self._finish(pending) if pending is not None else None
        if self.schedule_set is not None:  # set, and no step ran: read now
            schedule, self.schedule_set = self.schedule_set, None
            try:  # (a scheduler's init_noise_sigma that is no number: recorded, not raised into the user's call)
                self.write_schedule(schedule.read(), None)
            except Exception as error:
                self.guards.failed("set_timesteps", error, None)
        return row

    def _finish(self, pending: "_Pending") -> dict[str, Any] | None:
        entered = self.run.step if self.run.stepped else None
        try:
            values = rows.finish_step(pending.queued)
            extra, ready = pending.row, {}  # ready: the record's JSON copies of the row's dicts, made with them
            step, time_s, calls, runs = pending.step, extra["time_s"], extra["denoiser_calls"], extra["run"]
            row = rows.build_row(step, values, time_s=time_s, denoiser_calls=calls, run=runs, ready=ready)
            if "memory" in extra:  # (memory_sample's values: finite floats by its making)
                row["memory"], ready["memory"] = extra["memory"], {**extra["memory"]}
            if self.config.probes == "full":
                self.keep_readings(values.readings, pending.step)
            if values.schedule is not None:  # the run's first step: its schedule read with it
                self.write_schedule(values.schedule, values.scalars["timestep"])
            if len(self.experts) > 1 and extra["expert"] is not None:
                row["denoiser"] = extra["expert"]  # which expert ran the step
            self.record.add_step(row, ready=ready)
            if values.readings and self.probes.pace.sampled:  # a read step's: whether the next ones are read
                self.probes.pace.note(values.readings)
            # what the step's readings call for, decided once (nothing on a clean step: its latents' warnings at most)
            latents, finite = values.stats.get("latents"), values.output_finite  # (is_finite inline: at every step)
            bad = latents is not None and (latents.nan or latents.posinf or latents.neginf)
            # nothing read inside a compiled denoiser: its output's, in the row (past MAX_UNSTEPPED_CALLS calls
            # each was checked on its own, the row's last one too: CallEvents.check_call)
            if self.probes.compiled and finite and extra["denoiser_calls"] <= rows.MAX_UNSTEPPED_CALLS:
                output, fraction = values.stats.get("model_output"), self.config.overflow_fraction
                for stats in values.earlier if output is None else (*values.earlier, output):
                    if stats.dtype == "float16" and (stats.dtype_max_fraction or 0.0) >= fraction:
                        self.compiled_output_overflow(values, pending.makers, extra["expert"], pending.step)
                        break
            plan = None
            if values.readings or not finite or bad:  # (none probed, finite: nothing shows, no call)
                plan = checks.step_plan(
                    values.readings,
                    output_finite=finite,
                    latents_finite=not bad,
                    first_nonfinite_output=None if finite else values.first_nonfinite_output,
                    makers=pending.makers,
                    expert=extra["expert"],
                    denoiser=self.denoiser.name if self.denoiser else "",
                    fraction=self.config.overflow_fraction,
                )
            # the step's findings in one pass (the localizer's): a replay or bundle takes the plan's kept call
            localizer = self.localizer
            if plan is None:
                found = localizer.step_findings(pending.step, pending.inputs, values, None, self.run, self.holder)
                if found:
                    self.emit(found)
            else:
                with self.calls.calls_of(pending.calls, plan.maker, plan.back):
                    found = localizer.step_findings(pending.step, pending.inputs, values, plan, self.run, self.holder)
                    if found:
                        self.emit(found)
            self.run.last_row = row
            return row
        except Exception as error:
            self.guards.failed("step", error, entered)
            return None

    def write_schedule(self, schedule: rows.Schedule, ran: float | None) -> None:
        """``set_timesteps``' event and spacing rules, its values read with the run's first step (no sync at
        ``set_timesteps``; ``ran``: that step's timestep, None: none ran). A first step at another timestep than
        ``set_timesteps`` made was cut (img2img ``strength``) and starts partly denoised on purpose."""
        steps, first, self.run.init_noise_sigma = schedule.steps, schedule.first, schedule.init_noise_sigma
        event = dict(num_inference_steps=steps, first_timestep=first, init_noise_sigma=schedule.init_noise_sigma)
        self.record.add_event("set_timesteps", flush=False, **event)
        if schedule.custom or ran is None:
            return
        cut = first is None or abs(ran - first) > 1e-3
        first_ran, family = None if cut else ran, setup_checks.trained_family(self.pipe)
        checked = dict(num_inference_steps=steps, first_timestep=first_ran, last_timestep=schedule.last, family=family)
        for anomaly in setup_checks.scheduler_config(self.holder.scheduler, **checked):
            rule = anomaly.details.get("rule")
            if rule == "leading_spacing_few_steps":
                self.emit([(anomaly, ("scheduler_config", rule, steps))], once=True)
            elif rule == "steps_offset":
                self.emit([(anomaly, ("scheduler_config", rule))], once=True)

    def _maybe_bundle(self, anomaly: Anomaly) -> None:
        site = self.calls.site_for(anomaly.component, anomaly.module)
        if not self.config.repro_bundle or self.bundles or site is None:
            return
        with self.guard("repro_bundle"):
            args, kwargs = self.calls.kept_call(site)
            module = next(c.module for c in self.components if c.name == anomaly.component)
            kept = dict(call_prefix=site.prefix, component_module=module, args=args, kwargs=kwargs)
            kept.update(overflow_fraction=self.config.overflow_fraction)  # a replay names the maker the run did
            kept.update(self.calls.bundle_context(site, module))  # a caching hook's context, a guider's hooks
            self.bundles.append(str(save_anomaly_bundle(self.record, anomaly, **kept)))


@dataclass
class _Pending:
    """A step queued and not yet read: what its row and checks need a step later."""

    step: int
    inputs: rows.StepInputs
    queued: rows.QueuedStep
    row: dict[str, Any]  # time_s, denoiser_calls, run, expert and memory, taken when the step was queued
    calls: tuple[dict, dict, dict]  # the step's kept calls (for a localising replay)
    makers: list[str | None]  # the component that made each of the step's denoiser outputs (RunState.makers)
