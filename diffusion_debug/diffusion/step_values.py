"""One denoising step measured: tensor stats, probe readings and loose scalars reach the host in
ONE transfer, and become the step's row.

:func:`queue_step` hands the step's tensors to :func:`stats.queue_tensors`, with the sentinel
readings and the schedule's device scalars riding along in the same copy; :func:`finish_step`
turns that copy into :class:`StepValues` (the whole denoiser output's statistics merged from its
classifier-free-guidance halves, without a second pass on the device). A text encoder or VAE
call is measured the same way (:func:`measure_call`).

A denoiser called several times a step (Wan 2.2, Flux and QwenImage with true CFG: the conditional
and the unconditional pass as two calls; three-way guidance: three) has each output checked: the
last is the row's ``model_output``; the earlier ones ride in the same stack as the step's other
tensors (no added op where their shape is the latents', no added transfer) and are out of the
row, read for their finiteness only (:attr:`StepValues.first_nonfinite_output`). Up to
:data:`MAX_HELD_OUTPUTS` outputs (and their calls) are held until the step ends: as many as
:data:`MAX_UNSTEPPED_CALLS`, past which each further call is checked on its own.

Limits: in a step with more than :data:`MAX_UNSTEPPED_CALLS` denoiser calls each call from the
next one on is checked on its own (at the run's step, :attr:`RunState.call_step`), and the ones
held before it with it, then let go: the step's row measures its last call's output.

Long because the copy is one layout: what :func:`queue_step` stacks (the step's tensors, the
sentinel's readings, the held outputs, the schedule ``set_timesteps`` made) and how
:func:`finish_step` reads each back must change together.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..probes import ModuleReading
from ..record import Anomaly
from ..stats import (
    ANY_AUTOCAST,
    QueuedTensors,
    TensorStats,
    absmax_on_device,
    detached,
    queue_tensors,
    read_now,
    scalars_to_host,
    to_host,
)
from . import checks

# min and max are not in the row: no check and no report reads them, and they cost a pass each
STAT_KEYS = ("shape", "dtype", "mean", "std", "absmax", "l2", "nan", "posinf", "neginf")
ROW_TENSORS = ("latents", "model_output", "uncond", "cond", "pred_original_sample")  # row order
SCALARS = ("timestep", "sigma", "sigma_next", "guidance_gap")
# Denoiser calls without a scheduler step after which every further call is checked on its own
# (the scheduler was replaced, or the denoiser is called directly): the probe queue stays bounded.
MAX_UNSTEPPED_CALLS = 8
# Denoiser outputs held until the step ends (the last ones; their calls too): every call of a step
# that has a scheduler step, and the first call checked on its own with the ones before it (which are
# checked then, not let go unchecked). Holding them costs a list slot, not a Python call.
MAX_HELD_OUTPUTS = MAX_UNSTEPPED_CALLS + 1
EARLIER = "earlier_output_"  # + index: an earlier denoiser output of the step, measured, not in the row

ProbePart = tuple[str, list[torch.Tensor], Callable[[list[list[float]]], list[ModuleReading]]]
"""A probe's queued device values and how to turn their host copies into readings."""


