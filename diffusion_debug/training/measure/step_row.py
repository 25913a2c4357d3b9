"""One rank's row of the per-step collective: its named slots, the value types a rank's measurement
travels in (:class:`Measurement`, :class:`LocalReadings`), and how the gathered matrix comes back to
the host in the step's one transfer (:func:`gathered_rows_to_host`). How a rank measures its row:
``step_measurer``.

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
from typing import Mapping, Sequence

import torch

from ...stats import read_now, to_device

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
    norms: torch.Tensor | None = None
    """The per-parameter gradient norms (float64, on the device; 0.0 for another optimizer's
    parameters, :attr:`StepMeasurer.not_judged`): a step that read no module norms makes them of
    these when its judging finds something (``StepMonitor._judge``)."""
    forwards: list = dataclasses.field(default_factory=list)
    """The trained models' calls of the step, kept for a replay on a NaN step (``loss.CountedInputs.forwards``)."""

    def checksums_or_nan(self, count: int, device: torch.device) -> torch.Tensor:
        """This rank's ``count`` per-parameter checksums (float64; NaN where it could not measure them)."""
        if self.checksums is not None:
            return self.checksums.double()
        return torch.full((count,), math.nan, dtype=torch.float64, device=device)


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
