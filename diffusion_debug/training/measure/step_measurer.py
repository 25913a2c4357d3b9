"""How this rank measures its row of the per-step collective (``step_row``) on its device: the
gradient norms (unscaled, clipped or sharded as the run has them), the loss over micro-steps, the
optimizer's skip and learning rates, memory, and the local figures a detailed step reads
(:class:`StepMeasurer`); every value stays on the device until the step's one transfer.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

import torch

from ...memory import memory_sample
from ...stats import to_device
from . import gradients
from .deepspeed_stage0 import EngineWithoutZero
from .gradients import TrainableParameters
from .loss import LossAccumulator
from .optimizer_state import learning_rates, scale_tensor, scaler_already_unscaled, step_was_skipped
from .pre_reduction import PreReductionCheck
from .several_optimizers import OptimizerTurns
from .shards import ShardNorms
from .shared_clip import SharedClip
from .step_row import SKIPPED_BY_ACCELERATE, SKIPPED_BY_DEEPSPEED, Measurement, StepLayout
from .updates import UpdateSketch

_MASKS_KEPT = 8
"""Masks of judged parameters kept (:meth:`StepMeasurer._judged_mask`): one per optimizer of a run."""


class StepMeasurer:
    """Turns this rank's step in progress (:attr:`accumulated`) and its gradients into its row."""

    def __init__(self, params: TrainableParameters, device: torch.device, layout: StepLayout):
        self.params = params
        self.device = device
        self.layout = layout
        self.accumulated = LossAccumulator()
        self.learning_rates = LearningRateWatch()
        self.updates = UpdateSketch(params)
        self.shards: ShardNorms | None = None
        """Sharded parameters under several processes: the sum of the shards' norms over the ranks."""
        self.pre_reduction: PreReductionCheck | None = None
        """DDP: this rank's own gradients counted before the all-reduce (its comm hook)."""
        self.clip: SharedClip | None = None
        """One process under Accelerate, attached: the step's norms offered to the user's clip (``shared_clip``)."""
        self.not_judged: frozenset[int] | None = None
        """The parameters (by ``id``) whose gradients the next measured step leaves out of its judged
        slots (the global norm, the non-finite count and the first non-finite one): another
        optimizer's, which steps on them at a step of its own (``launch``: a GAN's generator's, at its
        discriminator's step). Taken by that step; None (the common case): every gradient is judged."""
        self.turns = OptimizerTurns()
        """The optimizers measured so far: with several (a GAN's), a step judges its optimizer's gradients."""
        self.frozen = FrozenParameters(params.params)
        """The parameters the script froze since (``requires_grad_(False)``): no reading at a detailed step."""
        self._judged: dict[int, tuple[frozenset[int], torch.Tensor | None]] = {}
        """Per :attr:`not_judged` set (by id; the set kept, so no id is another's): its mask of the
        judged parameters on the device (None: all). One per optimizer: a GAN's steps alternate."""
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def measure(
        self,
        *,
        scaler: Any,
        optimizer: Any,
        check_ranks: bool,
        refresh_weights: bool,
        per_module: bool,
        memory_tracking: bool,
        read_skipped: bool,
        clip_norm: Any = None,
        updates_at: int | None = None,
        listed: list | None = None,
    ) -> Measurement:
        """Gradient norms (unscaled by the GradScaler's scale unless already unscaled), reduced on
        the device; the checksum when ``check_ranks``; weight norms when ``refresh_weights``; the
        per-parameter and per-module norms for the host when ``per_module`` (a detailed step);
        ``clip_norm`` is the pre-clip norm the user passed (tensor or number: it rides in the row);
        ``updates_at``: the monitored step, for the update sketch's schedule (``UpdateSketch.measure``);
        ``listed``: the gradients as the debugger listed them (``Call.gradients``; None: listed here)."""
        params, dev = self.params, self.device
        others, self.not_judged = self.not_judged, None
        turns = self.turns
        if turns.several or optimizer is not turns.last():  # several optimizers (a GAN's): no call else
            turns.now(optimizer)
            if params.deepspeed is None and optimizer is not None:  # a raw engine's model watched: its wrapper's
                params.deepspeed = EngineWithoutZero.of_optimizer(params.params, optimizer)
        if others is None:
            others = turns.apart
        if per_module:  # the module figures: a part the script froze is left as it was, not read as zero
            others = self.frozen.apart(others)
        judged = self._judged_mask(others, dev) if others is not None else None
        clip = self.clip
        first = clip is not None and not clip.armed
        if first:  # no clip seen after a monitored step yet: no norms offered (the clip compares its own)
            if scaler is not None and clip.early_unscale:
                clip.monitored(scaler)
            clip.pending, clip = True, None
        if clip is not None and scaler is not None:  # fp16 that the user clips: unscaled as the clip does
            clip.unscale(scaler, optimizer)
        if clip is None:
            norms = gradients.grad_norms(params, dev, listed)
        else:  # the gradients listed once for the norms and the clip
            grads = listed if listed is not None else params.local_gradients()
            norms = gradients.grad_norms(params, dev, grads)
            clip.offer(norms, grads, scaler, optimizer)
        weights = gradients.weight_norms(params, dev) if refresh_weights else None
        own = norms
        if self.shards is not None:  # FSDP2, ZeRO: this rank's shards -> the whole parameters
            norms, weights = self.shards.whole(norms, weights)
        scale = scale_tensor(scaler) if scaler is not None else None
        deepspeed = params.deepspeed
        if scale is None and deepspeed is not None:  # DeepSpeed's fp16 loss scale: ZeRO's fragments or .grad hold it
            scale = None if (s := deepspeed.loss_scale(optimizer)) is None else torch.tensor(s, dtype=torch.float64)
        held = deepspeed is None or deepspeed.holds_scale  # DeepSpeed#8393: fp16's .grad held no loss scale
        if scale is not None and held and not scaler_already_unscaled(scaler, optimizer):
            norms = norms / scale.to(device=dev, dtype=torch.float32)
        if first:  # the norms the next clip compares with its own (SharedClip.measured)
            self.clip.measured = norms
        # sharded, a rank names the NaN/Inf of its own shards: the whole norms are NaN on every rank;
        # a norm is never negative, so below infinity is finite: one op (``isfinite`` is four)
        nonfinite = ~((norms if self.shards is None else own) < math.inf)
        positions, zero, nan, inf = self._constants_on(dev)
        checksums = gradients.parameter_checksums(params, dev) if check_ranks else None
        memory = memory_sample(dev) if memory_tracking else {}
        skipped = self.skipped(optimizer) if read_skipped else math.nan
        # float64 norms made once: the global norm, the module norms and the transfer share them (each op
        # is a kernel launch on a GPU: host time at real size); the global norm is one ``vector_norm`` of
        # them, and their squares are taken only where module norms are made (a detailed step, a finding)
        norms64 = judged_norms = norms.double()
        if judged is not None:  # another optimizer's gradients: read (module norms) but not judged here
            nonfinite = nonfinite & judged
            judged_norms = torch.where(judged, norms64, zero)
        device_values = {
            "loss": self.accumulated.mean() if self.accumulated.count else nan,  # NO_LOSS alone
            "grad_norm": torch.linalg.vector_norm(judged_norms),
            "nonfinite_parameters": nonfinite.sum(dtype=torch.float64),
            # the first registered non-finite one: the row's name, which the rank's own judging
            # replaces by where backward made the NaN (judges.step_checks.locate_nonfinite)
            "first_nonfinite": torch.where(nonfinite, positions, inf).amin(),
            "checksum": checksums.sum() if checksums is not None else nan,
            "grad_scale": scale.to(device=dev, dtype=torch.float64).reshape(()) if scale is not None else nan,
            "input_nonfinite": self.accumulated.input_nonfinite
            if self.accumulated.input_nonfinite is not None
            else nan,
            "clip_norm": _device_scalar(clip_norm, zero, nan),
            "local_nonfinite": self.pre_reduction.take(zero) if self.pre_reduction is not None else nan,
        }
        lr, jump_from, jump_to = self.learning_rates.read(optimizer)
        host_values = {
            "loss_count": self.accumulated.count,
            "rss_mb": memory.get("rss_mb", math.nan),
            "cuda_allocated_mb": memory.get("cuda_allocated_mb", math.nan),
            "samples": self.accumulated.samples,
            "accelerate_skipped": skipped,
            "lr": lr,
            "lr_jump_from": jump_from,
            "lr_jump_to": jump_to,
            "failed": 0.0,
        }
        vector = self.layout.to_vector(device_values, host_values, self.accumulated.bucket_sum, dev)
        local = {}
        if per_module:  # a detailed step (``step.detail``): the per-parameter and per-module norms
            local["param_norms"] = norms64
            # another optimizer's gradients are no module's figure at this step (``LocalJudge``: its modules unread)
            local["module_norms"] = params.module_norms_of_squares(judged_norms.square())
            if weights is not None:
                local["module_weight_norms"] = params.module_norms(weights)
        update = self.updates.measure(dev, updates_at)
        if update is not None:
            local["update_squares"] = update
        if judged is not None:
            local["judged"] = judged
        accumulated = self.accumulated
        return Measurement(
            vector,
            local,
            checksums,
            memory,
            dict(accumulated.input_counts),
            dict(accumulated.input_producers),
            judged_norms,
            accumulated.input_forwards,  # reset() makes a new list: the step keeps this one
        )

    def skipped(self, optimizer: Any, last: bool = False) -> float:
        """The optimizer's own word on its last step (NaN: it has none; ``last``: at close, of the last
        monitored step). DeepSpeed's overflow check is the only word where the engine is DeepSpeed's
        (``params.deepspeed``): Accelerate's ``step_was_skipped`` forwards the same flag, of the step
        that ran inside ``accelerator.backward``."""
        deepspeed = self.params.deepspeed
        if deepspeed is None:
            flag = step_was_skipped(optimizer)
        else:
            flag = deepspeed.last_skip(optimizer) if last else deepspeed.step_skipped(optimizer)
        if flag is None:
            return math.nan
        return (SKIPPED_BY_ACCELERATE if deepspeed is None else SKIPPED_BY_DEEPSPEED) * flag

    def _judged_mask(self, others: frozenset[int], device: torch.device) -> torch.Tensor | None:
        """Which parameters a step that leaves ``others`` out judges, on ``device`` (None: all of
        them); made once for each set (``launch`` and ``OptimizerTurns`` hand each optimizer's over
        as one object, made again when its groups change: a few kept, the oldest dropped)."""
        cached = self._judged.get(id(others))
        if cached is None or cached[0] is not others:
            keep = [id(p) not in others for p in self.params.params]
            cached = (others, None if all(keep) else to_device(keep, torch.bool, device))
            if len(self._judged) >= _MASKS_KEPT:  # sets of groups gone (``add_param_group``)
                del self._judged[next(iter(self._judged))]
            self._judged[id(others)] = cached
        return cached[1]

    def joined(self) -> None:
        """Parameters joined the watch (``TrainableParameters.join``): the positions and masks made for the old
        list are dropped, and the update sketch takes its blocks again at its next reading (the new ones' too)."""
        self._constants.clear()
        self._judged.clear()
        self.updates.release()

    def failed(self) -> Measurement:
        self.not_judged = None  # the step it was for is over
        if self.pre_reduction is not None:  # this step's counts are not carried into the next
            self.pre_reduction.reset()
        return Measurement(self.layout.failed_vector(self.device), {}, None, {})

    def _constants_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Parameter positions, and a zero, a NaN and an infinity (float64 scalars) on ``device``,
        made once (the row's stack copies them: no step writes into them)."""
        cached = self._constants.get(device)
        if cached is None:
            positions = torch.arange(len(self.params), device=device, dtype=torch.float64)
            scalars = to_device([0.0, math.nan, math.inf], torch.float64, device)
            cached = (positions, scalars[0], scalars[1], scalars[2])
            self._constants[device] = cached
        return cached


class FrozenParameters:
    """The watched parameters that no longer require a gradient: a script that freezes a part mid-run
    (``unet.down_blocks.requires_grad_(False)``) leaves its gradients None or zero on purpose, so a
    detailed step leaves them out as it does another optimizer's (its modules unread: neither low nor
    healthy, never called dead). One set object per distinct set (``StepMeasurer._judged_mask`` makes a
    mask once per object); nothing is made while every parameter requires a gradient.

    >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> frozen = FrozenParameters([a, b])
    >>> frozen.apart(None) is None
    True
    >>> _ = b.requires_grad_(False)
    >>> frozen.apart(None) == {id(b)}, frozen.apart(None) is frozen.apart(None)
    (True, True)
    >>> frozen.apart(frozenset({1})) == {1, id(b)}
    True
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self._flags: list[bool] = []
        self._apart: dict[int, tuple[frozenset[int] | None, frozenset[int]]] = {}

    def apart(self, others: frozenset[int] | None) -> frozenset[int] | None:
        """``others`` (ids; None: none) with the frozen parameters' ids added."""
        flags = list(map(attrgetter("requires_grad"), self.params))
        if all(flags):
            return others
        if flags != self._flags:
            self._flags, self._apart = flags, {}
        made = self._apart.get(id(others))
        if made is None or made[0] is not others:
            frozen = frozenset(id(p) for p, trained in zip(self.params, flags) if not trained)
            made = self._apart[id(others)] = (others, frozen | others if others is not None else frozen)
        return made[1]


def _device_scalar(value: Any, zero: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """``value`` (tensor or number; None: NaN) as a float64 scalar on ``zero``'s device, with no sync."""
    if value is None:
        return nan
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=zero.device, dtype=torch.float64).reshape(())
    return zero + float(value)


class LearningRateWatch:
    """Each param group's learning rate at the previous monitored step, and the largest seen.

    :meth:`read` gives the first group's lr and, when a group's lr rose above every earlier value
    of that group (not from 0: a warmup's first step is no jump), its previous and new value;
    the largest such rise by factor. NaN where there is none.

    >>> watch = LearningRateWatch()
    >>> class Opt:
    ...     param_groups = [{"lr": 1e-4}]
    >>> opt = Opt(); watch.read(opt)
    (0.0001, nan, nan)
    >>> opt.param_groups[0]["lr"] = 0.1; watch.read(opt)
    (0.1, 0.0001, 0.1)
    """

    def __init__(self) -> None:
        self.previous: list[float] = []
        self.largest: list[float] = []
        self.rates: list[float] = []
        """The rates the last :meth:`read` took (the step row's, which its description reuses)."""
        self.rose = False
        """At the last :meth:`read`, some group's rate was above its rate at the read before (a warmup)."""

    def read(self, optimizer: Any) -> tuple[float, float, float]:
        rates = self.rates = learning_rates(optimizer)
        best, jump, self.rose = 1.0, (math.nan, math.nan), False
        if len(rates) != len(self.previous):  # a new optimizer or new groups: start again
            self.previous, self.largest = list(rates), list(rates)
            return (rates[0] if rates else math.nan), *jump
        for i, lr in enumerate(rates):
            before, top = self.previous[i], self.largest[i]
            if lr > before:  # (a comparison: no call)
                self.rose = True
            if lr > top and before > 0 and lr / before > best:
                best, jump = lr / before, (before, lr)
            self.previous[i], self.largest[i] = lr, max(top, lr)
        return (rates[0] if rates else math.nan), *jump