@dataclass
class RunState:
    """What one pipeline run has seen so far; a new run (``set_timesteps``, a prompt encoded
    after a step) starts from a fresh one."""

    step: int = 0
    stepped: bool = False
    monitored: int = 0
    """Steps recorded (against ``max_debug_iterations``)."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The denoiser outputs of the current step (the last few; dropped at the step's end)."""
    makers: list[str | None] = field(default_factory=list)
    """The component that made each of :attr:`outputs` (a step may call two experts)."""
    denoiser_calls: int = 0
    expert: str | None = None
    """The denoiser component whose output the step measures (Wan 2.2 runs ``transformer`` or ``transformer_2``)."""
    last_row: dict[str, Any] | None = None
    """The row ``scheduler.step`` just recorded (``monitor_diffusion_step`` returns it)."""
    previous_l2: float | None = None
    init_noise_sigma: float = 1.0
    mark: float = field(default_factory=time.perf_counter)
    rng_state: torch.Tensor | None = None
    """torch's global CPU generator's state as the run began (a C method: no Python call): a call given
    ``generator=`` that moved it drew without it (:func:`~.determinism.global_rng_drawn`). None (not taken)
    for a run begun in a call given no generator or the global one: nothing compared as the call ends."""
    unstepped_noted: bool = False
    scheduled: bool = False
    """``set_timesteps`` ran in this run: :attr:`step` is known before the first ``scheduler.step``."""
    last_step: int | None = None
    """The schedule's last step (its timesteps, less one, as ``set_timesteps`` made them; None or -1: not known):
    no sentinel is paced for a step after it (a 1-step run not read puts none of their hooks in)."""
    step_callback: bool | None = None
    """Whether the pipeline call was passed a ``callback_on_step_end`` (None: not read yet, read at its
    first step): its steps arm :class:`~.components.step_end.StepEndWatch`."""

    @property
    def current_step(self) -> int | None:
        """The step the run is at, for anomalies between steps (None before the first one)."""
        return self.step if self.stepped else None

    def add_output(self, output: torch.Tensor | None, component: str | None = None) -> None:
        """A denoiser call of ``component`` finished (``output``: its first tensor)."""
        if output is not None:
            self.outputs = (self.outputs + [output])[-MAX_HELD_OUTPUTS:]
            self.makers = (self.makers + [component])[-MAX_HELD_OUTPUTS:]
        self.denoiser_calls += 1
        self.last_row = None

    def with_outputs(self, inputs: StepInputs) -> StepInputs:
        """``inputs`` with the step's denoiser outputs (seen by the hooks), where there are some: the
        last as ``denoiser_output``, the ones before it as ``earlier_outputs``."""
        if not self.outputs:
            return inputs
        return dataclasses.replace(inputs, denoiser_output=self.outputs[-1], earlier_outputs=tuple(self.outputs[:-1]))

    @property
    def call_step(self) -> int | None:
        """The step of a denoiser call checked on its own (past :data:`MAX_UNSTEPPED_CALLS` in one step:
        many guidance branches, a callback's own calls): the run's, once its schedule was set or a step
        taken; None where no watched scheduler was seen (the denoiser called directly)."""
        return self.step if self.stepped or self.scheduled else None

    @property
    def unstepped(self) -> bool:
        """More denoiser calls than a step makes: each further call is checked on its own."""
        return self.denoiser_calls > MAX_UNSTEPPED_CALLS

    def note_unstepped(self) -> bool:
        """True the first time in the run (for a one-line event)."""
        first, self.unstepped_noted = not self.unstepped_noted, True
        return first

    def end_step(self) -> None:
        """Drop what the step held: no activation is kept across steps."""
        self.outputs, self.makers, self.denoiser_calls, self.expert = [], [], 0, None


def stats_dict(stats: TensorStats) -> dict[str, Any]:
    """The row's view of one tensor's statistics (:meth:`TensorStats.to_dict`'s ``STAT_KEYS``, in
    their order)."""
    return stats_dicts({None: stats})[None]


def stats_dicts(
    stats: dict[Any, TensorStats], into: dict[Any, Any] | None = None, ready: dict[Any, Any] | None = None
) -> dict[Any, Any]:
    """:func:`stats_dict` of each of ``stats``, by its label, put into ``into`` (a step row: five a
    step, spelled out in one call). ``ready``: also, by label, a JSON copy of each whose four floats
    are finite (the record's, :func:`~diffusion_debug.record.jsonio.to_jsonable`'s ``ready``: its other
    values are text and ints by :class:`TensorStats`' making), which the record keeps as it is instead
    of checking it value by value; a NaN, an Inf or a None (no finite element) leaves it to the record."""
    out = {} if into is None else into
    for label, s in stats.items():
        shape, mean, std, absmax, l2 = list(s.shape), s.mean, s.std, s.absmax, s.l2
        out[label] = entry = {
            "shape": shape,
            "dtype": s.dtype,
            "mean": mean,
            "std": std,
            "absmax": absmax,
            "l2": l2,
            "nan": s.nan,
            "posinf": s.posinf,
            "neginf": s.neginf,
        }
        if ready is not None:
            try:  # x - x: 0.0 for a finite float, NaN for a NaN or an Inf (no C call); None raises
                if (mean - mean) + (std - std) + (absmax - absmax) + (l2 - l2) == 0.0:
                    ready[label] = {**entry, "shape": shape[:]}  # its own copy: the user's row is not the record's
            except TypeError:  # a None: no finite element (the record checks it value by value)
                pass
    return out


