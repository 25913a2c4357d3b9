"""A component call as the call sites' hooks see it (the half of :class:`~.steps.StepPipeline`
that one call makes happen): its site's plan, read once from its role; a text encoder or VAE call
checked on its own (its output and probe readings in one transfer, then what they show); a
denoiser call held for the step that follows (:mod:`.step_values`); past
:data:`~.step_values.MAX_UNSTEPPED_CALLS` denoiser calls with no scheduler step, each further one
checked on its own (at the run's step where one is known: :attr:`~.step_values.RunState.call_step`).
An encoder's NaN/Inf that may lie only in hidden states the pipeline skips (SDXL reads CLIP's
``hidden_states[-2]``) is held until the loop's calls show whether they were given it
(:meth:`CallEvents.hold_unread`): the error at its module, or a warning naming it.

Apart from ``steps`` because the per-step pipeline (a step queued, read a step late, its findings)
is the other half: both run on the same per-run state, which :class:`~.steps.StepPipeline` owns.
Long because a call's events, from its start to its output, an encoder's held findings and the
calls that end early (a step whose ``scheduler.step`` never returned, a pipeline call that raised
before any component received its NaN/Inf input, one that raised and was caught while attached,
seen ended at the next event of ours: :meth:`CallEvents.end_unseen_call`) read and settle that one state;
so does which deep copy of the scheduler a run's steps are, where the pipeline steps only copies
(:meth:`CallEvents.copy_counts`).
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass
from operator import itemgetter
from threading import get_ident
from typing import Any, Callable

import torch

from ..probes import ModuleReading, readings_by_call
from ..probes.fused import FUSED_DTYPES, _absmaxes
from ..record import Anomaly, rebuilt
from ..stats import (
    absmax_on_device,
    detached,
    dtype_name,
    measurable,
    plain_tensor,
    read_now,
    scalars_to_host,
    to_host,
)
from . import checks, origins
from . import step_values as rows
from .components.call_sites import CallSite
from .components.computes_in import autocast_over, computes_in
from .components.inventory import call_phase, is_loop_role
from .components.roles import role
from .replay.decide import replayed_how

_OUTPUT_MAX = {torch.float16: float(torch.finfo(torch.float16).max)}
"""The output dtypes whose near-overflow a text encoder or VAE call's output check flags."""
_FIRST_FIVE = itemgetter(slice(5))  # a ModuleReading's fields kept in modules.jsonl, module to output value
# Past MAX_UNSTEPPED_CALLS denoiser calls with no scheduler step each call is checked alone (RunState.call_step).
MAX_ENCODED = 8
"""Encoder calls held unread (:meth:`CallEvents.read_encoded`) past which they are read at once: a
loop of ``encode_prompt`` calls with no other call between holds no more than this."""
OUTPUT_CHECK = "output check (the call's output; no probe reading named a module)"
COMPILED_OUTPUT = "output check (a compiled component: nothing inside it is read)"
OUTPUT_REPLAYED = replayed_how("output check")
EARLIER_REPLAY = replayed_how("output check", earlier=True)
"""How a near-overflow output is found (:meth:`CallEvents.output_overflow`): a compiled component's apart; an eager
one's named by a replay, or by the same debugger's earlier replay of it (its replay memory: once per debugger)."""
UNSTEPPED_NOTE = "no scheduler.step seen between denoiser calls; each call is checked on its own"


@dataclass(frozen=True)
class SitePlan:
    """What the hooks do with one call site's calls, read from its role at its first call: ``check``
    is ``"own"`` (a VAE call, checked on its own), ``"encoder"`` (a text or image encoder call,
    checked on its own with the encoder calls after it: :meth:`CallEvents.read_encoded`), ``"step"``
    (a denoiser call, measured with the step that follows) or ``"none"`` (a ControlNet or adapter with
    a denoiser: measured with the step, before the denoiser); ``where``: the guard of its output's check."""

    begins_run: bool
    in_loop: bool
    check: str
    where: str
    phase: str


