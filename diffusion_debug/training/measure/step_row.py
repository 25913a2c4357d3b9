"""One rank's row of the per-step collective: named slots, how a rank measures it on the device,
and how the gathered matrix comes back to the host in the step's one transfer.

The row is float64: the :data:`DEVICE_SLOTS` are reductions made on the device, the
:data:`HOST_SLOTS` are host values copied to the device in one piece, then ``3 x buckets``
timestep-bucket values (sum, count, non-finite count per bucket). A rank whose measurement
failed sends :meth:`StepLayout.failed_vector`: NaN everywhere and ``failed`` set, so it still
joins the collective and its row is not judged.

>>> layout = StepLayout(buckets=2)
>>> row = layout.rows(read_now(layout.failed_vector(torch.device("cpu"))), world_size=1)[0]
>>> row.measured, row.failed, len(row.buckets)
(False, 1.0, 6)

Limits: a row carries one float64 per slot, so counts above 2**53 are not exact; ``checksum``
is NaN on steps without a replica check, ``grad_scale`` NaN without an enabled GradScaler,
``accelerate_skipped`` NaN when the optimizer is neither Accelerate's nor DeepSpeed's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Mapping, Sequence

import torch

from ...memory import memory_sample
from ...stats import read_now, to_device
from . import gradients
from .deepspeed_stage0 import EngineWithoutZero
from .gradients import TrainableParameters
from .loss import LossAccumulator
from .optimizer_state import learning_rates, scale_tensor, scaler_already_unscaled, step_was_skipped
from .pre_reduction import PreReductionCheck
from .several_optimizers import OptimizerTurns
from .shards import ShardNorms
from .shared_clip import SharedClip
from .updates import UpdateSketch

DEVICE_SLOTS = (
    "loss",
    "grad_norm",
    "nonfinite_parameters",
    "first_nonfinite",
    "checksum",
    "grad_scale",
    "input_nonfinite",
    "clip_norm",
    "local_nonfinite",
)
"""Reduced on the device: the step's mean loss, the global gradient norm, how many gradients are
non-finite and the first registered one of them, the sum of every parameter, the GradScaler's scale,
the non-finite values in the ``inputs=`` batch (NaN: not checked), the pre-clip norm the user
passed as ``grad_norm=`` (NaN: none), the flag (1.0) of NaN/Inf in this rank's own gradients before the
gradient all-reduce (``pre_reduction``; NaN: not checked)."""
HOST_SLOTS = (
    "loss_count",
    "rss_mb",
    "cuda_allocated_mb",
    "samples",
    "accelerate_skipped",
    "lr",
    "lr_jump_from",
    "lr_jump_to",
    "failed",
)
"""Host values: micro-steps in the step, memory, samples seen, the optimizer's skipped-step flag
(:data:`SKIPPED_BY_ACCELERATE` or :data:`SKIPPED_BY_DEEPSPEED`, 0 not skipped), the
first param group's learning rate, a learning rate that rose above every earlier value of its
group (from, to; NaN: none), and 1.0 when the rank could not measure the step."""
SLOTS = DEVICE_SLOTS + HOST_SLOTS
SKIPPED_BY_ACCELERATE = 1.0
"""Accelerate's ``optimizer_step_was_skipped``: the GradScaler skipped the last step."""
SKIPPED_BY_DEEPSPEED = 2.0
"""DeepSpeed's overflow check (ZeRO's, or the wrapper's without ZeRO) skipped the last step ("OVERFLOW!")."""
_MASKS_KEPT = 8
"""Masks of judged parameters kept (:meth:`StepMeasurer._judged_mask`): one per optimizer of a run."""