# -- a denoising step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepInputs:
    """What one step is measured from: its tensors (still on the device) and where it was in the
    schedule (``sigma`` / ``sigma_next``: 0-d device tensors, or None without sigmas)."""

    timestep: Any
    latents: torch.Tensor | None
    """The new latents (``prev_sample``), else the step's input ``sample``."""
    denoiser_output: torch.Tensor | None
    pred_original_sample: torch.Tensor | None = None
    batch: int | None = None
    sigma: Any = None
    sigma_next: Any = None
    sample: Any = None
    """The latents ``scheduler.step`` was given (where non-finite latents came from)."""
    scheduler_model_output: Any = None
    """The model output ``scheduler.step`` was given (after guidance), as passed."""
    earlier_outputs: tuple[torch.Tensor, ...] = ()
    """The step's denoiser outputs before ``denoiser_output`` (a conditional pass called apart from
    the unconditional one), oldest first."""


@dataclass
class StepValues:
    """A step's measurements on the host."""

    stats: dict[str, TensorStats]
    """By row name (:data:`ROW_TENSORS`)."""
    scalars: dict[str, float | None]
    """:data:`SCALARS`, None where unknown."""
    readings: dict[str, list[ModuleReading]]
    """Probe readings by component."""
    earlier: list[TensorStats] = field(default_factory=list)
    """The statistics of the step's earlier denoiser outputs (:attr:`StepInputs.earlier_outputs`)."""
    schedule: Schedule | None = None
    """The run's schedule, read (its first step only)."""

    @property
    def output_finite(self) -> bool:
        """Whether every denoiser output of the step is finite (asked twice a step: no call of its own)."""
        for stats in self.earlier:
            if stats.nan or stats.posinf or stats.neginf:
                return False
        output = self.stats.get("model_output")
        return output is None or not (output.nan or output.posinf or output.neginf)

    @property
    def first_nonfinite_output(self) -> int | None:
        """How many denoiser outputs before the last the step's first non-finite one is (0: the last,
        1: the one before it), None when every one is finite: the call that made the NaN/Inf."""
        output = self.stats.get("model_output")
        outputs = self.earlier + ([output] if output is not None else [])
        bad = [i for i, stats in enumerate(outputs) if not stats.is_finite]
        return len(outputs) - 1 - bad[0] if bad else None


@dataclass
class Schedule:
    """What ``set_timesteps`` made, unread: ``first`` and ``last`` timestep (``last`` only where a
    rule reads it) and ``init_noise_sigma``, each a number or a 1-element tensor where the scheduler
    keeps it on the device (a read there is a sync: the tensors ride in the first step's transfer
    instead, :func:`queue_step`, and :meth:`read` fills in their values from it; a schedule no step
    follows is read on its own)."""

    steps: int | None
    first: Any
    last: Any
    init_noise_sigma: Any
    custom: bool = False
    """The call gave its own ``timesteps`` or ``sigmas``: no spacing rule is checked."""

    def read(self, host: list[list[float]] | None = None) -> Schedule:
        """Itself, its numbers filled in from ``host`` (the rows of its tensors, in field order, as
        :func:`queue_step` joins them), else read now (one read)."""
        values = [self.first, self.last, self.init_noise_sigma]
        if host is None:
            unread = [value.reshape(1) for value in values if isinstance(value, torch.Tensor)]
            host = to_host(unread) if unread else []
        place = 0
        for i in range(3):
            if isinstance(values[i], torch.Tensor):
                values[i], place = host[place][0], place + 1
            elif values[i] is not None:  # a number (a numpy one: a scheduler's timesteps kept as an array)
                values[i] = float(values[i])
        self.first, self.last = values[0], values[1]
        self.init_noise_sigma = 1.0 if values[2] is None else float(values[2])
        return self


