"""TrainingDebugger: a few lines in a training loop, plain PyTorch or Accelerate.

Call it after ``accelerator.backward(loss)`` and before ``optimizer.step()``::

    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(level="advanced"))
    for batch in loader:
        with accelerator.accumulate(model):
            loss = ...
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=global_step, timesteps=timesteps)
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
    tdbg.report().save()

What a monitored step costs: the loss and a few fused reductions over the gradients
(``torch._foreach_norm``) stay on the device; with several processes one ``all_gather`` of a
fixed-size float64 vector (loss, global gradient norm, non-finite counts, memory, GradScaler
scale, timestep-bucket sums) carries every rank's figures to every rank; then ONE
device-to-host transfer. Extra transfers and collectives happen only in steps every rank knows
are special (a NaN/Inf somewhere, a parameter checksum every ``rank_check_every`` steps).

Choices, stated:

* Gradients are read only when complete (``accelerator.sync_gradients``; every call without an
  Accelerator). Micro-steps add their loss (and timesteps) to the step's mean on the device.
* Under fp16 with a GradScaler the gradients are read *without mutation*: norms are divided by
  the scaler's current scale (unless the optimizer was already unscaled). We do not call
  ``unscale_`` ourselves, because Accelerate's ``clip_grad_norm_`` calls it unconditionally and
  torch raises on a second ``unscale_`` in the same step.
* Gradient norms are *before clipping* (the user clips after monitoring).
* Update-to-weight ratio per module = ``lr * ||grad|| / ||weight||``, the plain-SGD step size
  (for Adam-like optimizers an indication, not the exact update); no copy of the weights kept.
  The weight norms are read every 10th monitored step (``_WEIGHT_NORMS_EVERY``) and cached in
  between: reading every weight costs as much as reading every gradient.
* Nothing waits in a collective because of us: a rank whose measurement raises still joins the
  step's ``all_gather`` with a row of NaNs and its failure slot set; every rank then records a
  ``debugger_error`` for it (not a NaN loss) and training goes on. An error after the gather
  (judging, recording the step, logging to trackers) is held until the step's other
  collectives are done and the policy has run, then recorded on its rank. Every further
  collective of a step, and the policy's decision (skip, stop, raise), comes from the gathered
  rows alone, so all ranks take the same branch whatever failed locally. With ``strict=True``
  a failed measurement raises on every rank; an error after the gather raises on its own rank
  only, after that rank has passed the step's collectives (the policy's barrier included).
* ``enable_autograd_anomaly=True`` turns on autograd anomaly mode for the whole process
  *without* ``check_nan``: every op keeps its forward traceback (an error in backward names the
  forward line; slow), but a NaN in the user's own backward does not raise in their loop: it
  is recorded at the next monitored step. Naming the backward op that made a NaN is what
  :meth:`TrainingDebugger.anomaly_mode` and the ``closure=`` replay do. ``detach()`` (or
  garbage collection of a debugger never detached) restores the previous mode.
* An anomaly that repeats on consecutive monitored steps (same kind, rank, parameter, module:
  e.g. a NaN loss every step once the weights are NaN) is recorded once;
  ``details["count"]`` and ``details["last_step"]`` follow the repeats, and events.jsonl gets a
  short ``anomaly_repeated`` line per repeat. The summary's step counts are exact.
* A step skipped by the GradScaler is known at the next monitored step (the scale went down,
  or Accelerate's ``optimizer_step_was_skipped``) and recorded against the skipped step.
* Policy ``skip`` zeroes the gradients (to zero, not ``None``, on every rank) so the following
  ``optimizer.step()`` adds nothing from this batch; optimizers with momentum or weight decay
  (Adam, SGD with momentum) still move the weights by their state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..config import DebugConfig, resolve_config
from ..core import DebugReport
from ..errors import DiffusionDebugError
from ..memory import growth_mb, memory_sample
from ..record import Anomaly, RunRecord, new_run_name, prepare_run_dir
from . import gradients as grads_mod
from .autograd import localize_backward, parse_anomaly
from .distributed import (
    RankContext,
    find_scaler,
    gradients_complete,
    raw_optimizer,
    scale_tensor,
    scaler_already_unscaled,
    step_was_skipped,
    tracking_enabled,
)
from .loss import LossSpikeDetector, TimestepBuckets

logger = logging.getLogger("diffusion_debug.training")

# Layout of one rank's vector in the per-step collective (then 3 x timestep_buckets values).
# The first _DEVICE_SCALARS are reduced on the device; the rest are host values, copied to the
# device in one piece. _FAILED is 1 when the rank could not measure the step: its row is NaN
# and is not judged.
(
    _LOSS,
    _GNORM,
    _N_NONFINITE,
    _FIRST_NONFINITE,
    _CHECKSUM,
    _SCALE,
    _LOSS_COUNT,
    _RSS,
    _CUDA_ALLOCATED,
    _SAMPLES,
    _ACCEL_SKIPPED,
    _FAILED,
) = range(12)
_DEVICE_SCALARS = 6
_SCALARS = 12
# Weight norms (the denominator of the update-to-weight ratio) are re-read every this many
# monitored steps: weights move slowly, and reading them costs as much as reading the gradients.
_WEIGHT_NORMS_EVERY = 10
_SEVERITY_LEVEL = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_TOP_MODULES = 5


class TrainingDebugger:
    """Loss and gradient anomalies, per-module gradient norms, skipped fp16 steps, memory
    growth and loss per timestep bucket of a training run, on one process or many.

    ``model`` is the model being trained (wrapped by ``accelerator.prepare`` or not); only its
    parameters with ``requires_grad`` are watched. Under several processes every rank must
    construct the debugger and call :meth:`monitor_training_step` at the same steps (as a
    training loop does); the run directory name is broadcast from the main process.
    """

    def __init__(
        self,
        model: nn.Module,
        accelerator: Any = None,
        config: DebugConfig | Mapping[str, Any] | None = None,
        *,
        noise_scheduler: Any = None,
        num_train_timesteps: int | None = None,
    ):
        config = resolve_config(config)
        if not isinstance(model, nn.Module):
            raise DiffusionDebugError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
        if accelerator is not None and not _is_accelerator(accelerator):
            raise DiffusionDebugError(
                f"accelerator must be an accelerate.Accelerator (or None), not {type(accelerator).__name__}."
            )
        params = grads_mod.TrainableParameters.of(model)
        if not len(params):
            raise DiffusionDebugError(
                f"{type(grads_mod.unwrap_model(model)).__name__} has no trainable parameters (every requires_grad is "
                "False): unfreeze the weights or adapters you train before creating the TrainingDebugger."
            )
        self.model = model
        self.accelerator = accelerator
        self.config = config
        self.params = params
        first_device = params.params[0].device
        self._ctx = RankContext(accelerator, device=first_device)
        self._device = first_device if accelerator is None else self._ctx.device
        if first_device.type != self._device.type:
            self._device = first_device
        if num_train_timesteps is None:
            num_train_timesteps = _num_train_timesteps(noise_scheduler)

        # The run directory: same name on every rank.
        run_name = config.run_name
        if run_name is None:
            run_name = self._ctx.broadcast_object(
                new_run_name(config.debug_file_prefix) if self._ctx.is_main else None
            )
        run_dir = prepare_run_dir(config.output_dir, run_name)
        events = "events.jsonl" if self._ctx.is_main else f"events-rank{self._ctx.rank}.jsonl"
        self.record = RunRecord(config, kind="training", run_dir=run_dir, rank=self._ctx.rank, events_name=events)
        # What detach (or, for a debugger never detached, garbage collection) gives back: the
        # process-wide anomaly mode as it was, and the event stream. Holds no reference to self.
        self._anomaly_mode_previous: list[tuple[bool, bool] | None] = [None]
        if config.enable_autograd_anomaly:
            # Process-wide, without check_nan: every op keeps its forward traceback, so an error
            # raised in the user's own backward names the forward line, but a NaN does not raise
            # in their loop (it is recorded at monitor_training_step like any other). Raising on
            # the first NaN to name the op is what anomaly_mode() and the closure replay do.
            self._anomaly_mode_previous[0] = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.set_anomaly_enabled(True, False)
        self._finalizer = weakref.finalize(self, _release, self.record, self._anomaly_mode_previous)

        world = self._ctx.world_size
        self._buckets = TimestepBuckets(config.timestep_buckets, num_train_timesteps)
        self._detectors = [
            LossSpikeDetector(config.loss_spike_window, config.loss_spike_threshold) for _ in range(world)
        ]
        self._rss: list[deque[float]] = [deque(maxlen=config.history_size) for _ in range(world)]
        self._cuda_allocated: list[deque[float]] = [deque(maxlen=config.history_size) for _ in range(world)]
        self._memory_flagged: set[tuple[int, str]] = set()
        self._device_constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prev_scale: list[float | None] = [None] * world
        self._prev_step: int | None = None
        self._order = grads_mod.BackwardOrder(params)
        self._module_max: dict[str, float] = {}
        self._module_last: dict[str, float] = {}
        self._module_weight_norms: list[float] | None = None
        self._lr_groups: tuple[Any, list[int | None]] | None = None
        self._folds: dict[tuple, Anomaly] = {}
        self._reset_accumulation()
        self._last_time: float | None = None
        self._calls = 0
        self._counts = dict(
            total_steps=0,
            anomaly_steps=0,
            loss_anomalies=0,
            gradient_explosions=0,
            gradient_vanishing=0,
            skipped_steps=0,
            skipped_by_scaler=0,
            skipped_by_policy=0,
            nonfinite_steps=0,
            micro_steps=0,
        )
        self.should_stop = False
        """Set when policy ``stop`` met an error anomaly: the loop should end."""
        self._closed = False

    # -- the per-step call ---------------------------------------------------------------
    def monitor_training_step(
        self,
        loss: torch.Tensor | float,
        optimizer: Any = None,
        step: int | None = None,
        timesteps: torch.Tensor | None = None,
        *,
        closure: Callable[[], torch.Tensor] | None = None,
        lr_scheduler: Any = None,
        per_sample_loss: torch.Tensor | None = None,
        scaler: Any = None,
        noise_scheduler: Any = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """Measure one call of the training loop; returns what was measured this call.

        Call after backward, before ``optimizer.step()``. ``closure`` (forward + loss of this
        batch) lets a non-finite step be replayed under autograd anomaly mode to name the
        backward op; ``per_sample_loss`` (one value per sample) makes timestep buckets exact;
        ``scaler`` is a GradScaler used without Accelerate.
        """
        if self._closed:
            raise DiffusionDebugError("This TrainingDebugger was closed; create a new one to monitor again.")
        self._calls += 1
        if (
            self.config.max_debug_iterations is not None
            and self._counts["total_steps"] >= self.config.max_debug_iterations
        ):
            return {"step": step, "monitored": False}
        if noise_scheduler is not None and self._counts["total_steps"] == 0 and not any(self._buckets.count):
            self._buckets = TimestepBuckets(self.config.timestep_buckets, _num_train_timesteps(noise_scheduler))
        try:
            return self._monitor(
                loss, optimizer, step, timesteps, closure, lr_scheduler, per_sample_loss, scaler, batch_size
            )
        except DiffusionDebugError:
            raise
        except Exception as error:
            if self.config.strict:
                raise
            self.record.add_anomaly(
                _debugger_error(
                    step,
                    self._ctx.rank,
                    error,
                    f"The training debugger failed to measure this step ({type(error).__name__}: "
                    f"{error}); training goes on, set strict=True to see the traceback.",
                )
            )
            self._reset_accumulation()
            return {"step": step, "monitored": False, "error": repr(error)}

    def _reset_accumulation(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._bucket_sum: torch.Tensor | None = None
        self._samples = 0

    def _accumulate(self, loss, timesteps, per_sample_loss, batch_size) -> torch.Tensor:
        if isinstance(loss, torch.Tensor):
            value = loss.detach().to(device=self._device, dtype=torch.float64).reshape(-1).mean()
        else:
            value = torch.tensor(float(loss), dtype=torch.float64, device=self._device)
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1
        if timesteps is not None:
            timesteps = torch.as_tensor(timesteps)
            vec = self._buckets.device_vector(timesteps, value, per_sample_loss, self._device)
            self._bucket_sum = vec if self._bucket_sum is None else self._bucket_sum + vec
            self._samples += timesteps.numel()
        elif per_sample_loss is not None:
            self._samples += per_sample_loss.numel()
        elif batch_size is not None:
            self._samples += int(batch_size)
        return value

    def _monitor(self, loss, optimizer, step, timesteps, closure, lr_scheduler, per_sample_loss, scaler, batch_size):
        failure: Exception | None = None
        try:
            self._accumulate(loss, timesteps, per_sample_loss, batch_size)
        except Exception as error:
            failure = error
        if not gradients_complete(self.accelerator):
            if failure is not None:
                raise failure  # a micro-step has no collective: the local error path is safe
            self._counts["micro_steps"] += 1
            return {"step": step, "gradients_read": False, "micro_steps": self._loss_count}
        cfg, ctx = self.config, self._ctx
        total = self._counts["total_steps"] + 1
        step = _step_index(step, total - 1)
        now = time.perf_counter()
        check_ranks = ctx.distributed and cfg.rank_check_every > 0 and total % cfg.rank_check_every == 0
        refresh_weights = cfg.per_module_grad_norms and (
            self._module_weight_norms is None or (total - 1) % _WEIGHT_NORMS_EVERY == 0
        )

        # -- on the device: this rank's row; a failure still joins the collective ---------------
        try:
            if failure is not None:
                raise failure
            measured = self._measure(optimizer, scaler, check_ranks, refresh_weights)
        except Exception as error:
            failure = error
            measured = self._failed_measurement()
        self._reset_accumulation()
        matrix = ctx.gather(measured.vector)
        deferred: Exception | None = (
            None  # a local error after the gather: recorded once the step's collectives are done
        )
        try:
            fetched = torch.cat(
                [matrix.reshape(-1)] + [t.double().to(matrix.device) for t in measured.local]
            ).tolist()  # the one transfer
        except Exception as error:
            deferred, measured.local = error, []
            fetched = matrix.reshape(-1).tolist()
        self._counts["total_steps"] += 1  # every rank counts the step it joined: the schedules stay aligned
        width = measured.vector.numel()
        n_rows = ctx.world_size * width
        rows = [fetched[r * width : (r + 1) * width] for r in range(ctx.world_size)]
        local = _split(fetched[n_rows:], [t.numel() for t in measured.local])
        param_norms = local[0] if local else None
        module_values = local[1] if len(local) > 1 else None
        module_weight_values = local[2] if len(local) > 2 else None

        # -- collectives decided from the gathered rows alone (the same on every rank) -----------
        desync = _differing_checksums(rows) if check_ranks else []
        per_param_checksums = None
        if desync:
            own = (
                measured.checksums
                if measured.checksums is not None
                else torch.full((len(self.params),), math.nan, dtype=torch.float64, device=self._device)
            )
            per_param_checksums = ctx.gather(own.double()).tolist()
        exchange = ctx.distributed and (bool(desync) or any(_special(row) for row in rows))

        # -- on the host: judge every rank's row; a local error waits until after the exchange ---
        anomalies: list[Anomaly] = []
        flags = dict(loss=False, explosion=False, vanishing=False, nonfinite=False)
        skipped: list[Anomaly] = []
        module_norms: dict[str, float] = {}
        update_ratio: dict[str, float] = {}
        try:
            if deferred is not None:
                raise deferred
            for r, row in enumerate(rows):
                if row[_FAILED] > 0:
                    anomalies.append(self._measurement_failed(r, step, failure if r == ctx.rank else None))
                    continue
                anomalies += self._judge_rank(r, row, step, flags)
                self._buckets.add(row[_SCALARS:])
            skipped = self._judge_skipped(rows, step)
            anomalies += skipped
            if desync:
                anomalies += self._judge_checksums(rows, desync, per_param_checksums, step)
            if param_norms is not None:
                if module_weight_values is not None:
                    self._module_weight_norms = module_weight_values
                module_norms = self._module_norms(module_values) if module_values is not None else {}
                update_ratio = self._update_ratios(module_norms, optimizer) if module_norms else {}
                self._enrich_local(anomalies, param_norms, module_norms)
            targets = [
                a
                for a in anomalies
                if a.rank == ctx.rank and a.severity == "error" and a.kind in ("nonfinite", "nonfinite_loss")
            ]
            if targets and closure is not None:  # not for a GradScaler overflow (info): the scaler handles it
                self._localize_into(closure, targets)
        except Exception as error:
            deferred = error
            anomalies.append(self._judging_failed(step, error))  # what was judged before the error stays
        if exchange:
            anomalies = self._exchange_details(anomalies)

        # -- record, count, log: local work; an error here waits until the policy has run -------
        errors = [a for a in anomalies if a.severity == "error"]  # after the exchange: the same list on every rank
        info: dict[str, Any] = {"step": step, "anomalies": [a.kind for a in anomalies]}
        late: Exception | None = None
        self._count(anomalies, flags, skipped)  # from the shared rows and list: the same counts on every rank
        self._prev_step = step
        elapsed = None if self._last_time is None else now - self._last_time
        self._last_time = now
        try:
            self._record_step_anomalies([a for a in anomalies if ctx.is_main or a.rank == ctx.rank])
            own_row = rows[ctx.rank]
            info.update(
                {
                    "gradients_read": failure is None,
                    "loss": own_row[_LOSS],
                    "micro_steps": _count_of(own_row[_LOSS_COUNT]),
                    "grad_norm": own_row[_GNORM],
                    "grad_norm_clipped": False,
                    "nonfinite_parameters": _count_of(own_row[_N_NONFINITE]),
                    "learning_rates": _learning_rates(optimizer),
                    "grad_scale": None if math.isnan(own_row[_SCALE]) else own_row[_SCALE],
                    "step_time_s": elapsed,
                    "samples_per_s": (own_row[_SAMPLES] / elapsed) if elapsed and own_row[_SAMPLES] > 0 else None,
                    "memory": measured.memory,
                }
            )
            if failure is not None or deferred is not None:
                info["error"] = repr(failure if failure is not None else deferred)
            if ctx.distributed:
                info["losses_by_rank"] = [row[_LOSS] for row in rows]
                info["grad_norms_by_rank"] = [row[_GNORM] for row in rows]
            if module_norms:
                info["module_grad_norms"] = module_norms
            if update_ratio:
                info["update_to_weight_ratio"] = update_ratio
            row = {
                k: v for k, v in info.items() if k not in ("module_grad_norms", "update_to_weight_ratio", "anomalies")
            }
            if module_norms:
                top = sorted(module_norms.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)[
                    :_TOP_MODULES
                ]
                row["top_module_grad_norms"] = dict(top)
            if update_ratio:
                row["max_update_to_weight_ratio"] = max(update_ratio.values(), default=None)
            self.record.add_step(row)
            if tracking_enabled(self.accelerator):
                self._log_trackers(info, step)
        except Exception as error:
            late = error
            info["error"] = repr(error)

        # -- the policy: decided from `errors` alone, so every rank takes it, whatever failed above --
        if late is not None and not cfg.strict:
            self._record_late_failure(step, late)  # before a raise policy saves the report
        if cfg.strict:
            try:
                info = self._apply_policy(errors, anomalies, info)  # its collectives first, on every rank
            finally:
                self._raise_if_strict(rows, failure, deferred if deferred is not None else late)
            return info
        return self._apply_policy(errors, anomalies, info)

    def _measure(self, optimizer, scaler, check_ranks: bool, refresh_weights: bool) -> "_Measurement":
        """This rank's row of the per-step collective, and what stays local: per-parameter
        gradient norms, per-module gradient norms and (on refresh steps) per-module weight norms,
        all reduced on the device so that they travel in the step's one transfer."""
        params, dev = self.params, self._device
        scaler = find_scaler(self.accelerator, optimizer, scaler)
        norms = grads_mod.grad_norms(params, dev)
        scale = scale_tensor(scaler) if scaler is not None else None
        if scale is not None and not scaler_already_unscaled(scaler, optimizer):
            norms = norms / scale.to(device=dev, dtype=torch.float32)
        nonfinite = ~torch.isfinite(norms)
        positions, zero = self._constants(dev)
        first_nonfinite = torch.where(nonfinite, positions, -1.0).amax()  # latest registered ~ first in backward
        checksums = grads_mod.parameter_checksums(params, dev) if check_ranks else None
        wnorms = grads_mod.weight_norms(params, dev) if refresh_weights else None
        memory = memory_sample(dev) if self.config.memory_tracking else {}
        accel_skipped = step_was_skipped(optimizer) if self._prev_step is not None else None
        nan = math.nan
        scalars = torch.stack(
            [  # _LOSS .. _SCALE, on the device
                self._loss_sum / self._loss_count,
                norms.double().square().sum().sqrt(),
                nonfinite.sum().double(),
                first_nonfinite,
                checksums.sum() if checksums is not None else zero + nan,
                scale.to(device=dev, dtype=torch.float64).reshape(()) if scale is not None else zero + nan,
            ]
        )
        host = torch.tensor(
            [  # _LOSS_COUNT .. _FAILED: one host-to-device copy
                float(self._loss_count),
                memory.get("rss_mb", nan),
                memory.get("cuda_allocated_mb", nan),
                float(self._samples),
                nan if accel_skipped is None else float(accel_skipped),
                0.0,
            ],
            dtype=torch.float64,
        )
        buckets = (
            self._bucket_sum
            if self._bucket_sum is not None
            else torch.zeros(3 * self._buckets.buckets, dtype=torch.float64, device=dev)
        )
        vector = torch.cat([scalars, host.to(dev), buckets])
        local = [norms]
        if self.config.per_module_grad_norms:
            local.append(params.module_norms(norms))
            if wnorms is not None:
                local.append(params.module_norms(wnorms))
        return _Measurement(vector, local, checksums, memory)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter positions (float64) and a float64 zero on ``device``, made once."""
        cached = self._device_constants.get(device)
        if cached is None:
            cached = (
                torch.arange(len(self.params), device=device, dtype=torch.float64),
                torch.zeros((), dtype=torch.float64, device=device),
            )
            self._device_constants[device] = cached
        return cached

    def _failed_measurement(self) -> "_Measurement":
        """A row of NaNs with the failure slot set: the rank still joins the step's collective."""
        vector = torch.full(
            (_SCALARS + 3 * self._buckets.buckets,), math.nan, dtype=torch.float64, device=self._device
        )
        vector[_FAILED] = 1.0
        return _Measurement(vector, [], None, {})

    def _measurement_failed(self, r: int, step: int, error: Exception | None) -> Anomaly:
        text = f" ({type(error).__name__}: {error})" if error is not None else ""
        return _debugger_error(
            step,
            r,
            error,
            f"Rank {r} failed to measure step {step}{text} and training went on; "
            "set strict=True to see the traceback.",
            **({} if error is not None else {"where": "measurement"}),
        )

    def _judging_failed(self, step: int, error: Exception) -> Anomaly:
        r = self._ctx.rank
        return _debugger_error(
            step,
            r,
            error,
            f"Rank {r} failed to judge step {step} ({type(error).__name__}: {error}) "
            "and training went on; set strict=True to see the traceback.",
            where="judging",
        )

    def _record_late_failure(self, step: int, error: Exception) -> None:
        """An error in this rank's recording or logging (after the step's collectives): recorded
        locally, best effort (the record itself may be what failed)."""
        r = self._ctx.rank
        try:
            self._add_anomaly(
                _debugger_error(
                    step,
                    r,
                    error,
                    f"Rank {r} failed to record step {step} ({type(error).__name__}: {error}) and training "
                    "went on; set strict=True to see the traceback.",
                    where="recording",
                )
            )
        except Exception:  # pragma: no cover - the record is broken: the log is all that is left
            logger.warning("The training debugger failed to record step %s: %r", step, error)

    def _raise_if_strict(self, rows, failure: Exception | None, deferred: Exception | None) -> None:
        """strict=True: a failed measurement raises on every rank (all saw the failure slot), so no
        rank waits for another in the next step's collective."""
        if failure is not None:
            raise failure
        failed = [r for r, row in enumerate(rows) if row[_FAILED] > 0]
        if failed:
            raise DiffusionDebugError(
                f"Rank {failed[0]}'s training debugger failed to measure this step (strict=True).",
                run_dir=self.record.run_dir,
            )
        if deferred is not None:
            raise deferred

    # -- judging ---------------------------------------------------------------------------
    def _judge_rank(self, r: int, row: list[float], step: int, flags: dict) -> list[Anomaly]:
        cfg, out = self.config, []
        scaled = math.isfinite(row[_SCALE])  # a GradScaler is in use on that rank
        loss, gnorm = row[_LOSS], row[_GNORM]
        base = dict(component="model", step=step, rank=r)
        if not math.isfinite(loss):
            flags["nonfinite_loss"] = flags["loss"] = True
            bucket_nonfinite = row[_SCALARS + 2 * self._buckets.buckets : _SCALARS + 3 * self._buckets.buckets]
            details = {"loss": loss, "micro_steps": int(row[_LOSS_COUNT])}
            if any(bucket_nonfinite):
                details["nonfinite_by_timestep_bucket"] = {i: int(v) for i, v in enumerate(bucket_nonfinite) if v}
            out.append(
                Anomaly(
                    kind="nonfinite_loss",
                    severity="error",
                    **base,
                    details=details,
                    message=f"The loss is {_fmt(loss)} at step {step} on rank {r}: check this batch and the "
                    "forward pass (pass closure= to name the op), or lower the learning rate.",
                )
            )
        else:
            spike = self._detectors[r].update(loss)
            if spike.spike:
                flags["loss"] = True
                out.append(
                    Anomaly(
                        kind="loss_spike",
                        severity="warning",
                        **base,
                        details={
                            "loss": loss,
                            "median": spike.median,
                            "robust_std": spike.scale,
                            "score": spike.score,
                        },
                        message=f"The loss jumped to {loss:.4g}, {spike.score:.1f} robust deviations above its "
                        f"rolling median {spike.median:.4g}: look at the learning rate and this batch.",
                    )
                )
        n_bad = int(row[_N_NONFINITE]) if math.isfinite(row[_N_NONFINITE]) else 0
        if n_bad:
            first = int(row[_FIRST_NONFINITE])
            name = self.params.names[first] if 0 <= first < len(self.params) else None
            module = self.params.module_names[self.params.module_of[first]] if name else ""
            flags["nonfinite"] = True
            severity = "info" if scaled else "error"
            hint = (
                "the GradScaler will skip this optimizer step and lower the scale"
                if scaled
                else "lower the learning rate, check the loss for NaN/Inf, or use closure= to name the backward op"
            )
            out.append(
                Anomaly(
                    kind="nonfinite",
                    severity=severity,
                    **base,
                    module=module,
                    parameter=name,
                    details={"nonfinite_parameters": n_bad, "grad_norm": gnorm, "order": "reverse registration"},
                    message=f"{n_bad} gradient(s) hold NaN/Inf, first {name} in module {module or '(root)'}: {hint}.",
                )
            )
        elif math.isfinite(gnorm) and gnorm > cfg.grad_explosion_threshold:
            flags["explosion"] = True
            out.append(
                Anomaly(
                    kind="gradient_explosion",
                    severity="warning",
                    **base,
                    details={"grad_norm": gnorm, "threshold": cfg.grad_explosion_threshold},
                    message=f"The global gradient norm (before clipping) is {gnorm:.4g}, above "
                    f"{cfg.grad_explosion_threshold:g}: lower the learning rate or clip gradients.",
                )
            )
        elif math.isfinite(gnorm) and gnorm < cfg.grad_vanishing_threshold:
            flags["vanishing"] = True
            out.append(
                Anomaly(
                    kind="gradient_vanishing",
                    severity="warning",
                    **base,
                    details={"grad_norm": gnorm, "threshold": cfg.grad_vanishing_threshold},
                    message=f"The global gradient norm is {gnorm:.3g}, below {cfg.grad_vanishing_threshold:g}: "
                    "check that the loss depends on the trained parameters and that zero_grad() runs after the step.",
                )
            )
        out += self._judge_memory(r, row, base)
        return out

    def _judge_memory(self, r: int, row: list[float], base: dict) -> list[Anomaly]:
        """``memory_growth``: process RSS, and CUDA allocated memory when the rank has it, each
        judged on its own (robust trend over the history, every 8 steps, flagged once)."""
        out = []
        for source, value, history, what in (
            ("rss", row[_RSS], self._rss[r], "Process memory"),
            ("cuda_allocated", row[_CUDA_ALLOCATED], self._cuda_allocated[r], "CUDA allocated memory"),
        ):
            if not math.isfinite(value):
                continue
            history.append(value)
            grown = growth_mb(list(history)) if len(history) >= 8 and len(history) % 8 == 0 else 0.0
            if grown > self.config.memory_growth_mb and (r, source) not in self._memory_flagged:
                self._memory_flagged.add((r, source))
                out.append(
                    Anomaly(
                        kind="memory_growth",
                        severity="warning",
                        **base,
                        details={
                            "growth_mb": grown,
                            "source": source,
                            f"{source}_mb": value,
                            "window_steps": len(history),
                        },
                        message=f"{what} grew by {grown:.0f} MB over the last {len(history)} steps: "
                        "look for tensors kept across steps (e.g. appending the loss without .item()).",
                    )
                )
        return out

    def _judge_skipped(self, rows: list[list[float]], step: int) -> list[Anomaly]:
        out = []
        for r, row in enumerate(rows):
            if row[_FAILED] > 0:
                continue
            scale, previous = row[_SCALE], self._prev_scale[r]
            self._prev_scale[r] = scale if math.isfinite(scale) else None
            accel = row[_ACCEL_SKIPPED]
            by_scale = previous is not None and math.isfinite(scale) and scale < previous
            by_accel = math.isfinite(accel) and accel > 0
            if self._prev_step is not None and (by_scale or by_accel):
                out.append(
                    Anomaly(
                        kind="skipped_step",
                        severity="warning",
                        component="model",
                        step=self._prev_step,
                        rank=r,
                        details={
                            "scale_before": previous,
                            "scale_after": scale if math.isfinite(scale) else None,
                            "detected_at_step": step,
                        },
                        message=f"The optimizer step {self._prev_step} was skipped by the GradScaler (gradients "
                        f"overflowed; scale {_fmt(previous)} -> {_fmt(scale)}): frequent skips mean fp16 "
                        "overflow, consider bf16 or a lower learning rate.",
                    )
                )
        return out[:1] if out else out  # the step is skipped on every rank alike

    def _judge_checksums(self, rows, differing: list[int], per_param: list[list[float]], step: int) -> list[Anomaly]:
        values = [row[_CHECKSUM] for row in rows]
        reference = _reference_rank(rows)
        out = []
        for r in differing:
            index = next(
                (i for i, (a, b) in enumerate(zip(per_param[reference], per_param[r])) if not _same(a, b)), None
            )
            name = self.params.names[index] if index is not None else None
            module = self.params.module_names[self.params.module_of[index]] if index is not None else ""
            out.append(
                Anomaly(
                    kind="rank_desync",
                    severity="error",
                    component="model",
                    step=step,
                    rank=r,
                    module=module,
                    parameter=name,
                    details={
                        "checksum": values[r],
                        "checksum_rank0": values[reference],
                        "reference_rank": reference,
                        "parameter_checksum": per_param[r][index] if index is not None else None,
                        "parameter_checksum_rank0": per_param[reference][index] if index is not None else None,
                    },
                    message=f"Rank {r}'s parameters differ from rank 0's (first {name}): the replicas "
                    "diverged; check that every rank loads the same weights and no rank updates outside DDP.",
                )
            )
        return out

    def _enrich_local(
        self, anomalies: list[Anomaly], param_norms: list[float], module_norms: dict[str, float]
    ) -> None:
        """Add what only this rank knows: exact non-finite parameters in backward order, and the
        modules with the largest gradients."""
        rank = self._ctx.rank
        for a in anomalies:
            if a.rank != rank:
                continue
            if a.kind == "nonfinite":
                flagged = [i for i, bad in enumerate(grads_mod.nonfinite_mask(self.params)) if bad]
                if not flagged:  # float32 norm overflow, not a NaN/Inf: an explosion
                    a.kind, a.severity = "gradient_explosion", "warning"
                    a.message = (
                        "A gradient norm overflowed float32 (values above ~1e19): "
                        "lower the learning rate or clip gradients."
                    )
                    a.parameter, a.module = None, ""
                    continue
                first = self._order.first(flagged)
                a.parameter = self.params.names[first]
                a.module = self.params.module_names[self.params.module_of[first]]
                a.details.update(
                    order="backward" if self._order.order else "reverse registration",
                    nonfinite_parameters=len(flagged),
                    parameters=[self.params.names[i] for i in flagged[:20]],
                    modules=sorted({self.params.module_names[self.params.module_of[i]] for i in flagged})[:20],
                )
                a.message = (
                    a.message.split(", first ")[0]
                    + f", first in backward order {a.parameter} in module {a.module or '(root)'}:"
                    + a.message.split(":", 1)[1]
                )
            elif a.kind == "gradient_explosion" and module_norms:
                top = sorted((kv for kv in module_norms.items() if math.isfinite(kv[1])), key=lambda kv: -kv[1])[
                    :_TOP_MODULES
                ]
                if top:
                    a.module = top[0][0]
                    a.details["top_module_grad_norms"] = dict(top)

    def _localize_into(self, closure, targets: list[Anomaly]) -> None:
        try:
            found = localize_backward(closure, self.params.params, self.model, self.config.debug_timeout)
        except Exception as error:
            if self.config.strict:
                raise
            found = {"found": False, "error": repr(error)}
        for a in targets:
            a.details["localization"] = found
            if found.get("op"):
                a.message = (
                    a.message.rstrip(".")
                    + f"; anomaly mode names {found['op']}"
                    + (f" from {found['forward_line']}." if found.get("forward_line") else ".")
                )

    def _exchange_details(self, anomalies: list[Anomaly]) -> list[Anomaly]:
        """In a step with an error (known to every rank), gather each rank's own anomalies with
        their local details, so the main process records them as that rank saw them."""
        try:
            mine = [a.to_dict() for a in anomalies if a.rank == self._ctx.rank]
        except Exception as error:  # this rank still joins the exchange
            mine = [self._judging_failed(anomalies[0].step if anomalies else None, error).to_dict()]
        gathered = self._ctx.gather_objects(mine)
        return [Anomaly.from_dict(d) for per_rank in gathered for d in per_rank]

    def _module_norms(self, values: list[float]) -> dict[str, float]:
        out = dict(zip(self.params.module_names, values))
        for name, v in out.items():
            self._module_last[name] = v
            if math.isfinite(v) and v > self._module_max.get(name, -1.0):
                self._module_max[name] = v
        return out

    def _update_ratios(self, module_norms: dict[str, float], optimizer) -> dict[str, float]:
        """``lr * ||grad|| / ||weight||`` per module. The weight norms are those read at the last
        refresh (every ``_WEIGHT_NORMS_EVERY`` monitored steps), so the ratio is exact on refresh
        steps and uses weights at most that many steps old in between."""
        raw = raw_optimizer(optimizer)
        if raw is None or self._module_weight_norms is None:
            return {}
        groups = raw.param_groups
        key = (id(raw), len(groups), tuple(len(g["params"]) for g in groups))
        if self._lr_groups is None or self._lr_groups[0] != key:
            self._lr_groups = (key, self._module_groups(groups))
        lrs = [float(g["lr"]) if "lr" in g else 0.0 for g in groups]
        out = {}
        for (module, grad), weight, group in zip(module_norms.items(), self._module_weight_norms, self._lr_groups[1]):
            lr = lrs[group] if group is not None else 0.0
            out[module] = lr * grad / weight if weight > 0 else float("inf")
        return out

    def _module_groups(self, groups) -> list[int | None]:
        """The param group of each module's first trainable parameter (None: in no group with an lr)."""
        group_of = {id(p): i for i, g in enumerate(groups) if "lr" in g for p in g["params"]}
        out: list[int | None] = [None] * len(self.params.module_names)
        seen = [False] * len(out)
        for p, m in zip(self.params.params, self.params.module_of):
            if not seen[m]:
                seen[m] = True
                out[m] = group_of.get(id(p))
        return out

    # -- counting, logging, policy ----------------------------------------------------------
    def _add_anomaly(self, a: Anomaly) -> None:
        self.record.add_anomaly(a)
        level = _SEVERITY_LEVEL[a.severity]
        if level >= _SEVERITY_LEVEL[self.config.log_level]:
            logger.log(level, "%s [%s] %s", a.kind, a.where(), a.message)

    def _record_step_anomalies(self, anomalies: list[Anomaly]) -> None:
        """Record this step's anomalies, folding repeats: an anomaly with the same (kind, rank,
        parameter, module) as one recorded at the previous monitored step is not recorded again;
        that one's ``details["count"]`` and ``details["last_step"]`` are updated in place, and
        events.jsonl gets a one-line ``anomaly_repeated`` event instead of the full anomaly."""
        folds: dict[tuple, Anomaly] = {}
        for a in anomalies:
            key = (a.kind, a.rank, a.parameter, a.module)
            first = self._folds.get(key)
            if first is None:
                a.details.setdefault("count", 1)
                self._add_anomaly(a)
                folds[key] = a
                continue
            first.details["count"] = first.details.get("count", 1) + 1
            first.details["last_step"] = a.step
            folds[key] = first
            self.record.add_event(
                "anomaly_repeated",
                kind=a.kind,
                rank=a.rank,
                module=a.module,
                parameter=a.parameter,
                step=a.step,
                count=first.details["count"],
            )
        self._folds = folds

    def _count(self, anomalies: list[Anomaly], flags: dict, skipped: list[Anomaly]) -> None:
        """Per-step counts (``total_steps`` is counted when the step's collective is joined).
        Judged from the gathered rows, so the same on every rank; a rank's own failure to judge
        a step (a local ``debugger_error``) is not counted, as the other ranks may not know it."""
        c = self._counts
        if any(a.severity != "info" and a.details.get("where") != "judging" for a in anomalies):
            c["anomaly_steps"] += 1
        c["loss_anomalies"] += bool(flags.get("loss"))
        c["gradient_explosions"] += bool(flags.get("explosion")) or any(
            a.kind == "gradient_explosion" for a in anomalies
        )
        c["gradient_vanishing"] += bool(flags.get("vanishing"))
        c["nonfinite_steps"] += bool(flags.get("nonfinite")) or bool(flags.get("nonfinite_loss"))
        if skipped:
            c["skipped_steps"] += 1
            c["skipped_by_scaler"] += 1

    def _log_trackers(self, info: dict, step: int) -> None:
        values = {
            "debug/loss": info["loss"],
            "debug/grad_norm": info["grad_norm"],
            "debug/nonfinite_parameters": info["nonfinite_parameters"],
            "debug/anomalies": len(info["anomalies"]),
        }
        if info.get("grad_scale") is not None:
            values["debug/grad_scale"] = info["grad_scale"]
        for i, lr in enumerate(info["learning_rates"]):
            values[f"debug/lr_group{i}"] = lr
        self.accelerator.log(
            {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step
        )

    def _apply_policy(self, errors: list[Anomaly], anomalies: list[Anomaly], info: dict) -> dict:
        policy = self.config.policy
        info["policy_action"] = None
        if policy == "warn":
            for a in anomalies:
                if a.severity != "info" and (self._ctx.is_main or a.rank == self._ctx.rank):
                    warnings.warn(f"{a.kind} ({a.where()}): {a.message}", RuntimeWarning, stacklevel=3)
        if not errors:
            return info
        if policy == "skip":
            grads_mod.zero_gradients(self.params)
            self._counts["skipped_steps"] += 1
            self._counts["skipped_by_policy"] += 1
            self.record.add_event("policy_skip", step=info["step"], anomalies=[a.kind for a in errors])
            info["policy_action"] = "skip"
        elif policy == "stop":
            self.should_stop = True
            info["policy_action"] = "stop"
        elif policy == "raise":
            first = errors[0]
            run_dir = self.record.run_dir
            try:
                if self._ctx.is_main:
                    run_dir = self.report().save()
            except Exception as error:  # every rank raises DiffusionDebugError all the same
                logger.error("Could not save the report before raising: %r", error)
            finally:
                self._ctx.barrier()  # every rank leaves the step together: nobody waits in a collective
            raise DiffusionDebugError(
                f"{first.kind} at {first.where()}: {first.message} (run directory: {run_dir})",
                anomaly=first,
                run_dir=run_dir,
            )
        return info

    # -- localisation and anomaly mode -----------------------------------------------------------
    def localize(self, closure: Callable[[], torch.Tensor]) -> dict[str, Any]:
        """Re-run ``closure`` (forward + loss) and its backward under autograd anomaly mode;
        the gradients are restored afterwards. Returns ``op`` (the backward function that made
        the NaN/Inf) and ``forward_line`` when found (``found: False`` otherwise), and records a
        ``nonfinite`` anomaly when it found one. Local to this process (no collective)."""
        found = localize_backward(closure, self.params.params, self.model, self.config.debug_timeout)
        if found.get("found"):
            self._add_anomaly(
                Anomaly(
                    kind="nonfinite",
                    severity="error",
                    component="model",
                    step=self._prev_step,
                    rank=self._ctx.rank,
                    details={"localization": found},
                    message=f"Autograd anomaly mode: {found.get('op', 'a backward function')} returned "
                    f"{found.get('value', 'non-finite')} values"
                    + (f", from {found['forward_line']}" if found.get("forward_line") else "")
                    + ": fix that op's inputs (e.g. a division by zero or log of 0).",
                )
            )
        return found

    @contextlib.contextmanager
    def anomaly_mode(self) -> Iterator[None]:
        """Run the enclosed forward and backward under ``torch.autograd.detect_anomaly(check_nan=True)``.

        When backward reports a NaN/Inf: ``autograd_anomaly_mode="detect"`` records a
        ``nonfinite`` anomaly (op and forward line) and zeroes the gradients so the following
        ``optimizer.step()`` adds nothing; ``"warn"`` also warns; ``"raise"`` raises
        DiffusionDebugError. Slow: every op keeps its forward traceback.
        """
        caught: list = []
        failure: tuple[RuntimeError, dict] | None = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with torch.autograd.detect_anomaly(check_nan=True):
                        yield
                except RuntimeError as error:
                    found = {"found": True, **parse_anomaly(str(error), [str(w.message) for w in caught])}
                    if "op" not in found:
                        raise
                    failure = (error, found)
        finally:
            _reemit(caught)  # outside the recorder: the user's own warnings are not swallowed
        if failure is None:
            return
        error, found = failure
        anomaly = Anomaly(
            kind="nonfinite",
            severity="error",
            component="model",
            step=self._prev_step,
            rank=self._ctx.rank,
            details={"localization": found, "source": "anomaly_mode"},
            message=f"Autograd anomaly mode: {found['op']} returned non-finite values"
            + (f", from {found['forward_line']}" if found.get("forward_line") else "")
            + ": fix that op's inputs (e.g. a division by zero or the log of 0).",
        )
        self._add_anomaly(anomaly)
        mode = self.config.autograd_anomaly_mode
        if mode == "raise":
            raise DiffusionDebugError(anomaly.message, anomaly=anomaly, run_dir=self.record.run_dir) from error
        grads_mod.zero_gradients(self.params)
        if mode == "warn":
            warnings.warn(anomaly.message, RuntimeWarning, stacklevel=3)

    # -- results ------------------------------------------------------------------------------
    def get_training_summary(self) -> dict[str, Any]:
        """Counts and rates over the monitored (optimizer) steps.

        The step counts and rates are judged from every rank's gathered figures and are identical
        on every rank (unless a rank failed to judge a step itself: its ``debugger_error`` is
        recorded, and its counts for that step may miss what it could not judge).
        ``anomaly_counts`` (per kind) is this process's record: on the main process every
        rank's anomalies, on another rank only its own.
        """
        c = self._counts
        total = c["total_steps"]

        def rate(n: int) -> float:
            return n / total if total else 0.0

        return {
            "total_steps": total,
            "anomaly_steps": c["anomaly_steps"],
            "anomaly_rate": rate(c["anomaly_steps"]),
            "loss_anomalies": c["loss_anomalies"],
            "loss_anomaly_rate": rate(c["loss_anomalies"]),
            "gradient_explosions": c["gradient_explosions"],
            "gradient_explosion_rate": rate(c["gradient_explosions"]),
            "gradient_vanishing": c["gradient_vanishing"],
            "gradient_vanishing_rate": rate(c["gradient_vanishing"]),
            "skipped_steps": c["skipped_steps"],
            "skipped_step_rate": rate(c["skipped_steps"]),
            "skipped_by_scaler": c["skipped_by_scaler"],
            "skipped_by_policy": c["skipped_by_policy"],
            "nonfinite_steps": c["nonfinite_steps"],
            "micro_steps": c["micro_steps"],
            "anomaly_counts": dict(self.record.anomaly_counts),
            "world_size": self._ctx.world_size,
        }

    def report(self) -> DebugReport:
        """The record so far: on the main process it holds every rank's anomalies (each with
        its ``rank``). No collective: call it on any rank; ``save()`` writes the summary and
        report on the main process only, and on another rank flushes that rank's events file
        and returns the (shared) run directory."""
        components = {
            "model": {
                "class": type(grads_mod.unwrap_model(self.model)).__name__,
                "trainable_parameters": sum(p.numel() for p in self.params.params),
                "trainable_tensors": len(self.params),
                "modules_with_trainable_parameters": len(self.params.module_names),
                "module_grad_norm_max": dict(sorted(self._module_max.items(), key=lambda kv: -kv[1])[:50]),
                "module_grad_norm_last": {m: self._module_last[m] for m in list(self._module_last)[:200]},
                "loss_by_timestep_bucket": self._buckets.summary(),
                "num_train_timesteps": self._buckets.num_train_timesteps,
            }
        }
        summary = {
            **self.record.summary(),
            "training": self.get_training_summary(),
            "rank": self._ctx.rank,
            "world_size": self._ctx.world_size,
        }
        return DebugReport(
            run_dir=self.record.run_dir,
            summary=summary,
            anomalies=list(self.record.anomalies),
            steps=list(self.record.steps),
            components=components,
            record=self.record,
            is_main=self._ctx.is_main,
        )

    def clear_debug_history(self) -> None:
        self.record.clear()
        self._folds = {}

    def detach(self) -> None:
        """Remove the backward-order hooks, restore anomaly mode, close the event stream."""
        if self._closed:
            return
        self._closed = True
        try:
            self._order.remove()
        finally:
            self._finalizer()  # anomaly mode as it was, the event stream closed (once)

    close = detach

    def __enter__(self) -> "TrainingDebugger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


@dataclass
class _Measurement:
    vector: torch.Tensor
    """This rank's row of the per-step collective."""
    local: list[torch.Tensor]
    """Per-parameter gradient norms (and weight norms on refresh steps): fetched with the gathered
    matrix in the step's one transfer; empty when the measurement failed."""
    checksums: torch.Tensor | None
    memory: dict


def _debugger_error(step: Any, rank: int, error: Exception | None, message: str, **details: Any) -> Anomaly:
    """The anomaly for a failure of the debugger itself (training went on)."""
    if error is not None:
        details = {"error": repr(error), **details}
    return Anomaly(
        kind="debugger_error",
        severity="warning",
        component="model",
        step=step,
        rank=rank,
        message=message,
        details=details,
    )


def _special(row: list[float]) -> bool:
    """A row every rank must look into together: a failed measurement, a NaN/Inf loss or gradient."""
    return (
        row[_FAILED] > 0
        or not math.isfinite(row[_LOSS])
        or (math.isfinite(row[_N_NONFINITE]) and row[_N_NONFINITE] > 0)
    )


def _reference_rank(rows: list[list[float]]) -> int:
    return next((r for r, row in enumerate(rows) if not row[_FAILED] > 0), 0)


def _differing_checksums(rows: list[list[float]]) -> list[int]:
    """Ranks whose parameter checksum differs from the first rank that measured the step."""
    reference = rows[_reference_rank(rows)][_CHECKSUM]
    return [r for r, row in enumerate(rows) if not row[_FAILED] > 0 and not _same(row[_CHECKSUM], reference)]


def _step_index(step: Any, default: int) -> Any:
    if step is None:
        return default
    try:
        return int(step)
    except (TypeError, ValueError):
        return step


def _count_of(value: float) -> int:
    return int(value) if math.isfinite(value) else 0


def _reemit(caught: list) -> None:
    """Give back the warnings caught while anomaly mode ran, except anomaly mode's own."""
    for w in caught:
        text = str(w.message)
        if "Anomaly Detection has been enabled" in text or "Traceback of forward call" in text:
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _split(values: list[float], sizes: list[int]) -> list[list[float]]:
    """Cut a fetched flat list back into the pieces that were concatenated."""
    out, start = [], 0
    for size in sizes:
        out.append(values[start : start + size])
        start += size
    return out


def _release(record: RunRecord, anomaly_mode_previous: list) -> None:
    """Undo what a TrainingDebugger changed outside itself: run by detach, or by the garbage
    collector for a debugger never detached."""
    try:
        if anomaly_mode_previous[0] is not None:
            torch.set_anomaly_enabled(*anomaly_mode_previous[0])
            anomaly_mode_previous[0] = None
    finally:
        record.close()


def _is_accelerator(obj: Any) -> bool:
    try:
        from accelerate import Accelerator
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, Accelerator)


def _num_train_timesteps(noise_scheduler: Any) -> int:
    config = getattr(noise_scheduler, "config", None)
    value = getattr(config, "num_train_timesteps", None) if config is not None else None
    if value is None and isinstance(config, dict):
        value = config.get("num_train_timesteps")
    return int(value) if value else 1000


def _learning_rates(optimizer: Any) -> list[float]:
    raw = raw_optimizer(optimizer)
    if raw is None:
        return []
    return [float(g["lr"]) for g in raw.param_groups if "lr" in g]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
