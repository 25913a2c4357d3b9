"""Judging a training step: every rank's gathered :class:`~..measure.step_row.StepRow` (and the small
per-rank history kept between steps) in, anomalies out. Pure: no tensors, no collectives, no
record; the same rows give the same anomalies on every rank.

Each message is built once, by one function per kind, from the anomaly's own fields and details
(the kind's message builder, ``record.training_messages``); adding what only this rank knows (:func:`locate_nonfinite`,
:func:`name_top_module`, :func:`with_localization`) returns a new anomaly with its message built
again, never an edited string. Long because every per-step judge of the gathered rows is here, beside the
:class:`RankHistory` they share (the skip's rules among them: after the scale settled, and from the start).

>>> from diffusion_debug.training.measure.step_row import SLOTS, StepRow
>>> values = dict.fromkeys(SLOTS, 0.0) | {"loss": float("nan"), "input_nonfinite": float("nan")}
>>> row = StepRow.from_row(list(values.values()))
>>> flags = StepFlags()
>>> (anomaly,) = judge_loss(1, row, 7, LossSpikeDetector(20, 6.0), flags)
>>> print(anomaly.message)
The loss is nan at step 7 on rank 1; the input batch was not checked (pass inputs=batch to tell a
bad batch from a bad forward pass): check the forward pass (pass closure= to name the op), or
lower the learning rate.
>>> flags.nonfinite_loss
True
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...config import DebugConfig
from ...memory import growth_mb
from ...probes import BackwardOrder
from ...record import Anomaly, make_anomaly, rebuilt
from ..measure.gradients import TrainableParameters
from ..measure.loss import TRAINED_ARGUMENT
from ..measure.step_row import SKIPPED_BY_DEEPSPEED, StepRow
from .loss_spikes import LossSpikeDetector
from .trends import LossTrend, judge_trend

TOP_MODULES = 5
_MEMORY_JUDGED_EVERY = 8

FREQUENT_SKIPS = 3
"""Skipped steps within :data:`SKIP_WINDOW` measured steps (after the scale settled) that make a
skip a warning."""
SKIP_WINDOW = 20
UNSETTLED_SKIPS = 16
"""Skipped steps in a row from the start (no step applied yet) that make a skip a warning: every step skipped,
the loss scale falling each one, nothing trains. Halved 16 times, GradScaler's and DeepSpeed's default scale
(2**16) reaches 1, where DeepSpeed stops the run (its minimum scale); a scale that settles takes fewer (an
init of 2**24 settled in 10 in the tests)."""
UNSETTLED_SCALE = 2.0
"""The loss scale at or below which such a run of skips is a warning: a scale that starts high (``init_scale``
2**32, DeepSpeed's ``initial_scale_power`` 32) with large gradients skips 16 and more on its way down and
then trains; only a scale halved to (near) its floor says nothing will (the scale before the skip or after
it: the last skip, judged at close, may have no scale after it to read)."""

# ``details["order"]`` of a ``nonfinite``, the rule that named it (:func:`locate_nonfinite`)
BY_BACKWARD = "last_in_forward"  # of several modules, the last in forward order: the first backward reached
BY_LAST_REGISTERED = "last_registered"  # the same where no backward order was recorded (FSDP2, ZeRO) or used
BY_REGISTRATION = "registration"  # one module, or NaN/Inf that follows a NaN loss: the first registered


@dataclass
class RankHistory:
    """What judging remembers about one rank between steps."""

    detector: LossSpikeDetector
    rss: deque[float]
    cuda_allocated: deque[float]
    memory_flagged: set[str] = field(default_factory=set)
    """Memory sources already flagged (``memory_growth`` is reported once per source)."""
    previous_scale: float | None = None
    """The loss scale of the last measured row that carried one (a row with none, a GAN's optimizer stepped
    without the GradScaler, keeps it: the other's skip is still read from the scale's fall)."""
    skips: deque[int] = field(default_factory=lambda: deque(maxlen=FREQUENT_SKIPS))
    """The measured-step numbers of the last skipped steps after the scale settled."""
    measured: int = 0
    """Steps whose row this rank measured (the clock of :attr:`skips`)."""
    settled: bool = False
    """A step was applied: skips from here on are not the scale settling at the start."""
    in_a_row: int = 0
    """Skipped steps in a row (0 once a step is applied), the first at step :attr:`skipped_since`."""
    skipped_since: Any = None
    converged: bool = False
    """The last measured loss had converged (``LossSpikeDetector.converged``)."""
    trend: LossTrend = field(default_factory=LossTrend)
    """The recent losses, for a slow rise (``loss_divergence``)."""

    def count_skip(self, step: Any) -> None:
        """Step ``step``'s optimizer step was skipped: among the recent skips once the scale settled, else in the
        row from the start (:func:`judge_skipped`'s, and a held step's skip released by ``step.found_scaler``)."""
        if self.settled:
            self.skips.append(self.measured)
        if not self.in_a_row:
            self.skipped_since = step
        self.in_a_row += 1

    @classmethod
    def new(cls, config: DebugConfig) -> "RankHistory":
        return cls(
            LossSpikeDetector(config.loss_spike_window, config.loss_spike_threshold, config.loss_spike_min_ratio),
            deque(maxlen=config.history_size),
            deque(maxlen=config.history_size),
        )


@dataclass
class StepFlags:
    """A step's findings on any rank; ``weights_moved``: its update moved this rank's weights (False: none read)."""

    loss: bool = False
    nonfinite_loss: bool = False
    explosion: bool = False
    vanishing: bool = False
    nonfinite: bool = False
    weights_moved: bool = False


# -- one rank's row ------------------------------------------------------------------------------


def judge_rank(
    rank: int,
    row: StepRow,
    step: Any,
    history: RankHistory,
    params: TrainableParameters,
    config: DebugConfig,
    flags: StepFlags,
) -> list[Anomaly]:
    """The loss (its value, then its trend), the gradients and the memory of one rank's measured row."""
    found = judge_input(rank, row, step, flags)
    if row.loss_count > 0:  # none: no call of the step gave a loss (NO_LOSS), none is judged (a field: no call)
        found += judge_loss(rank, row, step, history.detector, flags)
        found += (trend := judge_trend(rank, row.loss, step, history.trend, history.detector.early_level))
        flags.loss, history.converged = flags.loss or bool(trend), history.detector.converged(row.loss)
    return (
        found
        + judge_gradients(rank, row, step, params, config, flags, converged=history.converged)
        + judge_memory(rank, row, step, history, config)
    )


def judge_input(rank: int, row: StepRow, step: Any, flags: StepFlags) -> list[Anomaly]:
    """``nonfinite_input``: the batch passed as ``inputs=`` held NaN/Inf (the cause of the
    loss's and the gradients' NaN that follow)."""
    count = int(row.input_nonfinite) if row.input_checked and row.input_nonfinite > 0 else 0
    if not count:
        return []
    flags.nonfinite_loss = True
    details = {"nonfinite_values": count}
    return [
        make_anomaly(
            kind="nonfinite_input", severity="error", component="input", step=step, rank=rank, details=details
        )
    ]


def judge_loss(rank: int, row: StepRow, step: Any, detector: LossSpikeDetector, flags: StepFlags) -> list[Anomaly]:
    base = dict(component="model", step=step, rank=rank)
    if not math.isfinite(row.loss):
        flags.nonfinite_loss = flags.loss = True
        details: dict[str, Any] = {
            "loss": row.loss,
            "micro_steps": int(row.loss_count),
            "input_checked": row.input_checked,
        }
        if any(row.bucket_nonfinite()):
            details["nonfinite_by_timestep_bucket"] = {i: int(v) for i, v in enumerate(row.bucket_nonfinite()) if v}
        return [make_anomaly(kind="nonfinite_loss", severity="error", **base, details=details)]
    spike = detector.update(row.loss)
    if not spike.spike:
        return []
    flags.loss = True
    details = {"loss": row.loss, "median": spike.median, "robust_std": spike.scale, "score": spike.score}
    return [make_anomaly(kind="loss_spike", severity="warning", **base, details=details)]


def judge_gradients(
    rank: int,
    row: StepRow,
    step: Any,
    params: TrainableParameters,
    config: DebugConfig,
    flags: StepFlags,
    *,
    converged: bool = False,
) -> list[Anomaly]:
    """NaN/Inf gradients, an exploding norm, a vanishing one (not once the loss has ``converged``: the gradients
    of a fitted model are small, nothing left to learn; nor 0 where the script froze every watched parameter)."""
    base = dict(component="model", step=step, rank=rank)
    gnorm = row.pre_clip_norm
    if row.nonfinite_count:
        first = int(row.first_nonfinite)
        name = params.names[first] if 0 <= first < len(params) else None
        flags.nonfinite = True
        return [
            make_anomaly(
                kind="nonfinite",
                severity="info" if row.scaled else "error",  # under a GradScaler: an overflow it handles
                **base,
                module=params.module_of_parameter(first) if name else "",
                parameter=name,
                details={
                    "nonfinite_parameters": row.nonfinite_count,
                    "grad_norm": gnorm,
                    "order": BY_REGISTRATION,
                },
            )
        ]
    if (overflow := _float32_sum_overflow(row)) is not None:
        flags.explosion = True
        details = {"grad_norm": overflow, "sum_overflow": True, "float32_norm_limit": FLOAT32_NORM_LIMIT}
        return [make_anomaly(kind="gradient_explosion", severity="warning", **base, details=details)]
    if math.isfinite(gnorm) and gnorm > config.grad_explosion_threshold:
        flags.explosion = True
        details = {"grad_norm": gnorm, "threshold": config.grad_explosion_threshold}
        return [make_anomaly(kind="gradient_explosion", severity="warning", **base, details=details)]
    frozen = gnorm == 0 and not any(p.requires_grad for p in params.params)  # requires_grad_(False) mid-run
    if math.isfinite(gnorm) and gnorm < config.grad_vanishing_threshold and not converged and not frozen:
        flags.vanishing = True
        details = {"grad_norm": gnorm, "threshold": config.grad_vanishing_threshold}
        kept = params.deepspeed is not None and params.deepspeed.capture  # norms kept by a step in backward
        # every .grad None (FSDP2's, ZeRO's live elsewhere): monitored before loss.backward() or after zero_grad()
        if gnorm == 0 and not params.sharded and not kept and all(p.grad is None for p in params.params):
            details["no_gradients"] = True
        return [make_anomaly(kind="gradient_vanishing", severity="warning", **base, details=details)]
    return []


FLOAT32_MAX = 3.4028234663852886e38
"""``torch.finfo(torch.float32).max``."""
FLOAT32_NORM_LIMIT = math.sqrt(FLOAT32_MAX)
"""The largest L2 norm float32 computes: it sums the squares in float32 (``torch.linalg.vector_norm``,
``clip_grad_norm_``), so a larger one is inf (about 1.845e19)."""


def _float32_sum_overflow(row: StepRow) -> float | None:
    """The global gradient norm when it is made of finite parts (no gradient counted non-finite:
    each parameter's or shard's own float32 norm is finite) but passes :data:`FLOAT32_NORM_LIMIT`,
    so that float32 sums it to inf (``clip_grad_norm_`` does, and then scales every gradient by 0);
    else None. The row's norm is summed in float64 from those parts. A norm the user passed as ``grad_norm=``
    that is inf over finite gradients is that overflow too (inf: the measured gradients are the clipped ones).

    >>> from diffusion_debug.training.measure.step_row import SLOTS
    >>> _float32_sum_overflow(StepRow.from_row([1.0, 2.5e19] + [0.0] * (len(SLOTS) - 2)))
    2.5e+19
    """
    if row.nonfinite_count:
        return None
    if math.isfinite(row.grad_norm) and row.grad_norm > FLOAT32_NORM_LIMIT:
        return row.grad_norm
    return math.inf if row.clip_norm == math.inf else None


def judge_memory(rank: int, row: StepRow, step: Any, history: RankHistory, config: DebugConfig) -> list[Anomaly]:
    """``memory_growth``: process RSS, and CUDA allocated memory when the rank has it, each judged
    on its own (robust trend over the history, every 8 steps, flagged once per source)."""
    out = []
    for source, value, values in (
        ("rss", row.rss_mb, history.rss),
        ("cuda_allocated", row.cuda_allocated_mb, history.cuda_allocated),
    ):
        if not math.isfinite(value):
            continue
        values.append(value)
        judged = len(values) >= _MEMORY_JUDGED_EVERY and len(values) % _MEMORY_JUDGED_EVERY == 0
        grown = growth_mb(list(values)) if judged else 0.0
        if grown > config.memory_growth_mb and source not in history.memory_flagged:
            history.memory_flagged.add(source)
            details = {"growth_mb": grown, "source": source, f"{source}_mb": value, "window_steps": len(values)}
            where = {"component": "model", "step": step, "rank": rank}
            out.append(make_anomaly(kind="memory_growth", severity="warning", **where, details=details))
    return out


# -- across ranks ---------------------------------------------------------------------------------


def judge_skipped(
    rows: list[StepRow], histories: list[RankHistory], previous_step: Any, step: Any, first_rank: int = 0
) -> list[Anomaly]:
    """``skipped_step`` against the previous monitored step: the GradScaler's scale went down, or
    Accelerate (its GradScaler) or DeepSpeed (its overflow check) says the step was skipped (``reason``).
    One anomaly: the step is skipped on every rank alike.
    ``rows[i]`` is rank ``first_rank + i``'s (a rank judging its own row alone passes its rank).

    An info while the scale settles at the start (before any step was applied) and for an
    occasional skip (each growth attempt of the scaler costs one); a warning once
    :data:`FREQUENT_SKIPS` skips fall within :data:`SKIP_WINDOW` measured steps: the model
    overflows in fp16; a warning too from the :data:`UNSETTLED_SKIPS`-th skip in a row from the start (no step
    applied: every step skipped, the scale never settles) once the scale is down to :data:`UNSETTLED_SCALE`,
    saying since when and the scale now."""
    out = []
    for r, row in enumerate(rows):
        if not row.measured:
            continue
        history = histories[r]
        history.measured += 1
        scale, previous = row.grad_scale, history.previous_scale
        if math.isfinite(scale):  # a row with none (a GAN's other optimizer, unscaled) keeps the one before
            history.previous_scale = scale
        by_scale = previous is not None and math.isfinite(scale) and scale < previous
        by_accelerate = math.isfinite(row.accelerate_skipped) and row.accelerate_skipped > 0
        skipped = previous_step is not None and (by_scale or by_accelerate)
        if previous is not None and not skipped:
            history.settled = True
            history.in_a_row = 0
        if skipped:
            history.count_skip(previous_step)
            frequent = len(history.skips) == FREQUENT_SKIPS and history.measured - history.skips[0] < SKIP_WINDOW
            details = {
                "scale_before": previous,
                "scale_after": scale if math.isfinite(scale) else None,
                "detected_at_step": step,
                "reason": "deepspeed_overflow" if row.accelerate_skipped == SKIPPED_BY_DEEPSPEED else "grad_scaler",
            }
            low = any(s is not None and s <= UNSETTLED_SCALE for s in (previous, details["scale_after"]))
            if not history.settled and history.in_a_row >= UNSETTLED_SKIPS and low:  # every step since the start
                frequent = True
                details.update(skipped_in_a_row=history.in_a_row, skipped_since=history.skipped_since)
            out.append(
                make_anomaly(
                    kind="skipped_step",
                    severity="warning" if frequent else "info",
                    component="model",
                    step=previous_step,
                    rank=first_rank + r,
                    details=details,
                )
            )
    return out[:1]


def judge_learning_rate(rows: list[StepRow], step: Any, factor: float, first_rank: int = 0) -> list[Anomaly]:
    """``lr_spike`` when a rank's learning rate rose more than ``factor`` above its previous value
    and above every earlier one (``LearningRateWatch``). One anomaly: the first rank with it (the
    ranks share the schedule); ``rows[i]`` is rank ``first_rank + i``'s."""
    for r, row in enumerate(rows):
        before, after = row.lr_jump_from, row.lr_jump_to
        if row.measured and math.isfinite(before) and before > 0 and after / before > factor:
            details = {"reason": "lr_jump", "lr_before": before, "lr": after, "factor": after / before}
            return [
                make_anomaly(
                    kind="lr_spike",
                    severity="warning",
                    component="optimizer",
                    step=step,
                    rank=first_rank + r,
                    details=details,
                )
            ]
    return []


def note_clipping(anomalies: list[Anomaly], rank: int, clipping: float | bool) -> list[Anomaly]:
    """The step's anomalies, this rank's exploding gradient norm and oversized update noting that the
    script clips its gradients (``clipping``: the ``max_grad_norm=`` it passed, or True where it passed
    ``grad_norm=`` from a clip before monitoring): their advice then does not say "clip gradients"."""
    if clipping is None or clipping is False:
        return anomalies
    return [
        rebuilt(a, details={**a.details, "clipping": clipping})
        if a.rank == rank and a.kind in ("gradient_explosion", "lr_spike") and a.details.get("reason") != "lr_jump"
        else a
        for a in anomalies
    ]


def judge_update_ratio(rank: int, step: Any, update_ratio: dict[str, float], threshold: float) -> list[Anomaly]:
    """``lr_spike`` when this rank's largest finite update-to-weight ratio passes ``threshold``
    (a module with zero weights, e.g. a fresh LoRA ``lora_B``, has an infinite ratio: skipped)."""
    values = np.fromiter(update_ratio.values(), dtype=np.float64, count=len(update_ratio))
    finite = np.isfinite(values).nonzero()[0]  # numpy's methods: no Python dispatch a call
    if not len(finite):
        return []
    largest = int(finite[values[finite].argmax()])  # the first of equal ones, as max() takes
    module, ratio = list(update_ratio)[largest], float(values[largest])
    if ratio <= threshold:
        return []
    details = {"reason": "update_ratio", "update_to_weight_ratio": ratio, "threshold": threshold}
    return [
        make_anomaly(
            kind="lr_spike",
            severity="warning",
            component="optimizer",
            module=module,
            step=step,
            rank=rank,
            details=details,
        )
    ]


def distributed_split(environment_world_size: int, rank: int) -> Anomaly:
    """``distributed_split``: the launcher started several processes but this one runs alone."""
    details = {"environment_world_size": environment_world_size, "world_size": 1}
    return make_anomaly(
        kind="distributed_split", severity="warning", component="model", step=None, rank=rank, details=details
    )


# -- what only this rank knows ---------------------------------------------------------------------


def first_in_module(first: int | None, flagged: list[int], params: TrainableParameters) -> int | None:
    """Of ``flagged`` (ascending), the first registered parameter of ``first``'s module. One
    module's parameters (a convolution's weight and bias) get their gradients from one backward
    op, together: the order autograd accumulates them in says nothing of where a NaN came from
    (DDP named ``conv_in.bias``, FSDP2 and ZeRO, which record no order, ``conv_in.weight``), so
    every engine names the first registered of them.

    >>> import torch
    >>> params = TrainableParameters.of(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)))
    >>> first_in_module(1, [0, 1, 3], params), first_in_module(3, [0, 1, 3], params), first_in_module(None, [], params)
    (0, 3, None)
    """
    if first is None:
        return None
    module = params.module_of[first]
    return next((i for i in flagged if params.module_of[i] == module), first)


def locate_nonfinite(
    anomaly: Anomaly, flagged: list[int], order: BackwardOrder, params: TrainableParameters
) -> Anomaly:
    """The ``nonfinite`` anomaly with the exact non-finite gradients (``flagged``, from
    ``gradients.nonfinite_mask``, ascending) and the one it names.

    A NaN made in the backward of a module reaches that module's gradients and those of every module
    upstream of it (earlier in forward order): of several modules, the one named is where backward
    made it, the last in forward order (``order.first``: the first the recorded backward reached;
    ``details["order"]`` :data:`BY_BACKWARD`), or the last registered where no backward order was
    recorded (sharded engines) or the backward ran compiled (``BackwardOrder.compiled``):
    :data:`BY_LAST_REGISTERED`; within it, its first registered (:func:`first_in_module`). One
    module's gradients (a NaN made in its backward, or one gradient) are named by
    :data:`BY_REGISTRATION` on every engine. The first registered of several modules is kept in
    ``details["first_registered"]``: when the NaN/Inf turns out to follow a non-finite loss,
    input or loss weight (every gradient of the model then holds it), ``causes.trace_causes`` names
    that one, as every engine does. Without any, the norm overflowed float32: a ``gradient_explosion``."""
    if not flagged:
        return make_anomaly(
            kind="gradient_explosion",
            severity="warning",
            component=anomaly.component,
            step=anomaly.step,
            rank=anomaly.rank,
            details=dict(anomaly.details),  # no "threshold": the norm overflowed
        )
    first, rule = flagged[0], BY_REGISTRATION
    several = any(params.module_of[i] != params.module_of[first] for i in flagged)
    if several:
        first = first_in_module(order.first(flagged), flagged, params)
        rule = BY_BACKWARD if order.used(flagged) else BY_LAST_REGISTERED
    details = {
        **anomaly.details,
        "order": rule,
        **({"compiled_backward": True} if several and order.compiled else {}),
        "nonfinite_parameters": len(flagged),
        "parameters": [params.names[i] for i in flagged[:20]],
        "modules": sorted({params.module_of_parameter(i) for i in flagged})[:20],
    }
    if several:
        details["first_registered"] = {
            "component": anomaly.component,
            "parameter": params.names[flagged[0]],
            "module": params.module_of_parameter(flagged[0]),
        }
    return rebuilt(anomaly, parameter=params.names[first], module=params.module_of_parameter(first), details=details)


def named_by_registration(anomaly: Anomaly) -> Anomaly:
    """A ``nonfinite`` located by :func:`locate_nonfinite` named instead by its first registered
    gradient (it follows a non-finite loss, input or loss weight: where backward met the NaN says
    nothing, every gradient holds it); unchanged when it has no other to name. The name is the one
    ``locate_nonfinite`` gave, with its component (``model``): several watched models name their own
    again after it (``WatchedModels.name_judged``)."""
    other = anomaly.details.get("first_registered")
    if not isinstance(other, dict):
        return anomaly
    details = {k: v for k, v in anomaly.details.items() if k != "first_registered"}
    details["order"] = BY_REGISTRATION
    component = other.get("component", anomaly.component)
    return rebuilt(anomaly, component=component, parameter=other["parameter"], module=other["module"], details=details)


def name_inputs(anomaly: Anomaly, counts: dict[str, float], producers: dict[str, tuple] | None = None) -> Anomaly:
    """A ``nonfinite_input`` with the inputs that hold NaN/Inf, by path (this rank's counts, in the
    order they were made). When the first is the output of a frozen model that took finite inputs
    (``producers``: path -> its component and module, and optionally a function that reads its
    first non-finite weight, ``(name, count)`` or None), that model is the component: it made the
    NaN, and a non-finite weight of it is the module and parameter.

    >>> a = make_anomaly("nonfinite_input", component="input", step=5, rank=0, details={"nonfinite_values": 96})
    >>> counts = {"batch['pixels']": 0.0, "text_encoder(...)[0]": 64.0, "unet(encoder_hidden_states)": 32.0}
    >>> named = name_inputs(a, counts, {"text_encoder(...)[0]": ("text_encoder", "")})
    >>> (named.component, named.parameter, named.details["inputs"])
    ('text_encoder', 'text_encoder(...)[0]', ['text_encoder(...)[0]', 'unet(encoder_hidden_states)'])
    """
    bad = [name for name, count in counts.items() if count > 0]
    details = {**anomaly.details, "inputs": bad[:20]}
    if bad:
        details["first_input_values"] = int(counts[bad[0]])
    made_by = (producers or {}).get(bad[0]) if bad else None
    if made_by is None or made_by == TRAINED_ARGUMENT:  # seen first at a trained model's argument: its weights'?
        details.update({"trained_argument": True} if made_by else {})
        return rebuilt(anomaly, parameter=bad[0] if bad else None, details=details)
    component, module, *weights = made_by
    found = weights[0]() if weights and weights[0] is not None else None  # its weights, read on this step only
    if found is None:
        return rebuilt(anomaly, component=component, module=module, parameter=bad[0], details=details)
    parameter, count = found
    details["nonfinite_weight_values"] = count
    owner = parameter.rpartition(".")[0]
    return rebuilt(anomaly, component=component, module=owner, parameter=parameter, details=details)


def name_top_module(anomaly: Anomaly, module_norms: dict[str, float]) -> Anomaly:
    """A ``gradient_explosion`` with the modules of the largest gradient norms."""
    top = sorted((kv for kv in module_norms.items() if math.isfinite(kv[1])), key=lambda kv: -kv[1])[:TOP_MODULES]
    if not top:
        return anomaly
    return rebuilt(anomaly, module=top[0][0], details={**anomaly.details, "top_module_grad_norms": dict(top)})


def with_localization(anomaly: Anomaly, found: dict[str, Any]) -> Anomaly:
    """A ``nonfinite`` / ``nonfinite_loss`` anomaly with what the closure replay found."""
    return rebuilt(anomaly, details={**anomaly.details, "localization": found})
