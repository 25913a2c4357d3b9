"""Name the module that made a NaN/Inf (or a near-overflow): :class:`Localizer` takes a call's sentinel readings once
(:func:`~.checks.suspects`; a step's, every component's in one pass: :func:`~.checks.step_plan`, then
:meth:`Localizer.step_findings`), decides every replay they call for at once (:func:`~.replay.decide.decide`), replays
the call with full probes (:meth:`~.components.call_sites.CallSiteHooks.replay_kept`) where they only name a block, and
settles each NaN/Inf against the run's origin (:meth:`Localizer.settle`). Values in, findings out (anomalies with their
fold keys); the caller emits them.

The replay runs the same module on the same arguments under ``torch.no_grad()`` with every module probed, with the
torch RNG state saved and restored around it, and returns the readings. An overflow's replay that shows a module whose
output was Inf, which its block then clipped to the dtype's largest value (diffusers' Flux blocks clip their fp16
streams to +-65504), names that module as the ``nonfinite`` error (the origin), not the block's near-overflow.

A component under diffusers' stateful hooks (FirstBlockCache, PyramidAttentionBroadcast, FasterCache...) is replayed in
the watched call's cache context from the hooks' state as that call began, and every hook's state is put back
afterwards (:mod:`~.components.cache_hooks`), so the image and later calls do not change.

Limits: other hidden state that changes per call (a stateful attention processor) sees one extra call, on a finding."""

from __future__ import annotations

import time
from typing import Any, Callable, ContextManager

from torch import nn

from ..config import DebugConfig
from ..probes import ModuleReading
from ..record import Anomaly, RunRecord
from . import checks, origins
from . import step_values as rows
from .components.call_sites import CallSiteHooks, kept_arguments
from .components.computes_in import autocast_over, computes_in, weights_finite
from .components.inventory import role_of, stable_diffusion_vae
from .components.made import MadeNonfinite, made_origin
from .components.vae_details import LazyUpcast
from .replay.decide import (
    ALREADY_REPORTED,
    NOTHING,
    UNLOCALISED,
    Clip,
    Decision,
    Overflow,
    ReplayMemory,
    Source,
    decide,
    nonfinite_replayed,
    overflow_replayed,
    replayed_how,
    unwatched_text,
)
from .run_guard import RunGuards

Finding = tuple[Anomaly, "tuple | None"]
"""An anomaly and its fold key (None: the sink's default)."""


