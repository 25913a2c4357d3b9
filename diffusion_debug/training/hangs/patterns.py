"""Naming a stall from where every rank is: positions in, one sentence out (no I/O, no clock).

The liveness side channel (``liveness``) publishes each rank's :class:`Position`; once no rank has
moved for ``stall_timeout`` seconds and they disagree, :func:`name_stall` says what the pattern is,
with the ranks and the step::

    >>> waiting = [Position(rank=r, phase="backward", step=3, exchanges=3, forwards=4) for r in range(1, 8)]
    >>> print(name_stall([Position(rank=0, phase="validation", step=2, exchanges=3, forwards=3), *waiting]).text)
    rank 0 is in validation at step 2; ranks 1–7 wait in backward (the gradient all-reduce) at step 3

A rank whose training forward raised (caught, or its process not yet gone) is named with its error
while the others wait in the collectives it never reached; under FSDP2 or ZeRO-3 they wait in the
same forward it left::

    >>> raised = Position(1, "raised", 3, error="ValueError: a bad batch")
    >>> print(name_stall([Position(0, "forward", 3, engine="fsdp2"), raised]).text)
    rank 1 raised ValueError: a bad batch in its forward at step 3; rank 0 waits in forward at step 3

and so is one whose error left the step elsewhere (the loss, backward, a hook of the user's, the optimizer step:
``unwinding``), with where it left it (``raised_in``) and whether its process is ending with it::

    >>> raised = Position(1, "raised", 3, error="ValueError: a bad target", raised_in="backward", uncaught=True)
    >>> print(name_stall([Position(0, "backward", 3), raised]).text)
    rank 1 raised ValueError: a bad target in its backward at step 3 (not caught: its process is ending); \
rank 0 waits in backward (the gradient all-reduce) at step 3

Patterns, the first that fits: a rank whose error left its step (``raised``); a rank that skipped a step
others monitored (``skipped_step``);
``monitor_training_step`` called on some ranks only (``monitor_subset``); a rank that left the
training loop while others wait (``left_early``); otherwise the ranks elsewhere than the largest
group, which waits (``rank_elsewhere``).

A rank in backward waits in its engine's reduction, named by :attr:`Position.engine` (what the
debugger watches, ``pre_reduction.engine_of``): DDP's gradient all-reduce, FSDP2's and FSDP1's
parameter all-gather or gradient reduce-scatter, DeepSpeed ZeRO's gradient reduction, DeepSpeed's all-reduce
without ZeRO::

    >>> print(name_stall([Position(0, "validation", 2), Position(1, "backward", 3, engine="zero")]).text)
    rank 0 is in validation at step 2; rank 1 waits in backward (DeepSpeed ZeRO's gradient reduction) at step 3

Limits: a stall is named only while some rank waits in a phase that holds a collective (forward,
backward, the monitor's exchange, DeepSpeed ZeRO's optimizer step): ranks that all sit after their
optimizer step or in phases of their own (validation, save) are not waiting on each other as far as
the debugger can tell (a collective of the user's there, a ``clip_grad_norm_`` under FSDP2 after the
monitor, is not marked). Two ranks in the same phase and step read as together; an error raised outside the
watched model's forward is seen only while the rank unwinds with it (``unwinding``'s limits). A skipped step is
seen only when ``step=`` numbers consecutive monitored steps.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any

# Phases that hold a collective under DDP/FSDP or the monitor: a rank frozen there waits for others
# (``step``: inside an optimizer step that holds collectives, DeepSpeed ZeRO's).
WAITING_PHASES = ("forward", "backward", "monitor", "step")
_WAITING_TEXT = {
    "monitor": "the monitor's exchange",
    "backward": "backward (the gradient all-reduce)",
    "forward": "forward",
    "step": "the optimizer step",
}
_ENGINE_WAITING_TEXT = {  # by Position.engine; DDP's (and an engine not known) is _WAITING_TEXT's
    ("backward", "fsdp2"): "backward (FSDP2's parameter all-gather or gradient reduce-scatter)",
    ("backward", "fsdp1"): "backward (FSDP1's (FullyShardedDataParallel) parameter all-gather or gradient "
    "reduce-scatter)",
    ("backward", "zero"): "backward (DeepSpeed ZeRO's gradient reduction)",
    ("backward", "deepspeed"): "backward (DeepSpeed's gradient all-reduce)",
    ("step", "zero"): "the optimizer step (DeepSpeed ZeRO's gradient norm and overflow all-reduce, then its "
    "parameter all-gather)",
}
_PHASE_TEXT = {
    "start": "the loop (no phase marked since the debugger started)",
    "optimizer": "the loop after the monitor (the optimizer step, zero_grad, the next batch)",
    "before_forward": "the loop after its optimizer step, before the forward",
}
_RAISED_IN = {  # by Position.raised_in: where the error left the step ("": the watched forward, its hook saw it)
    "": "in its forward",
    "start": "before its first forward",
    "forward": "in its forward or its loss",
    "backward": "in its backward",
    "monitor": "in monitor_training_step",
    "optimizer": "after its monitor (the optimizer step, zero_grad or the next batch)",
    "step": "in its optimizer step",
    "before_forward": "before its forward (the next batch)",
}
_ENDING = ("skipped_step", "monitor_subset", "left_early")
_ADVICE = {
    "raised": (
        "An error on some ranks only (a bad batch, an out-of-memory) leaves the others in the collective it never "
        "reached: let it end the process (the launcher then stops the others), or skip the batch on every rank "
        "together (decide from a value all ranks share); stacks-rank*.txt shows where each rank is."
    ),
    "skipped_step": (
        "A rank that leaves out a step (a `continue` after a bad batch or a local NaN) pairs its later collectives "
        "with the other ranks' earlier ones: skip a step on every rank together (decide from a value all ranks "
        "share, e.g. policy skip) or not at all."
    ),
    "monitor_subset": (
        "Call monitor_training_step on every rank (it holds a collective), not under `if "
        "accelerator.is_main_process:`; the report is written by the main process alone."
    ),
    "left_early": (
        "Ranks ran different numbers of steps (uneven data): give every rank the same number of batches "
        "(drop_last, or accelerator.even_batches)."
    ),
    "rank_elsewhere": (
        "Work done on some ranks only (validation, sampling, saving) makes the others wait in their next "
        "collective: keep it short, or run it on every rank; stacks-rank*.txt shows where each rank is."
    ),
}


@dataclass
class Position:
    """Where one rank is: the phase it marked last, the step it is on, and counters that only grow."""

    rank: int
    phase: str = "start"
    step: Any = None
    counter: int = 0
    """Marks so far: a rank whose counter does not change has not moved."""
    exchanges: int = 0
    """Exchanges of the monitor this rank has entered (the collective's count)."""
    forwards: int = 0
    """Training forwards (grad enabled) seen by the forward mark."""
    skipped: list[Any] = field(default_factory=list)
    """The last steps this rank's monitor calls jumped over (bounded), and ``skipped_total`` their count."""
    skipped_total: int = 0
    host: str = ""
    engine: str = ""
    """The engine whose collectives this rank's backward waits in: ``ddp``, ``fsdp2``, ``fsdp1``, ``zero``,
    ``deepspeed`` (no ZeRO) ("": none known; named as DDP's all-reduce)."""
    error: str = ""
    """In phase ``raised``: the error that left the step (``ValueError: a bad batch``)."""
    raised_in: str = ""
    """In phase ``raised``: the phase the error left ("": the watched model's forward, whose hook saw it)."""
    uncaught: bool = False
    """In phase ``raised``: no one caught the error: the process's main thread ended with it and it is exiting."""
    left: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    """This rank's own, not published: the phase of the user's the last error left, its step, and that error as
    ``core.out_of_memory.raised_at`` tells it (never the error: its frames hold the step's tensors); read while
    that error is handled (``hangs.unwinding``)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["left"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Position":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Stall:
    """A named stall: ``pattern``, the ranks to look at first (``ranks``), the step, the sentence."""

    pattern: str
    ranks: list[int]
    step: Any
    text: str
    waiting: list[int] = field(default_factory=list)
    uncaught: bool = False
    """``raised``: every rank named is exiting with its error (``Position.uncaught``): none will come back."""
    raised_in: str = ""
    """``raised``: the phase the first rank named left with its error ("": the watched forward)."""

    @property
    def advice(self) -> str:
        return _ADVICE[self.pattern]

    @property
    def definite(self) -> bool:
        """No rank can get out of it (a skipped step, a monitor on some ranks, a rank gone, one exiting with an
        uncaught error): the job ends whatever ``stall_action`` says; ``rank_elsewhere`` may resolve (a long
        validation), and so may ``raised`` while a rank named handles its error (a retry)."""
        return self.pattern in _ENDING or (self.pattern == "raised" and self.uncaught)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "advice": self.advice}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Stall":
        waiting, uncaught = list(data.get("waiting", ())), bool(data.get("uncaught", False))
        raised_in = str(data.get("raised_in", ""))
        return cls(data["pattern"], list(data["ranks"]), data["step"], data["text"], waiting, uncaught, raised_in)


def rank_list(ranks: list[int]) -> str:
    """``rank 5``, ``ranks 1–7``, ``ranks 0–4, 6–7``: runs of consecutive ranks joined by an en dash.

    >>> rank_list([0, 1, 2, 3, 4, 6, 7])
    'ranks 0–4, 6–7'
    """
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _phase_text(phase: str, engine: str = "") -> str:
    return _PHASE_TEXT.get(phase) or _waiting_phase(phase, engine)


def _waiting_phase(phase: str, engine: str) -> str:
    """``backward (the gradient all-reduce)``: a phase that holds a collective, with the engine's.

    >>> _waiting_phase("backward", "zero")
    "backward (DeepSpeed ZeRO's gradient reduction)"
    """
    return _ENGINE_WAITING_TEXT.get((phase, engine)) or _WAITING_TEXT.get(phase, phase)


def _at(step: Any) -> str:
    return "" if step is None else f" at step {step}"


def _in(phase: str, step: Any, engine: str = "") -> str:
    """Where a rank is: `` in validation at step 2``; after a step's monitor, between it and the
    next forward (nothing marks the end of the optimizer step: the stack file shows the line).

    >>> _in("optimizer", 5)
    " between step 5's monitor and step 6's forward (its optimizer step, zero_grad or the next batch)"
    """
    if phase == "optimizer" and isinstance(step, int):
        after = "its optimizer step, zero_grad or the next batch"
        return f" between step {step}'s monitor and step {step + 1}'s forward ({after})"
    return f" in {_phase_text(phase, engine)}{_at(step)}"


def _stall_step(position: "Position") -> Any:
    """The step a rank holds the others at: after step k's monitor, step k + 1."""
    step = position.step
    return step + 1 if position.phase == "optimizer" and isinstance(step, int) else step


def _waiting_text(positions: list[Position]) -> str:
    """``ranks 1–7 wait in backward (the gradient all-reduce) at step 3``, one clause per place."""
    groups: dict[tuple[str, Any, str], list[int]] = collections.defaultdict(list)
    for p in positions:
        groups[(p.phase, p.step, p.engine)].append(p.rank)
    return "; ".join(
        f"{rank_list(ranks)} wait{'s' if len(ranks) == 1 else ''} in {_waiting_phase(phase, engine)}{_at(step)}"
        for (phase, step, engine), ranks in sorted(groups.items(), key=lambda item: item[1][0])
    )


def name_stall(positions: list[Position]) -> Stall | None:
    """The stall these (frozen) positions show, or None when the ranks agree or nobody waits."""
    if len({(p.phase, p.step, p.exchanges) for p in positions}) <= 1:
        return None
    if not any(p.phase in WAITING_PHASES for p in positions):
        return None
    return (
        _raised(positions)
        or _skipped(positions)
        or _monitor_subset(positions)
        or _left_early(positions)
        or _elsewhere(positions)
    )


def _majority(values: list[Any]) -> Any:
    return collections.Counter(values).most_common(1)[0][0]


def _raised(positions: list[Position]) -> Stall | None:
    raised = sorted((p for p in positions if p.phase == "raised"), key=lambda p: p.rank)
    waiting = [p for p in positions if p.phase in WAITING_PHASES]
    if not raised or not waiting:
        return None
    groups = _grouped(raised, lambda p: (p.error or "an error", p.step, p.raised_in, p.uncaught))
    clauses = [
        f"{rank_list(ranks)} raised {error} {_raised_where(raised_in, len(ranks))}{_at(step)}{_ending(left, ranks)}"
        for (error, step, raised_in, left), ranks in groups.items()
    ]
    text = "; ".join([*clauses, _waiting_text(waiting)])
    ranks, uncaught = [p.rank for p in raised], all(p.uncaught for p in raised)
    return Stall("raised", ranks, raised[0].step, text, [p.rank for p in waiting], uncaught, raised[0].raised_in)


def _raised_where(raised_in: str, ranks: int) -> str:
    """Where an error left the step: ``in its backward`` (``their``: several ranks), ``in validation``."""
    where = _RAISED_IN.get(raised_in) or f"in {raised_in}"
    return where.replace(" its ", " their ") if ranks > 1 else where


def _ending(uncaught: bool, ranks: list[int]) -> str:
    """What follows an error no one caught: the ranks' processes are exiting with it."""
    if not uncaught:
        return ""
    return f" (not caught: {'its process is' if len(ranks) == 1 else 'their processes are'} ending)"


ERROR_CHARACTERS = 200
"""The most of an error's text a position carries (the store holds every rank's position)."""


def error_text(error: BaseException) -> str:
    """``ValueError: a bad batch``, on one line, at most :data:`ERROR_CHARACTERS` characters.

    >>> error_text(ValueError("a bad\\nbatch"))
    'ValueError: a bad batch'
    """
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= ERROR_CHARACTERS else text[: ERROR_CHARACTERS - 1] + "…"


def _grouped(positions: list[Position], key: Any) -> dict[Any, list[int]]:
    """The ranks of ``positions`` by ``key(position)``, in the order each key first comes."""
    groups: dict[Any, list[int]] = {}
    for p in positions:
        groups.setdefault(key(p), []).append(p.rank)
    return groups


def _skipped(positions: list[Position]) -> Stall | None:
    usual = _majority([p.skipped_total for p in positions])
    skippers = [p for p in positions if p.skipped_total > usual]
    if not skippers or len(skippers) * 2 >= len(positions):
        return None
    common = set.intersection(*(set(p.skipped) for p in positions if p.skipped_total == usual)) if usual else set()
    first = min((s for p in skippers for s in p.skipped if s not in common), default=None)
    others = [p for p in positions if p not in skippers]
    text = (
        f"{rank_list([p.rank for p in skippers])} skipped step {first} (no monitor_training_step call for it, so "
        f"its later collectives pair with the other ranks' earlier ones); {_waiting_text(others)}"
    )
    return Stall("skipped_step", [p.rank for p in skippers], first, text, [p.rank for p in others])


def _monitor_subset(positions: list[Position]) -> Stall | None:
    inside = [p for p in positions if p.phase == "monitor"]
    if not inside:
        return None
    entered = max(p.exchanges for p in inside)
    # a rank that monitored before and then closed left the loop early: not this pattern
    outside = [p for p in positions if p.exchanges < entered and p.phase != "monitor" and p.phase != "closed"]
    outside += [p for p in positions if p.phase == "closed" and p.exchanges == 0]
    ran = min(q.forwards for q in inside)
    if not outside or any(p.forwards <= ran and p.phase != "closed" for p in outside):
        return None  # the others have not run past this step (nor left the loop): they are late, not missing
    outside.sort(key=lambda p: p.rank)
    calling, step = [p.rank for p in inside], inside[0].step
    if all(p.exchanges == 0 for p in outside):
        head = f"monitor_training_step is called on {rank_list(calling)} only"
    else:
        head = f"monitor_training_step is called on {rank_list(calling)}{_at(step)} but not on the others"
    where = "; ".join(
        f"{rank_list(ranks)} went on to {_phase_text(phase)} without it"
        for phase, ranks in _by_phase([p for p in outside]).items()
    )
    return Stall("monitor_subset", calling, step, f"{head}: {where}", [p.rank for p in outside])


def _by_phase(positions: list[Position]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for p in positions:
        groups[p.phase].append(p.rank)
    return dict(groups)


def _left_early(positions: list[Position]) -> Stall | None:
    closed = [p for p in positions if p.phase == "closed"]
    waiting = [p for p in positions if p.phase in WAITING_PHASES]
    if not closed or not waiting:
        return None
    text = (
        f"{rank_list([p.rank for p in closed])} left the training loop (closed its debugger){_after(closed)}; "
        f"{_waiting_text(waiting)}"
    )
    return Stall("left_early", [p.rank for p in closed], closed[0].step, text, [p.rank for p in waiting])


def _after(positions: list[Position]) -> str:
    step = positions[0].step
    return "" if step is None else f" after step {step}"


def _elsewhere(positions: list[Position]) -> Stall | None:
    groups: dict[tuple[str, Any], list[Position]] = collections.defaultdict(list)
    for p in positions:
        groups[(p.phase, p.step)].append(p)
    # the waiting group: the largest in a phase that holds a collective; of equal ones the furthest
    # on (a rank in backward waits for one still in forward), then the lowest rank
    waiting_key = max(
        (k for k in groups if k[0] in WAITING_PHASES),
        key=lambda k: (len(groups[k]), _progress(groups[k][0]), -groups[k][0].rank),
    )
    waiting = groups.pop(waiting_key)
    culprits = sorted((p for group in groups.values() for p in group), key=lambda p: p.rank)
    in_step = waiting_key[0] == "step"  # the others wait inside step k's optimizer step: a rank before it
    before = ("optimizer", waiting_key[1]) if in_step else None
    clauses = [
        f"{rank_list([p.rank for p in group])} {'is' if len(group) == 1 else 'are'}"
        + (_before_step(step) if (phase, step) == before else _in(phase, step, group[0].engine))
        for (phase, step), group in sorted(groups.items(), key=lambda item: item[1][0].rank)
    ]
    text = "; ".join([*clauses, _waiting_text(waiting)])
    step = waiting_key[1] if in_step else _stall_step(culprits[0])
    return Stall("rank_elsewhere", [p.rank for p in culprits], step, text, [p.rank for p in waiting])


def _before_step(step: Any) -> str:
    """Where a rank is that has not entered the optimizer step the others wait in.

    >>> _before_step(6)
    " after step 6's monitor, before its optimizer step (a save, a log or a wait of its own)"
    """
    return f" after step {step}'s monitor, before its optimizer step (a save, a log or a wait of its own)"


def _progress(p: Position) -> tuple[int, int, int]:
    """How far a rank got: monitored steps, training forwards, then its place in the step."""
    return (p.exchanges, p.forwards, WAITING_PHASES.index(p.phase) if p.phase in WAITING_PHASES else -1)
