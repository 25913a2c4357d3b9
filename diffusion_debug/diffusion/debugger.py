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

How it watches, without changing what it watches:

* every component (denoiser, VAE, text encoders) gets a :class:`~diffusion_debug.probes.Probe`
  (block level by default, every module at level ``extreme``) and a forward pre-hook / hook on
  its call site (the component, or the VAE's ``encoder`` / ``decoder``) for timing, memory and
  the arguments of the current call;
* ``pipe.scheduler.step``, ``pipe.scheduler.set_timesteps`` and ``pipe.encode_prompt`` get
  instance-attribute wrappers (classes are never patched; detach deletes them again), so steps
  are seen in every pipeline, with or without ``callback_on_step_end``;
* per step, the latents, the denoiser output and the probe readings reach the host in one
  transfer; a NaN/Inf seen at block level is localised by replaying that one call with full
  probes (RNG state saved and restored), and the call's arguments are dropped after the step.

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
import inspect
import logging
import time
import traceback
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from ..config import DebugConfig, resolve_config
from ..core import DebugReport
from ..errors import DiffusionDebugError
from ..memory import memory_sample, reset_cuda_peak
from ..probes import ModuleReading, Probe, ProbeHandle, find_producer, first_nonfinite
from ..record import Anomaly, RunRecord
from ..stats import TensorStats, absmax_on_device, dtype_name, iter_tensors, measure
from . import checks
from .bundle import save_bundle
from .components import (
    TOKENIZER_FOR_ENCODER,
    CallSite,
    Component,
    analyze_pipeline,
    call_sites,
    find_components,
    module_dtype,
    validate_pipeline,
)
from .localize import replay_readings
from .methods import MethodPatch
from .previews import PreviewBuffer, downsample, latent_space, latent_to_rgb, render_files
from .transfer import fetch_step, merge_stats

logger = logging.getLogger("diffusion_debug")

_STAT_KEYS = ("shape", "dtype", "mean", "std", "min", "max", "absmax", "l2", "nan", "posinf", "neginf")
_ROW_TENSORS = ("latents", "model_output", "uncond", "cond", "pred_original_sample")  # row order
_SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}
_MAX_HELD_OUTPUTS = 2  # denoiser outputs held until the step ends (the last ones of the step)
# Denoiser calls without a scheduler step after which every further call is checked on its own
# (the scheduler was replaced, or the denoiser is called directly): the probe queue stays bounded.
_MAX_UNSTEPPED_CALLS = 8


def _stats_dict(stats: TensorStats) -> dict[str, Any]:
    full = stats.to_dict()
    return {key: full[key] for key in _STAT_KEYS}


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next((t for _, t in iter_tensors(obj)), None)