@dataclass
class QueuedStep:
    """A step's statistics queued on the device, on their way to the host (:func:`queue_step`)."""

    stats: QueuedTensors
    """The step's tensors; the scalars and probe values ride along as its extra values."""
    raw: dict[str, Any]
    on_device: list[str]
    probes: list[ProbePart]
    schedule: Schedule | None = None
    """The run's schedule, read with its first step (its device values after the scalars)."""
    schedule_values: int = 0
    """How many of its values ride in the copy."""


def queue_step(
    inputs: StepInputs, probes: list[ProbePart] = (), *, deferred: bool = False, schedule: Schedule | None = None
) -> QueuedStep:
    """Queue every statistic of one step on its device and start their copy to the host.

    The step's tensors (latents, the denoiser output — as its two halves under classifier-free
    guidance, whose gap norm rides along —, the predicted x0) are measured together by
    :func:`stats.queue_tensors`: a handful of ops whatever their number, since at real size on a
    GPU every added op is a kernel launch in a launch-bound loop. ``deferred``: the copy goes into
    pinned memory without blocking, to be read by :func:`finish_step` a step later. ``schedule``:
    the run's (its first step), whose device values ride along too (no read at ``set_timesteps``)."""
    latents, denoiser_output, batch = inputs.latents, inputs.denoiser_output, inputs.batch
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(latents, torch.Tensor):
        tensors["latents"] = latents
    gap, merged = None, {}
    halves = isinstance(denoiser_output, torch.Tensor) and bool(batch) and denoiser_output.dim() > 0
    halves = halves and denoiser_output.shape[0] == 2 * batch
    if halves:  # the halves only: the whole's stats are merged from them on the host
        # detached where autograd tracks it (under inference a detach is an op for nothing)
        whole = denoiser_output.detach() if denoiser_output.requires_grad else denoiser_output
        tensors["uncond"], tensors["cond"] = whole.chunk(2)
        merged["model_output"] = (("uncond", "cond"), tuple(denoiser_output.shape))
        # one op (fp16: |gap| far below 65504), on the detached halves: no graph, no no_grad context
        gap = torch.dist(tensors["cond"], tensors["uncond"])
    elif isinstance(denoiser_output, torch.Tensor):
        tensors["model_output"] = denoiser_output
    if isinstance(inputs.pred_original_sample, torch.Tensor):
        tensors["pred_original_sample"] = inputs.pred_original_sample
    for i, earlier in enumerate(inputs.earlier_outputs):  # in the same stack where shaped as the latents
        if isinstance(earlier, torch.Tensor):
            tensors[f"{EARLIER}{i}"] = earlier
    raw = {"timestep": inputs.timestep, "sigma": inputs.sigma, "sigma_next": inputs.sigma_next, "guidance_gap": gap}
    # each a 1-element view: the copy joins them as they are (0-d ones would be stacked first, an op);
    # loops, not comprehensions, here and below: no frame of their own, at every step
    names, extra = [], []
    for name, value in raw.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            names.append(name)
            extra.append(value if value.ndim == 1 else value.reshape(1))
    scheduled = 0
    if schedule is not None:  # the run's first step: the schedule's tensors, in field order
        for value in (schedule.first, schedule.last, schedule.init_noise_sigma):
            if isinstance(value, torch.Tensor):
                extra.append(value.reshape(1))
                scheduled += 1
    for _, values, _ in probes:
        extra += values
    queued = queue_tensors(tensors, extra, merged=merged, deferred=deferred)  # the one transfer
    return QueuedStep(queued, raw, names, list(probes), schedule, scheduled)