class CallEvents:
    """The call sites' events of a :class:`~.steps.StepPipeline` (its base: every attribute read
    here is the pipeline's)."""

    _plans: dict[tuple[str, str], SitePlan]
    """By ``(component, prefix)``: made at a site's first call, made again when a component is replaced."""
    unread: list[tuple] | None = None
    """Encoder calls whose NaN/Inf may lie only in hidden states the pipeline does not pass on, their
    findings held until the loop's calls show whether they were given them (:meth:`hold_unread`);
    None while none is held (an instance's list while one is)."""
    unread_finite: bool = False
    """A call of the loop was given finite values since :attr:`unread` was held."""
    ended_run: int = 0
    """The last run whose call ended (returned, or raised: :meth:`check_raised_call`)."""
    ended_unseen: int = 0
    """The last run :meth:`end_unseen_call` ended: its call's, whose exception a detach may still see."""
    raised_error: Any = None
    """A weak reference to the error the debugger's policy raised out of the call (:meth:`end_raising_call`)."""
    copy_clock: Any = None
    """The run whose steps are its scheduler's copies' (:meth:`copy_counts`), None before one is."""
    probe_again: Callable[[], None] | None = None
    """The debugger's: its components probed again as a later attach would (a first call's full read done), asked
    as a run begins where no pipeline call end (``maybe_free_model_hooks``) did (Modular Diffusers)."""

    def copy_counts(self) -> bool:
        """Whether a deep copy of the pipeline's scheduler, stepped in the watched call, takes the
        run's step (``StepPipeline.on_scheduler_step`` with ``of``): SkyReels-V2's diffusion forcing
        steps a copy per latent frame and never its own, so the first copy stepped after the
        denoiser's calls is the step (a row per denoising round, measured on that frame's copy; the
        other frames' steps are not measured). Where the pipeline's own scheduler has stepped in the
        run (LTX-2 steps its audio's copy beside it), a copy never counts: a step counted once."""
        run, frames = self.run, self.frames
        if not run.denoiser_calls or frames is None or frames.frame is None:
            return False  # a second copy in the round, or a copy stepped outside the pipeline's call
        if run.stepped and self.copy_clock is not run:
            return False  # the run's steps are its own scheduler's
        self.copy_clock = run
        return True

    def _new_plan(self, site: CallSite) -> SitePlan:
        in_loop, stepped = is_loop_role(site.role), self.denoiser is not None
        check = ("step" if site.role == "denoiser" else "none") if in_loop and stepped else "own"
        begins_run = role(site.role).begins_run  # an encoder, read with the encoder calls after it where no
        if begins_run and check == "own" and self.config.policy in ("record", "warn"):  # policy acts on it alone
            check = "encoder"
        where = "denoiser_output" if check == "step" else f"{site.component}_output"
        plan = SitePlan(begins_run, in_loop, check, where, call_phase(site.role, site.prefix))
        self._plans[site.component, site.prefix] = plan
        return plan

    def on_call_start(self, site: CallSite, args: tuple = (), kwargs: dict | None = None) -> None:
        plan = self._plans.get((site.component, site.prefix)) or self._new_plan(site)
        if self.encoded and plan.check != "encoder":  # the encoder calls before it, read before it runs on them
            self.read_encoded()
        if self.unread is not None and plan.in_loop:  # held encoder findings: what the loop is given decides
            self.settle_unread((args, kwargs))
            if self.sink.errors and self.on_errors is not None:  # the policy acts before the call runs
                self.on_errors()
        if plan.begins_run:  # encoding a prompt or an image begins a run, but in a step's callback of the run's call
            run = self.run  # (a prompt switched there is the loop's: steps.StepPipeline.on_encode_prompt)
            if (run.stepped or self.runs == 0) and not (run.step_callback and self.ended_run != self.runs):
                self.begin_run_if_needed(calling=site.component)  # (its test read here: no call when none begins)
            if self.scheduler is not None and self.pipe.scheduler is not self.scheduler:
                self.scheduler_replaced()  # swapped between two calls of one attach: before its set_timesteps
        elif not plan.in_loop:
            if plan.phase == "encode" and (self.runs == 0 or (self.run.stepped and self.ended_run == self.runs)):
                # a VAE's encode as a call's first event (Marigold keeps its prompt's embedding) begins its run:
                # a NaN/Inf it makes is the run's origin, not forgotten when the schedule is set
                self.begin_run_if_needed(calling=site.component)
            if self.step_end.handle is not None and self.step_end.thread == get_ident():
                # no module call since the last step (a VAE whose decode is compiled, watched around it):
                # its global pre-hook off before dynamo sees it (a guard on it: a recompile when it is gone)
                self.step_end.disarm()
            if self.pending is not None:  # the VAE after the loop: its last step is read first
                self.flush()
            if self.run.outputs and self.denoiser is not None and not self.run.unstepped:
                with self.guard("unstepped_outputs"):  # denoiser calls no step of the watched scheduler followed
                    self.check_held(every=True)
            if self.scheduler is not None and self.pipe.scheduler is not self.scheduler:  # attribute reads
                self.scheduler_replaced()  # swapped with the denoiser in one callback: no hook of ours ran since
                if self.denoiser is not None and self.follow_components is not None:
                    self.follow_components(self.run.current_step, now=False)  # hooked again as the call ends
        elif self.scheduler is not None and self.pipe.scheduler is not self.scheduler:  # attribute reads, no call
            self.scheduler_replaced()  # swapped inside the call: its next step is this call's

    def on_call_output(self, site: CallSite, output: Any, tensor: torch.Tensor | None) -> None:
        if tensor is not None and type(tensor) is not torch.Tensor:  # a compiled GGUF model's GGUFParameter
            tensor = plain_tensor(tensor)
        plan = self._plans.get((site.component, site.prefix)) or self._new_plan(site)
        # plan.check "none": a ControlNet or adapter, its readings measured with the step, before the denoiser's
        if plan.check != "none":
            try:
                if plan.check == "encoder":  # read with the encoder calls after it, before any other call
                    step = self.run.step - 1 if self.run.stepped else None
                    self.hold_encoded(site, plan, tensor, step, getattr(output, "hidden_states", None))
                    # no call whose loop may read it runs (pipe.encode_prompt, vae.encode alone; a modular
                    # pipeline of encoder blocks alone, a ComponentsManager's encoder called so): read now
                    frames = self.frames
                    if frames is not None and frames.frame is None:
                        self.read_encoded()
                    elif (frames is None or frames.modular) and not origins.loop_may_follow(frames):
                        self.read_encoded()
                elif plan.check == "own":  # a VAE call (or an encoder's where the policy acts on it): on its own
                    # a decode, or any call after the schedule's last step (UniDiffuser's captions): no step's
                    run = self.run
                    after = plan.phase == "decode" or (run.last_step is not None and -1 < run.last_step < run.step)
                    step = run.step - 1 if run.stepped and not after else None
                    hidden = getattr(output, "hidden_states", None) if plan.begins_run else None
                    self.check_call(site, tensor, step, plan.phase, hidden=hidden)
                else:
                    self.run.add_output(tensor, site.component)  # a denoiser's: measured with the step that follows
                    self.run.expert = site.component
                    if self.run.unstepped:  # no step follows (direct calls, a replaced scheduler)
                        if self.run.note_unstepped():
                            calls, note = self.run.denoiser_calls, UNSTEPPED_NOTE
                            self.record.add_event(
                                "unstepped_denoiser_calls", component=site.component, calls=calls, note=note
                            )
                        if self.run.denoiser_calls == rows.MAX_HELD_OUTPUTS:  # the first on its own: those before too
                            self.check_held()
                        self.check_call(site, tensor, self.run.call_step, "denoise (no scheduler step)")
                        del self.run.outputs[:-1], self.run.makers[:-1]  # checked each on its own: the last for a row
            except Exception as error:
                self.guards.failed(plan.where, error, self.run.step if self.run.stepped else None)
        if self.sink.errors and self.on_errors is not None:  # the policy acts as the event ends
            self.on_errors()

    def _probe_error(self, where: str, error: Exception) -> None:
        """A probe's failure: recorded (read at take), or with ``strict`` recorded once, marked and
        then raised from the probe's hook, at the step in progress as an OOM there would be (an OOM
        in it is no OOM of the component's)."""
        if self.config.strict:
            self.sink.raised(where, error, step=self.run.step)
        else:
            self.sink.debugger_error(where, error, step=self.run.current_step)

    def check_held(self, every: bool = False) -> None:
        """The step's denoiser outputs held before its first call checked on its own (past
        :data:`~.step_values.MAX_UNSTEPPED_CALLS`), let go next: the first non-finite one is checked
        on its own, on its kept call (a replay names the module that made it), not let go unchecked
        to be blamed on the code that passed it on. ``every``: the last one too, and the step's calls
        let go after, as a VAE call begins with denoiser calls that no ``scheduler.step`` of the
        watched scheduler followed (a loop stepping schedulers the debugger does not see; SkyReels-V2's
        diffusion forcing steps deep copies of it, which :meth:`copy_counts` takes as its steps)."""
        run = self.run
        outputs = run.outputs if every else run.outputs[:-1]  # tensors (add_output holds no None)
        makers, expert = run.makers, run.expert
        if every:
            run.end_step()
        if not outputs:
            return
        device = outputs[0].device  # one read for all of them, once in a step that makes more calls
        finite = torch.stack([output.isfinite().all().to(device) for output in outputs]).tolist()
        latest = len(outputs) - every  # the index of the step's latest call, from which ``back`` counts
        for index, output in enumerate(outputs):
            if not finite[index]:
                expert, back = checks.made_by(makers, latest - index, expert)
                site = next(s for s in self.calls.sites if s.component == expert and s.prefix == "")
                calls = self.calls  # copies: its check drops its kept call, not this call's
                with calls.calls_of((dict(calls.kept), dict(calls.contexts), dict(calls.earlier)), expert, back):
                    self.check_call(site, output, self.run.call_step, "denoise (no scheduler step)")
                return

    def check_unfinished_step(self) -> None:
        """The step whose denoiser ran but whose ``scheduler.step`` never returned (the call raised
        in between: text diffusion's sampling raises on a NaN logit): its last denoiser output is
        checked on its own, at that step, while the hooks are still there (at detach); and the
        encoder calls still unread (a call that encoded and then raised), and their findings still
        held (:meth:`settle_unread`: no call of the loop showed what it was given)."""
        if self.encoded:
            self.read_encoded()
        if self.unread is not None:
            self.settle_unread(None)
        if self.denoiser is None or not self.run.outputs or self.run.unstepped:
            return  # no step in progress, or its calls were each checked already
        with self.guard("unfinished_step"):
            component = self.run.expert or self.denoiser.name
            site = next(s for s in self.calls.sites if s.component == component and s.prefix == "")
            self.check_call(site, self.run.outputs[-1], self.run.step, "denoise (scheduler.step did not return)")

    def check_raised_call(self, error: BaseException, hooked: Any) -> None:
        """A call of the pipeline that raised ``error`` (asked at detach while it propagates): a NaN/Inf
        the user passed and no component received is the error (:func:`~.origins.raised_origin`)
        where the call's run found no origin. ``hooked``: the frame our hooks kept; a run begun in
        that call took its inputs as it began, else the call's are read from its frame in the
        traceback, in a run of its own. Either way its run is over: the next call begins one."""
        with self.guard("raised_call"):  # (the traceback's frames read inside it too: nothing of ours escapes)
            frame = origins.raised_call_frame(self.pipe, error.__traceback__)
            if frame is None:  # not this pipeline's call (the user's code after it, another pipeline's)
                return
            # a run began in this call (ended unseen by a report() its handler asked, or at our policy's raise)
            ours = self.raised_error() if self.raised_error is not None else None  # (its frame let go at the raise)
            hooked = hooked or (frame if ours is error else None)
            own = hooked is frame and (self.runs != self.ended_run or self.ended_unseen == self.runs)
            if not own:
                self.run.stepped = True  # (begin_run_if_needed's test)
                self.begin_run_if_needed()
            if self.localizer.origin is None:
                inputs = self.localizer.inputs
                if not own or inputs.passed is None:
                    inputs = origins.RunInputs(self.pipe, origins.pipeline_inputs(self.pipe, frame))
                if names := inputs.nonfinite():
                    anomaly = origins.raised_origin(names, self.pipe, error, step=self.run.current_step)
                    self.emit([(self.localizer.settle(anomaly), ("nonfinite", "input", names[0]))])
        self.ended_run = self.runs
        self.run.stepped = True  # (begin_run_if_needed's test: the next call's first event begins a run)

    def end_unseen_call(self, frame: Any, let_go: bool = False) -> None:
        """The pipeline call whose ``__call__`` frame the busy check kept (``frame``), where it ended
        with no call end of ours (asked by the next event of ours, or ``report()``, where that frame is
        not on the stack): it raised and the user caught it (diffusers' ``maybe_free_model_hooks``,
        its call end, is never reached), or its pipeline has none (Modular Diffusers). It is ended
        as a call end would: its encoder calls still unread read, its held findings settled as its
        own (:meth:`settle_unread`), no policy acting on them (its exception went on unchanged), its
        run over. A frame on some thread's stack (asked from a worker thread's hook) still runs.
        ``let_go`` (``report()``, ``get_summary()``): an ended call's frame is let go too, with its
        locals (the call's latents and embeddings: a user's ``except`` that drops them frees them);
        a hook's busy check lets it go itself, and a detach does. A ComponentsManager keeps no frame: there
        ``report()`` asked while no pipeline call runs settles what is held (its run goes on)."""
        if frame is None:  # a ComponentsManager's (none kept) asked by report(): no pipeline call runs, none held
            if let_go and self.frames is None and self.unread is not None and not _pipeline_call_runs():
                self.settle_ended()  # (its runs are not split: no call of its pipelines is seen ending)
            return
        if self.unread is None and not self.encoded and self.run.stepped:  # nothing of the call's held, its run over
            if let_go and not origins.running(frame):
                self.forget(frame)
            return
        try:
            if origins.running(frame):
                return
        except Exception as error:
            self.guards.failed("raised_call", error, None)
        self.settle_ended()
        self.ended_run = self.ended_unseen = self.runs
        self.run.stepped = True  # (begin_run_if_needed's test: the next call's first event begins a run)
        if let_go:
            self.forget(frame)

    def end_raising_call(self, error: BaseException) -> None:
        """The debugger's policy raises out of the pipeline's call: the call ends at the raise, as
        :meth:`end_unseen_call` ends one that raised, and a NaN/Inf maker's frame and the kept frame are let go
        with their locals (the call's latents and images: a user's ``except`` inside ``with dbg:`` frees them),
        not held until the next event of ours, a look-up or detach; ``error`` (what it raises) is held weakly."""
        try:
            self.localizer.made.settle(raising=True)
            frames = self.frames
            if frames is None or frames.frame is None:
                return
            self.settle_ended()
            self.ended_run = self.ended_unseen = self.runs
            self.run.stepped = True  # (begin_run_if_needed's test: the next call's first event begins a run)
            self.raised_error, frames.frame = weakref.ref(error), None  # (the detach that sees it knows the call)
        except Exception as failure:
            self.guards.failed("raised_call", failure, None)

    def settle_ended(self) -> None:
        """What an ended call held settled as its own (:meth:`end_unseen_call`): its encoder calls read, its
        held findings emitted, no policy acting on them."""
        try:
            if self.encoded:
                self.read_encoded()
            if self.unread is not None:
                self.settle_unread(None)
            if self.sink.errors:  # recorded: the call they belong to has ended, no policy acts on them in a later one
                self.sink.take_errors()
        except Exception as error:
            self.guards.failed("raised_call", error, None)

    def forget(self, frame: Any) -> None:
        """The ended call's ``frame`` no longer kept by the busy check (:class:`~.origins.PipelineFrame`),
        unless the exception being handled holds it (a handler asking ``report()``, which may raise it on:
        the detach that sees it finds the call by that frame, :meth:`check_raised_call`); it costs nothing
        then, and the next event of ours, or ``report()``, lets it go once the handler has ended."""
        if self.frames is None or self.frames.frame is not frame:
            return
        error = sys.exc_info()[1]
        trace = error.__traceback__ if error is not None else None
        while trace is not None:
            if trace.tb_frame is frame:
                return
            trace = trace.tb_next
        self.frames.forget()

    # -- encoder calls, read together ---------------------------------------------------------------
    def hold_encoded(
        self, site: CallSite, plan: SitePlan, tensor: torch.Tensor | None, step: int | None, hidden: Any = None
    ) -> None:
        """An encoder call held unread: its output's abs-max held with its sentinel's block outputs
        (:meth:`~diffusion_debug.probes.Probe.hold`; without a probe, the output held, reduced with the
        other unprobed calls' outputs when read: one ``_foreach_norm`` for the prompt's and the negative
        prompt's, where each had its own ``linalg_vector_norm``), its kept call
        taken from the call sites' (a replay of it, or a repro bundle, is made from it when read).
        The calls of a prompt's encoding (the prompt and the negative prompt under CFG; SDXL's two
        encoders) are read together by :meth:`read_encoded`: one reduction a probe and one host read
        for all, before any other component's call begins (a NaN/Inf is still found before the
        denoiser runs on it). The findings are each call's, at its step, as read one by one. An encoder
        called outside a pipeline call (``pipe.encode_prompt(...)`` or ``vae.encode`` alone: the busy
        check kept no ``__call__`` frame) is read as its call ends, its findings there at once (a CFG
        ``encode_prompt`` alone so reads twice, where a pipeline call reads both calls in one).

        Limit: an output the pipeline changes in place before the read (Cosmos zeroes the padding of
        its T5 output) is read as changed (its abs-max taken then, with the others), not as the call
        returned it; a held block output so changed reads 0, as a sentinel's does (:mod:`~..probes.fused`).
        ``hidden``: the output's ``hidden_states`` (read only if the call shows a NaN/Inf: :meth:`hold_unread`)."""
        pace = self.probes.pace  # a run its sentinel does not read: checked at its output alone, as unprobed
        out = site.component in pace.once_out
        own = self.probes.probes.get(site.component) if tensor is not None and not out else None  # (no call unprobed)
        slot = own.hold(tensor) if own is not None else None
        # no slot: its abs-max is taken when read, with the other calls' (an empty or meta output has none)
        scalar = slot is None and tensor is not None and measurable(tensor)
        version = tensor._version if slot is not None and not tensor.is_inference() else None
        key, calls = (site.component, site.prefix), self.calls
        call, context = calls.kept.pop(key, None), calls.contexts.pop(key, None)
        calls.earlier.pop(key, None)
        mark = own.pending if own is not None else None if out else 0  # where its readings end among its probe's
        self.encoded.append((site, plan, tensor, slot, scalar, version, mark, step, call, context, hidden))
        if len(self.encoded) >= MAX_ENCODED:
            self.read_encoded()

    def read_encoded(self) -> None:
        """The encoder calls held unread (:meth:`hold_encoded`), each checked on its own as
        :meth:`check_call` checks a call, from one take of each probe and one host read for all."""
        encoded, self.encoded = self.encoded, []
        parts: dict[str, tuple[int, int, Callable | None]] = {}  # component -> its values' place, its readings
        by_call: dict[str, list[list[ModuleReading]]] = {}
        places: list[int | None] = []  # each call's own abs-max (none held, or changed since): its place in values
        values: list[torch.Tensor] = []
        try:
            for site, _, _, _, _, _, mark, *_ in encoded:  # (mark None: held with its sentinel out, nothing to take)
                if site.component not in parts and mark is not None:
                    probe = self.probes.take(site.component)
                    if probe is None:
                        parts[site.component] = (len(values), 0, None)
                    else:
                        parts[site.component] = (len(values), len(probe[1]), probe[2])
                        values += probe[1]
            outputs: list[torch.Tensor] = []  # the outputs whose abs-max is taken now, reduced together
            for _, _, tensor, slot, scalar, version, *_ in encoded:
                if version is not None and tensor._version != version:  # changed in place since: read as it is
                    scalar = measurable(tensor)
                places.append(len(values) + len(outputs) if scalar else None)
                if scalar:
                    outputs.append(tensor)
            if outputs:
                values += _output_absmaxes(outputs)
            host = _host_rows(values)
            for component, (first, size, readings) in parts.items():
                if readings is not None:
                    marks, prefixes = [], []  # where each of its calls' readings end; its call site
                    for site, _, _, _, _, _, mark, *_ in encoded:
                        if site.component == component:  # (a call held with its sentinel out: none of its own)
                            marks.append(mark if mark is not None else marks[-1] if marks else 0)
                            prefixes.append(site.prefix)
                    got = readings(host[first : first + size])
                    by_call[component] = readings_by_call(got, _site_read_last(got, marks, prefixes))
        except Exception as error:  # recorded; the calls go unchecked rather than the run broken
            self.guards.failed(encoded[0][1].where, error, encoded[0][7])
            return
        for (site, plan, tensor, slot, _, _, _, step, call, context, hidden), place in zip(encoded, places):
            try:
                absmax = None
                if place is not None:
                    absmax = host[place][0] if host[place] else math.nan
                elif slot is not None:
                    first, size, _ = parts[site.component]
                    absmax = math.nan  # (never: the slot is among the flushed values) not read as finite
                    for row in host[first : first + size]:  # the flushed values joined
                        if slot < len(row):
                            absmax = row[slot]
                            break
                        slot -= len(row)
                key = (site.component, site.prefix)  # its kept call back, for a replay or a repro bundle
                if call is not None:
                    self.calls.kept[key] = call
                if context is not None:
                    self.calls.contexts[key] = context
                found = by_call.get(site.component)
                values = rows.CallValues(found.pop(0) if found else [], absmax)
                self.check_call(site, tensor, step, plan.phase, values, hidden)  # (which drops the kept call)
            except Exception as error:
                self.guards.failed(plan.where, error, step)
                self.calls.drop_call(site.component, site.prefix)

    # -- hidden states the pipeline may not read ---------------------------------------------------
    def hold_unread(self, site: CallSite, found: list, hidden: Any, output_finite: bool, step: int | None) -> bool:
        """Whether the NaN/Inf an encoder call made (``found``: its findings) may lie only in hidden
        states the pipeline does not pass on, its ``nonfinite`` findings then held (with the kept
        call, for a repro bundle) until :meth:`settle_unread`. SDXL reads its CLIP encoders'
        ``hidden_states[-2]`` and HunyuanVideo skips its Llama's last two layers, so a NaN/Inf made
        in a last layer (the output this call is judged on) changes nothing when the earlier
        layers' states are finite; which one the pipeline takes is not known at the call. Held when
        some hidden state is finite and one is not (or the output is not); never for a NaN/Inf the
        call was given (its origin is elsewhere). One host read, on a call that shows a NaN/Inf."""
        made = [finding for finding in found if finding[0].kind == "nonfinite"]
        if not made or any(a.component != site.component or a.details.get("passed_on") for a, _ in made):
            return False
        # no call whose loop may read it runs (pipe.encode_prompt alone, a modular pipeline of text encoder
        # blocks): its caller takes what it returned
        if not origins.loop_may_follow(self.frames):
            return False
        states = [h for h in hidden if isinstance(h, torch.Tensor)] if isinstance(hidden, (tuple, list)) else []
        states = [h for h in states if h.is_floating_point() and h.numel()]
        if len(states) < 2:
            return False
        try:
            device = states[0].device
            finite = torch.stack([h.isfinite().all().to(device) for h in states]).tolist()
        except Exception as error:  # recorded; the findings go out as they were made
            self.guards.failed("unread_output", error, step)
            return False
        if not any(finite) or (all(finite) and output_finite):
            return False
        key = (site.component, site.prefix)
        held = (self.runs, site, made, self.calls.kept.get(key), self.calls.contexts.get(key))
        if self.runs:  # the run it was made in, wherever it is settled
            for anomaly, _ in made:
                anomaly.details.setdefault("run", self.runs)
        if self.unread is not None and self.unread[0][0] != self.runs:  # an earlier run's: settled first
            self.settle_unread(None)
        if self.unread is None:
            self.unread = []
        self.unread.append(held)
        return True

    def settle_unread(self, given: tuple | None) -> None:
        """The held encoder findings (:meth:`hold_unread`) emitted, or held on: ``given`` is what a
        call of the loop (the denoiser, a ControlNet) is passed, ``(args, kwargs)``. Non-finite: the
        findings as they were made (the error at the encoder's module, before that call runs; the
        loop's NaN/Inf points at it). Finite: held on through the first step (its unconditional
        pass may be given the negative prompt's states), then a warning that names the module, its
        NaN/Inf in states the pipeline did not pass on. ``given`` None (the pipeline's call ended,
        or the debugger detached) or a later run's call: a warning if a call of the loop was given
        finite values, else whether they were used is not known, and the findings stay what they
        were made (an encode-only call that returns them keeps its error)."""
        held = self.unread
        if given is not None and held and held[0][0] == self.runs:
            if self.unread_finite and self.run.stepped:  # the first step's calls were given finite values:
                used = False  # a NaN/Inf given now is the loop's own (its latents), not the encoder's
            elif origins.is_nonfinite(given):
                used = True
            else:
                self.unread_finite = True
                if not self.run.stepped:  # the first step's other calls still to come
                    return
                used = False
        else:
            used = False if self.unread_finite else None
        self.unread, self.unread_finite = None, False
        for _, site, made, call, context in held or ():
            try:
                if used is False:
                    findings = [(_unread(anomaly), key) for anomaly, key in made]
                else:
                    findings = [(self.localizer.settle(anomaly), key) for anomaly, key in made]
                key = (site.component, site.prefix)  # its kept call back, for the repro bundle
                if call is not None:
                    self.calls.kept[key] = call
                if context is not None:
                    self.calls.contexts[key] = context
                self.emit(findings)
            except Exception as error:
                self.guards.failed("nonfinite", error, made[0][0].step)
            finally:
                if call is not None:
                    self.calls.drop_call(site.component, site.prefix)

    # -- one call ----------------------------------------------------------------------------------
    def check_call(
        self,
        site: CallSite,
        tensor: torch.Tensor | None,
        step: int | None,
        phase: str,
        values: rows.CallValues | None = None,
        hidden: Any = None,
    ) -> None:
        """One call on its own: its output and probe readings in one transfer (``values``: read
        already, :meth:`read_encoded`), then the checks. ``hidden``: an encoder output's
        ``hidden_states``, where a NaN/Inf may lie only in layers the pipeline does not read
        (:meth:`hold_unread`)."""
        limit = self.config.max_debug_iterations
        if site.role == "denoiser" and limit is not None and self.run.monitored >= limit:
            self.probes.reset(site.component)
        else:
            decoded = site.prefix == "decoder"
            if values is None:
                # the output's abs-max taken with the sentinel's block outputs (a decoded image: its own extremes);
                # a run its sentinel does not read: checked at its output alone, as an unprobed component's
                pace = self.probes.pace
                out = site.component in pace.once_out
                own = None if decoded or tensor is None or out else self.probes.probes.get(site.component)
                held = own.hold(tensor) if own is not None else None
                probe = self.probes.take(site.component) if not out else None
                values = rows.measure_call(tensor, probe, decoded_images=decoded, held=held)
            readings, finite = values.readings, values.output_finite
            if self.config.probes == "full":
                self.keep_readings({site.component: readings}, step, site.prefix)
            # what the readings show, read once (as a step's): a clean call stops here
            seen = checks.suspects(readings, self.config.overflow_fraction) if readings else checks.NONE
            pace = self.probes.pace
            if readings and site.component in pace.once:  # warm: its next run is read (pace.note_call, inline)
                for reading in readings:
                    if reading.output_value is not None and not reading.output_value < pace.warm_at:  # (NaN too)
                        pace.once_warm[pace.once[site.component]] = True
                        break
            if seen is not checks.NONE or not finite:
                origin = self.localizer.origin
                found = self.localizer.check(site.component, readings, seen, finite, step, None, phase, site.prefix)
                if hidden is not None and self.hold_unread(site, found, hidden, finite, step):
                    self.localizer.origin = origin  # not the run's origin unless the loop is given it
                    found = [finding for finding in found if finding[0].kind != "nonfinite"]
                self.emit(found)
            # an fp16 output near its max that no reading named (the sentinel leaves out the end modules):
            # its abs-max is measured already, so a dict look-up and a comparison on a clean call
            # (a compiled denoiser's too, called with no scheduler step: no sentinel inside it)
            near = None if tensor is None else _OUTPUT_MAX.get(tensor.dtype)
            if near is not None and site.role == "denoiser" and site.component not in self.probes.compiled:
                near = None
            absmax = values.output_absmax
            if near is not None and finite and seen.overflow is None and absmax is not None:
                if absmax >= near * self.config.overflow_fraction:
                    self.output_overflow(site, absmax, step, phase=phase)
            # a non-finite image is the NaN/Inf's consequence, already named at its origin: not saturation
            if decoded and values.outside_fraction is not None and finite:
                threshold = self.config.vae_saturation_fraction
                try:
                    sd_vae = site.component in self.localizer.sd_vaes
                    dtype = None if tensor is None else tensor.dtype  # what it decoded in (read on a flat image)
                    kw = dict(threshold=threshold, step=step, component=site.component, sd_vae=sd_vae, dtype=dtype)
                    kw["upcast"] = self.localizer.upcast
                    kw["ran"] = lambda: self._decoded_under(site.component, dtype)  # (no C call made)
                    self.emit(rows.decoded_image_anomalies(values, **kw))
                except Exception as error:
                    self.guards.failed("vae_saturation", error, self.run.step if self.run.stepped else None)
                ranges, absmax = values.image_ranges, values.output_absmax
                self.record.add_event(  # on disk now: a run killed in post-processing keeps it
                    "vae_decode",
                    outside_fraction=values.outside_fraction,
                    image_ranges=ranges,
                    output_absmax=absmax,
                )
        self.calls.drop_call(site.component, site.prefix)

    def _decoded_under(self, component: str, dtype: torch.dtype | None) -> tuple[str | None, str | None]:
        """``(its weights' dtype, the autocast dtype)`` of a VAE that decoded ``dtype`` values, asked on a flat image
        during the call (``force_upcast`` casts it for the decode alone); the autocast's where the values are in it
        (a bfloat16 VAE under float16 autocast overflows float16's range): its advice is about the autocast."""
        root = self.localizer.modules.get(component)
        decoded = dtype_name(dtype) if dtype is not None else None
        weights = computes_in(root, "") if root is not None else None
        if decoded is None or weights is None:  # (unknown weights: the image's dtype is its decoded_dtype alone)
            return weights, None
        under = autocast_over(root)
        return weights, under if under == decoded else None

    def output_overflow(
        self, site: CallSite, absmax: float, step: int | None, timestep: float | None = None, phase: str = ""
    ) -> None:
        """``overflow_risk`` at the call's output (a text encoder's, a VAE half's, a compiled component's), which no
        probe reading named: an eager component's is named at the module that made it by one replay of the kept call
        with full probes (DESIGN: a near-overflow output is localised by a replay). The debugger's replay memory
        makes it once per debugger (its later calls: :data:`EARLIER_REPLAY`); a debugger made per call replays once
        per call while the near-max persists, the price of a name that is right after the inputs or the weights
        changed (on the warning path only). A compiled VAE's or text encoder's too (no probe inside it: its end
        modules' near-max is seen here alone), by an eager replay as its NaN/Inf is; where that replay names no module
        (it is not the compiled call: a hook the compiled code skips, their roundings apart) the warning is the
        compiled output's, 'its inside is not read', every call, replayed once a debugger (its replay memory: no
        module named). A compiled denoiser's, read from the step's row at every step, is that warning, no replay
        (:data:`_REPLAYED_COMPILED`); the advice (upcast, the VAE's own) is the component's."""
        with self.guard("overflow_risk"):
            compiled = site.component in self.probes.compiled
            reading = ModuleReading(site.prefix, 0, "float16", None, absmax, signal="absmax")
            if not compiled or site.role in _REPLAYED_COMPILED:  # one replay of the kept call (or an earlier call's)
                seen = checks.Suspects(None, None, reading)
                found = self.localizer.check(
                    site.component, [reading], seen, True, step, timestep, phase, site.prefix, OUTPUT_CHECK, compiled
                )
                if not compiled or any(_named(anomaly, site.prefix) for anomaly, _ in found):
                    self.emit(found)
                    return
                # its eager replay named no module (a hook the compiled code skips, compiled and eager rounding
                # apart): the compiled output's own warning, every call, as before the replay
                self.emit([(anomaly, key) for anomaly, key in found if anomaly.kind != "overflow_risk"])
            found = checks.overflow_risk(
                site.component,
                reading,
                step=step,
                timestep=timestep,
                fraction=self.config.overflow_fraction,
                localized_by=COMPILED_OUTPUT,
                role=self.localizer.roles.get(site.component, "other"),
                sd_vae=site.component in self.localizer.sd_vaes,
                upcast=self.localizer.upcast,
                compiled="replayed" if compiled and site.role in _REPLAYED_COMPILED else compiled,
                weights_dtype=self.localizer.weights_dtype(site.component, site.prefix),
                autocast=autocast_over(self.localizer.modules.get(site.component)),
            )
            self.emit([(anomaly, None) for anomaly in found])

    def compiled_output_overflow(
        self, values: rows.StepValues, makers: list[str | None], expert: str | None, step: int
    ) -> None:
        """``overflow_risk`` at the output of a compiled fp16 denoiser (no probe inside it: its sentinel
        would be traced) from the step's row, whose abs-max of each denoiser output is read at the call
        site anyway (for NaN/Inf): no op, graph or host read of its own. The step's largest output at
        ``overflow_fraction`` of fp16's max or beyond, where its maker (:func:`~.checks.made_by`) is
        compiled and its readings hold nothing (:meth:`output_overflow`)."""
        with self.guard("overflow_risk").at(step):
            output = values.stats.get("model_output")
            outputs = values.earlier if output is None else [*values.earlier, output]
            worst, maker = None, None
            for index, stats in enumerate(outputs):
                share = stats.dtype_max_fraction
                if stats.dtype == "float16" and share is not None and share >= self.config.overflow_fraction:
                    if worst is None or share > worst.dtype_max_fraction:
                        worst, maker = stats, checks.made_by(makers, len(outputs) - 1 - index, expert)[0]
            maker = maker or (self.denoiser.name if self.denoiser is not None else None)
            if worst is None or maker not in self.probes.compiled or values.readings.get(maker):
                return
            site = next(s for s in self.calls.sites if s.component == maker and s.prefix == "")
            self.output_overflow(site, worst.absmax, step, values.scalars.get("timestep"))

    def keep_readings(self, readings: dict[str, list], step: int | None, site: str = "") -> None:
        """Level ``extreme`` (full probes; its callers ask only then): each component call's module
        readings, in the order the modules returned, to ``modules.jsonl`` (what ``diffusion-debug
        diff`` compares)."""
        with self.guard("module_readings"):
            for component, found in readings.items():
                if found:  # each reading's module, call, dtype, input and output value: a plain tuple, a list in JSON
                    modules = list(map(_FIRST_FIVE, found))  # sliced in C, no bytecode a reading
                    entry = {"run": self.runs, "step": step, "component": component, "site": site}
                    entry.update(signal=found[0].signal, modules=modules)
                    self.record.add_readings(entry)


