"""What only this rank knows, added to a judged step (:class:`LocalJudge`): per-module norms and
update ratios, the modules whose gradients died (``module_health``), a run whose updates move no
weight (``not_learning``), the exact non-finite gradients (where backward made them), the non-finite
inputs by name, the modules with the largest gradients, the weights that went non-finite, and the
backward op a ``closure=`` replay names.

Reads beyond the step's one transfer happen only on steps every rank knows are special (a
NaN/Inf somewhere): the exact non-finite gradients and weights, the per-input counts, the replay.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...config import DebugConfig
from ...probes import BackwardOrder
from ...record import Anomaly, make_anomaly, rebuilt
from ...stats import read_now
from .. import failures
from ..measure import gradients, updates, wrappers
from ..measure.flat_parameters import named_in_flat, weights_named_in_flat
from ..measure.gradients import ModuleNormBook, TrainableParameters
from ..measure.optimizer_state import param_groups, steps_by_its_gradient
from ..measure.step_row import LocalReadings
from ..measure.updates import UpdateSketch, judge_applied_update
from . import step_checks
from .anomaly_mode import localize_backward
from .causes import CauseTracker, at_trained_arguments
from .forward_replay import replay_forwards
from .module_health import judge_modules
from .not_learning import StallWatch
from .stall_findings import judge_optimizer_stall, judge_stall, judge_unscaled_loss
from .step_checks import StepFlags


def _gradient_step(optimizer: Any) -> tuple[Any, bool]:
    """``History.gradient_steps``' entry for ``optimizer``: a weak reference to it (itself where it
    takes none) and whether its step moves a weight by lr x its gradient."""
    try:
        ref: Any = weakref.ref(optimizer)
    except TypeError:  # None, or an object without weak references: held (a reused id is then never it)
        ref = lambda held=optimizer: held  # noqa: E731
    return ref, steps_by_its_gradient(optimizer)


_REPLAYED = ("nonfinite", "nonfinite_loss")
"""The kinds a ``closure=`` replay names the backward op of (errors only: a GradScaler's overflow is none)."""


@dataclass
class Judgement:
    """One step's judgement in progress: its anomalies and what the step record shows."""

    anomalies: list[Anomaly] = field(default_factory=list)
    flags: StepFlags = field(default_factory=StepFlags)
    skipped: list[Anomaly] = field(default_factory=list)
    module_norms: dict[str, float] = field(default_factory=dict)
    update_ratio: dict[str, float] = field(default_factory=dict)
    applied_update: dict[str, float] = field(default_factory=dict)
    """``||dw|| / ||w||`` per module of the previous step's update, measured from the weights."""


class LocalJudge:
    """Adds this rank's own findings to a :class:`Judgement`. Keeps no state of its own: what
    persists between steps is the monitor's ``history`` (its ``modules``, ``causes``,
    ``previous_step`` and ``update_flagged``)."""

    def __init__(
        self,
        *,
        params: TrainableParameters,
        order: BackwardOrder,
        model: nn.Module,
        rank: int,
        sketch: UpdateSketch,
        history: Any,
        rates: Any = None,
    ):
        self.params = params
        self.rates = rates
        """The measurer's ``LearningRateWatch``: whether the learning rate rose at the step (None: not known)."""
        self.order = order
        self.model = model
        self.rank = rank
        self.sketch = sketch
        self.history = history
        self.scaling = getattr(params.deepspeed, "scaling", None)
        """DeepSpeed fp16 without ZeRO: whether its engine scaled the loss, judged once it shows (then None)."""
        self.sharding = _sharding(params, model)
        """The engine under which no ``closure=`` replay runs (``zero``, ``fsdp2``, ``fsdp1``; "": none),
        which this rank's NaN loss and gradients name in their advice (``details["sharded"]``)."""

    def judge(
        self,
        judged: Judgement,
        local: LocalReadings,
        optimizer: Any,
        input_counts: dict,
        index: Any,
        config: DebugConfig,
        *,
        clip_scale: float = 1.0,
        input_producers: dict | None = None,
        grad_norm: float | None = None,
        norms: torch.Tensor | None = None,
        forwards: list = (),
    ) -> None:
        """Per-module norms and update ratios (``lr_spike`` beyond the threshold, from the gradients
        as the optimizer will see them: ``clip_scale`` of the measured ones); the exact
        non-finite gradients (``step_checks.locate_nonfinite``), the non-finite inputs by name and the
        modules with the largest gradients in this rank's anomalies (``input_producers``: the inputs a
        frozen model made, ``loss.CountedInputs``); the weights on a NaN step. ``grad_norm``: the
        row's global norm of the same per-parameter norms (else summed here: 684 floats on an SD UNet).
        ``norms``: the per-parameter norms on the device (float64): a step that read no module norms
        (``step.detail``) and found something reads them now (a second transfer)."""
        modules: ModuleNormBook = self.history.modules
        stall: StallWatch = self.history.stall
        if id(optimizer) not in stall.seen.followed:  # its step's hook, and its own stall's count (several)
            stall.follow_step(optimizer, self.params)  # before the reading: a GAN's second at its first step
        if self.scaling is not None:  # once: DeepSpeed#8393's unscaled loss (measure.deepspeed_fp16_scale)
            judged.anomalies += judge_unscaled_loss(self.rank, index, self.scaling)
            self.scaling = self.scaling.waiting()  # None once found, or not found in two steps
        if norms is not None and judged.anomalies and local.module_norms is None and config.per_module_grad_norms:
            local.module_norms = read_now(self.params.module_norms_of_squares(norms.square()))
        if local.module_weight_norms is not None:
            modules.weight_norms = local.module_weight_norms
        read = None  # the modules of the parameters the step's optimizer steps (None: all)
        if local.module_norms is not None and local.judged is not None:
            read = self._modules_read(local.judged)
        if local.module_norms is not None:
            # a module of another optimizer's keeps its last reading (the book's last norms: the report's)
            norms = (
                local.module_norms if read is None else np.where(read, local.module_norms, modules.last_norms).tolist()
            )
            judged.module_norms = modules.update(norms)
        # lr x gradient / weight foretells only a gradient step's update (SGD's), not an adaptive
        # optimizer's (Adam's, Prodigy's at lr 1.0, Muon's): for those it is neither computed nor
        # recorded, and the update measured from the weights (``applied_update``) judges them a step later
        if judged.module_norms and self._steps_by_its_gradient(optimizer):
            judged.update_ratio = modules.update_ratios(
                judged.module_norms, param_groups(optimizer), self.params.params, clip_scale, norms=modules.last_norms
            )
            if read is not None:  # a module of another optimizer's: no figure at this step
                judged.update_ratio = _only_read(judged.update_ratio, read)
            # one lr_spike per step (a clean step has none: no generator run)
            if not judged.anomalies or not any(a.kind == "lr_spike" for a in judged.anomalies):
                judged.anomalies += step_checks.judge_update_ratio(
                    self.rank, index, judged.update_ratio, config.update_ratio_threshold
                )
        if judged.module_norms and read is not None:  # a module of another optimizer's: no figure at this step
            judged.module_norms = _only_read(judged.module_norms, read)
        out = []
        for a in judged.anomalies:
            if a.rank == self.rank and a.kind == "nonfinite":
                flagged = [i for i, bad in enumerate(gradients.nonfinite_mask(self.params)) if bad]
                if local.judged is not None:  # another optimizer's gradients are its step's to judge
                    flagged = [i for i in flagged if local.judged[i]]
                a = step_checks.locate_nonfinite(a, flagged, self.order, self.params)
                if self.sharding == "fsdp1":  # without use_orig_params: at the user's parameter in the flat one
                    a = named_in_flat(a, self.params)
            elif a.rank == self.rank and a.kind == "nonfinite_input" and input_counts:
                counts = {name: float(v) for name, v in zip(input_counts, _host(input_counts))}
                a = step_checks.name_inputs(a, counts, input_producers)
            elif a.rank == self.rank and a.kind == "gradient_explosion" and judged.module_norms:
                a = step_checks.name_top_module(a, judged.module_norms)
            deepspeed = self.params.deepspeed is not None  # ZeRO's, or an engine's without ZeRO
            if deepspeed and a.rank == self.rank and a.kind == "nonfinite" and a.severity == "info":
                a = rebuilt(
                    a, details={**a.details, "loss_scaler": "deepspeed"}
                )  # fp16's overflow: DeepSpeed skips it
            if self.sharding and a.rank == self.rank and a.severity == "error" and a.kind in _REPLAYED:
                a = rebuilt(a, details={**a.details, "sharded": self.sharding})  # not "pass closure="
            out.append(a)
        judged.anomalies = out
        if local.update_squares is not None:
            self._judge_applied_update(judged, local.update_squares, index, config)
            self._judge_stall(judged, index, optimizer, config)
        if grad_norm is None:
            grad_norm = math.sqrt(sum([v * v for v in local.param_norms])) if local.param_norms else math.nan
        stall.pending_grad_norm = grad_norm  # (its optimizer, ``pending_optimizer``: set by the monitor)
        if local.module_norms is not None and self.history.health is not None:
            # the book's array of the same norms: not made again from the list
            found = judge_modules(self.rank, index, self.history.health.update(index, modules.last_norms, read))
            judged.anomalies += found
        self._check_weights(judged, index, forwards, config)

    def _steps_by_its_gradient(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` moves a weight by lr x its gradient, decided once per optimizer object
        (``History.gradient_steps``: its weak reference tells a new optimizer at a reused id)."""
        kind = self.history.gradient_steps.get(id(optimizer))
        if kind is None or kind[0]() is not optimizer:
            kind = self.history.gradient_steps[id(optimizer)] = _gradient_step(optimizer)
        return kind[1]

    def _modules_read(self, judged: list[float]) -> np.ndarray:
        """The modules that hold a parameter whose gradient the step judged (its optimizer's)."""
        read = np.zeros(len(self.params.module_names), dtype=bool)
        read[np.asarray(self.params.module_of, dtype=np.int64)[np.asarray(judged) > 0]] = True
        return read

    def _judge_applied_update(self, judged: Judgement, squares: list[float], index: Any, config: DebugConfig) -> None:
        """The previous step's update as measured from the weights: ``lr_spike`` at that step the
        first time it moves a module by more than ``update_ratio_threshold`` x its norm (again only
        after an update under it), unless that step has an ``lr_spike`` already."""
        sketch = self.sketch
        first = sketch.grown_from_zero is None  # the sketch's first comparison (``ratios`` sets it)
        judged.applied_update = sketch.ratios(squares)
        update_step = self.history.previous_step
        found = judge_applied_update(
            self.rank,
            update_step,
            judged.applied_update,
            config.update_ratio_threshold,
            detected_at=index,
            skip=sketch.grown_from_zero or set(),
            tables=sketch.table_modules,
            growing=sketch.growing,
            first=first,
            warming=self.rates is not None and self.rates.rose,  # a warmup: a resumed LoRA's lora_B still grows
        )
        flagged_before, self.history.update_flagged = self.history.update_flagged, bool(found)
        causes: CauseTracker = self.history.causes
        if found and not flagged_before and not causes.has("lr_spike", update_step):
            judged.anomalies += found

    def _judge_stall(self, judged: Judgement, index: Any, optimizer: Any, config: DebugConfig) -> None:
        """``not_learning`` when the last updates moved no weight although the gradients they should
        have applied were normal (finite, above the vanishing and below the explosion threshold) and
        the loss has not converged (a fitted model's updates may round away: nothing left to learn)."""
        watch: StallWatch = self.history.stall
        norm = watch.pending_grad_norm
        normal = math.isfinite(norm) and config.grad_vanishing_threshold < norm <= config.grad_explosion_threshold
        normal = normal and not self.history.ranks[0].converged
        skipped = bool(judged.skipped) or watch.policy_skipped  # (taken by the whole model's update)
        reading = dict(  # the whole model's run takes it, and of several the run of the optimizer it is of
            update_step=self.history.previous_step,
            ratios=judged.applied_update,
            grad_norm=norm if normal else math.nan,
            skipped=skipped,
            weights=lambda: gradients.weight_fingerprint(self.params),
        )
        clear = watch.update(**reading)
        judged.flags.weights_moved = watch.moved  # several processes: OR-ed by the step's reduce
        if watch.read_on:  # a run's stall withheld (one optimizer not stepped): the others' own stalls read on
            watch.read_on = False
            self._read_near()
        if clear:
            found = judge_stall(self.rank, watch, index, optimizer, self.params)
            judged.anomalies += found
        if watch.several:  # a GAN's: the optimizer whose update this was counts its own run too
            stalled = watch.update_each(**reading)
            if stalled is not None:
                judged.anomalies += judge_optimizer_stall(self.rank, watch, stalled, index, self.params)
        # a clean run: one call at each optimizer's first step judged (``id``: no Python call)
        if watch.updates or watch.seen.active or id(optimizer) not in watch.seen.followed:
            watch.follow_step(optimizer, self.params)  # what the optimizer's step receives, while still

    def judge_across_ranks(self, judged: Judgement) -> None:
        """After the step's reduce (several processes; ``judged.flags`` OR-ed over the ranks): where some
        rank's weights moved in the update the step read, this rank's run of still updates ends and a
        ``not_learning`` it found at this step is withdrawn, before the details carry it; where none did,
        the stall stands and the steps after it read in full (:meth:`stall_alone`). A stall is the
        whole model's: under FSDP2 or ZeRO a rank's shard may never move while the run learns (textual
        inversion trains an embedding table's new rows, all in the last rank's shard, and puts the others
        back). A reading at a step is the update of the step before on every rank (``not_learning``'s limits)."""
        if not judged.flags.weights_moved:
            if judged.anomalies and any(_stall_of(a, self.rank) for a in judged.anomalies):
                self._read_near()  # the stall stands: the steps after it read in full, as after any finding
            return
        self.history.stall.some_rank_moved()
        if judged.anomalies:
            judged.anomalies = [a for a in judged.anomalies if not _stall_of(a, self.rank)]

    def stall_alone(self, judged: Judgement) -> bool:
        """``judged``'s anomalies are this rank's stall alone: under several processes it stands only after
        the reduce (:meth:`judge_across_ranks`), which then marks the per-module schedule. Marked before, a
        stall withdrawn there kept a still shard beside a learning one reading every step: five still
        updates came within the ten steps after each withdrawn one, each withdrawn in turn."""
        return all(_stall_of(a, self.rank) for a in judged.anomalies)

    def _read_near(self) -> None:
        """This step found something: the next steps read the per-module figures in full (``step.detail``),
        the first of them the update this step applies."""
        history = self.history
        history.detail.found_at(history.joined)  # (the schedule's turn for this step was taken by the monitor)
        if history.detail(history.joined + 1):
            self.sketch.keep(history.joined)

    def _check_weights(self, judged: Judgement, index: Any, forwards: list, config: DebugConfig) -> None:
        """On a step whose own loss or gradients are NaN (and not from its input batch): which
        weights are non-finite, in registration order, and, the first time, the update that made
        them so; with finite weights and a NaN loss, the module of a trained model's forward that
        made it, by a replay of ``forwards`` (launch's kept calls: ``forward_replay``). Registration
        order on every engine: a NaN update reaches its weights together, so no order of backward says
        which came first, and FSDP2 and ZeRO record none (DDP's recorded one named another first
        weight, the first in forward order)."""
        if not judged.anomalies:  # a clean step: nothing suspect (two Python calls fewer)
            return
        own = [a for a in judged.anomalies if a.rank == self.rank]
        # a DeepSpeed step in accelerator.backward applied this step's own NaN gradients already: its weights'
        # NaN is theirs, found by the next step's NaN loss (as a raw engine's, whose step comes after the monitor)
        applied = self.params.deepspeed is not None and self.params.deepspeed.capture
        suspect = any(
            a.kind == "nonfinite_loss" or (a.kind == "nonfinite" and a.severity == "error" and not applied)
            for a in own
        )
        # a NaN batch or frozen model explains the step; one seen first at a trained model's argument may be
        # the output of a trained text encoder whose weights went non-finite: they are checked
        if not suspect or any(a.kind == "nonfinite_input" and not at_trained_arguments(a) for a in own):
            return
        flagged = [i for i, bad in enumerate(updates.nonfinite_weight_mask(self.params)) if bad]
        module = self.params.module_of_parameter(flagged[0]) if flagged else ""
        names = [self.params.names[i] for i in flagged]
        if self.sharding == "fsdp1" and flagged:  # without use_orig_params: the user's parameters
            names = weights_named_in_flat(flagged, self.params)
            module = names[0].rpartition(".")[0] if names[0] != self.params.names[flagged[0]] else module
        update = self.history.causes.weights_found(names, module, self.history.previous_step, index, self.rank)
        if update is not None:
            judged.anomalies.append(update)
        if not flagged and forwards and not self.sharding:  # finite weights: a module of the forward made it?
            if any(a.kind == "nonfinite_loss" or at_trained_arguments(a) for a in own):
                self._replay_forwards(judged, forwards, index, config)

    def _replay_forwards(self, judged: Judgement, forwards: list, index: Any, config: DebugConfig) -> None:
        """The module that made this rank's NaN loss in a trained model's forward (``forward_replay``),
        added as a ``nonfinite`` (``localized_by: "forward replay"``, no ``parameter``); else this rank's
        NaN loss says the replay found none (its advice is then not ``closure=``'s). A failed replay is a
        ``debugger_error`` at ``forward replay``; with ``strict=True`` it is raised (recorded as the step's judging
        failure)."""
        try:
            made = replay_forwards(forwards)
        except Exception as error:
            if config.strict:
                raise
            judged.anomalies.append(failures.forward_replay_failed(self.rank, index, error))
            return
        if made is not None and "module" in made:
            details = {"micro_step": made["micro_step"], "localized_by": "forward replay"}
            found = make_anomaly(  # DESIGN's nonfinite: the producer (its step's NaN gradients name a parameter)
                "nonfinite",
                component=made["component"],
                module=made["module"],
                step=index,
                rank=self.rank,
                details=details,
            )
            judged.anomalies.append(found)
            return
        outcome = made["skipped"][0] if made else "finite"  # not replayed: "changed", "compiled", "collective"
        judged.anomalies[:] = [
            rebuilt(a, details={**a.details, "forward_replay": outcome})
            if a.kind == "nonfinite_loss" and a.rank == self.rank
            else a
            for a in judged.anomalies
        ]

    def localize(self, anomalies: list[Anomaly], closure: Callable, config: DebugConfig, step: int | None) -> None:
        """Replay ``closure`` under anomaly mode and name what it found in this rank's NaN/Inf
        errors (not a GradScaler overflow, an info: the scaler handles it). The caller decides when:
        under several processes every rank replays together (``StepMonitor._localize``), so a rank
        with nothing of its own to name replays too. A failed replay (an OOM in it, a closure that
        raises) is named in the anomalies and is a ``debugger_error`` at ``replay`` of ``step``
        added to them; with ``strict=True`` it is then raised (an OOM too, as the diffusion side's
        own replays), its ``debugger_error`` saying so and the error marked as recorded (the NaN/Inf
        errors still name the failed replay: not 'pass closure=')."""
        if self.sharding:  # no replay there (see __init__): the NaN/Inf errors say what to do instead
            return
        targets = [
            i for i, a in enumerate(anomalies) if a.rank == self.rank and a.severity == "error" and a.kind in _REPLAYED
        ]
        failed: list[Anomaly] = []

        def replay_failed(error: BaseException) -> None:  # its traceback read now: the error is not kept
            if config.strict:  # kept and raised: the except below records it
                raise error
            failed.append(failures.replay_failed(self.rank, step, error))

        try:
            found = localize_backward(
                closure, self.params.params, self.model, config.debug_timeout, on_error=replay_failed
            )
        except Exception as error:
            found = {"found": False, "error": repr(error)}
            if config.strict:  # raised, recorded here once (marked); the NaN says the replay failed
                self._localized(anomalies, targets, found)
                anomalies.append(failures.replay_failed(self.rank, step, error, raised=True))
                raise
            replay_failed(error)
        self._localized(anomalies, targets, found)
        anomalies.extend(failed)

    @staticmethod
    def _localized(anomalies: list[Anomaly], targets: list[int], found: dict[str, Any]) -> None:
        for i in targets:
            anomalies[i] = step_checks.with_localization(anomalies[i], found)


def _sharding(params: TrainableParameters, model: Any) -> str:
    """The engine that shards ``params`` over the ranks, where a ``closure=`` replay cannot run: FSDP2's
    and ZeRO's forward on some ranks only would hang; FSDP1's forward uses views of its unsharded flat
    parameters, not the watched ones, so a backward into those runs nothing and the replay "stays
    finite" whatever the step held. "": none (one process, DDP)."""
    if params.partitions is not None:
        return "zero"
    if params.sharded:
        return "fsdp2"
    modules = model.modules() if hasattr(model, "modules") else ()
    return "fsdp1" if any(map(wrappers.is_fsdp1, modules)) else ""


def _stall_of(anomaly: Anomaly, rank: int) -> bool:
    """``anomaly`` is this rank's stall (``not_learning`` from its still updates, not DeepSpeed's unscaled loss)."""
    return anomaly.kind == "not_learning" and anomaly.rank == rank and "updates" in anomaly.details


def _host(counts: dict[str, torch.Tensor]) -> list[float]:
    """Per-input NaN/Inf counts on the host (one transfer; only on a step with a non-finite input)."""
    return read_now(torch.stack([c.double() for c in counts.values()]))


def _only_read(by_module: dict[str, float], read: np.ndarray) -> dict[str, float]:
    """``by_module`` (every module, in order) without the modules the step did not read."""
    return {name: value for (name, value), keep in zip(by_module.items(), read.tolist()) if keep}
