"""The anomaly, and the one registry of anomaly kinds: severity, colour, guide text, message
builder, fold key and cause stage.

A kind is registered once here; both debuggers build their anomalies with :func:`make_anomaly`
(which refuses a kind not registered), and the sink, the HTML report, the plots and the README's
table read the kind from here.

>>> KINDS["nonfinite"].severity, KINDS["nonfinite"].stable
('error', True)
>>> sorted(SEVERITIES, key=severity_rank, reverse=True)
['error', 'warning', 'info']
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

from ..config import SEVERITIES
from ..errors import DiffusionDebugError
from . import training_messages
from .jsonio import to_jsonable


def severity_rank(severity: str) -> int:
    """0 for ``info``, 1 for ``warning``, 2 for ``error``; -1 for anything else."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def default_key(anomaly: "Anomaly") -> tuple:
    """What makes two anomalies "the same one again": kind, rank and place."""
    return (anomaly.kind, anomaly.rank, anomaly.component, anomaly.module, anomaly.parameter)


_LAST_STAGE = 9


@dataclass(frozen=True)
class AnomalyKind:
    """What a kind of anomaly means, what to do about it, and how it is drawn."""

    name: str
    severity: str
    """The usual severity (an anomaly may carry another: a skipped fp16 step is info or warning)."""
    colour: str
    meaning: str
    action: str
    stable: bool = False
    """Named in DESIGN.md: tests outside this repository use it."""
    stage: int = _LAST_STAGE
    """Where the kind sits in a training step (cause before consequence): 0 the set-up, 1 the input
    batch, 2 the forward pass and loss, 3 the gradients, 4 the optimizer's update, 5 the weights;
    inference kinds and the debugger's own come last."""
    message: "Callable[[Anomaly], str] | None" = None
    """Builds the message from the anomaly's fields and details; ``None``: the caller passes it."""
    fold_key: "Callable[[Anomaly], Hashable]" = default_key
    """What makes two anomalies of this kind "the same one again" (the sink folds repeats)."""


KINDS: dict[str, AnomalyKind] = {}


def register_kind(
    name: str,
    *,
    severity: str,
    colour: str,
    meaning: str,
    action: str,
    stable: bool = False,
    stage: int = _LAST_STAGE,
    message: "Callable[[Anomaly], str] | None" = None,
    fold_key: "Callable[[Anomaly], Hashable]" = default_key,
) -> AnomalyKind:
    """Add a kind of anomaly (or replace one, with a warning) and return it: everything about a
    kind is given here, once; :func:`make_anomaly` builds its anomalies."""
    if not name.isidentifier():
        raise ValueError(f"An anomaly kind is a lower-case identifier, not {name!r}.")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, not {severity!r}.")
    if not (colour.startswith("#") and len(colour) == 7):
        raise ValueError(f"colour must be '#rrggbb', not {colour!r}.")
    if name in KINDS:
        warnings.warn(f"Anomaly kind {name!r} is registered again; the new entry replaces it.", stacklevel=2)
    KINDS[name] = kind = AnomalyKind(name, severity, colour, meaning, action, stable, stage, message, fold_key)
    return kind


_OTHER_COLOURS = ("#1f77b4", "#393b79", "#637939", "#843c39", "#7b4173")


def kind_info(name: str) -> AnomalyKind:
    """The registered kind, or a generic entry (with a colour stable across runs) for one that
    is not registered."""
    kind = KINDS.get(name)
    if kind is not None:
        return kind
    colour = _OTHER_COLOURS[sum(map(ord, name)) % len(_OTHER_COLOURS)]  # not hash(): stable across runs
    return AnomalyKind(name, "warning", colour, "A finding of this debugger.", "See the message.")


@dataclass
class Anomaly:
    """Something worth a person's attention, and where it happened."""

    kind: str
    severity: str
    message: str
    component: str = ""
    module: str = ""
    step: int | None = None
    timestep: float | None = None
    rank: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    parameter: str | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}.")

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Anomaly":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def where(self) -> str:
        """``unet up_blocks.1.resnets.0.conv2, step 3 (t=761), rank 1`` (parts that are set)."""
        place = " ".join(p for p in (self.component, self.parameter or self.module) if p)
        parts = [place] if place else []
        if self.step is not None:
            parts.append(f"step {self.step}" + (f" (t={_short(self.timestep)})" if self.timestep is not None else ""))
        if self.rank:
            parts.append(f"rank {self.rank}")
        return ", ".join(parts)