def finish_step(queued: QueuedStep) -> StepValues:
    """The step's values on the host, from its queued copy (a NaN/Inf tensor is measured again,
    fully — its NaN/Inf counts —, on that step only)."""
    measured, rows = queued.stats.wait()
    by_name, earlier = {}, []
    for name in ROW_TENSORS:  # loops, not comprehensions: no frame of their own, at every step
        if name in measured:
            by_name[name] = measured[name]
    if len(measured) > len(by_name):  # a denoiser called more than once in the step
        found = [(int(k[len(EARLIER) :]), v) for k, v in measured.items() if k.startswith(EARLIER)]
        earlier = [v for _, v in sorted(found, key=lambda item: item[0])]
    values = []
    for row in rows[: len(queued.on_device)]:  # the probes' rows are read as lists below
        values.append(row[0] if row else math.nan)
    scalars = dict(zip(queued.on_device, values))
    skip = len(queued.on_device)
    schedule = queued.schedule
    if schedule is not None:  # its values after the scalars
        size = queued.schedule_values
        schedule, skip = schedule.read(rows[skip : skip + size]), skip + size
    for name in SCALARS:
        if name not in scalars:
            raw = queued.raw[name]  # None (no sigma) asked first: numbers.Real is an ABC, slow to ask
            scalars[name] = None if raw is None else float(raw) if isinstance(raw, numbers.Real) else None
    readings = _readings(queued.probes, rows[skip:]) if queued.probes else {}
    return StepValues(by_name, scalars, readings, earlier, schedule)


def measure_step(inputs: StepInputs, probes: list[ProbePart] = ()) -> StepValues:
    """Every statistic of one step, brought to the host at once (:func:`queue_step`, then
    :func:`finish_step`)."""
    return finish_step(queue_step(inputs, probes))


def _readings(probes: list[ProbePart], host: list[list[float]]) -> dict[str, list[ModuleReading]]:
    readings, offset = {}, 0
    for name, values, make in probes:
        readings[name] = make(host[offset : offset + len(values)])
        offset += len(values)
    return readings


