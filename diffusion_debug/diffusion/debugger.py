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

How it watches, without changing what it watches (this file holds the API and the lifecycle;
each room takes and returns plain values; every anomaly goes through one
:class:`~diffusion_debug.core.AnomalySink`): ``components`` finds every ``nn.Module`` component
and its role; ``call_sites`` probes each one (block level in the loop, every module in
components called once per image) and hooks its call site; ``pipeline_patches`` wraps
``scheduler.step``, ``set_timesteps`` and ``encode_prompt`` on the instances; ``step_row`` brings
a step to the host in one transfer; ``localize`` names the module that made a NaN/Inf (a replay
with full probes when a block is all the readings say); ``origins`` finds the one origin
outside the modules (an input, the scheduler, the guidance); ``checks``, ``blackouts`` (the
safety checker), ``guidance``, ``previews``, ``bundle``, ``summary``.

Limits: the step index counts ``scheduler.step`` calls since ``set_timesteps`` (a second-order
scheduler such as Heun counts two per denoising step); replacing ``pipe.scheduler`` while
attached is not seen: after 8 denoiser calls without a scheduler step (also when the denoiser is
called directly) each further call is checked on its own, with ``step`` None; when a denoiser is
called several times per step only the last output is measured; ``debug_timeout`` does not
interrupt a replay; where a block-level overflow was localised is kept across pipeline runs
(the anomaly of a later run repeats the localising replay's values) until
``clear_debug_history``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from ..config import DebugConfig, resolve_config
from ..core import AnomalySink, DebugReport, Lifecycle, check_policy, open_run, raise_after_saving, release
from ..memory import memory_sample
from ..record import Anomaly
from ..report.server import start_live_server
from . import checks, guidance, origins, summary
from . import pipeline_patches as patches
from . import step_row as rows
from .blackouts import safety_blackout
from .bundle import save_anomaly_bundle
from .call_sites import CallSite, CallSiteHooks, ComponentProbes, kept_arguments, probe_levels
from .components import (
    Component,
    analyze_pipeline,
    call_phase,
    component_dtypes,
    find_components,
    is_loop_role,
    no_denoiser_note,
    preview_decoder,
    validate_pipeline,
)
from .localize import Localizer
from .previews import Previews, decode_first_image
from .roles import role
from .signatures import check_monitor_arguments, check_no_pipeline_argument

logger = logging.getLogger("diffusion_debug")

# Past MAX_UNSTEPPED_CALLS denoiser calls with no scheduler step each call is checked alone (step None).
UNSTEPPED_NOTE = "no scheduler.step seen between denoiser calls; each call is checked on its own"
POLICIES = ("record", "warn", "raise", "stop")
"""The policies a pipeline run can follow (``skip`` has no optimizer step to skip here)."""


class DiffusionModelDebugger(Lifecycle):
    """Watches a diffusers pipeline: per-step record, NaN/Inf producer, overflow risk, previews.

    ``with dbg: pipe(...)`` attaches on enter and detaches on exit (also on an exception);
    ``dbg.attach()`` returns a handle whose ``remove()`` detaches; a later ``attach()`` watches
    again. Nothing is written before the pipeline and config are validated. ``events.jsonl`` stays
    open (and the ``serve_port`` server runs) until :meth:`close` or the debugger's collection.
    """

    def __init__(self, pipe: Any, config: DebugConfig | Mapping[str, Any] | None = None):
        cfg = resolve_config(config)
        check_policy(cfg, POLICIES, "DiffusionModelDebugger")
        validate_pipeline(pipe)
        self.pipe = pipe
        self.config = cfg
        self.components: list[Component] = find_components(pipe)
        # serve_port: bound before the run directory is made, so a port in use creates nothing
        self._server = start_live_server(cfg, self, {"/debug/summary": DiffusionModelDebugger.get_debug_summary})
        try:  # whatever fails from here gives back the run's stream and the server
            self.record = open_run(cfg, kind="diffusion")  # creates the run directory: after validation
            self._finalizer = weakref.finalize(self, release, self.record.close, self._server and self._server.stop)
            self.sink = AnomalySink(self.record, cfg, logger)
            self._calls = CallSiteHooks(self.components, cfg)
            self._localizer = Localizer(
                {c.name: c.module for c in self.components},
                cfg,
                self.sink,
                self._calls,
                guard=self._guard,
                quiet=self._quiet,
                on_new_error=self._maybe_bundle,
                levels=probe_levels(self.components, cfg.probes),
                explain=self._explain,
            )
            self._previews = Previews(cfg.preview_vae_every)
            self._probes = ComponentProbes(cfg, on_error=self._probe_error)
            self._removers: list[Any] = []  # hook handles and patches, each with remove(), undone in reverse
            self._busy = False  # the debugger's own calls (replays, VAE previews) are not watched
            self._run = rows.RunState()
            self._step_call: tuple[tuple, dict] | None = None  # the scheduler.step call being recorded
            self._runs = 0
            self._bundles: list[str] = []
        except BaseException:
            release(self._finalizer or (self._server and self._server.stop))
            raise

    @property
    def denoiser(self) -> Component | None:
        """The component that drives the per-step row (None for a pipeline without one)."""
        first = self.components[0]
        return first if first.role == "denoiser" else None

    # -- lifecycle ----------------------------------------------------------------------------
    def _register(self) -> None:
        self._removers += self._probes.attach(self.components)
        self._removers += self._calls.register(
            busy=self._is_busy, guard=self._guard, on_start=self._on_call_start, on_output=self._on_call_output
        )
        self._removers += patches.patch_pipeline(
            self.pipe,
            busy=self._is_busy,
            on_step=self._on_scheduler_step,
            on_set_timesteps=self._on_set_timesteps,
            on_encode_prompt=self._on_encode_prompt,
            on_safety_checker=self._on_safety_checker,
        )
        roles = {c.name: c.role for c in self.components}
        self.record.add_event("attach", components=list(roles), roles=roles, probes=self.config.probes)
        if self.denoiser is None:
            note = no_denoiser_note(type(self.pipe).__name__)
            logger.warning("diffusion-debug: %s", note)
            self.record.add_event("no_denoiser", note=note)
        self._static_checks()

    def _unregister(self) -> None:
        removers, self._removers = self._removers, []
        self._probes.detach()
        self._end_step()
        self._run.last_row = None
        patches.remove_all(removers)

    def detach(self) -> None:
        """Remove every hook and wrapper this debugger added; idempotent; ``attach()`` watches again."""
        if self.attached:
            super().detach()
            self.record.add_event("detach")

    def close(self) -> None:
        """Detach (if attached) and close ``events.jsonl``; idempotent and final.

        ``report()`` and ``report().save()`` still work afterwards (the events already streamed
        stay in the file; later ones are kept in memory only).  Leaving a ``with dbg:`` block
        only detaches, so the debugger can be entered again; call ``close()`` when done with it.
        """
        super().close()
        self._finalizer()

    def _is_busy(self) -> bool:
        return self._busy

    def _guard(self, where: str) -> contextlib.AbstractContextManager[None]:
        return self.sink.guard(where, step=self._run.current_step)

    @contextlib.contextmanager
    def _quiet(self, component: str) -> Iterator[None]:
        """The debugger's own call of ``component``: unseen by the hooks, forgotten by its probe."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            self._probes.reset(component)

    def _begin_run_if_needed(self) -> None:
        if self._run.stepped or self._runs == 0:
            self._runs += 1
            self._new_run_state()
            self.sink.new_window()  # repeats fold within one pipeline run
            self.record.add_event("run_start", run=self._runs)

    def _new_run_state(self) -> None:
        self._run = rows.RunState()
        self._calls.new_run()
        self._localizer.new_run()

    def _end_step(self) -> None:
        self._calls.drop_calls()
        self._step_call = None
        self._run.end_step()

    def _apply_policy(self) -> None:
        errors = self.sink.take_errors()
        if not errors or self.config.policy in ("record", "warn"):
            return
        anomaly = errors[0]
        if self.config.policy == "stop" and patches.can_interrupt(self.pipe):
            self._removers.append(patches.AttributePatch(self.pipe, "_interrupt", True))  # detach restores it
            self.record.add_event("policy_stop", kind=anomaly.kind, step=anomaly.step)
            return
        reason = ""
        if self.config.policy == "stop":
            reason = f" ({type(self.pipe).__name__} has no interrupt flag, so policy 'stop' raises)"
        raise_after_saving(anomaly, lambda: self.report().save(), reason)

    # -- pipeline calls -------------------------------------------------------------------------
    def _static_checks(self) -> None:
        with self._guard("static_checks"):
            for anomaly, key in checks.static_checks(self.pipe, component_dtypes(self.components)):
                self.sink.emit(anomaly, key, once=True)

    def _on_set_timesteps(self, args: tuple, kwargs: dict) -> None:
        with self._guard("set_timesteps"):
            self._begin_run_if_needed()
            scheduler = self.pipe.scheduler
            steps, first, self._run.init_noise_sigma = patches.read_set_timesteps(scheduler, args, kwargs)
            self._run.step = 0
            sigma0 = self._run.init_noise_sigma
            self.record.add_event(
                "set_timesteps", num_inference_steps=steps, first_timestep=first, init_noise_sigma=sigma0
            )
            for anomaly in checks.scheduler_config(scheduler, num_inference_steps=steps, first_timestep=first):
                if anomaly.details.get("rule") == "leading_spacing_few_steps":
                    self.sink.emit(anomaly, ("scheduler_config", "leading_spacing_few_steps", steps), once=True)
            self._run.mark = time.perf_counter()

    def _on_encode_prompt(self, signature: Any, args: tuple, kwargs: dict) -> None:
        with self._guard("prompt_truncated"):
            self._begin_run_if_needed()
            for anomaly, key in checks.truncated_prompts(patches.prompt_texts(self.pipe, signature, args, kwargs)):
                self.sink.emit(anomaly, key)
        self._apply_policy()

    def _on_safety_checker(self, has_nsfw_concept: Any) -> None:
        with self._guard("safety_checker"):
            for anomaly in safety_blackout(has_nsfw_concept):
                self.sink.emit(anomaly)  # a warning: the policy has nothing to act on

    def _on_scheduler_step(self, args: tuple, kwargs: dict, output: Any, index_before: int | None) -> None:
        with self._guard("step"):
            inputs = patches.read_scheduler_step(self.pipe.scheduler, args, kwargs, output, index_before)
            inputs = guidance.with_cfg_batch(self._run.with_last_output(inputs), self.denoiser, self.pipe)
            self._step_call = (args, kwargs)  # where non-finite latents came from, if they turn out so
            self._run.last_row = self._record_step(self._run.step, inputs)
            self._run.step += 1
        self._apply_policy()

    def _on_call_start(self, site: CallSite) -> None:
        if role(site.role).begins_run:  # encoding a prompt or an image begins a run
            self._begin_run_if_needed()

    def _on_call_output(self, site: CallSite, output: Any, tensor: torch.Tensor | None) -> None:
        if site.role != "denoiser" and is_loop_role(site.role) and self.denoiser is not None:
            return  # a ControlNet or adapter: its readings are measured with the step, before the denoiser's
        if site.role != "denoiser" or self.denoiser is None:  # a text encoder or VAE call: checked on its own
            with self._guard(f"{site.component}_output"):
                phase = call_phase(site.role, site.prefix)
                step = self._run.step - 1 if self._run.stepped and phase != "decode" else None
                self._check_call(site, tensor, step, phase)
            self._apply_policy()
            return
        with self._guard("denoiser_output"):  # measured with the step that follows
            self._run.add_output(tensor)
            if self._run.unstepped:  # no step follows (direct calls, a replaced scheduler)
                if self._run.note_unstepped():
                    calls, note = self._run.denoiser_calls, UNSTEPPED_NOTE
                    self.record.add_event("unstepped_denoiser_calls", component=site.component, calls=calls, note=note)
                self._check_call(site, tensor, None, "denoise (no scheduler step)")
        if self._run.unstepped:
            self._apply_policy()

    def _check_call(self, site: CallSite, tensor: torch.Tensor | None, step: int | None, phase: str) -> None:
        """One call on its own: its output and probe readings in one transfer, then the checks."""
        limit = self.config.max_debug_iterations
        if site.role == "denoiser" and limit is not None and self._run.monitored >= limit:
            self._probes.reset(site.component)
        else:
            probe, decoded = self._probes.take(site.component), site.prefix == "decoder"
            values = rows.measure_call(tensor, probe, decoded_images=decoded)
            self._localizer.check(site.component, values.readings, values.output_finite, step, None, phase)
            # a non-finite image is the NaN/Inf's consequence, already named at its origin: not saturation
            if decoded and values.outside_fraction is not None and values.output_finite:
                threshold = self.config.vae_saturation_fraction
                with self._guard("vae_saturation"):
                    for anomaly, key in rows.decoded_image_anomalies(
                        values, threshold=threshold, step=step, component=site.component
                    ):
                        self.sink.emit(anomaly, key)
                ranges, absmax = values.image_ranges, values.output_absmax
                self.record.add_event(
                    "vae_decode", outside_fraction=values.outside_fraction, image_ranges=ranges, output_absmax=absmax
                )
        self._calls.drop_call(site.component, site.prefix)

    def _probe_error(self, where: str, error: Exception) -> None:
        self.sink.debugger_error(where, error, step=self._run.current_step)

    # -- a step -----------------------------------------------------------------------------------
    def _record_step(self, step: int, inputs: rows.StepInputs) -> dict[str, Any]:
        """Measure everything of one step in one transfer, record the row, run the checks."""
        run = self._run
        run.stepped, run.monitored = True, run.monitored + 1
        if self.config.max_debug_iterations is not None and run.monitored > self.config.max_debug_iterations:
            self._probes.reset()
            self._end_step()
            return {"step": step, "skipped": "max_debug_iterations"}
        decoder, latents = preview_decoder(self.components), inputs.latents  # the VAE role's component
        vae = decoder.module if decoder is not None else None
        if self.config.previews:
            with self._guard("previews"):
                x0 = inputs.pred_original_sample
                self._previews.add_latents(step, x0 if x0 is not None else latents, vae)
        values = rows.measure_step(inputs, self._probes.take_all())
        now = time.perf_counter()
        row = rows.build_row(step, values, time_s=now - run.mark, denoiser_calls=run.denoiser_calls, run=self._runs)
        run.mark = now
        if self.config.memory_tracking:
            with self._guard("memory"):
                row["memory"] = memory_sample(latents.device if isinstance(latents, torch.Tensor) else None)
        self.record.add_step(row)
        self._check_step(step, values)
        if self._previews.wants_vae(step, latents, vae):
            with self._guard("vae_preview"), self._quiet(decoder.name):
                self._previews.add_vae(step, decode_first_image(vae, latents))
        self._end_step()  # no activation or call argument is held across steps
        return row

    def _check_step(self, step: int, values: rows.StepValues) -> None:
        denoiser, timestep = self.denoiser.name if self.denoiser else "", values.scalars["timestep"]
        # in execution order: ControlNets and adapters run before the denoiser they feed
        for name, readings in sorted(values.readings.items(), key=lambda item: item[0] == denoiser):
            if name == denoiser or readings:
                finite = values.output_finite if name == denoiser else True
                self._localizer.check(name, readings, finite, step, timestep, "denoise")
        if not values.readings and not values.output_finite:
            self._localizer.check(denoiser, [], False, step, timestep, "denoise")
        if "latents" in values.stats:
            with self._guard("latent_divergence"):
                for anomaly, key in rows.latent_anomalies(
                    step,
                    values,
                    init_noise_sigma=self._run.init_noise_sigma,
                    tolerance=self.config.latent_std_tolerance,
                    previous_l2=self._run.previous_l2,
                ):
                    if anomaly.severity != "error":
                        self.sink.emit(anomaly, key)
                        continue
                    if self._localizer.origin is None and self._step_call is not None:  # not made by the denoiser
                        origin = origins.explain_latents(self._step_call, self.pipe, step=step, timestep=timestep)
                        self._localizer.emit_nonfinite(origin)
                    self._localizer.emit_nonfinite(anomaly, key)  # the origin, or a warning pointing at it
                self._run.previous_l2 = values.stats["latents"].l2

    def _explain(self, component: str, step: int | None, timestep: float | None, phase: str) -> Anomaly:
        """Where the NaN/Inf that ``component`` received came from (no watched module made it)."""
        kept = kept_arguments(self._calls, component)
        return origins.explain_received(component, kept, self.pipe, step=step, timestep=timestep, phase=phase)

    def _maybe_bundle(self, anomaly: Anomaly) -> None:
        site = self._calls.site_for(anomaly.component, anomaly.module)
        if not self.config.repro_bundle or self._bundles or site is None:
            return
        with self._guard("repro_bundle"):
            args, kwargs = self._calls.kept_call(site)
            module = next(c.module for c in self.components if c.name == anomaly.component)
            kept = dict(call_prefix=site.prefix, component_module=module, args=args, kwargs=kwargs)
            self._bundles.append(str(save_anomaly_bundle(self.record.run_dir, anomaly, **kept)))

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
        check_monitor_arguments(step, latents)  # the seed documents' (pipe, step, latents): one TypeError
        if self.attached and self._run.last_row is not None:
            return self._run.last_row  # scheduler.step just recorded this step
        row: dict[str, Any] = {"step": step}
        with self._guard("monitor_diffusion_step"):
            if isinstance(timestep, (int, float)):
                timestep = torch.tensor(float(timestep))
            timestep = timestep if isinstance(timestep, torch.Tensor) else None
            inputs = rows.StepInputs(timestep, latents, denoiser_output=None, batch=latents.shape[0])
            row = self._record_step(int(step), self._run.with_last_output(inputs))
        self._apply_policy()
        return row

    def analyze_diffusion_pipeline(self, *misused: Any) -> dict[str, Any]:
        """Per component: class, parameters (total, trainable), dtype(s), device(s), bytes; the
        pipeline's ``total_parameters``; the scheduler's class and key config. Takes no argument
        (a pipeline passed, as the seed documents did, is a TypeError naming the right call)."""
        check_no_pipeline_argument(misused)
        return analyze_pipeline(self.pipe)

    def get_debug_summary(self) -> dict[str, Any]:
        """Counts and the first error, for a terminal or a log line."""
        runtime, total = self._calls.runtime, self.analyze_diffusion_pipeline()["total_parameters"]
        return summary.debug_summary(self.record, self.pipe, self.attached, self._runs, runtime, self._bundles, total)

    def clear_debug_history(self) -> None:
        """Forget steps, anomalies, previews, timings and where overflows were localised (the
        files already written stay)."""
        self.record.clear()
        self.sink.clear()
        self._previews.clear()
        self._calls.runtime.clear()
        self._bundles.clear()
        self._localizer.clear()
        self._probes.reset()
        self._new_run_state()

    def report(self) -> DebugReport:
        """The record so far, with components and previews, ready to ``save()``."""
        return summary.build_report(
            self.record,
            self.pipe,
            self.components,
            runs=self._runs,
            runtime=self._calls.runtime,
            bundles=self._bundles,
            files=self._previews.files(),
        )