_REPLAYED_COMPILED = ("vae", "text_encoder")
"""The roles whose compiled component's near-max output is named at its module by one eager replay of the kept call
(called once an image: a decode, a prompt's encoding); a compiled denoiser's (or ControlNet's, adapter's: every step)
is warned at its output, read from the step's row."""


def _named(anomaly: Anomaly, site: str) -> bool:
    """Whether a compiled component's output check named where its near-max values came from: a module inside it
    (or where its own forward built them), an Inf a block clipped, the user's near-max inputs; not its output."""
    return (
        anomaly.kind != "overflow_risk"
        or anomaly.module != site
        or anomaly.details.get("localized_by") != OUTPUT_CHECK
    )


def _output_absmaxes(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``outputs``' abs-max (0-d, in its dtype, NaN before Inf), in one fused reduction where
    they share a device and a dtype it reduces (:func:`~diffusion_debug.probes.fused._absmaxes`: a GPU's
    one ``_foreach_norm`` kernel for the prompt's and the negative prompt's encoder outputs, where each
    had a ``linalg_vector_norm`` of its own), else one each (:func:`~diffusion_debug.stats.absmax`)."""
    first = outputs[0]
    fused = len(outputs) > 1 and first.dtype in FUSED_DTYPES
    for output in outputs:  # a loop, not all() over a generator: no frame a value
        if output.device != first.device or output.dtype is not first.dtype:
            fused = False
            break
    if not fused:
        return [absmax_on_device(output) for output in outputs]
    return list(_absmaxes([detached(output) for output in outputs])[0])


def _site_read_last(readings: list[ModuleReading], marks: list[int], prefixes: list[str]) -> list[int]:
    """Each call's end (``marks``: its probe's pending readings as its output was held) moved past the reading of its
    call site's own module (``prefixes``) where that comes next: a full probe reads a module that had hooks at its
    attach (the call site's own) by a hook after them, so the module's reading, its call's last, came after the mark
    and opened the next call's readings (the negative prompt's CLIP call under CFG then had the prompt's NaN output
    first, its input unread: a second error, "made in its own forward", that became the run's origin)."""
    return [m + 1 if m < len(readings) and readings[m].module == p else m for m, p in zip(marks, prefixes)]


def _pipeline_call_runs() -> bool:
    """Whether a pipeline's ``__call__`` runs on some thread now (``report()`` may be asked from the live
    server's thread while the user's runs): a ComponentsManager's held findings then wait for its loop."""
    for top in sys._current_frames().values():
        while top is not None:
            if top.f_code.co_name == "__call__" and hasattr(type(top.f_locals.get("self")), "components"):
                return True
            top = top.f_back
    return False


def _unread(anomaly):
    """A held encoder's ``nonfinite`` as a warning: its NaN/Inf lay in states the pipeline did not pass on."""
    details = {k: v for k, v in anomaly.details.items() if k != "origin"}
    return rebuilt(anomaly, severity="warning", details={**details, "unread_output": True})


def _host_rows(values: list[torch.Tensor]) -> list[list[float]]:
    """The host values of ``values``, a list each, in one read: one probe's one flushed vector as it
    is, 0-d abs-maxes of one dtype stacked (:func:`~diffusion_debug.stats.scalars_to_host`), else every
    value joined (:func:`~diffusion_debug.stats.to_host`)."""
    if not values:
        return []
    if len(values) == 1 and values[0].dim() == 1:
        return [read_now(values[0])]
    for value in values:  # a loop, not all() over a generator: no frame a value
        if value.dim():
            return to_host(values)
    return [[value] for value in scalars_to_host(values)]