class Localizer:
    """Checks a component's readings for NaN/Inf and near-overflow and names the module that made them.

    With full probes the readings already name the module; at block level a leaf producer is named as is, and a
    block is replayed with full probes on the call's kept arguments to find the module inside it (within the
    run's ``debug_timeout`` of replays: each FreeInit pass's). Per call, a component's first NaN/Inf is localised
    once (later ones count there), again only where it may be another origin (``ReplayMemory.count``).

    One origin per call, until another is made (a module's from finite arguments, its component's or another's
    first, or the callback's, once the user's callback cleaned the latents): the first NaN/Inf error is the run's
    :attr:`origin`; a component that received non-finite input before any origin is known is explained by
    :mod:`origins` from the run's :attr:`inputs` and the call's kept arguments as passed (an input, the user's
    callback, the pipeline's code, or the component's own state: a cache it filled in an earlier call, never taken
    for an input; an input a watched component made in an earlier run: that component, :mod:`.components.made`) and
    that becomes the origin; every later ``nonfinite`` (a component given non-finite arguments, a repeat) is a
    warning pointing at the origin's ``where()``. Where a block-level overflow was localised is kept across runs
    (the same weights overflow in the same place) until :meth:`clear`.

    Limits: a replay sees the call's arguments as kept at the call (its lists and dicts copied then, so a cache the
    call fills is seen as it was passed); a module that changed a tensor argument in place is replayed on the
    changed values; ``debug_timeout`` does not interrupt a replay.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        config: DebugConfig,
        record: RunRecord,
        calls: CallSiteHooks,
        *,
        guards: RunGuards,
        quiet: Callable[[str], ContextManager[None]],
        levels: dict[str, str] | None = None,
    ):
        self.modules = modules
        self.roles = {name: role_of(name, module) for name, module in modules.items()}
        """Each component's role (its checks' advice comes from it); ``other`` for one not known."""
        self.sd_vaes = {name for name, module in modules.items() if stable_diffusion_vae(module)}
        """The components that are Stable Diffusion's VAE (the fp16-fixed VAE is advice for them only)."""
        self.upcast: dict | LazyUpcast = {}  # what its call does with the VAE, read lazily (new_run: a new pipe's)
        self.levels = levels if levels is not None else {}
        """Probe level per component (``full`` readings name the module without a replay); updated at every attach."""
        self.inputs = origins.RunInputs()  # what the user passed to this run (see new_run)
        self.origin: Anomaly | None = None  # this run's one NaN/Inf error
        self.made = MadeNonfinite()  # what watched components made non-finite: an input given it back names them
        self.config = config
        self.record = record
        self.calls = calls
        self.guards = guards
        self.guard = guards.__getitem__
        """``guard(where).at(step)``: a failure is recorded at the step checked (read late, the run is at the next)."""
        self.quiet = quiet
        """``quiet(component)``: the debugger's own call, unseen by its hooks."""
        self.memory = ReplayMemory(timeout=config.debug_timeout)
        """What the replays found and tried (:func:`~.replay.decide.decide` reads it)."""
        self.unwatched_since: tuple[list[str], int | None] | None = None
        """This run's: the components (the scheduler among them) replaced during the call and the step
        from which their steps ran with no hook of ours (found at the VAE's call)."""
        self.first_unwatched: dict[str, int] = {}
        """This run's: component -> the step of its first call, which ran unwatched (replaced while
        attached, in the call: event ``component_replaced`` at that step; hooked from its next call)."""

    def use_modules(self, modules: dict[str, nn.Module]) -> None:
        """Localise in ``modules`` from now on (a component replaced on the pipeline): where an
        overflow was localised in a component that is no longer the same module is forgotten."""
        self.memory.forget({name for name, module in self.modules.items() if modules.get(name) is not module})
        self.modules = modules
        self.roles = {name: role_of(name, module) for name, module in modules.items()}
        self.sd_vaes = {name for name, module in modules.items() if stable_diffusion_vae(module)}

    def full(self, component: str) -> bool:
        return self.levels.get(component, self.config.probes) == "full"

    def new_run(self, inputs: origins.RunInputs | None = None, *, same_call: bool = False) -> None:
        """``same_call``: a run in the run before's call (FreeInit) keeps its NaN/Inf origin and replays' memory."""
        self.inputs = inputs if inputs is not None else origins.RunInputs()
        if self.inputs.pipe is not None and self.inputs.pipe is not self.made.pipe:  # (a new pipe's class read once)
            self.made.pipe, self.upcast = self.inputs.pipe, LazyUpcast(self.inputs.pipe)
        if self.made.pending:  # a method that made a NaN/Inf in the run before: what it returned, kept weakly
            self.made.settle()
        if not same_call:
            self.origin = None
            self.memory.new_run()
        else:  # (FreeInit's next pass: its own replay budget)
            self.memory.next_pass()
        self.first_unwatched.clear()
        self.unwatched_since = None

    def clear(self) -> None:
        self.new_run()
        self.made.clear()
        self.memory.clear()

    def is_leaf(self, component: str, module: str) -> bool:
        try:
            return not any(True for _ in self.modules[component].get_submodule(module).children())
        except AttributeError:
            return False

    def step_findings(
        self,
        step: int,
        inputs: rows.StepInputs,
        values: rows.StepValues,
        plan: checks.StepPlan | None,
        run: rows.RunState,
        holder: Any,
    ) -> list[Finding]:
        """What one denoising step's values show (:class:`~.step_values.StepValues`), in one pass: each component that
        ``plan`` checks (:func:`~.checks.step_plan`; None: a clean step), in execution order (:meth:`check`: its
        replays decided at once), then the latents' divergence, non-finite latents after their origin (from the step's
        ``scheduler.step`` arguments ``inputs``). ``run``: the run's state (its ``init_noise_sigma``; ``previous_l2``
        moved on here); ``holder``: whose ``scheduler`` stepped."""
        found: list[Finding] = []
        timestep = values.scalars["timestep"]
        if plan is not None:
            for component, suspects in plan.checked.items():
                finite = plan.output_finite if component == plan.denoiser else True
                readings = values.readings.get(component, [])
                found += self.check(component, readings, suspects, finite, step, timestep, "denoise")
        latents = values.stats.get("latents")
        if latents is not None:
            try:  # (no guard's with: a clean step takes this path)
                for anomaly, key in checks.latent_findings(
                    latents,
                    values.scalars,
                    step=step,
                    output_finite=values.output_finite,
                    init_noise_sigma=run.init_noise_sigma,
                    tolerance=self.config.latent_std_tolerance,
                    previous_l2=run.previous_l2,
                ):
                    if anomaly.severity != "error":
                        found.append((anomaly, key))
                    elif inputs.scheduler_model_output is None:  # a custom loop's step: no scheduler call to read
                        found.append((self.settle(anomaly), key))
                    else:  # not made by the denoiser: the origin first, from the scheduler.step call
                        scheduler = type(getattr(holder, "scheduler", None)).__name__
                        denoiser = plan.denoiser if plan is not None else ""
                        found += self.latents(anomaly, key, inputs, denoiser=denoiser, scheduler=scheduler)
                run.previous_l2 = latents.l2
            except Exception as error:
                self.guards.failed("latent_divergence", error, step)
            self.inputs.latents_finite = latents.nan == 0 and latents.posinf == 0 and latents.neginf == 0
            self.inputs.dirtied = self.inputs.dirtied or not self.inputs.latents_finite
        return found

    def check(
        self,
        component: str,
        readings: list[ModuleReading],
        seen: checks.Suspects,
        output_finite: bool,
        step: int | None,
        timestep: float | None,
        phase: str,
        site: str = "",
        output: str | None = None,
        compiled: bool = False,
    ) -> list[Finding]:
        """``nonfinite`` and ``overflow_risk`` for one component call (or step) whose readings show ``seen``
        (:func:`~.checks.suspects`, read once by the caller): every replay they call for decided at once
        (:func:`~.replay.decide.decide`), then run, then the findings. ``site``: the call site's prefix (the VAE's
        ``decoder``), where a replay starts when no reading names a block; ``output``: the reading is the output's
        (``compiled``: a compiled component's, no probe inside it whatever its level: a replay names the module)."""
        found: list[Finding] = []
        plan = NOTHING
        with self.guard("nonfinite").at(step):
            if seen is checks.NONE and output_finite:  # a clean call: nothing to localise
                return found
            plan = decide(
                component,
                seen,
                readings,
                memory=self.memory,
                output_finite=output_finite,
                full=not compiled and self.full(component),
                leaf=self.is_leaf,
                received=self._received_nonfinite,
                unwatched=unwatched_text(component, step) if self.first_unwatched.get(component, -1) == step else None,
                localize=self.config.localize,
                site=site,
                fraction=self.config.overflow_fraction,
                step=step,
            )
            if plan.clipped is not None:  # an Inf a block clipped, read with full probes: the call's finding
                return found + self._clipped_inf(component, plan.clipped, "full probes", None, step, timestep, phase)
            if plan.failed and "nonfinite" in plan.failed:  # recorded here; the overflow is still checked below
                raise plan.failed["nonfinite"]
            if plan.source is not None or plan.replay is not None:
                found += self.nonfinite(component, seen, plan, bool(readings), step, timestep, phase, site)
        with self.guard("overflow_risk").at(step):
            if plan.failed and "overflow_risk" in plan.failed:  # (its NaN/Inf named above all the same)
                raise plan.failed["overflow_risk"]
            if plan.overflow is not None:
                risks = self.overflow(component, plan.overflow, step, timestep, phase, output, compiled)
                named = {a.module for a, _ in found if "overflowed_in" in a.details}  # a NaN/Inf's cause: said once
                found += [risk for risk in risks if risk[0].module not in named] if named else risks
        return found

    # -- NaN / Inf ----------------------------------------------------------------------------------
    def settle(self, anomaly: Anomaly) -> Anomaly:
        """A NaN/Inf anomaly as it is to be emitted (:func:`~.origins.settle`): the run's first error becomes
        its :attr:`origin`, a later one a warning pointing at it. Every NaN/Inf finding is settled here."""
        anomaly, self.origin = origins.settle(anomaly, self.origin)
        if anomaly is self.origin:  # (made again after another origin: the origin again, ReplayMemory.count)
            self.memory.origins[(anomaly.component, anomaly.module)] = anomaly
        return anomaly

    def latents(self, anomaly: Anomaly, key: tuple | None, inputs, *, denoiser: str, scheduler: str) -> list[Finding]:
        """A step's non-finite latents (``anomaly``): their origin first when no module made
        them (from the step's ``scheduler.step`` arguments ``inputs``), then ``anomaly`` itself."""
        found: list[Finding] = []
        if self.origin is None:
            origin = origins.explain_latents(
                inputs.sample,
                inputs.scheduler_model_output,
                self.inputs,
                denoiser=denoiser or "the denoiser",
                scheduler=scheduler,
                step=anomaly.step,
                timestep=anomaly.timestep,
                fraction=self.config.overflow_fraction,
            )
            found.append((self.settle(origin), None))
        return found + [(self.settle(anomaly), key)]

    def nonfinite(
        self, component: str, seen: checks.Suspects, plan: Decision, probed: bool, step, timestep, phase: str, site=""
    ) -> list[Finding]:
        """The ``nonfinite`` anomaly (with its fold key) for a call whose readings (``seen``; ``probed``: it has some)
        or output show a NaN/Inf, where ``plan`` or its replay found it; after its origin if no module made it."""
        first = component not in self.memory.reported
        source, replayed = plan.source, None
        if source is None:
            source, replayed = self._replayed_source(component, plan.replay, probed, step)
        module, how, again = source.module, source.how, None
        if how == ALREADY_REPORTED and phase == "denoise" and self.origin is not None:  # the callback's, now?
            received = lambda: self._nonfinite_arguments(component, site)[0]  # noqa: E731
            again = origins.callback_again(self.inputs, self.origin, received, seen_in=component, step=step)
        made = first and not source.consequence and self._made_after_another(component, site)
        consequence, another = self.memory.count(component, source, seen.producer, step, again is not None, made)
        entry = self.memory.origins.get((component, self.memory.named[component]), self.origin)  # (its entry's)
        self.origin = None if another else entry  # another origin: the run's now, later ones point at it
        found = [] if again is None else [(self.settle(again), ("nonfinite", again.component, again.module))]
        if consequence and first and self.origin is None:  # an input, the user's callback, the pipeline, itself
            received, state = self._nonfinite_arguments(component, site)
            if self.unwatched_since is not None and not self.inputs.nonfinite():  # made in steps no hook saw
                replaced, since = self.unwatched_since
                origin = origins.unwatched_origin(replaced, since, seen_in=component, timestep=timestep, phase=phase)
            else:
                origin = origins.explain_received(
                    component,
                    received,
                    state,
                    self.inputs,
                    step=step,
                    timestep=timestep,
                    phase=phase,
                    fraction=self.config.overflow_fraction,
                )
                if origin.component == "input" and self.made.made:  # passed back from a watched component's call?
                    made = self.made.maker_of(self.inputs.values(), origin.details["inputs"])
                    origin = origin if made is None else made_origin(*made, origin)
            found.append((self.settle(origin), ("nonfinite", origin.component, origin.module)))
            if origin.component == component:  # its own state: the origin is this component, said once
                return found
        bad = seen.first_nonfinite
        details = {"phase": phase, "sentinel_module": bad.module if bad else None}
        if not consequence and self.first_unwatched.get(component, -1) == step:  # its inputs were not seen either
            details["unwatched_call"] = True
        if replayed is not None:
            details["replay_readings"] = replayed
        if made:  # the evidence that it is not the origin's consequence
            details["arguments_finite"] = True
        details.update(source.between)
        near = None if consequence else source.near_max  # made from another module's near-max values
        dtype = source.dtype
        return found + self._nonfinite_at(component, module, how, consequence, details, step, timestep, near, dtype)

    def _nonfinite_at(
        self, component, module, how: str, consequence: bool, details, step, timestep, near_max=None, read_as=None
    ) -> list[Finding]:
        """The ``nonfinite`` anomaly at ``module`` (``how``: what localised it; a ``consequence`` points at the run's
        origin; ``read_as``: the dtype its output was read in), settled against the origin (the run's first error
        becomes it). ``near_max``: :attr:`~.replay.decide.Source.near_max` (the error is at the module that made those
        values, ``module``'s NaN/Inf a warning that follows it, with a fold key of its own: no repeat of the error)."""
        made = checks.nonfinite(
            component,
            module,
            step=step,
            timestep=timestep,
            localized_by=how,
            consequence=consequence,
            details=details,
            origin=self.origin.where() if self.origin is not None else None,
            role=self.roles.get(component, "other"),
            sd_vae=component in self.sd_vaes,
            upcast=self.upcast,
            dtype=self.weights_dtype(component, module),
            near_max=near_max,
            read_as=read_as if read_as != "float16" or weights_finite(self.modules.get(component), module) else None,
            autocast=autocast_over(self.modules.get(component)),
        )
        key = ("nonfinite", component, consequence, self.memory.named.setdefault(component, module))  # its entry
        return [(self.settle(a), key + (a.module,) if "near_max_from" in a.details else key) for a in made]

    def weights_dtype(self, component: str, module: str) -> str | None:
        """The dtype ``component.module`` computes in now (:func:`~.components.computes_in.computes_in`)."""
        root = self.modules.get(component)
        return None if root is None else computes_in(root, module)

    def _replayed_source(self, component: str, block: str, probed: bool, step: int | None):
        """``(source, replay reading count)``: where the replay with full probes of the kept call holding
        ``block`` (a call of ``step``) shows the NaN/Inf was made, and where inside it
        (:func:`~.replay.decide.between_modules`: the same diagnosis as full probes read in the call)."""
        replayed = self.replay(component, block, step)
        # cache tensors beyond the budget that the call replaced: None in the replay
        released = {"replay_cache_released_bytes": self.calls.released} if self.calls.released else {}
        shown = nonfinite_replayed(replayed, self.config.overflow_fraction) if replayed is not None else None
        if shown is not None and shown[0] is not None:
            how, (made, where, near) = replayed_how("sentinel" if probed else "output check"), shown
            where = {**where, **released}
            return Source(made.module, how, False, where, near, made.dtype), len(replayed)
        if shown is not None:
            return Source("", "replay with full probes: inputs were already non-finite", True), len(replayed)
        return Source(block, UNLOCALISED, False, released), None

    def _made_after_another(self, component: str, site: str) -> bool:
        """Whether ``component``'s first NaN/Inf this run, made in it, follows another component's origin from
        finite arguments (its kept call's, a host read): another origin (the VAE's own, after the user's callback
        cleaned the UNet's from the latents), not a consequence of that one; only where that origin's NaN/Inf
        reached the latents (:func:`~.origins.cleaned_away`)."""
        if not origins.cleaned_away(self.inputs, self.origin, component):  # (a clipped Inf left no NaN to clean)
            return False
        return bool(kept_arguments(self.calls, component, site)) and not self._received_nonfinite(component, site)

    def _received_nonfinite(self, component: str, site: str) -> bool:
        """Whether the kept call of ``component`` at ``site`` (the one being checked) was passed a
        NaN/Inf, its own state (a cache it filled in an earlier call) aside."""
        return bool(self._nonfinite_arguments(component, site)[0])

    def _nonfinite_arguments(self, component: str, site: str) -> tuple[list[str], list[str]]:
        """The names of the kept call's arguments (at ``site``, the call being checked) that held NaN/Inf as passed:
        ``(received, own state)``, its own state being what it gets back from its earlier calls (``feat_cache``)."""
        kept = kept_arguments(self.calls, component, site)
        if kept is None:
            return [], []
        state = self.calls.own_state(component)
        bad = origins.nonfinite_names(origins.call_arguments(*kept))
        return [n for n in bad if n not in state], [n for n in bad if n in state]

    # -- overflow risk ------------------------------------------------------------------------------
    def overflow(
        self, component: str, plan: Overflow, step: int | None, timestep, phase: str, by: str | None, compiled: bool
    ) -> list[Finding]:
        """``overflow_risk`` for the module whose output came close to its dtype's maximum (``plan``:
        :func:`~.replay.decide.decide`'s; a block's is replayed to find the module inside).

        A block whose replay shows a module that made an Inf the block then clipped to the dtype's
        largest value (diffusers' Flux blocks clip their fp16 streams to +-65504) is a ``nonfinite``
        error at that module instead (:meth:`_clipped_inf`). A block at the max (or 1000 below) is replayed once
        a run even where an earlier run's overflow was localised there: a clip hides an Inf that way. ``by``:
        :meth:`check`'s ``output`` (the call's output at its site, ``""`` a text encoder's: not the user's inputs)."""
        fraction, shown = self.config.overflow_fraction, None
        if plan.replay is not None:
            replayed = self.replay(component, plan.replay, step)
            if replayed is not None:  # (``compiled``: passed in is no module named, overflow_replayed)
                shown = overflow_replayed(replayed, plan.replay, fraction, plan.clean, compiled)
            plan = self.memory.overflow_shown(plan, shown, len(replayed or ()))
        if plan.clipped is not None:  # (its replay's; where the replay showed none, as the sentinel read it: plan.how)
            return self._clipped_inf(component, plan.clipped, plan.how, plan.replayed, step, timestep, phase)
        reading, how = plan.reading, by or ("full probes" if self.full(component) else "sentinel")
        if plan.known is not None:  # (a reading of its own, "": where its own forward built the values)
            reading, how = plan.known, replayed_how("output check" if by else "sentinel", earlier=shown is None)
        if plan.skip or not (by or reading.module):  # brought by the call's arguments, before its first module
            passed = self.inputs.near_max(fraction)  # the user's (a host read, on a near-overflow only)
            if passed:
                if plan.key is not None:  # the user's values this run, not where the block's own forward builds them
                    self.memory.passed_in.add(plan.key)
                    self.memory.overflow_where.pop(plan.key, None)
                    self.memory.grown.pop(plan.key, None)
                risk = checks.input_overflow_risk(passed, component, step=step, timestep=timestep, fraction=fraction)
                return [(risk, None)]
        if plan.skip:
            return []
        made = checks.overflow_risk(
            component,
            reading,
            step=step,
            timestep=timestep,
            fraction=fraction,
            localized_by=how,
            role=self.roles.get(component, "other"),
            sd_vae=component in self.sd_vaes,
            upcast=self.upcast,
            between=plan.between,
            weights_dtype=self.weights_dtype(component, reading.module),  # (a warning's)
            autocast=autocast_over(self.modules.get(component)),
        )
        return [(anomaly, None) for anomaly in made]  # the kind's fold key: the module

    def _clipped_inf(self, component: str, clip: Clip, how: str, replayed: int | None, step, timestep, phase: str):
        """The ``nonfinite`` error at ``clip.producer``, the module that made an Inf from finite inputs which
        ``clip.block`` clipped to (about) the dtype's largest value (its output, and the image, stayed finite). An
        error, not an overflow warning: the module's output overflowed, and what the clip leaves is
        the dtype's max, not the value the model computed. The run's origin when it is the first.
        ``replayed``: the replay's reading count (None: read in the call)."""
        self.memory.reported.setdefault(component, False)  # a NaN/Inf that escapes later counts here
        details = {"phase": phase, **clip.details(), **({} if replayed is None else {"replay_readings": replayed})}
        made = clip.producer
        return self._nonfinite_at(component, made.module, how, False, details, step, timestep, None, made.dtype)

    # -- replay -------------------------------------------------------------------------------------
    def replay(self, component: str, module: str, step: int | None) -> list[ModuleReading] | None:
        """The readings of the kept call holding ``module`` (a call of ``step``), replayed with full
        probes; None without a kept call, when the run's ``debug_timeout`` of replays is spent, or
        when the replay failed (a ``debugger_error`` at ``replay``, at ``step``)."""
        site = self.calls.site_for(component, module)
        if site is None:
            return None
        spent, timeout = self.memory.seconds, self.config.debug_timeout
        if spent >= timeout:
            self.record.add_event(
                "replay_skipped",
                component=component,
                call=site.prefix,
                spent_seconds=spent,
                reason=f"debug_timeout={timeout}s of replays already spent",
            )
            return None
        started, readings = time.perf_counter(), None
        with self.guard("replay").at(step):  # the debugger's own call: its failure (an OOM) is its own, the
            readings = self.calls.replay_kept(site, self.quiet(component))  # anomaly is kept, unlocalised
        seconds = time.perf_counter() - started
        self.memory.seconds += seconds
        if readings is None:
            return None
        released = {"cache_released_bytes": self.calls.released} if self.calls.released else {}
        self.record.add_event(
            "replay", component=component, call=site.prefix, modules=len(readings), seconds=seconds, **released
        )
        return readings