def make_anomaly(kind: str, *, severity: str | None = None, message: str | None = None, **fields: Any) -> Anomaly:
    """An anomaly of the registered ``kind`` (the one factory both debuggers call): its severity is
    the kind's unless given, its message the kind's builder's unless given. An unregistered kind
    (a typo) raises here; reading a saved run (:meth:`Anomaly.from_dict`) still takes any kind.

    >>> try:
    ...     make_anomaly("nonfinte", message="NaN")
    ... except DiffusionDebugError as error:
    ...     print(error)
    Unknown anomaly kind 'nonfinte' (did you mean 'nonfinite'?); register it with register_kind() first.
    """
    info = KINDS.get(kind)
    if info is None:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DiffusionDebugError(f"Unknown anomaly kind {kind!r}{hint}; register it with register_kind() first.")
    anomaly = Anomaly(kind, severity or info.severity, message or "", **fields)
    if message is None:
        if info.message is None:
            raise DiffusionDebugError(f"Anomaly kind {kind!r} has no message builder: pass message=.")
        anomaly.message = info.message(anomaly)
    return anomaly


def rebuilt(anomaly: Anomaly, **changes: Any) -> Anomaly:
    """``anomaly`` with ``changes`` and its message built again by its kind (never an edited string)."""
    changed = dataclasses.replace(anomaly, **changes)
    return dataclasses.replace(changed, message=KINDS[changed.kind].message(changed))