class DiffusionModelDebugger:
    """Watches a diffusers pipeline: per-step record, NaN/Inf producer, overflow risk, previews.

    ``with dbg: pipe(...)`` attaches on enter and detaches on exit (also on an exception);
    ``dbg.attach()`` returns a handle whose ``remove()`` detaches.  Nothing is written before
    the pipeline and config are validated.

    ``events.jsonl`` stays open for the debugger's life, so ``with dbg:`` can be entered again;
    :meth:`close` (or the debugger being garbage-collected) closes it.
    """

    def __init__(self, pipe: Any, config: DebugConfig | Mapping[str, Any] | None = None):
        cfg = resolve_config(config)
        validate_pipeline(pipe)
        self.pipe = pipe
        self.config = cfg
        self.components: list[Component] = find_components(pipe)
        self.denoiser: Component = self.components[0]
        self._sites: list[CallSite] = [site for c in self.components for site in call_sites(c)]
        self._by_name = {c.name: c for c in self.components}
        self.record = RunRecord(cfg, kind="diffusion")  # creates the run directory: after validation
        self._handles: list[Any] = []
        self._patches: list[MethodPatch] = []
        self._probes: dict[str, Probe] = {}
        self._handle: ProbeHandle | None = None
        self._interrupt_saved: tuple[bool, Any] | None = None
        self._busy = False
        self._static_seen: set[tuple] = set()
        # where a block-level overflow was localised by a replay: kept across runs (the same
        # weights overflow in the same place), forgotten by clear_debug_history
        self._overflow_where: dict[tuple[str, str], ModuleReading | None] = {}
        self._previews = PreviewBuffer(32)
        self._vae_previews = PreviewBuffer(16)
        self._runtime: dict[str, dict[str, Any]] = {}
        self._bundles: list[str] = []
        self._runs = 0
        self._last_step_row: dict[str, Any] | None = None  # the row scheduler.step just recorded
        self._reset_run_state()
        # closes events.jsonl when the debugger is collected; holds the record, not the debugger
        self._finalizer = weakref.finalize(self, self.record.close)

    # -- state ------------------------------------------------------------------------------
    def _reset_run_state(self) -> None:
        self._step = 0
        self._stepped = False
        self._seen: dict[tuple, Anomaly] = {}
        self._overflow_tried: set[tuple[str, str]] = set()  # replays that could not run this run
        self._captured: dict[tuple[str, str], tuple[tuple, dict]] = {}
        self._replays: list[dict[str, Any]] = []  # this run's replays, against debug_timeout
        self._outputs: list[torch.Tensor] = []
        self._denoiser_calls = 0
        self._open_timers: dict[int, list[float]] = {}
        self._policy_queue: list[Anomaly] = []
        self._previous_l2: float | None = None
        self._mark = time.perf_counter()
        self._init_noise_sigma = 1.0
        self._monitored = 0
        self._last_step_row = None
        self._unstepped_noted = False

    def _begin_run_if_needed(self) -> None:
        if self._stepped or self._runs == 0:
            self._runs += 1
            policy_queue = self._policy_queue
            self._reset_run_state()
            self._policy_queue = policy_queue
            self.record.add_event("run_start", run=self._runs)

    @property
    def attached(self) -> bool:
        return self._handle is not None

    # -- attach / detach --------------------------------------------------------------------
    def attach(self) -> ProbeHandle:
        """Register the probes, hooks and method wrappers; returns a handle that detaches."""
        if self._handle is not None:
            return self._handle
        try:
            if self.config.probes != "off":
                for component in self.components:
                    probe = Probe(component.module, self.config.probes, strict=self.config.strict)
                    self._probes[component.name] = probe
                    self._handles.append(probe.attach())
            for site in self._sites:
                # the call site's device, found once here and then followed from its outputs
                # (offloading moves a component between calls): no parameter walk per call
                where = {"device": _device_of(site.module)}
                self._handles.append(
                    site.module.register_forward_pre_hook(self._make_pre_hook(site, where), with_kwargs=True)
                )
                self._handles.append(
                    site.module.register_forward_hook(self._make_post_hook(site, where), with_kwargs=True)
                )
            scheduler = getattr(self.pipe, "scheduler", None)
            if scheduler is not None and callable(getattr(scheduler, "step", None)):
                self._patches.append(MethodPatch(scheduler, "step", self._wrap_scheduler_step))
                if callable(getattr(scheduler, "set_timesteps", None)):
                    self._patches.append(MethodPatch(scheduler, "set_timesteps", self._wrap_set_timesteps))
            if callable(getattr(self.pipe, "encode_prompt", None)):
                self._patches.append(MethodPatch(self.pipe, "encode_prompt", self._wrap_encode_prompt))
        except BaseException:
            self._release()
            raise
        handle = ProbeHandle([], on_remove=lambda: self._detach_from(ref))
        ref = weakref.ref(handle)
        self._handle = handle
        self.record.add_event("attach", components=[c.name for c in self.components], probes=self.config.probes)
        self._static_checks()
        return self._handle

    def _detach_from(self, ref: "weakref.ref[ProbeHandle]") -> None:
        """A handle's ``remove()``: detach only if that handle's attach is the current one (an
        old handle must not undo a later attach)."""
        handle = ref()
        if handle is not None and handle is self._handle:
            self.detach()

    def detach(self) -> None:
        """Remove every hook and wrapper this debugger added; idempotent."""
        if self._handle is None and not self._handles and not self._patches:
            return
        self._handle = None
        self._release()
        self.record.add_event("detach")

    def _release(self) -> None:
        handles, self._handles = self._handles, []
        patches, self._patches = self._patches, []
        try:
            for handle in reversed(handles):
                handle.remove()
        finally:
            for patch in reversed(patches):
                patch.restore()
            if self._interrupt_saved is not None:
                had, value = self._interrupt_saved
                self._interrupt_saved = None
                if had:
                    object.__setattr__(self.pipe, "_interrupt", value)
                elif "_interrupt" in vars(self.pipe):
                    object.__delattr__(self.pipe, "_interrupt")
            self._probes = {}
            self._captured = {}
            self._outputs = []
            self._last_step_row = None

    def close(self) -> None:
        """Detach (if attached) and close ``events.jsonl``; idempotent.

        ``report()`` and ``report().save()`` still work afterwards (the events already streamed
        stay in the file; later ones are kept in memory only).  Leaving a ``with dbg:`` block
        only detaches, so the debugger can be entered again; call ``close()`` when done with it.
        """
        self.detach()
        self._finalizer()

    def __enter__(self) -> "DiffusionModelDebugger":
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()  # not close(): a debugger can be entered again

    # -- internal errors and anomalies ------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        try:
            yield
        except DiffusionDebugError:
            raise
        except Exception as error:
            if self.config.strict:
                raise
            self._internal_error(where, error)

    def _internal_error(self, where: str, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        self._emit(
            Anomaly(
                kind="debugger_error",
                severity="warning",
                message=f"The debugger's {where} measurement failed ({text[:200]}); the run went on without it.",
                step=self._step if self._stepped else None,
                details={"where": where, "error": text, "traceback": traceback.format_exc(limit=4)[-2000:]},
            ),
            ("debugger_error", where),
        )

    def _emit(self, anomaly: Anomaly, key: tuple, *, static: bool = False) -> bool:
        """Record ``anomaly`` once per key and run (later ones count in ``details["count"]``);
        error-severity ones go to the policy queue every time."""
        if anomaly.severity == "error":
            self._policy_queue.append(anomaly)
        seen = self._static_seen if static else None
        if static:
            if key in seen:
                return False
            seen.add(key)
        elif key in self._seen:
            first = self._seen[key]
            first.details["count"] = first.details.get("count", 1) + 1
            if anomaly.step is not None:
                first.details["last_step"] = anomaly.step
            if anomaly.severity == "error":
                self._policy_queue[-1] = first
            return False
        else:
            self._seen[key] = anomaly
        anomaly.details.setdefault("count", 1)
        self.record.add_anomaly(anomaly)
        if _SEVERITY_RANK[anomaly.severity] >= _SEVERITY_RANK[self.config.log_level]:
            log = (
                logger.error
                if anomaly.severity == "error"
                else logger.warning
                if anomaly.severity == "warning"
                else logger.info
            )
            log("%s at %s: %s", anomaly.kind, anomaly.where() or "pipeline", anomaly.message)
        if self.config.policy == "warn" and anomaly.severity == "error":
            warnings.warn(
                f"diffusion-debug {anomaly.kind} at {anomaly.where()}: {anomaly.message}", RuntimeWarning, stacklevel=3
            )
        return True

    def _apply_policy(self) -> None:
        queue, self._policy_queue = self._policy_queue, []
        if not queue or self.config.policy in ("record", "warn", "skip"):
            return
        anomaly = queue[0]
        if self.config.policy == "stop" and self._can_interrupt():
            if self._interrupt_saved is None:
                self._interrupt_saved = ("_interrupt" in vars(self.pipe), vars(self.pipe).get("_interrupt"))
            object.__setattr__(self.pipe, "_interrupt", True)
            self.record.add_event("policy_stop", kind=anomaly.kind, step=anomaly.step)
            return
        reason = (
            ""
            if self.config.policy == "raise"
            else f" ({type(self.pipe).__name__} has no interrupt flag, so policy 'stop' raises)"
        )
        try:
            run_dir = self.report().save()
        except Exception as save_error:  # the user gets a DiffusionDebugError either way
            raise DiffusionDebugError(
                f"{anomaly.kind} at {anomaly.where()}: {anomaly.message} The report could not be saved "
                f"({type(save_error).__name__}: {str(save_error)[:200]}){reason}.",
                anomaly=anomaly,
                run_dir=None,
            ) from save_error
        raise DiffusionDebugError(
            f"{anomaly.kind} at {anomaly.where()}: {anomaly.message} Report saved to {run_dir}{reason}.",
            anomaly=anomaly,
            run_dir=run_dir,
        )

    def _can_interrupt(self) -> bool:
        return isinstance(getattr(type(self.pipe), "interrupt", None), property)

    # -- static checks ----------------------------------------------------------------------
    def _static_checks(self) -> None:
        with self._guard("scheduler_config"):
            scheduler = getattr(self.pipe, "scheduler", None)
            if scheduler is not None:
                for anomaly in checks.scheduler_config(scheduler):
                    self._emit(anomaly, ("scheduler_config", anomaly.details.get("rule")), static=True)
        with self._guard("dtype_mismatch"):
            dtypes = {c.name: (dtype_name(d) if (d := module_dtype(c.module)) else None) for c in self.components}
            for anomaly in checks.dtype_mismatch(self.pipe, dtypes, self.denoiser.name):
                self._emit(anomaly, ("dtype_mismatch", anomaly.message), static=True)

    # -- method wrappers --------------------------------------------------------------------
    def _wrap_set_timesteps(self, original):
        def set_timesteps(*args, **kwargs):
            result = original(*args, **kwargs)
            if not self._busy:
                with self._guard("set_timesteps"):
                    self._on_set_timesteps(original, args, kwargs)
            return result

        return set_timesteps

    def _on_set_timesteps(self, original, args, kwargs) -> None:
        self._begin_run_if_needed()
        self._step = 0
        scheduler = self.pipe.scheduler
        timesteps = getattr(scheduler, "timesteps", None)
        steps = kwargs.get("num_inference_steps", args[0] if args else None)
        if not isinstance(steps, int):
            steps = len(timesteps) if timesteps is not None else None
        first = float(timesteps[0]) if timesteps is not None and len(timesteps) else None  # once per run
        sigma0 = getattr(scheduler, "init_noise_sigma", 1.0)
        self._init_noise_sigma = float(sigma0) if sigma0 is not None else 1.0
        self.record.add_event(
            "set_timesteps", num_inference_steps=steps, first_timestep=first, init_noise_sigma=self._init_noise_sigma
        )
        for anomaly in checks.scheduler_config(scheduler, num_inference_steps=steps, first_timestep=first):
            if anomaly.details.get("rule") == "leading_spacing_few_steps":
                self._emit(anomaly, ("scheduler_config", "leading_spacing_few_steps", steps), static=True)
        self._mark = time.perf_counter()

    def _wrap_encode_prompt(self, original):
        signature = inspect.signature(original)

        def encode_prompt(*args, **kwargs):
            if not self._busy:
                with self._guard("prompt_truncated"):
                    self._begin_run_if_needed()
                    self._check_prompts(signature, args, kwargs)
                self._apply_policy()
            return original(*args, **kwargs)

        return encode_prompt

    def _check_prompts(self, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        bound = signature.bind_partial(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        for encoder, tokenizer_name in TOKENIZER_FOR_ENCODER.items():
            tokenizer = getattr(self.pipe, tokenizer_name, None)
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
                    if not isinstance(text, str):
                        continue
                    dropped, dropped_text = checks.count_dropped_tokens(tokenizer, text, max_length)
                    for anomaly in checks.prompt_truncated(
                        encoder, tokenizer_name, role, index, dropped, dropped_text, max_length
                    ):
                        self._emit(anomaly, ("prompt_truncated", tokenizer_name, role, index))

    def _wrap_scheduler_step(self, original):
        def step(*args, **kwargs):
            if self._busy:
                return original(*args, **kwargs)
            index_before = getattr(self.pipe.scheduler, "step_index", None)
            output = original(*args, **kwargs)
            with self._guard("step"):
                self._on_scheduler_step(args, kwargs, output, index_before)
            self._apply_policy()
            return output

        return step

    # -- component hooks --------------------------------------------------------------------
    def _make_pre_hook(self, site: CallSite, where: dict[str, Any]):
        key = (site.component, site.prefix)
        keep_call = self.config.localize or self.config.repro_bundle
        sync = self.config.cuda_synchronize
        track_memory = self.config.memory_tracking
        starts_run = self._by_name[site.component].role == "text_encoder"

        def pre_hook(module, args, kwargs):
            if self._busy:
                return None
            with self._guard("timing"):
                if starts_run:
                    self._begin_run_if_needed()
                if keep_call:
                    self._captured[key] = (args, kwargs)
                device = where["device"]
                if device is not None and device.type == "cuda":
                    if sync:
                        torch.cuda.synchronize(device)
                    if track_memory:
                        reset_cuda_peak(device)
                self._open_timers.setdefault(id(module), []).append(time.perf_counter())
            return None

        return pre_hook

    def _make_post_hook(self, site: CallSite, where: dict[str, Any]):
        component = self._by_name[site.component]
        sync = self.config.cuda_synchronize
        track_memory = self.config.memory_tracking

        def post_hook(module, args, kwargs, output):
            if self._busy:
                return None
            tensor = None
            with self._guard("timing"):
                tensor = _first_tensor(output)
                if tensor is not None:
                    where["device"] = tensor.device
                device = where["device"]
                if sync and device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                stack = self._open_timers.get(id(module))
                started = stack.pop() if stack else None
                entry = self._runtime.setdefault(
                    site.component, {"calls": 0, "total_time_s": 0.0, "peak_memory_mb": None}
                )
                entry["calls"] += 1
                if started is not None:
                    entry["total_time_s"] += time.perf_counter() - started
                if track_memory:
                    sample = memory_sample(device)
                    peak = sample.get("cuda_peak_mb", sample["rss_mb"])
                    entry["peak_memory_mb"] = max(entry["peak_memory_mb"] or 0.0, peak)
            if component.role == "denoiser":
                with self._guard("denoiser_output"):
                    if tensor is not None:
                        self._outputs = (self._outputs + [tensor])[-_MAX_HELD_OUTPUTS:]
                    self._denoiser_calls += 1
                    self._last_step_row = None
                    if self._denoiser_calls > _MAX_UNSTEPPED_CALLS:
                        self._on_unstepped_call(tensor)
                if self._denoiser_calls > _MAX_UNSTEPPED_CALLS:
                    self._apply_policy()
                return None
            with self._guard(f"{site.component}_output"):
                self._on_component_output(site, output, tensor)
            self._apply_policy()
            return None

        return post_hook

    # -- text encoder and VAE calls ---------------------------------------------------------
    def _on_component_output(self, site: CallSite, output: Any, tensor: torch.Tensor | None = None) -> None:
        """A text encoder or VAE call finished: fetch its readings (one transfer) and check."""
        name = site.component
        if tensor is None:
            tensor = _first_tensor(output)
        if tensor is not None and not tensor.is_floating_point():
            tensor = None
        scalars: list[torch.Tensor] = []
        probe_values, make_readings = self._take_probe(name)
        absmax = absmax_on_device(tensor) if tensor is not None else None  # None: empty or meta
        if absmax is not None:
            scalars.append(absmax)
        decoded = (
            site.prefix == "decoder"
            and tensor is not None
            and tensor.dim() >= 2
            and tensor.numel() > 0
            and not tensor.is_meta
        )
        first_decoded = len(scalars)
        if decoded:
            with torch.no_grad():
                x = tensor.detach()
                scalars.append(((x.abs() > 1) | ~torch.isfinite(x)).float().mean())
                flat = x.flatten(1).float()
                scalars.extend((flat.amax(1) - flat.amin(1)).unbind())
        _, host = fetch_step([], scalars + probe_values)
        n = len(scalars)
        readings = make_readings(host[n:])
        output_absmax = host[0] if absmax is not None else None
        phase = {"": "encode_prompt", "encoder": "encode", "decoder": "decode"}.get(site.prefix, site.prefix)
        step = self._step - 1 if (self._stepped and phase != "decode") else None
        output_finite = output_absmax is None or (output_absmax == output_absmax and output_absmax != float("inf"))
        self._check_component(name, readings, output_finite, step=step, timestep=None, phase=phase)
        if decoded:
            outside, ranges = host[first_decoded], host[first_decoded + 1 : n]
            with self._guard("vae_saturation"):
                for anomaly in checks.vae_saturation(
                    outside, ranges, threshold=self.config.vae_saturation_fraction, step=step
                ):
                    self._emit(anomaly, ("vae_saturation", "flat_images" in anomaly.details))
            self.record.add_event(
                "vae_decode", outside_fraction=outside, image_ranges=ranges, output_absmax=output_absmax
            )
        self._captured.pop((site.component, site.prefix), None)

    def _on_unstepped_call(self, tensor: torch.Tensor | None) -> None:
        """The denoiser was called more than ``_MAX_UNSTEPPED_CALLS`` times without a scheduler
        step (the scheduler was replaced, or the denoiser is called directly): check this call's
        readings on their own (``step`` None) so that a fault is still reported and nothing
        queues up.  Costs one transfer per call, like a step."""
        name = self.denoiser.name
        if not self._unstepped_noted:
            self._unstepped_noted = True
            self.record.add_event(
                "unstepped_denoiser_calls",
                component=name,
                calls=self._denoiser_calls,
                note="no scheduler.step seen between denoiser calls; each call is checked on its own",
            )
        limit = self.config.max_debug_iterations
        if limit is not None and self._monitored >= limit:
            probe = self._probes.get(name)
            if probe is not None:
                probe.reset()
            self._captured.pop((name, ""), None)
            return
        absmax = absmax_on_device(tensor) if tensor is not None and tensor.is_floating_point() else None
        probe_values, make_readings = self._take_probe(name)
        scalars = [absmax] if absmax is not None else []
        _, host = fetch_step([], scalars + probe_values)
        readings = make_readings(host[len(scalars) :])
        output_absmax = host[0] if scalars else None
        output_finite = output_absmax is None or (output_absmax == output_absmax and output_absmax != float("inf"))
        self._check_component(
            name, readings, output_finite, step=None, timestep=None, phase="denoise (no scheduler step)"
        )
        self._captured.pop((name, ""), None)

    def _take_probe(self, name: str):
        probe = self._probes.get(name)
        if probe is None:
            return [], lambda host: []
        for module, error in probe.errors:
            self._internal_error(f"probe {name}.{module}", RuntimeError(error))
        probe.errors.clear()
        return probe.take()

    # -- nonfinite and overflow -------------------------------------------------------------
    def _check_component(
        self,
        name: str,
        readings: list[ModuleReading],
        output_finite: bool,
        *,
        step: int | None,
        timestep: float | None,
        phase: str,
    ) -> None:
        with self._guard("nonfinite"):
            bad = first_nonfinite(readings)
            if bad is not None or not output_finite:
                module, how, consequence, replayed = self._localize_nonfinite(name, readings)
                key = ("nonfinite", name, consequence)
                for earlier in (False, True):  # already reported this run: count it there
                    if ("nonfinite", name, earlier) in self._seen:
                        key, consequence = ("nonfinite", name, earlier), earlier
                        break
                details = {"phase": phase, "sentinel_module": bad.module if bad else None}
                if replayed is not None:
                    details["replay_readings"] = replayed
                for anomaly in checks.nonfinite(
                    name,
                    module,
                    step=step,
                    timestep=timestep,
                    localized_by=how,
                    consequence=consequence,
                    details=details,
                ):
                    if self._emit(anomaly, key) and anomaly.severity == "error":
                        self._maybe_bundle(name, module, step, timestep, anomaly)
        with self._guard("overflow_risk"):
            self._check_overflow(name, readings, step=step, timestep=timestep)

    def _localize_nonfinite(self, name: str, readings: list[ModuleReading]):
        """``(module, how, consequence, replay reading count)``."""
        if ("nonfinite", name, False) in self._seen or ("nonfinite", name, True) in self._seen:
            return "", "already reported", False, None  # counted, not localised again
        full = self.config.probes == "full"
        bad = first_nonfinite(readings)
        producer = find_producer(readings)
        if bad is not None and producer is None:
            return "", "full probes" if full else "sentinel", True, None
        inputs_known = producer is not None and producer.input_value is not None
        if producer is not None and (full or (inputs_known and self._is_leaf(name, producer.module))):
            return producer.module, "full probes" if full else "sentinel (a leaf module)", False, None
        block = producer.module if producer is not None else ""
        if self.config.localize:
            replayed = self._replay(name, block)
            if replayed is not None:
                found = find_producer(replayed)
                if found is not None:
                    how = (
                        "sentinel -> replay with full probes"
                        if readings
                        else "output check -> replay with full probes"
                    )
                    return found.module, how, False, len(replayed)
                if first_nonfinite(replayed) is not None:
                    return "", "replay with full probes: inputs were already non-finite", True, len(replayed)
        return block, "sentinel (block level; localize is off or the call was not kept)", False, None

    def _is_leaf(self, name: str, module: str) -> bool:
        try:
            return not any(True for _ in self._by_name[name].module.get_submodule(module).children())
        except AttributeError:
            return False

    def _site_for(self, name: str, module: str) -> CallSite | None:
        sites = [
            s
            for s in self._sites
            if s.component == name and (s.prefix == "" or module == s.prefix or module.startswith(s.prefix + "."))
        ]
        sites = [s for s in sites if (s.component, s.prefix) in self._captured]
        return sites[0] if sites else None

    def _replay(self, name: str, module: str) -> list[ModuleReading] | None:
        site = self._site_for(name, module)
        if site is None:
            return None
        spent = sum(e.get("seconds", 0.0) for e in self._replays)
        if spent >= self.config.debug_timeout:  # the run's replay budget is spent
            self.record.add_event(
                "replay_skipped",
                component=name,
                call=site.prefix,
                spent_seconds=spent,
                reason=f"debug_timeout={self.config.debug_timeout}s of replays already spent",
            )
            return None
        args, kwargs = self._captured[(site.component, site.prefix)]
        started = time.perf_counter()
        self._busy = True
        try:
            readings = replay_readings(site.module, args, kwargs, site.prefix)
        finally:
            self._busy = False
            probe = self._probes.get(name)
            if probe is not None:
                probe.reset()  # the sentinel saw the replay too
        seconds = time.perf_counter() - started
        self._replays.append({"component": name, "seconds": seconds})
        self.record.add_event("replay", component=name, call=site.prefix, modules=len(readings), seconds=seconds)
        return readings

    def _check_overflow(self, name: str, readings: list[ModuleReading], *, step, timestep) -> None:
        fraction = self.config.overflow_fraction
        risky = checks.overflow_producer(readings, fraction)
        if risky is None:
            return
        how = "full probes" if self.config.probes == "full" else "sentinel"
        module = risky.module
        reading = risky
        if self.config.probes != "full" and not self._is_leaf(name, module):
            cache_key = (name, module)
            if (
                cache_key not in self._overflow_where
                and cache_key not in self._overflow_tried
                and self.config.localize
            ):
                replayed = self._replay(name, module)
                if replayed is None:  # no kept call or no replay budget: try again next run
                    self._overflow_tried.add(cache_key)
                else:  # localised once for the debugger's life (until clear_debug_history)
                    self._overflow_where[cache_key] = checks.overflow_producer(replayed, fraction)
            inner = self._overflow_where.get(cache_key)
            if inner is not None:
                reading, how = inner, "sentinel -> replay with full probes"
        for anomaly in checks.overflow_risk(
            name, reading, step=step, timestep=timestep, fraction=fraction, localized_by=how
        ):
            self._emit(anomaly, ("overflow_risk", name, reading.module))

    def _maybe_bundle(self, name: str, module: str, step, timestep, anomaly: Anomaly) -> None:
        if not self.config.repro_bundle or self._bundles:
            return
        site = self._site_for(name, module)
        if site is None:
            return
        with self._guard("repro_bundle"):
            args, kwargs = self._captured[(site.component, site.prefix)]
            label = f"{name}-step{step}" if step is not None else f"{name}-{site.prefix or 'call'}"
            path = save_bundle(
                self.record.run_dir / "bundles" / label,
                component=name,
                component_module=self._by_name[name].module,
                call_prefix=site.prefix,
                args=args,
                kwargs=kwargs,
                step=step,
                timestep=timestep,
                module=module,
                anomaly_kind=anomaly.kind,
            )
            self._bundles.append(str(path))
            anomaly.details["bundle"] = f"bundles/{label}"

    # -- steps ------------------------------------------------------------------------------
    def _on_scheduler_step(self, args: tuple, kwargs: dict, output: Any, index_before: int | None) -> None:
        scheduler = self.pipe.scheduler
        model_output = kwargs.get("model_output", args[0] if len(args) > 0 else None)
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        sample = kwargs.get("sample", args[2] if len(args) > 2 else None)
        if isinstance(output, tuple):
            prev = output[0]
            x0 = output[1] if len(output) > 1 and isinstance(output[1], torch.Tensor) else None
        else:
            prev = getattr(output, "prev_sample", None)
            x0 = getattr(output, "pred_original_sample", None)
        index = getattr(scheduler, "step_index", None)
        if index is not None:
            index = index - 1
        elif index_before is not None:
            index = index_before
        sigmas = getattr(scheduler, "sigmas", None)
        sigma = sigma_next = None
        if isinstance(sigmas, torch.Tensor) and index is not None and 0 <= index < len(sigmas):
            sigma = sigmas[index]
            sigma_next = sigmas[index + 1] if index + 1 < len(sigmas) else None
        denoiser_output = (
            self._outputs[-1] if self._outputs else (model_output if isinstance(model_output, torch.Tensor) else None)
        )
        batch = sample.shape[0] if isinstance(sample, torch.Tensor) else None
        self._last_step_row = self._record_step(
            step=self._step,
            timestep=timestep,
            latents=prev if isinstance(prev, torch.Tensor) else sample,
            denoiser_output=denoiser_output,
            x0=x0,
            batch=batch,
            sigma=sigma,
            sigma_next=sigma_next,
        )
        self._step += 1

    def _record_step(
        self,
        *,
        step: int,
        timestep: Any,
        latents: torch.Tensor | None,
        denoiser_output: torch.Tensor | None,
        x0: torch.Tensor | None,
        batch: int | None,
        sigma: Any = None,
        sigma_next: Any = None,
    ) -> dict[str, Any]:
        """Measure everything of one step, fetch it in one transfer, record the row, run checks."""
        self._stepped = True
        self._monitored += 1
        limit = self.config.max_debug_iterations
        if limit is not None and self._monitored > limit:
            for probe in self._probes.values():
                probe.reset()
            self._captured, self._outputs, self._denoiser_calls = {}, [], 0
            return {"step": step, "skipped": "max_debug_iterations"}
        pending, names = [], []

        def queue(label: str, tensor: torch.Tensor | None) -> None:
            if isinstance(tensor, torch.Tensor):
                pending.append(measure(tensor))
                names.append(label)

        queue("latents", latents)
        gap = None
        cfg_halves = (
            denoiser_output is not None
            and batch
            and denoiser_output.dim() > 0
            and denoiser_output.shape[0] == 2 * batch
        )
        if cfg_halves:  # the halves only: the whole's stats are merged from them on the host
            uncond, cond = denoiser_output.detach().chunk(2)
            queue("uncond", uncond)
            queue("cond", cond)
            with torch.no_grad():
                gap = torch.linalg.vector_norm((cond - uncond).float())
        else:
            queue("model_output", denoiser_output)
        queue("pred_original_sample", x0)
        scalars, scalar_names = [], []
        for label, value in (
            ("timestep", timestep),
            ("sigma", sigma),
            ("sigma_next", sigma_next),
            ("guidance_gap", gap),
        ):
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                scalars.append(value.reshape(()))
                scalar_names.append(label)
        probe_parts = [(name, *self._take_probe(name)) for name in list(self._probes)]
        probe_values = [v for _, values, _ in probe_parts for v in values]
        if self.config.previews:
            with self._guard("previews"):
                self._queue_preview(step, x0 if x0 is not None else latents)
        stats, host = fetch_step(pending, scalars + probe_values)  # the one transfer of the step
        by_name = dict(zip(names, stats))
        if cfg_halves:
            by_name["model_output"] = merge_stats([by_name["uncond"], by_name["cond"]], tuple(denoiser_output.shape))
            by_name = {k: by_name[k] for k in _ROW_TENSORS if k in by_name}
        values: dict[str, Any] = dict(zip(scalar_names, host[: len(scalars)]))
        for name in ("timestep", "sigma", "sigma_next", "guidance_gap"):
            if name not in values:
                raw = {"timestep": timestep, "sigma": sigma, "sigma_next": sigma_next}.get(name)
                values[name] = float(raw) if isinstance(raw, (int, float)) else None
        offset = len(scalars)
        readings: dict[str, list[ModuleReading]] = {}
        for name, part_values, make in probe_parts:
            readings[name] = make(host[offset : offset + len(part_values)])
            offset += len(part_values)
        now = time.perf_counter()
        row: dict[str, Any] = {
            "step": step,
            "timestep": values["timestep"],
            "sigma": values["sigma"],
            "time_s": now - self._mark,
            "guidance_gap": values["guidance_gap"],
            "denoiser_calls": self._denoiser_calls,
            "run": self._runs,
        }
        self._mark = now
        for label, s in by_name.items():
            row[label] = _stats_dict(s)
        if self.config.memory_tracking:
            with self._guard("memory"):
                row["memory"] = memory_sample(_device_of_tensor(latents))
        self.record.add_step(row)
        timestep_value = values["timestep"]
        output_stats = by_name.get("model_output")
        for name, component_readings in readings.items():
            if name == self.denoiser.name:
                output_finite = output_stats is None or output_stats.is_finite
                self._check_component(
                    name, component_readings, output_finite, step=step, timestep=timestep_value, phase="denoise"
                )
            elif component_readings:
                self._check_component(
                    name, component_readings, True, step=step, timestep=timestep_value, phase="denoise"
                )
        if not readings and output_stats is not None and not output_stats.is_finite:
            self._check_component(self.denoiser.name, [], False, step=step, timestep=timestep_value, phase="denoise")
        latent_stats = by_name.get("latents")
        if latent_stats is not None:
            with self._guard("latent_divergence"):
                sigma_for_latents = values["sigma_next"] if values["sigma_next"] is not None else values["sigma"]
                expected = checks.expected_latent_std(sigma_for_latents, self._init_noise_sigma)
                for anomaly in checks.latent_divergence(
                    latent_stats,
                    expected_std=expected,
                    tolerance=self.config.latent_std_tolerance,
                    step=step,
                    timestep=timestep_value,
                    model_output_finite=output_stats is None or output_stats.is_finite,
                    previous_l2=self._previous_l2,
                ):
                    self._emit(anomaly, ("latent_divergence", anomaly.severity, tuple(sorted(anomaly.details))))
                self._previous_l2 = latent_stats.l2
        if self.config.preview_vae_every and step % self.config.preview_vae_every == 0 and latents is not None:
            with self._guard("vae_preview"):
                self._vae_preview(step, latents)
        self._captured, self._outputs, self._denoiser_calls = {}, [], 0  # never held across steps
        return row

    def _queue_preview(self, step: int, latents: torch.Tensor | None) -> None:
        if latents is None or latents.dim() not in (4, 5) or not self._previews.wants(step):
            return
        vae = getattr(self.pipe, "vae", None)
        scaling = getattr(getattr(vae, "config", None), "scaling_factor", None) if vae is not None else None
        self._previews.add(step, latent_to_rgb(latents, latent_space(latents.shape[1], scaling)))

    def _vae_preview(self, step: int, latents: torch.Tensor) -> None:
        vae = getattr(self.pipe, "vae", None)
        if vae is None or latents.dim() != 4 or not self._vae_previews.wants(step):
            return
        config = vae.config
        z = latents[:1].detach() / getattr(config, "scaling_factor", 1.0)
        shift = getattr(config, "shift_factor", None)
        if shift:
            z = z + shift
        dtype = module_dtype(vae) or z.dtype
        self._busy = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                image = vae.decode(z.to(dtype), return_dict=False)[0]
        finally:
            self._busy = False
            probe = self._probes.get("vae")
            if probe is not None:
                probe.reset()
        rgb = downsample((image[0].float().clamp(-1, 1) + 1) / 2, 128)
        self._vae_previews.add(step, rgb)

    # -- public -----------------------------------------------------------------------------
    def monitor_diffusion_step(self, step: int, latents: torch.Tensor, timestep: Any = None) -> dict[str, Any]:
        """Record one step of a custom denoising loop; returns the step row.

        Call it after ``scheduler.step`` with the new latents.  If the debugger is attached, the
        denoiser output and probe readings since the last step are included.

        When to use it: in a hand-written loop whose scheduler is not ``pipe.scheduler`` (or that
        never calls a scheduler), or to record latents without attaching.  While attached,
        ``pipe.scheduler.step`` records every step by itself: a call right after it (e.g. from
        ``callback_on_step_end``) records nothing more and returns the row already recorded.
        """
        if not isinstance(latents, torch.Tensor):
            raise DiffusionDebugError(
                f"monitor_diffusion_step needs the latents as a torch.Tensor, not {type(latents).__name__}."
            )
        if self.attached and self._last_step_row is not None:
            return self._last_step_row  # scheduler.step just recorded this step
        row: dict[str, Any] = {"step": step}
        with self._guard("monitor_diffusion_step"):
            timestep_tensor = (
                timestep
                if isinstance(timestep, torch.Tensor)
                else (torch.tensor(float(timestep)) if isinstance(timestep, (int, float)) else None)
            )
            denoiser_output = self._outputs[-1] if self._outputs else None
            row = self._record_step(
                step=int(step),
                timestep=timestep_tensor,
                latents=latents,
                denoiser_output=denoiser_output,
                x0=None,
                batch=latents.shape[0],
            )
        self._apply_policy()
        return row

    def analyze_diffusion_pipeline(self) -> dict[str, Any]:
        """Per component: class, parameters (total, trainable), dtype(s), device(s), bytes; the
        pipeline's ``total_parameters``; the scheduler's class and key config."""
        return analyze_pipeline(self.pipe)

    def _component_report(self) -> dict[str, Any]:
        analysis = self.analyze_diffusion_pipeline()
        out: dict[str, Any] = {}
        for component in self.components:
            entry = dict(analysis.get(component.name, {}))
            runtime = dict(
                self._runtime.get(component.name, {"calls": 0, "total_time_s": 0.0, "peak_memory_mb": None})
            )
            runtime["mean_time_s"] = runtime["total_time_s"] / runtime["calls"] if runtime["calls"] else None
            entry.update(runtime)
            out[component.name] = entry
        if "scheduler" in analysis:
            out["scheduler"] = analysis["scheduler"]
        return out

    def get_debug_summary(self) -> dict[str, Any]:
        """Counts and the first error, for a terminal or a log line."""
        anomalies = self.record.anomalies
        first_error = next((a for a in anomalies if a.severity == "error"), None)
        steps = list(self.record.steps)
        return {
            "run_dir": str(self.record.run_dir),
            "pipeline": type(self.pipe).__name__,
            "attached": self.attached,
            "runs": self._runs,
            "steps_recorded": len(steps),
            "anomaly_counts": dict(self.record.anomaly_counts),
            "severity_counts": dict(self.record.severity_counts),
            "first_error": first_error.to_dict() if first_error else None,
            "components": {name: dict(v) for name, v in self._runtime.items()},
            "bundles": list(self._bundles),
            "total_parameters": self.analyze_diffusion_pipeline()["total_parameters"],
        }

    def clear_debug_history(self) -> None:
        """Forget steps, anomalies, previews and timings (the files already written stay)."""
        self.record.clear()
        self._static_seen.clear()
        self._previews.clear()
        self._vae_previews.clear()
        self._runtime.clear()
        self._bundles.clear()
        self._overflow_where.clear()
        for probe in self._probes.values():
            probe.reset()
        self._reset_run_state()

    def report(self) -> DebugReport:
        """The record so far, with components and previews, ready to ``save()``."""
        files: dict[str, bytes] = {}
        if self._previews.items:
            files.update(render_files(self._previews))
        if self._vae_previews.items:
            files.update(
                {k.replace("previews/", "previews/vae_"): v for k, v in render_files(self._vae_previews).items()}
            )
        summary = self.record.summary()
        summary.update(
            pipeline=type(self.pipe).__name__,
            runs=self._runs,
            steps_recorded=len(self.record.steps),
            total_parameters=self.analyze_diffusion_pipeline()["total_parameters"],
            bundles=list(self._bundles),
            previews=sorted(files),
        )
        return DebugReport(
            run_dir=self.record.run_dir,
            summary=summary,
            anomalies=list(self.record.anomalies),
            steps=list(self.record.steps),
            components=self._component_report(),
            files=files,
            record=self.record,
        )


def _device_of(module: nn.Module) -> torch.device | None:
    for p in module.parameters():
        return p.device
    return None


def _device_of_tensor(t: Any) -> torch.device | None:
    return t.device if isinstance(t, torch.Tensor) else None
