"""TrainingDebugger: a few lines in a training loop, plain PyTorch or Accelerate.

Call it after ``accelerator.backward(loss)`` and before ``optimizer.step()``::

    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(level="advanced"))
    for batch in loader:
        with accelerator.accumulate(model):
            loss = ...
            accelerator.backward(loss)
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=global_step, timesteps=timesteps,
                                       inputs=batch, max_grad_norm=args.max_grad_norm)
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
    tdbg.report().save()

This file holds the API and the lifecycle (the summary and report it hands out are
``reporting.TrainingResults``, the replays under anomaly mode ``judges.anomaly_mode.Localization``: bases
of its class); each choice is stated by the code that makes it. A
monitored step is one pipeline (``monitor``): this rank's row measured on the device and brought
to the host in one transfer (``measure``: gradient norms before clipping, the GradScaler read
without mutation, the loss over micro-steps, the update the optimizer applied), judged
(``judges``; cause before consequence in ``judges.causes``), exchanged between ranks in one
fixed-size collective so nothing waits in one (``ranks``), recorded through ``core.AnomalySink``
(which folds repeats), then the stability actions and the policy (``step``); ``hangs`` names a
rank that stalls.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import deque
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..config import DebugConfig, resolve_config
from ..core import AnomalySink, Lifecycle, open_run, release
from ..errors import DiffusionDebugError
from ..probes import BackwardOrder, ProbeHandle, accumulates_compiled, apply_grad_order, copies
from ..record import RunRecord
from ..report.server import start_live_server
from . import failures
from .hangs.liveness import RankLiveness
from .judges import step_checks
from .judges.anomaly_mode import Localization, ProcessAnomalyMode
from .measure.deepspeed_stage0 import find_deepspeed
from .measure.gradients import embedding_tables
from .measure.loss import TimestepBuckets, num_train_timesteps, per_sample
from .measure.optimizer_state import gradients_incomplete, param_groups
from .measure.pre_reduction import PreReductionCheck, engine_of
from .measure.shared_clip import SharedClip
from .measure.step_measurer import StepMeasurer
from .measure.step_row import StepLayout
from .measure.wrappers import unwrap_model
from .monitor import StepMonitor
from .oom_watch import training_oom_watch
from .ranks.elsewhere import RankFiles
from .ranks.processes import RankContext, environment_world_size, open_shared_run
from .reporting import LIVE_ENDPOINTS, TrainingResults
from .signatures import check_accelerator, check_loss, check_policy, check_trainable
from .step.state import Call, History
from .watched_models import SWAP_CHECK_EVERY, ParameterSwaps, WatchedModels

logger = logging.getLogger("diffusion_debug.training")

ORDER_REFRESH = 100
"""Monitored steps between two recordings of the backward order (``TrainingDebugger._pace_order_hooks``)."""


class TrainingDebugger(TrainingResults, Localization, Lifecycle):
    """Loss and gradient anomalies, per-module gradient norms, skipped fp16 steps, memory
    growth and loss per timestep bucket of a training run, on one process or many.

    ``model`` is the model being trained (wrapped by ``accelerator.prepare`` or not), or several by
    name, ``{"unet": unet, "text_encoder": text_encoder}`` (``component`` then names the model:
    ``watched``); only parameters with ``requires_grad`` are watched, and what an optimizer trains
    outside them is named (``optimizer_coverage``). Under several processes every rank must
    construct the debugger and call :meth:`monitor_training_step` at the same steps (as a
    training loop does); the run directory name is broadcast from the main process.

    >>> import tempfile, torch
    >>> from diffusion_debug import DebugConfig
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> tdbg = TrainingDebugger(model, config=DebugConfig(level="basic", output_dir=tempfile.mkdtemp()))
    >>> for step in range(3):
    ...     loss = model(torch.ones(2, 4)).pow(2).mean()
    ...     loss.backward()
    ...     info = tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
    ...     optimizer.step(); optimizer.zero_grad()
    >>> summary = tdbg.get_summary()
    >>> summary["total_steps"], summary["anomaly_steps"], tdbg.report().anomalies
    (3, 0, [])
    >>> tdbg.close()

    Lifecycle (``core.Lifecycle``): the constructor attaches (a training loop has no block around
    it): the backward-order hooks, and anomaly mode when ``enable_autograd_anomaly``. ``detach()``
    removes them (a later ``attach()`` adds them again); ``close()`` is final and closes the event
    stream; ``with TrainingDebugger(...) as tdbg:`` detaches at the end of the block. Monitoring
    while detached still works (gradients are then named in reverse registration order). With
    ``serve_port`` the main process serves the run (:attr:`server_url`, ``reporting.LIVE_ENDPOINTS``)
    from construction until ``close()``, one URL for the whole run; the port is bound before the
    run directory is made, so a port in use is one error on every rank and creates nothing.
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module],
        accelerator: Any = None,
        config: DebugConfig | Mapping[str, Any] | None = None,
        *,
        noise_scheduler: Any = None,
        num_train_timesteps: int | None = None,
    ):
        config = resolve_config(config)
        watched = WatchedModels.of(model)
        check_accelerator(accelerator)
        params = watched.parameters()
        check_trainable(watched, params)
        # DeepSpeed: ZeRO keeps the gradients in its partitions (read there, as shards); its scale and skip
        params.partitions, params.deepspeed = find_deepspeed(params.params, watched.models.values(), accelerator)
        self._plain_gradients = not params.sharded  # each gradient read is its parameter's .grad
        check_policy(config, params.deepspeed)  # before the run directory: skip cannot reach every engine
        self.model = model
        self.watched = watched
        self.accelerator = accelerator
        self._config = config
        self.params = params
        first_device = params.params[0].device
        self._ctx = RankContext(accelerator, device=first_device)
        device = first_device if accelerator is None else self._ctx.device
        device = first_device if first_device.type != device.type else device
        # serve_port: bound before the run directory is made, so a port in use creates nothing
        self._server = start_live_server(
            config, self, LIVE_ENDPOINTS, is_main=self._ctx.is_main, agree=self._ctx.broadcast_object
        )
        try:
            self._open(config, device, noise_scheduler, num_train_timesteps)
        except BaseException:
            release(self._server and self._server.stop)
            raise

    def _open(self, config: DebugConfig, device: torch.device, noise_scheduler: Any, timesteps: int | None) -> None:
        """The rest of the constructor: the run directory, the record, the step monitor, attach."""
        ctx, params = self._ctx, self.params
        # every rank streams its own rows; the main process's file also gets every rank's anomalies
        events = "events.jsonl" if ctx.is_main else f"events-rank{ctx.rank}.jsonl"
        self.record: RunRecord = open_shared_run(
            ctx, lambda name: open_run(config, kind="training", name=name, rank=ctx.rank, events_name=events)
        )
        self.sink = AnomalySink(self.record, config, logger)
        self._rank_files = RankFiles(self.record.run_dir, ctx.rank, self.record.max_anomalies)  # read by main's report
        buckets = TimestepBuckets(
            config.timestep_buckets,
            timesteps if timesteps is not None else num_train_timesteps(noise_scheduler),
        )
        self._order = BackwardOrder(params.params)
        self._order_hooks = ProbeHandle()
        # load_state_dict(assign=True) mid-run: the new parameters are watched in the old ones' places
        # (FSDP2 and ZeRO swap their own in each forward: not followed)
        swapped = [params.params, self._order.params]
        on = not params.sharded and params.partitions is None
        self._swaps = ParameterSwaps(self.watched, params.paths or params.names, swapped, on=on)
        self._zero_step = ProbeHandle()
        self._clip = SharedClip(params, self.accelerator)  # the user's clip made of the step's norms
        self._steps = StepMonitor(
            params=params,
            config=config,
            ctx=ctx,
            measurer=StepMeasurer(params, device, StepLayout(config.timestep_buckets)),
            history=History.new(config, params, buckets),
            order=self._order,
            sink=self.sink,
            model=self.model,
            accelerator=self.accelerator,
            save_report=lambda: self.report().save(),
            watched=self.watched,
        )
        self._pre_reduction = None
        if ctx.distributed:
            # DDP, FSDP2, ZeRO 1-3: each rank's own gradients checked before the reduction (names who made a NaN)
            models = list(self.watched.models.values())
            self._pre_reduction = PreReductionCheck.of_run(params, models, self.accelerator)
            self._steps.measurer.pre_reduction = self._pre_reduction
            for reason in self._pre_reduction.off if ctx.is_main else ():
                logger.warning("diffusion-debug: %s.", reason)
        self._oom = training_oom_watch(self.sink, self.watched, self._steps.history, config.step_offset, ctx.rank)
        # What detach (or, for a debugger never detached, garbage collection) gives back: the
        # process-wide anomaly mode as it was, and the event stream. Holds no reference to self.
        self._anomaly_mode = ProcessAnomalyMode()
        server_stop = self._server and self._server.stop
        # the engine whose collectives a rank in backward waits in: named in a stall
        engine = engine_of(params, self.watched.models.values(), self.accelerator)
        self._liveness = RankLiveness.open(ctx, config, self.sink, owner=self, engine=engine)  # names a stall early
        stops = (self._liveness.close, self._anomaly_mode.remove, self.record.close, server_stop)
        stops += (self._steps.history.stall.seen.stop,)  # not_learning's hook on the optimizer's step
        # copies of the model leave our hooks out from now to close (probes.copies), held for the debugger's
        # life: the grad-order hooks' hold went with them once paced, leaving the forward hooks unheld
        copies.hold()
        stops += (copies.release,)
        stops += (self._pre_reduction.release,) if self._pre_reduction is not None else ()
        self._finalizer = weakref.finalize(self, release, *stops)
        split = environment_world_size()
        if split > 1 and not ctx.distributed:
            self.sink.emit(step_checks.distributed_split(split, ctx.rank), once=True)
        self.attach()

    @property
    def config(self) -> DebugConfig:
        return self._config

    @config.setter
    def config(self, config: DebugConfig) -> None:
        check_policy(config, self.params.deepspeed)
        self._config = self._steps.config = self.sink.config = config

    @property
    def should_stop(self) -> bool:
        """Set when policy ``stop`` met an error anomaly: the loop should end."""
        return self._steps.policy.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._steps.policy.should_stop = value

    @property
    def stop_reason(self) -> str | None:
        """Why policy ``stop`` set :attr:`should_stop`: the cause (the step's first error), with its rank."""
        return self._steps.policy.stop_reason

    # -- lifecycle ----------------------------------------------------------------------------
    def _register(self) -> None:
        # FSDP2 calls these hooks after each group's reduce-scatter, in registration order within
        # the group: not backward's order (the gradients are then named in registration order)
        if not self.params.sharded:
            self._order_hooks = apply_grad_order(self._order)
        if self.params.deepspeed is not None:  # DeepSpeed under Accelerate: its step runs in backward
            self._zero_step = self.params.deepspeed.attach()
        partitions = self.params.partitions  # ZeRO's step holds collectives: a rank inside it is marked there
        self._liveness.attach(self.watched.models.values(), partitions.optimizers if partitions is not None else ())
        if self.config.enable_autograd_anomaly:
            self._anomaly_mode.enable()
        if self._pre_reduction is not None:
            self._pre_reduction.active = True
        self._steps.measurer.clip = self._clip if self._clip.attach() else None

    def _unregister(self) -> None:
        if self._pre_reduction is not None:  # DDP keeps the hook: it only forwards to the all-reduce now
            self._pre_reduction.active = False
            self._pre_reduction.reset()
        try:
            self._steps.measurer.clip = None
            self._clip.detach()
            self._order_hooks.remove()
            self._zero_step.remove()
            self._steps.history.stall.seen.stop()
            self._liveness.detach()
        finally:
            self._anomaly_mode.remove()

    def _carry_pre_reduction(self, early: PreReductionCheck) -> None:
        """``launch``'s handover (no Accelerator): ``early``, the check of this rank's gradients it
        attached before step 0's backward, before this debugger was made, lets go and gives its count
        so far to this debugger's check, so that a NaN made in step 0's backward names its rank."""
        if self._pre_reduction is not None:
            self._pre_reduction.carry(early)
        else:  # one process: no reduction to name a rank by
            early.release()

    def close(self) -> None:
        """Detach and close the event stream; final (``report()`` still works). The last
        monitored step's skip (by the GradScaler), which no later step shows, is judged first."""
        try:
            self._steps.judge_last_skip()
            super().close()
        finally:
            self._steps.measurer.updates.release()  # views into the weights: a model moved after close frees them
            self._finalizer()

    # -- the per-step call ---------------------------------------------------------------------
    def monitor_training_step(
        self,
        loss: torch.Tensor | float,
        optimizer: Any = None,
        step: int | None = None,
        timesteps: torch.Tensor | None = None,
        *,
        closure: Callable[[], torch.Tensor] | None = None,
        per_sample_loss: torch.Tensor | None = None,
        scaler: Any = None,
        noise_scheduler: Any = None,
        batch_size: int | None = None,
        inputs: Any = None,
        max_grad_norm: float | None = None,
        grad_norm: Any = None,
        loss_weights: torch.Tensor | None = None,
        sample_ids: Any = None,
        accumulating: bool = False,
    ) -> dict[str, Any]:
        """Measure one call of the training loop; returns what was measured this call.

        Call after backward, before ``optimizer.step()``. ``closure`` (forward + loss of this
        batch) lets a non-finite step be replayed under autograd anomaly mode to name the
        backward op; ``per_sample_loss`` (one value per sample, or the loss before reduction,
        ``[batch, ...]`` with ``timesteps``: each sample's mean) makes timestep buckets exact;
        ``scaler`` is a GradScaler used without Accelerate (one not passed is found at the first step
        that looks scaled and, once its ``scaler.step`` confirms it, read as passed: ``scaler_not_passed``).
        ``inputs`` (the batch: a tensor or a
        dict / list / tuple of them) is checked for NaN/Inf on the device (``nonfinite_input``,
        named before the NaN loss it causes). ``max_grad_norm`` (the ``max_norm`` you clip with)
        sets the step's ``grad_norm_clipped``; if you clip *before* monitoring, pass what
        ``clip_grad_norm_`` returned as ``grad_norm`` (the pre-clip norm; a tensor stays on the
        device). ``step`` is recorded plus ``config.step_offset``. Per sample (``samples``):
        ``per_sample_loss`` with ``timesteps`` names the samples whose loss is NaN/Inf or far
        above the run's (``sample_ids``: their names, a list or an integer tensor), and
        ``loss_weights`` (each sample's loss weight, e.g. min-SNR's) a weight that is NaN/Inf,
        with its timesteps; all read with the step's one transfer. ``accumulating=True`` says that
        no optimizer step follows this call (a plain loop's gradient accumulation, which has no
        Accelerate ``sync_gradients`` to read): its loss joins the next optimizer step's mean and
        nothing else is measured, as on Accelerate's micro-steps; a loop that monitors only the
        call before ``optimizer.step()`` needs no flag.
        """
        if self._closed:
            raise DiffusionDebugError("This TrainingDebugger was closed; create a new one to monitor again.")
        check_loss(loss)
        if isinstance(optimizer, (list, tuple)):  # no call: the step's Python is pinned
            raise TypeError(
                f"monitor_training_step takes one optimizer, not a {type(optimizer).__name__}: with several "
                "(a GAN's), call it after each optimizer's backward with the optimizer that steps next."
            )
        history = self._steps.history
        if self.config.max_debug_iterations is not None and history.joined >= self.config.max_debug_iterations:
            return {"step": step, "monitored": False}
        swaps, grads = self._swaps, None  # every watched parameter still where it was, before a gradient is read
        try:  # ParameterSwaps: its quick check or its whole one (no Python call but follow's)
            whole = optimizer is None or optimizer is not swaps.optimizer() or not history.joined % SWAP_CHECK_EVERY
            groups, count, frozen = swaps.trained  # the followed optimizer trains more since: unfrozen, a group added
            if len(groups) != count or not all(map(is_, map(attrgetter("grad"), frozen), repeat(None))):
                whole, history.coverage_checked = True, False  # followed again, and compared with the optimizer now
            if not (follow := whole):  # the optimizer's lists and their items; a watched parameter with no
                # gradient (one put in its place that the optimizer was not given may have it): the whole check
                (dicts, keys, held), (lists, items) = swaps.quick, swaps.quick_items
                same = all(map(is_, map(dict.get, dicts, keys), held)) and all(map(is_, chain(*lists), items))
                grads = list(map(attrgetter("grad"), self.params.params))
                whole = same and any(map(is_, grads, repeat(None)))
            if whole and (same := all(map(is_, map(dict.get, *swaps.check[:2]), swaps.check[2]))) and follow:
                swaps.follow(optimizer)
        except Exception as error:  # an error of ours (a malformed check)
            swaps.error, same = error, False
        if not same:
            with self.sink.guard("watching the parameters the model replaced", step=step, rank=self._ctx.rank):
                self._parameters_replaced()
        if swaps.joining:  # the optimizer trains parameters the watch lacks, new since (an attribute read a step)
            swaps.joining = False
            with self.sink.guard("watching the parameters that started training", step=step, rank=self._ctx.rank):
                self._parameters_joined(optimizer)
        if per_sample_loss is not None:  # the loss before reduction: each sample's mean
            per_sample_loss = per_sample(per_sample_loss, timesteps)
        if noise_scheduler is not None and history.joined == 0 and not any(history.buckets.count):
            history.buckets = TimestepBuckets(self.config.timestep_buckets, num_train_timesteps(noise_scheduler))
        call = Call(
            loss,
            optimizer,
            step,
            timesteps,
            closure,
            per_sample_loss,
            scaler,
            batch_size,
            inputs,
            max_grad_norm,
            grad_norm,
            loss_weights,
            sample_ids,
            bool(accumulating),
            grads if same and self._plain_gradients else None,  # the norms' (684 .grad reads: >= 0.26 ms a CPU step)
        )
        incomplete = gradients_incomplete(
            call.accumulating, self.accelerator, self.params.deepspeed, self._steps.fsdp_groups
        )
        try:
            if self._order_hooks.attached and getattr(loss, "grad_fn", None) is not None:  # recorded now
                self._order.compiled = accumulates_compiled(loss)  # a compiled backward's order is not used
            with self._liveness.monitoring(step, exchange=incomplete is None, optimizer=optimizer):
                info = self._steps.monitor(call, incomplete)
            self._pace_order_hooks()
            return info
        except DiffusionDebugError:
            raise
        except Exception as error:
            if self.config.strict:  # recorded once (not again when the step recorded it already)
                self.sink.raised("monitoring", error, step=step, rank=self._ctx.rank)
                raise
            self.sink.emit(failures.monitoring_failed(self._ctx.rank, step, error))
            self._steps.measurer.accumulated.reset()
            self._steps.samples.reset()
            return {"step": step, "monitored": False, "error": repr(error)}

    def _parameters_replaced(self) -> None:
        """The parameters the model holds now, in the old ones' places (``ParameterSwaps``), and what was cached
        of the old (the stand-in zero's kind, module groups, backward-order hooks); our error: the caller's guard.
        Those the models no longer hold (``ParameterSwaps.gone``: an adapter deleted) are let go, as the update
        sketch's blocks and the stability copy of them."""
        gone = frozenset(self._swaps.gone)
        self._swaps.refresh()
        if not self._swaps.replaced:
            return
        self._swaps.replaced = False
        if self._swaps.gone != gone:
            self._steps.measurer.joined()
            self._steps.stability.joined()
        self.params._one_kind = None
        self._steps.history.modules._groups = {}
        if self._order_hooks.attached:
            self._order_hooks.remove()
        if self.attached and not self.params.sharded:
            self._order.order.clear()
            self._order_hooks = apply_grad_order(self._order)

    def _parameters_joined(self, optimizer: Any) -> None:
        """Parameters of the watched models that the optimizer trains and the watch lacks (a part it held frozen
        and unfrozen since, ``text_encoder.requires_grad_(True)`` at step N; a module or LoRA adapter added and
        given to it, or to a new optimizer) join the watch at the end of its lists, read from this step as those
        trained from the start: their gradients in the step's norms (a NaN/Inf named at its module), their modules
        in the detailed steps and the module health, their weights in the applied-update sketch. One process,
        parameters whole (not DeepSpeed's, not sharded, not under several processes: the ranks' per-parameter
        checks are fixed): there they stay the ``unwatched_parameters`` warning. Where none joins and the
        optimizer holds watched parameters, it is compared with the watch at this step (a new optimizer's
        others named now, not within ``COVERAGE_EVERY`` steps)."""
        params, history = self.params, self._steps.history
        whole = not (self._ctx.distributed or params.sharded or params.deepspeed is not None)
        tables = embedding_tables(*map(unwrap_model, self.watched.models.values())) if whole else frozenset()
        added = params.join(self.watched.named_parameters(), tables) if whole else []
        if not added:
            groups = param_groups(optimizer) if optimizer is not None else None
            watched = set(map(id, params.params))
            if any(id(p) in watched for g in groups or () for p in g.get("params", ())):
                history.coverage_checked = False
            return
        order = self._order
        order.params.extend(params.params[len(order.params) :])  # before the check's refresh: its lists grow
        order.order = deque(order.order, maxlen=len(order.params))
        self._swaps.join(self.watched, added)
        self._swaps.refresh()
        self._swaps.replaced = False  # the positions held before are as they were
        self._steps.measurer.joined()
        self._steps.stability.joined()
        history.modules.grow()
        if history.health is not None:
            history.health.grow(params.module_names)
        history.stall.seen.rehold()  # the optimizers' step hooks read the joined parameters' gradients too
        history.detail.found_at(history.joined)  # their modules read in full for a while: their histories settle
        history.coverage_checked = False  # compared with the optimizer at this step: others outside still named
        if self._order_hooks.attached:
            self._order_hooks.remove()
        if self.attached and not params.sharded:
            order.order.clear()
            self._order_hooks = apply_grad_order(order)

    def _pace_order_hooks(self) -> None:
        """The backward-order hooks (a Python call per parameter a backward: 684 on an SD UNet, two thirds
        of a monitored step's Python) record a whole backward, then come off, and one again every
        :data:`ORDER_REFRESH` monitored steps: the order (naming the first non-finite gradient in forward
        order; a backward's is the same from step to step) is at most as many steps old."""
        if not self.attached or self.params.sharded:
            return
        if self._order_hooks.attached:
            if len(self._order.order) == len(self._order.params):
                self._order_hooks.remove()
        elif self._steps.history.joined % ORDER_REFRESH == 0:
            self._order_hooks = apply_grad_order(self._order)

    def phase(self, name: str, step: int | None = None) -> contextlib.AbstractContextManager[None]:
        """``with tdbg.phase("validation"):`` marks where this rank is (also ``"save"``, any name) for
        the stall watch of several processes (``stall_timeout``); nothing else, and free on one. An error
        leaving the phase keeps the rank in it: the others read where it raised, not where it was before."""
        return self._liveness.phase(name, step)