def _short(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


# -- the kinds ----------------------------------------------------------------------------
# Kinds that tend to appear together get colours far apart.
register_kind(
    "nonfinite",
    severity="error",
    colour="#d62728",
    meaning=(
        "NaN or Inf appeared: in inference, the module named first produced it from finite inputs; in "
        "training, a gradient holds it."
    ),
    action=(
        "Check that module's dtype and weights (fp16 overflow is the usual cause: try float32 or "
        "bfloat16, or an fp16-fix VAE); in training lower the learning rate or check the loss."
    ),
    stable=True,
    stage=3,
    message=training_messages.nonfinite_gradients,
)
register_kind(
    "overflow_risk",
    severity="warning",
    colour="#ff7f0e",
    meaning="An activation came close to the largest value its dtype can hold; one more step up and it becomes Inf.",
    action="Run that component in float32 or bfloat16 (SDXL VAE: force_upcast or the fp16-fix VAE).",
    stable=True,
    fold_key=lambda a: (a.kind, a.component, a.module),  # one a module, whatever the step
)
register_kind(
    "latent_divergence",
    severity="warning",
    colour="#9467bd",
    meaning=(
        "The latents' spread left the range the scheduler expects, so the image is drifting to noise or saturation."
    ),
    action=(
        "Check the scheduler's prediction_type and timestep_spacing against the model, the guidance "
        "scale, and the initial noise sigma."
    ),
    stable=True,
)
register_kind(
    "vae_saturation",
    severity="warning",
    colour="#8c564b",
    meaning="Many decoded pixels sit at the edge of the output range: the image is clipped, black or white.",
    action="Decode in float32 (force_upcast) or use a VAE fixed for fp16; check the latents' scaling factor.",
    stable=True,
)
register_kind(
    "constant_image",
    severity="warning",
    colour="#393b79",
    meaning=(
        "A decoded image is one flat colour (often black) although no value was NaN: nothing of the picture survived."
    ),
    action=(
        "Decode in float32 (force_upcast) or use the fp16-fix VAE; check the latents reaching the VAE (the "
        "step table) and the latents' scaling factor."
    ),
)
register_kind(
    "safety_blackout",
    severity="warning",
    colour="#637939",
    meaning="The safety checker flagged the image as NSFW and replaced it with a black one; the model is fine.",
    action=(
        "Change the prompt or seed; for research on your own model, load the pipeline with "
        "safety_checker=None (and respect the model's licence)."
    ),
)
register_kind(
    "nondeterministic",
    severity="warning",
    colour="#8c6d31",
    meaning="The same call with the same seed gave a different image: the run cannot be reproduced.",
    action=(
        "Look at the first step whose latents differ: a non-deterministic kernel (torch.use_deterministic_"
        "algorithms(True)), a generator not passed to the pipeline, or state kept between calls."
    ),
)
register_kind(
    "prompt_truncated",
    severity="warning",
    colour="#e377c2",
    meaning=(
        "The prompt was longer than the text encoder's limit (77 tokens for CLIP); the tail was dropped "
        "without a word."
    ),
    action="Shorten the prompt, or use prompt embeddings built from several chunks.",
    stable=True,
)
register_kind(
    "scheduler_config",
    severity="warning",
    colour="#7f7f7f",
    meaning=(
        "The scheduler's settings do not fit the model or the number of steps (prediction_type, "
        "timestep_spacing, zero-terminal-SNR with epsilon)."
    ),
    action="Load the scheduler config that ships with the model, or follow the fix in the message.",
    stable=True,
)
register_kind(
    "dtype_mismatch",
    severity="warning",
    colour="#bcbd22",
    meaning=(
        "Components or inputs run in different dtypes, so values are cast back and forth (or an fp16 "
        "component runs where it overflows)."
    ),
    action="Put the pipeline in one dtype (pipe.to(dtype)) and keep the VAE in float32 where it needs it.",
    stable=True,
    fold_key=lambda a: (a.kind, a.message),  # one a mismatch found
)
register_kind(
    "nonfinite_loss",
    severity="error",
    colour="#17becf",
    meaning="The training loss was NaN or Inf at this step.",
    action=(
        "Look at the batch and the forward pass of that step; lower the learning rate; with fp16 use a "
        "GradScaler (Accelerate does) or switch to bfloat16."
    ),
    stable=True,
    stage=2,
    message=training_messages.nonfinite_loss,
)
register_kind(
    "loss_spike",
    severity="warning",
    colour="#ff7f0e",
    meaning="The loss jumped far above its recent average.",
    action="Check the learning rate schedule and the batch of that step; clip gradients.",
    stable=True,
    stage=2,
    message=training_messages.loss_spike,
)
register_kind(
    "gradient_explosion",
    severity="warning",
    colour="#9467bd",
    meaning="The gradient norm (before clipping) passed the configured threshold.",
    action=(
        "Lower the learning rate, clip gradients (accelerator.clip_grad_norm_), or check the module with "
        "the largest gradient."
    ),
    stable=True,
    stage=3,
    message=training_messages.gradient_explosion,
)
register_kind(
    "gradient_vanishing",
    severity="warning",
    colour="#2ca02c",
    meaning="The gradient norm fell below the configured threshold: the model is barely learning.",
    action="Check that the parameters you train require grad and receive a loss, and the loss scale.",
    stable=True,
    stage=3,
    message=training_messages.gradient_vanishing,
)
register_kind(
    "skipped_step",
    severity="warning",
    colour="#8c564b",
    meaning="The optimizer step was skipped (fp16 loss scaler found Inf/NaN gradients, or the policy skipped it).",
    action="A few skips while the scale settles are normal; many in a row mean the model overflows in fp16.",
    stable=True,
    stage=4,
    message=training_messages.skipped_step,
)
register_kind(
    "memory_growth",
    severity="warning",
    colour="#bcbd22",
    meaning="Memory kept growing across steps beyond the configured allowance.",
    action="Look for tensors kept across steps (losses appended without .item() or .detach(), caches).",
    stable=True,
    message=training_messages.memory_growth,
)
register_kind(
    "rank_desync",
    severity="error",
    colour="#e377c2",
    meaning="Processes disagree (different step, loss or parameters); a collective may hang.",
    action="Check that every rank runs the same steps and that random seeds and data sharding are set up.",
    stable=True,
    stage=5,
    message=training_messages.rank_desync,
)
register_kind(
    "debugger_error",
    severity="warning",
    colour="#000000",
    meaning="A measurement of the debugger itself failed; the run went on without it.",
    action="The rest of the report still holds; please report the message with the versions shown above.",
)

register_kind(
    "nonfinite_input",
    severity="error",
    colour="#ff9896",
    meaning="The training batch passed as inputs= held NaN or Inf: the loss and the gradients after it follow.",
    action="Check the data pipeline of that step (decoding, normalisation, cached latents) before the model.",
    stage=1,
    message=training_messages.nonfinite_input,
)
register_kind(
    "lr_spike",
    severity="warning",
    colour="#aec7e8",
    meaning=(
        "The learning rate rose by more than lr_jump_factor between two optimizer steps, above any earlier value; "
        "or the update-to-weight ratio (lr x gradient norm / weight norm) passed update_ratio_threshold."
    ),
    action="Check the learning-rate scheduler (its step count and warmup) and any code that sets param_groups' lr.",
    stage=4,
    message=training_messages.lr_spike,
)
register_kind(
    "distributed_split",
    severity="warning",
    colour="#c49c94",
    meaning=(
        "WORLD_SIZE > 1 in the environment but this process runs alone: every process trains on its own, "
        "with its own run directory."
    ),
    action="On CPU create the Accelerator with cpu=True (or launch with --cpu); check the launcher's backend.",
    stage=0,
    message=training_messages.distributed_split,
)


# -- cause before consequence -------------------------------------------------------------------
def cause_key(anomaly: Anomaly) -> tuple:
    """Sort key, cause before consequence: most severe first, then the earliest step, then the
    stage of the step (input, loss, gradients, update, weights), then the lowest rank."""
    step = anomaly.step if isinstance(anomaly.step, (int, float)) else -1
    return (-severity_rank(anomaly.severity), step, kind_info(anomaly.kind).stage, anomaly.rank)


def by_cause(anomalies: "list[Anomaly] | tuple[Anomaly, ...]") -> list[Anomaly]:
    """The anomalies in :func:`cause_key` order (stable): the first is the headline.

    >>> a = Anomaly("nonfinite", "error", "NaN grads", step=5, rank=0)
    >>> b = Anomaly("nonfinite_loss", "error", "NaN loss", step=5, rank=1)
    >>> [(x.kind, x.rank) for x in by_cause([a, b])]
    [('nonfinite_loss', 1), ('nonfinite', 0)]
    """
    return sorted(anomalies, key=cause_key)


#: The kinds named in DESIGN.md (stable: tests outside this repository use them).
STABLE_KINDS = tuple(name for name, kind in KINDS.items() if kind.stable)
ANOMALY_KINDS = STABLE_KINDS  # the name this tuple had before the registry
