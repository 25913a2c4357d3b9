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
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..config import SEVERITIES
from ..errors import DiffusionDebugError
from .jsonio import to_jsonable


def severity_rank(severity: str) -> int:
    """0 for ``info``, 1 for ``warning``, 2 for ``error``; -1 for anything else."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def default_key(anomaly: "Anomaly") -> tuple:
    """What makes two anomalies "the same one again": kind, rank and place, and what they follow
    from (``details["cause"]``, an earlier step's, and ``details["follows"]``, their own step's).
    A consequence is never a repeat of its cause: the NaN gradients that NaN weights give the next
    step fold under the step that made them (``by_cause``), on every engine, whether or not they
    happen to name the same parameter.

    >>> made = Anomaly("nonfinite", "error", "x", "model", "conv_in", step=12, parameter="conv_in.weight")
    >>> later = Anomaly("nonfinite", "error", "x", "model", "conv_in", step=13, parameter="conv_in.weight",
    ...                 details={"cause": cause_reference(made), "follows": {"kind": "nonfinite_loss", "rank": 0}})
    >>> default_key(made) == default_key(later), default_key(later) == default_key(dataclasses.replace(later, step=14))
    (False, True)
    """
    details = anomaly.details if isinstance(anomaly.details, dict) else {}
    cause, follows = details.get("cause"), details.get("follows")
    return (
        anomaly.kind,
        anomaly.rank,
        anomaly.component,
        anomaly.module,
        anomaly.parameter,
        tuple(cause.get(k) for k in ("kind", "where", "step", "rank")) if isinstance(cause, dict) else None,
        (follows.get("kind"), follows.get("rank")) if isinstance(follows, dict) else None,
    )


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
    training_action: str = ""
    """What to do when a training run shows it, where that differs from ``action`` (no VAE advice
    for a NaN gradient)."""
    distinct_by: tuple[str, ...] = ()
    """The ``details`` that tell two anomalies of this kind at one place apart (``not_learning``: one
    optimizer's stall from another's, both at ``optimizer``): part of the fold key, and written on each
    repeat's event so that a summary rebuilt from the events folds the same (:func:`distinct_details`)."""


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
    training_action: str = "",
    distinct_by: tuple[str, ...] = (),
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
    if distinct_by:  # the place's key, and the details that tell two at that place apart
        fold_key = functools.partial(_distinct_key, fold_key, distinct_by)
    KINDS[name] = kind = AnomalyKind(
        name, severity, colour, meaning, action, stable, stage, message, fold_key, training_action, distinct_by
    )
    return kind


def _distinct_key(key: "Callable[[Anomaly], Hashable]", names: tuple[str, ...], anomaly: "Anomaly") -> Hashable:
    details = anomaly.details if isinstance(anomaly.details, dict) else {}
    return key(anomaly), tuple(details.get(name) for name in names)