def build_row(
    step: int, values: StepValues, *, time_s: float, denoiser_calls: int, run: int, ready: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The step's row for the record (``memory`` is added by the caller when tracked); ``ready``: the JSON
    copies of its statistics the record can keep as they are (:func:`stats_dicts`)."""
    row: dict[str, Any] = {
        "step": step,
        "timestep": values.scalars["timestep"],
        "sigma": values.scalars["sigma"],
        "time_s": time_s,
        "guidance_gap": values.scalars["guidance_gap"],
        "denoiser_calls": denoiser_calls,
        "run": run,
    }
    stats_dicts(values.stats, row, ready)
    return row


def decoded_image_anomalies(values: CallValues, **vae: Any) -> list[tuple[Anomaly, tuple]]:
    """``vae_saturation`` and ``constant_image`` (with their fold keys) for decoded images (none for other calls);
    ``vae``: :func:`~.checks.vae_saturation`'s keywords (the threshold, the step, the VAE and what it ran in)."""
    if values.outside_fraction is None:
        return []
    found = checks.vae_saturation(values.outside_fraction, values.image_ranges, **vae)
    return [(a, (a.kind,)) for a in found]


# -- one call of a component (text encoder, VAE, a denoiser call without a step) ---------------------


@dataclass
class CallValues:
    """A component call's measurements on the host."""

    readings: list[ModuleReading]
    output_absmax: float | None
    """None when the output could not be measured (none, empty, meta, not floating point)."""
    outside_fraction: float | None = None
    """Decoded images only: the share of values outside [-1, 1] or non-finite."""
    image_ranges: list[float] | None = None
    """Decoded images only: max - min of each image."""

    @property
    def output_finite(self) -> bool:
        value = self.output_absmax
        return value is None or (value == value and value != float("inf"))


def measure_call(
    output: torch.Tensor | None, probe: ProbePart | None, *, decoded_images: bool = False, held: int | None = None
) -> CallValues:
    """The output's abs-max (and, for ``decoded_images``, the saturation values) with the
    probe's readings, in one transfer. ``held``: the output's slot in the probe's flushed values
    (:meth:`~diffusion_debug.probes.readings.Probe.hold`, not for decoded images): its
    abs-max was reduced with the block outputs, so no op of its own, and the probe's one flushed
    vector is read as it is (no float64 join)."""
    if held is not None and probe is not None and not decoded_images:
        values = probe[1]
        rows = [read_now(values[0])] if len(values) == 1 and values[0].dim() == 1 else to_host(values)
        slot, absmax = held, None
        for row in rows:  # the flushed values joined (the 0-d ones after them: never reached)
            if slot < len(row):
                absmax = row[slot]
                break
            slot -= len(row)
        else:  # (never: the slot is among the flushed values) measured on its own rather than read as finite
            absmax = scalars_to_host([absmax_on_device(output)])[0] if output is not None else None
        return CallValues(probe[2](rows), absmax)
    tensor = output if output is not None and output.is_floating_point() else None
    decoded = decoded_images and tensor is not None and tensor.dim() >= 2 and tensor.numel() > 0
    decoded = decoded and not tensor.is_meta
    if decoded:  # four ops, five on a CPU (a VAE decode is checked at every call); detached: no graph
        x = detached(tensor) if tensor.dtype.itemsize > 1 else detached(tensor).float()  # fp8: no reductions
        # NaN compares False and |inf| > 1: both count as outside [-1, 1], as the fraction says
        flat = x.flatten(1)  # per image, NaN-propagating, exact in its dtype:
        if flat.device.type == "cpu":  # the CPU's aminmax along a dim takes 7 to 16 times amin and amax
            low, high = flat.amin(dim=1), flat.amax(dim=1)  # (3.8 against 0.23 ms at 512x512 in fp16)
        else:  # one kernel
            low, high = torch.aminmax(flat, dim=1)
        inside = (x.abs() <= 1).sum(dtype=torch.float32)
        if probe is None and not ANY_AUTOCAST():  # the count and each image's extremes in one read: one cat,
            # which promotes fp16/bf16 extremes to the count's float32 itself, exactly (2 casts and a stack before)
            host = read_now(torch.cat((inside.reshape(1), low, high)))
            return _decoded(host, tensor.numel(), [])
        if probe is None and (low.dtype is torch.float16 or low.dtype is torch.bfloat16):  # under autocast, whose
            low, high = low.float(), high.float()  # cat casts (and refuses fp16 beside bf16): a float32 stack
        scalars = [inside, *low.unbind(), *high.unbind()]
    else:
        absmax = absmax_on_device(tensor) if tensor is not None else None  # None: empty or meta
        scalars = [absmax] if absmax is not None else []
    n = len(scalars)
    if probe is None:
        host, readings = scalars_to_host(scalars), []  # one transfer
    else:  # a probe's values are read as one row each
        rows = to_host(scalars + probe[1])
        host = [row[0] if row else math.nan for row in rows[:n]]
        readings = probe[2](rows[n:])
    if not decoded:
        return CallValues(readings, host[0] if scalars else None)
    return _decoded(host[:n], tensor.numel(), readings)


def _decoded(host: list[float], size: int, readings: list[ModuleReading]) -> CallValues:
    """A decoded image's values from ``host``: the count of its ``size`` values within [-1, 1], then each
    image's lowest, then each one's highest."""
    images = (len(host) - 1) // 2
    lows, highs = host[1 : 1 + images], host[1 + images :]
    bounds = lows + highs  # the output's abs-max from each image's extremes: no op of its own
    absmax = math.nan if any(map(math.isnan, bounds)) else max(map(abs, bounds))  # builtins: no frame a value
    values = CallValues(readings, absmax)
    values.outside_fraction = 1.0 - host[0] / size
    values.image_ranges = [high - low for low, high in zip(lows, highs)]
    return values