@dataclass(frozen=True)
class StepRow:
    """One rank's gathered row, by slot name (floats as they travelled: NaN where unknown)."""

    loss: float
    grad_norm: float
    nonfinite_parameters: float
    first_nonfinite: float
    checksum: float
    grad_scale: float
    input_nonfinite: float
    clip_norm: float
    local_nonfinite: float
    loss_count: float
    rss_mb: float
    cuda_allocated_mb: float
    samples: float
    accelerate_skipped: float
    lr: float
    lr_jump_from: float
    lr_jump_to: float
    failed: float
    buckets: tuple[float, ...] = ()
    """``sum``, ``count`` and ``nonfinite`` per timestep bucket, one block after the other."""

    @classmethod
    def from_row(cls, values: Sequence[float]) -> "StepRow":
        return cls(*values[: len(SLOTS)], buckets=tuple(values[len(SLOTS) :]))

    def to_list(self) -> list[float]:
        return [getattr(self, name) for name in SLOTS] + list(self.buckets)

    @property
    def measured(self) -> bool:
        return not self.failed > 0

    @property
    def nonfinite_count(self) -> int:
        value = self.nonfinite_parameters  # ``_count`` inlined: read three times a step
        return int(value) if math.isfinite(value) and value > 0 else 0

    @property
    def micro_steps(self) -> int:
        value = self.loss_count  # ``_count`` inlined: read every step
        return int(value) if math.isfinite(value) and value > 0 else 0

    @property
    def scaled(self) -> bool:
        """A GradScaler is in use on that rank."""
        return math.isfinite(self.grad_scale)

    @property
    def input_checked(self) -> bool:
        """The rank passed its batch as ``inputs=``."""
        return math.isfinite(self.input_nonfinite)

    @property
    def pre_clip_norm(self) -> float:
        """The step's gradient norm before clipping: the one the user passed as ``grad_norm=`` (what
        ``clip_grad_norm_`` returned, when clipping came before monitoring: the gradients measured
        then are the clipped ones), else the measured one. What is recorded and judged."""
        return self.grad_norm if math.isnan(self.clip_norm) else self.clip_norm

    def clipped(self, max_grad_norm: float | None) -> bool | None:
        """Whether ``clip_grad_norm_(max_norm=max_grad_norm)`` clips this step: the pre-clip norm
        above ``max_grad_norm``; None unknown."""
        if max_grad_norm is None or math.isnan(self.pre_clip_norm):
            return None
        return bool(self.pre_clip_norm > max_grad_norm)

    def clip_scale(self, max_grad_norm: float | None) -> float:
        """What ``clip_grad_norm_(max_norm=max_grad_norm)`` after monitoring multiplies the measured
        gradients by (1: no clipping, or clipping came before, ``grad_norm=``, and they were
        measured clipped)."""
        clipped_before = not math.isnan(self.clip_norm)
        norm = self.grad_norm
        if max_grad_norm is None or clipped_before or not math.isfinite(norm) or norm <= max_grad_norm:
            return 1.0
        return max_grad_norm / norm

    def bucket_nonfinite(self) -> list[float]:
        return list(self.buckets[2 * len(self.buckets) // 3 :])


@dataclass(frozen=True)
class StepLayout:
    """The row's length for ``buckets`` timestep buckets, and its two ways onto the device."""

    buckets: int

    @property
    def width(self) -> int:
        return len(SLOTS) + 3 * self.buckets

    def to_vector(
        self,
        device_values: Mapping[str, torch.Tensor],
        host_values: Mapping[str, float],
        bucket_sums: torch.Tensor | None,
        device: torch.device,
    ) -> torch.Tensor:
        """The row on ``device``: the device scalars stacked, the host values in one copy."""
        # ``map`` over the slots: loops in C, no comprehension's frame (two Python calls a step)
        on_device = torch.stack(list(map(device_values.__getitem__, DEVICE_SLOTS)))
        host = to_device(list(map(float, map(host_values.__getitem__, HOST_SLOTS))), torch.float64, device)
        if bucket_sums is None:
            bucket_sums = torch.zeros(3 * self.buckets, dtype=torch.float64, device=device)
        return torch.cat([on_device, host, bucket_sums])

    def failed_vector(self, device: torch.device) -> torch.Tensor:
        """A row of NaNs with ``failed`` set: the rank still joins the step's collective."""
        vector = torch.full((self.width,), math.nan, dtype=torch.float64, device=device)
        vector[SLOTS.index("failed")] = 1.0
        return vector

    def rows(self, values: Sequence[float], world_size: int) -> list[StepRow]:
        """Cut the fetched gathered matrix (flat) into one row per rank."""
        w = self.width
        return [StepRow.from_row(values[r * w : (r + 1) * w]) for r in range(world_size)]


@dataclass
class Measurement:
    """What a rank measured for one step: its row and what stays local."""

    vector: torch.Tensor
    """This rank's row of the per-step collective."""
    local: dict[str, torch.Tensor]
    """By :class:`LocalReadings` field: per-parameter gradient norms, per-module gradient norms and
    weight norms (with ``per_module_grad_norms``; weights on refresh steps only), the update
    sketch's per-module squared norms (from the second step): fetched with the gathered matrix in the step's
    one transfer; empty when the measurement failed."""
    checksums: torch.Tensor | None
    memory: dict
    input_counts: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Non-finite values per named input (device tensors; read only on a special step)."""
    input_producers: dict[str, tuple] = dataclasses.field(default_factory=dict)
    """The inputs a frozen model made, ``{path: (component, module[, weights])}`` (``loss.CountedInputs``)."""
    squares: torch.Tensor | None = None
    """The per-parameter squared gradient norms (float64, on the device; 0.0 for another optimizer's
    parameters, :attr:`StepMeasurer.not_judged`): a step that read no module norms makes them of
    these when its judging finds something (``StepMonitor._judge``)."""


@dataclass
class LocalReadings:
    """This rank's local figures, back on the host (``None`` where not measured)."""

    param_norms: list[float] | None = None
    module_norms: list[float] | None = None
    module_weight_norms: list[float] | None = None
    update_squares: list[float] | None = None
    """``UpdateSketch.measure``: each sampled module's previous squared norm, then its change's."""
    samples: list[float] | None = None
    """``samples.SampleAccumulator``: the step's per-sample losses, timesteps, weights and ids."""
    judged: list[float] | None = None
    """Whether each parameter's gradient was judged at this step (1.0) or left to another
    optimizer's step (0.0: :attr:`StepMeasurer.not_judged`); None: every one was."""


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
        judged = self._judged_mask(others, dev) if others is not None else None
        clip = self.clip
        if clip is not None and not clip.armed:  # no clip seen after a monitored step yet: no norms offered
            clip.pending, clip = clip.monitored() if scaler is not None and clip.early_unscale else True, None
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
        # sharded, a rank names the NaN/Inf of its own shards: the whole norms are NaN on every rank;
        # a norm is never negative, so below infinity is finite: one op (``isfinite`` is four)
        nonfinite = ~((norms if self.shards is None else own) < math.inf)
        positions, zero, nan, inf = self._constants_on(dev)
        checksums = gradients.parameter_checksums(params, dev) if check_ranks else None
        memory = memory_sample(dev) if memory_tracking else {}
        skipped = self.skipped(optimizer) if read_skipped else math.nan
        # float64 norms and their squares made once: the global norm, the module norms and the
        # transfer share them (each op is a kernel launch on a GPU: host time at real size)
        norms64 = norms.double()
        squares = judged_squares = norms64.square()
        if judged is not None:  # another optimizer's gradients: read (module norms) but not judged here
            nonfinite = nonfinite & judged
            judged_squares = torch.where(judged, squares, zero)
        device_values = {
            "loss": self.accumulated.mean() if self.accumulated.count else nan,  # NO_LOSS alone
            "grad_norm": judged_squares.sum().sqrt(),
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
            local["module_norms"] = params.module_norms_of_squares(judged_squares)
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
            judged_squares,
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

    def read(self, optimizer: Any) -> tuple[float, float, float]:
        rates = self.rates = learning_rates(optimizer)
        best, jump = 1.0, (math.nan, math.nan)
        if len(rates) != len(self.previous):  # a new optimizer or new groups: start again
            self.previous, self.largest = list(rates), list(rates)
            return (rates[0] if rates else math.nan), *jump
        for i, lr in enumerate(rates):
            before, top = self.previous[i], self.largest[i]
            if lr > top and before > 0 and lr / before > best:
                best, jump = lr / before, (before, lr)
            self.previous[i], self.largest[i] = lr, max(top, lr)
        return (rates[0] if rates else math.nan), *jump


def gathered_rows_to_host(
    matrix: torch.Tensor, measured: Measurement, layout: StepLayout
) -> tuple[list[StepRow], LocalReadings, Exception | None]:
    """The step's one device-to-host transfer: the gathered matrix and this rank's local figures.
    A failure of the local part is returned (not raised): the rows still come back, in a second
    transfer, so the step's further collectives are decided as on every other rank."""
    error = None
    try:
        # the float64 matrix first: ``cat`` promotes a float32 piece exactly, with no copy of its own
        # ``map``: loops in C, no comprehension's frame (two Python calls a step)
        pieces_on_device = list(map(torch.Tensor.to, measured.local.values(), repeat(matrix.device)))
        values = read_now(torch.cat([matrix.reshape(-1)] + pieces_on_device))
        sizes = list(map(torch.Tensor.numel, measured.local.values()))
    except Exception as failure:
        error, sizes = failure, []
        values = read_now(matrix.reshape(-1))
    world_size = matrix.shape[0]
    rows = layout.rows(values, world_size)
    pieces, start = [], world_size * layout.width
    for size in sizes:
        pieces.append(values[start : start + size])
        start += size
    return rows, LocalReadings(**dict(zip(measured.local, pieces))), error