def distinct_details(kind: str, details: Any) -> dict[str, Any]:
    """The ``details`` entries that tell an anomaly of ``kind`` apart from another at its place
    (:attr:`AnomalyKind.distinct_by`; None where one is not given), from an anomaly or a saved row.

    >>> distinct_details("not_learning", {"reason": "lr_zero", "stalled_optimizer": "SGD holding g.0.weight"})
    {'stalled_optimizer': 'SGD holding g.0.weight'}
    >>> distinct_details("nonfinite", {"count": 2})
    {}
    """
    details = details if isinstance(details, dict) else {}
    return {name: details.get(name) for name in kind_info(kind).distinct_by}


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
    local_rank: int = 0
    """The process's index on its machine (training under several processes)."""
    host: str = ""
    """The machine's name (training; ``""`` where not known)."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}.")

    def to_dict(self) -> dict[str, Any]:
        # to_jsonable copies every container it meets: no dataclasses.asdict deep copy before it
        return to_jsonable({name: getattr(self, name) for name in _field_names()})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Anomaly":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def place(self) -> str:
        """``unet up_blocks.1.resnets.0.conv2``: the component and the parameter (else module)."""
        return " ".join(p for p in (self.component, self.parameter or self.module) if p)

    def where(self, show_rank: bool = False) -> str:
        """``unet up_blocks.1.resnets.0.conv2, step 3 (t=761), rank 1`` (parts that are set; rank 0
        only with ``show_rank``: a run of several ranks names every rank, one of one names none)."""
        place = self.place()
        parts = [place] if place else []
        if self.step is not None:
            parts.append(f"step {self.step}" + (f" (t={_short(self.timestep)})" if self.timestep is not None else ""))
        if self.rank or show_rank:
            parts.append(f"rank {self.rank}")
        return ", ".join(parts)


@functools.cache
def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Anomaly))


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
    """``anomaly`` with ``changes`` and, where its kind built its message, the message built again
    (never an edited string); a message its caller passed is kept as it is."""
    changed = dataclasses.replace(anomaly, **changes)
    if not built_by_kind(anomaly):
        return changed
    return dataclasses.replace(changed, message=KINDS[changed.kind].message(changed))


def built_by_kind(anomaly: Anomaly) -> bool:
    """Whether ``anomaly``'s message is its kind's builder's, not one its caller passed (every
    built-in kind has a builder; a kind registered elsewhere may not, and a test may pass its own)."""
    info = KINDS.get(anomaly.kind)
    try:
        return info is not None and info.message is not None and info.message(anomaly) == anomaly.message
    except (KeyError, TypeError, ValueError):  # details of another shape: the caller's message
        return False


def _short(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


# -- cause before consequence -------------------------------------------------------------------
def cause_key(anomaly: Anomaly) -> tuple:
    """Sort key, cause before consequence: most severe first, then the earliest step, then the
    stage of the step (input, loss, gradients, update, weights), then the lowest rank."""
    step = anomaly.step if isinstance(anomaly.step, (int, float)) else -1
    return (-severity_rank(anomaly.severity), step, kind_info(anomaly.kind).stage, anomaly.rank)


def cause_reference(cause: Anomaly) -> dict[str, Any]:
    """What a consequence in a later step keeps of its cause (``details["cause"]``): enough to
    name it (``where``) and to find it again in a saved record (:func:`is_cause`); of a kind told apart at
    one place by its details (:attr:`AnomalyKind.distinct_by`), those too (``distinct``)."""
    reference = {"kind": cause.kind, "where": cause.where(), "place": cause.place(), "step": cause.step}
    reference["rank"] = cause.rank
    if kind_info(cause.kind).distinct_by:
        reference["distinct"] = distinct_details(cause.kind, cause.details)
    return reference


def is_cause(anomaly: Anomaly, reference: Mapping[str, Any]) -> bool:
    """Whether ``anomaly`` is the one ``reference`` names: same kind, rank and place (and the details that
    tell its kind apart there, where the reference has them), and the referenced step within the steps it
    stands for (a repeat folded into it included)."""
    if (anomaly.kind, anomaly.rank, anomaly.place()) != (
        reference.get("kind"),
        reference.get("rank"),
        reference.get("place"),
    ):
        return False
    if "distinct" in reference and distinct_details(anomaly.kind, anomaly.details) != reference["distinct"]:
        return False
    step, first = reference.get("step"), anomaly.step
    if not isinstance(step, int) or not isinstance(first, int):
        return step == first
    last = anomaly.details.get("last_step", first) if isinstance(anomaly.details, dict) else first
    return first <= step <= (last if isinstance(last, int) else first)


def by_cause(anomalies: "list[Anomaly] | tuple[Anomaly, ...]") -> list[Anomaly]:
    """The anomalies in :func:`cause_key` order (stable): the first is the headline.

    An anomaly that names its cause in an earlier step (``details["cause"]``, see
    :func:`cause_reference`), or in its own (``details["follows"]``), lends that cause its severity for the
    order: a warning that explains a later error (a learning-rate jump before a NaN loss, a rank's forward
    error before the stall it left the others in) comes before it.

    >>> a = Anomaly("nonfinite", "error", "NaN grads", step=5, rank=0)
    >>> b = Anomaly("nonfinite_loss", "error", "NaN loss", step=5, rank=1)
    >>> [(x.kind, x.rank) for x in by_cause([a, b])]
    [('nonfinite_loss', 1), ('nonfinite', 0)]
    >>> jump = Anomaly("lr_spike", "warning", "lr x1e6", component="optimizer", step=5)
    >>> nan = Anomaly("nonfinite_loss", "error", "NaN loss", "model", step=6, details={"cause": cause_reference(jump)})
    >>> [x.kind for x in by_cause([nan, jump])]
    ['lr_spike', 'nonfinite_loss']

    What follows another anomaly of its own step (``details["follows"]``) comes right after it:
    rank 0's NaN gradients, received through the all-reduce from rank 1, after rank 1's.

    >>> made = Anomaly("nonfinite", "error", "NaN grads", step=12, rank=1)
    >>> received = {"follows": {"kind": "nonfinite", "rank": 1}}
    >>> got = Anomaly("nonfinite", "error", "NaN grads", step=12, rank=0, details=received)
    >>> [x.rank for x in by_cause([got, made])]
    [1, 0]
    """
    anomalies = list(anomalies)
    severity = [severity_rank(a.severity) for a in anomalies]
    links = _cause_links(anomalies) + _follows_links(anomalies)
    for _ in range(len(links)):  # a cause of a cause: each pass lends one link further
        changed = False
        for consequence, cause in links:
            if severity[cause] < severity[consequence]:
                severity[cause], changed = severity[consequence], True
        if not changed:
            break
    order = sorted(range(len(anomalies)), key=lambda i: (-severity[i],) + cause_key(anomalies[i])[1:])
    ordered = [anomalies[i] for i in order]
    # what follows another in its own step comes right after it (a rank that received a NaN
    # through the reduction, lower than the rank that made it, after that rank's)
    parent = dict(_follows_links(ordered))

    def placed(i: int) -> tuple[int, int, int]:
        chain = [i]
        while parent.get(chain[-1]) is not None and parent[chain[-1]] not in chain:  # a chain, never a loop
            chain.append(parent[chain[-1]])
        return chain[-1], len(chain) - 1, i

    return [ordered[i] for i in sorted(range(len(ordered)), key=placed)]


def headline(anomalies: "list[Anomaly] | tuple[Anomaly, ...]", world_size: int = 1) -> dict[str, Any] | None:
    """The first of :func:`by_cause` as the summary gives it (kind, severity, where, message), or None;
    with ``consequences`` (their count, and a count per kind) when later anomalies follow from it.
    ``world_size`` above 1: ``where`` names the rank, rank 0 too. ``severity`` is the anomaly's own (the
    headline mirrors the anomaly it names); the terminal's row and report.html's card show the diagnosis's,
    :func:`diagnosis_severity`: a warning whose consequence is an error heads an error there.

    >>> error = Anomaly("step_error", "warning", "Raised at up_blocks.1.", "model", "up_blocks.1", step=3, rank=1)
    >>> stall = Anomaly("rank_desync", "error", "Rank 0 waits.", "model", step=3, details={"follows":
    ...                 {"kind": "step_error", "rank": 1}})
    >>> top = headline([stall, error], world_size=2)
    >>> top["kind"], top["severity"], top["consequences"]
    ('step_error', 'warning', {'count': 1, 'kinds': {'rank_desync': 1}})
    >>> diagnosis_severity(*folded([stall, error])[0])
    'error'
    """
    if not anomalies:
        return None
    first, following = folded(anomalies)[0]
    where = first.where(show_rank=world_size > 1)
    out = {"kind": first.kind, "severity": first.severity, "where": where, "message": first.message}
    if following:
        kinds: dict[str, int] = {}
        for a in following:
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
        out["consequences"] = {"count": len(following), "kinds": kinds}
    return out


def diagnosis_severity(cause: Anomaly, under: "Sequence[Anomaly]") -> str:
    """The severity of a diagnosis: the worst of ``cause``'s and of what follows from it (``under``, as
    :func:`folded` lists it). The headline, the terminal's row and report.html's card show it, so a cause
    heads its consequences at their severity; each anomaly keeps its own in the record.

    >>> jump = Anomaly("lr_spike", "warning", "lr x1e4", component="optimizer", step=10)
    >>> nan = Anomaly("nonfinite_loss", "error", "NaN", "model", step=16)
    >>> diagnosis_severity(jump, [nan]), diagnosis_severity(jump, []), jump.severity
    ('error', 'warning', 'warning')
    """
    return max((cause.severity, *(a.severity for a in under)), key=severity_rank)


def folded(anomalies: "list[Anomaly] | tuple[Anomaly, ...]") -> list[tuple[Anomaly, list[Anomaly]]]:
    """The anomalies in :func:`by_cause` order, each that follows from another one left out and
    listed under the one that started it instead: (anomaly, what follows from it) pairs; the first
    is the headline.

    >>> jump = Anomaly("lr_spike", "warning", "lr x1e4", component="optimizer", step=10)
    >>> nan = Anomaly("nonfinite_loss", "error", "NaN", "model", step=16, details={"cause": cause_reference(jump)})
    >>> grads = Anomaly("nonfinite", "error", "NaN grads", "model", step=16, rank=1,
    ...                 details={"follows": {"kind": "nonfinite_loss", "rank": 0}})
    >>> [(a.kind, [b.kind for b in under]) for a, under in folded([grads, nan, jump])]
    [('lr_spike', ['nonfinite_loss', 'nonfinite'])]
    """
    ordered = by_cause(anomalies)
    parent = _parents(ordered)
    root = {}
    for i in range(len(ordered)):
        j, seen = i, {i}
        while parent.get(j) is not None and parent[j] not in seen:  # a chain, never a loop
            j = parent[j]
            seen.add(j)
        root[i] = j
    under: dict[int, list[Anomaly]] = {i: [] for i in range(len(ordered))}
    for i, r in root.items():
        if r != i:
            under[r].append(ordered[i])
    return [(a, under[i]) for i, a in enumerate(ordered) if root[i] == i]


def consequences(anomalies: "list[Anomaly] | tuple[Anomaly, ...]", cause: Anomaly) -> list[Anomaly]:
    """What :func:`folded` lists under ``cause``: the anomalies that follow from it, through their
    ``details["cause"]`` (an earlier step's) or ``details["follows"]`` (its own step's), in :func:`by_cause`
    order.

    >>> jump = Anomaly("lr_spike", "warning", "lr x1e4", component="optimizer", step=10)
    >>> nan = Anomaly("nonfinite_loss", "error", "NaN", "model", step=16, details={"cause": cause_reference(jump)})
    >>> [a.kind for a in consequences([jump, nan], jump)], consequences([jump, nan], nan)
    (['nonfinite_loss'], [])
    """
    return next((under for a, under in folded(anomalies) if a is cause), [])


def _parents(anomalies: list[Anomaly]) -> dict[int, int]:
    """Position of each anomaly -> position of the one it names as its cause (``details["cause"]``)
    or, in its own step, follows (``details["follows"]``: the first of that kind and rank)."""
    parent = dict(_cause_links(anomalies))
    for i, j in _follows_links(anomalies):
        parent.setdefault(i, j)
    return parent


def _follows_links(anomalies: list[Anomaly]) -> list[tuple[int, int]]:
    """(consequence, cause) positions for each anomaly that follows another of its own step
    (``details["follows"]``: the first of that kind and rank in ``anomalies``)."""
    first: dict[tuple, int] = {}
    for i, a in enumerate(anomalies):
        first.setdefault(follows_key(a), i)
    links = []
    for i, a in enumerate(anomalies):
        follows = a.details.get("follows") if isinstance(a.details, dict) else None
        if isinstance(follows, Mapping):
            j = first.get(followed_key(follows, a.step))
            if j is not None and j != i:
                links.append((i, j))
    return links


def follows_key(anomaly: Anomaly) -> tuple:
    """What a ``details["follows"]`` of ``anomaly``'s step names it by: (kind, rank, step, module), the
    module only for a producer found by a replay of a trained model's forward (``localized_by``), which
    shares kind, rank and step with that step's NaN gradients (``{"kind": "nonfinite", "rank": r}``
    names those), and for a module whose near-max values another overflowed on (``overflowed_in``), which
    shares them with the NaN/Inf that module made.

    >>> made = Anomaly("nonfinite", "error", "x", "model", "fc1", step=2, details={"localized_by": "forward replay"})
    >>> grads = Anomaly("nonfinite", "error", "x", "model", "fc1", step=2, parameter="fc1.weight")
    >>> follows_key(made), follows_key(grads)
    (('nonfinite', 0, 2, 'fc1'), ('nonfinite', 0, 2, None))
    """
    details = anomaly.details if isinstance(anomaly.details, dict) else {}
    named = anomaly.module if details.get("localized_by") == "forward replay" or "overflowed_in" in details else None
    return (anomaly.kind, anomaly.rank, anomaly.step, named)


def followed_key(follows: Mapping, step: Any, rank: int | None = None) -> tuple:
    """The :func:`follows_key` of what a ``details["follows"]`` at ``step`` names (``rank``: its rank
    where it names none)."""
    return (follows.get("kind"), follows.get("rank", rank), step, follows.get("module"))


def _cause_links(anomalies: list[Anomaly]) -> list[tuple[int, int]]:
    """(consequence, cause) positions for each anomaly whose ``details["cause"]`` is in the list."""
    by_place: dict[tuple, list[int]] = {}
    for i, a in enumerate(anomalies):
        by_place.setdefault((a.kind, a.rank, a.place()), []).append(i)
    links = []
    for i, a in enumerate(anomalies):
        reference = a.details.get("cause") if isinstance(a.details, dict) else None
        if not isinstance(reference, Mapping):
            continue
        candidates = by_place.get((reference.get("kind"), reference.get("rank"), reference.get("place")), [])
        cause = next((j for j in candidates if j != i and is_cause(anomalies[j], reference)), None)
        if cause is not None:
            links.append((i, cause))
    return links
