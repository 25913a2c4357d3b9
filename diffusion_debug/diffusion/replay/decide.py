"""Which replays a call's readings call for, decided in one place (:func:`decide`), and what a replay's
readings show (:func:`nonfinite_replayed`, :func:`overflow_replayed`; where inside a module, as full probes
read in the call would show it too: :func:`between_modules`, :func:`overflow_between`,
:func:`clipped_producer`; whose near-max values a NaN/Inf was made from, its cause:
:func:`~.near_max.near_max_source`). The run's earlier answers are :class:`ReplayMemory`: a component's
NaN/Inf is localised once a run (again where a call after a clean one, at another block, or with two origins
and no reading that says whose, made it from finite arguments: it may be another origin, or count at the
entry of one it had before); a block's near-overflow once for the
debugger's life (the same weights overflow in the same place), but again each run where it was passed in,
an Inf was clipped there or the replay could not run.

Values in, a decision out: nothing here runs a replay or builds an anomaly (the
:class:`~..localize.Localizer` does both). Two looks are handed in, asked only where the rule needs them:
whether a module is a leaf, and whether the kept call was passed a NaN/Inf (a host read).

Long because the rules of when to replay and the readers of what a replay shows are one rule set, read
together (a decision names the reader its replay's readings go to): apart, each half would point at the other.

>>> from diffusion_debug.probes import ModuleReading
>>> block = ModuleReading("down.0", 0, "float16", 1.0, 60000.0, "float16")
>>> fp16 = dict(output_finite=True, full=False, leaf=lambda c, m: False, received=lambda c, s: False,
...             unwatched=None, localize=True, site="", fraction=0.5)
>>> memory = ReplayMemory()
>>> decide("unet", checks.Suspects(None, None, block), [block], memory=memory, **fp16).overflow.replay
'down.0'
>>> memory.overflow_where[("unet", "down.0")] = None  # localised (here: no module named)
>>> decide("unet", checks.Suspects(None, None, block), [block], memory=memory, **fp16).overflow.replay is None
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from ...probes import ModuleReading
from ...stats import dtype_max
from .. import checks
from .near_max import near_max_source

Key = tuple[str, str]
"""``(component, block)``: where a block-level reading was seen."""


@dataclass
class ReplayMemory:
    """What the replays found and tried, read by :func:`decide`; cleared per run, but :attr:`overflow_where`."""

    overflow_where: dict[Key, ModuleReading | None] = field(default_factory=dict)
    """Where a block's near-overflow was localised (None: no module named), until the debugger's history is cleared."""
    grown: dict[Key, dict[str, str]] = field(default_factory=dict)
    """Where the component's own forward built them (an ``overflow_where`` reading of module ``""``)."""
    tried: set[Key] = field(default_factory=set)
    """This run's overflow replays that could not run (no kept call, the budget spent): tried again next run."""
    passed_in: set[Key] = field(default_factory=set)
    """This run's blocks whose near-max values no module made (the call's own arguments brought them)."""
    clipped: dict[Key, tuple[Clip, int]] = field(default_factory=dict)
    """This run's blocks that clipped an Inf: ``(the clip, replay reading count)``."""
    replayed_at_max: set[Key] = field(default_factory=set)
    """This run's blocks at the dtype's max (:func:`at_dtype_max`) replayed once (a clip hides an Inf that way)."""
    reported: dict[str, bool] = field(default_factory=dict)
    """This run's components whose NaN/Inf was named, and whether it was a consequence (later ones count there)."""
    made_in: dict[str, dict[str, str]] = field(default_factory=dict)
    """This run's: component -> the readings' modules that were seen making its NaN/Inf -> the entry each counted at
    (a call whose first such module is another, given finite arguments, is another origin: localised again; one
    whose is known counts at that module's entry)."""
    named: dict[str, str] = field(default_factory=dict)
    """This run's: component -> the module of its latest ``nonfinite`` entry (repeats no module names count there)."""
    entries: dict[str, dict[str, bool]] = field(default_factory=dict)
    """This run's: component -> the modules of its ``nonfinite`` entries -> whether each is a consequence."""
    origins: dict[Key, object] = field(default_factory=dict)
    """This run's: ``(component, module)`` -> the error that was the run's origin there (the origin again where a
    NaN/Inf counts at its entry after another origin's)."""
    last_step: dict[str, int | None] = field(default_factory=dict)
    """This run's: component -> the step of its latest call that showed a NaN/Inf (None: in the pass before,
    :meth:`next_pass`); one that follows a clean call of it, or starts the next pass, is localised again: it
    may be another origin."""
    placed: set[str] = field(default_factory=set)
    """This run's: the components with two entries whose latest NaN/Inf no reading said whose, placed at an entry
    (by a replay, or at the latest where it gave nothing), with each call since a NaN/Inf: repeats, not replayed."""
    seconds: float = 0.0
    """This run's replay time, against ``debug_timeout`` (each FreeInit pass's: :meth:`next_pass`)."""
    timeout: float = math.inf
    """The run's ``debug_timeout`` of replays (spent: two entries and no reading that says whose is a repeat)."""

    def new_run(self) -> None:
        self.tried.clear()
        self.passed_in.clear()
        self.clipped.clear()
        self.replayed_at_max.clear()
        self.reported.clear()
        self.made_in.clear()
        self.named.clear()
        self.entries.clear()
        self.origins.clear()
        self.last_step.clear()
        self.placed.clear()
        self.seconds = 0.0

    def next_pass(self) -> None:
        """A run in the same call (FreeInit's next pass) keeps what this one named, its steps counted anew, with
        a ``debug_timeout`` of replays of its own: a pass costs what a call does, and its fault (another origin
        after the callback cleaned the latents) would find the budget the first pass's replays spent."""
        self.last_step = dict.fromkeys(self.last_step)
        self.seconds = 0.0

    def clear(self) -> None:
        self.new_run()
        self.overflow_where.clear()
        self.grown.clear()

    def count(
        self, component: str, source: Source, producer: ModuleReading | None, step: int | None, given=False, made=False
    ) -> tuple[bool, bool]:
        """``(consequence, another)`` for a NaN/Inf of ``component`` at ``step`` found at ``source`` (``producer``:
        the reading that first showed it made): a repeat is counted at an entry of the component's (its
        consequence): the module's it was localised at again, the one whose reading ``producer`` made it before,
        else the latest; ``another``: a module with no entry made it from finite arguments, or (``given``) it was
        given another origin's (the user's callback's), or (``made``) its first one was made here from finite
        arguments after another component's origin: a new entry, the latest. With two entries, one no reading and no
        replay says whose (it gave nothing: :data:`UNLOCALISED`) is a repeat at the latest."""
        self.last_step[component] = step
        entries, seen_at = self.entries.setdefault(component, {}), self.made_in.setdefault(component, {})
        if component in self.named:  # (one named where no count ran: an Inf a block clipped, Localizer._clipped_inf)
            entries.setdefault(self.named[component], self.reported.get(component, False))
        first, unsure = component not in self.reported, producer is None and len(entries) > 1
        again = not (first or source.consequence or source.how == ALREADY_REPORTED)  # here, from finite arguments
        again = again and not (unsure and source.how == UNLOCALISED)  # (no answer: at the latest entry)
        another = given or made or (again and source.module not in entries)
        if another or not unsure:
            self.placed.discard(component)
        else:  # placed at an entry: the calls right after it count there unreplayed (_again)
            self.placed.add(component)
        if first or another:
            self.reported[component], self.named[component] = source.consequence or given, source.module
            entries[source.module] = self.reported[component]
        else:  # A, B, then A again: at A's entry
            known = source.module if again else seen_at.get(producer.module) if producer is not None else None
            if known in entries:
                self.reported[component], self.named[component] = entries[known], known
        if producer is not None:
            seen_at.setdefault(producer.module, self.named[component])
        return self.reported[component], another

    def forget(self, gone: set[str]) -> None:
        """Where an overflow was localised in the components ``gone`` (no longer the same module)."""
        self.overflow_where = {key: found for key, found in self.overflow_where.items() if key[0] not in gone}
        self.tried = {key for key in self.tried if key[0] not in gone}

    def overflow_shown(self, asked: Overflow, shown: OverflowReplayed | None, count: int) -> Overflow:
        """Keep what the replay ``asked`` for (``count`` readings; ``shown`` None: it could not run) showed;
        what it means for the call: an Inf clipped there, values passed in (skip), or the module known. Where the
        sentinel read the clip in the call (``asked.inf``: :func:`clipping_block`) and the replay shows none, the
        Inf is the call's finding as read: the clip at the module whose Inf the sentinel read."""
        key, reading = asked.key, asked.reading
        self.replayed_at_max.add(key)
        found = None
        if shown is None:  # no kept call or no replay budget: tried again next run
            self.tried.add(key)
        elif shown.clipped is not None:  # for this run: a later run's call is replayed again
            self.clipped[key] = (shown.clipped, count)
            return Overflow(reading, key, clipped=shown.clipped, replayed=count)
        elif shown.passed_in:  # for this run too
            self.passed_in.add(key)
            found = Overflow(reading, key, skip=True)
        else:  # localised once for the debugger's life (until clear)
            self.overflow_where[key] = shown.made
            if shown.between is not None:
                self.grown[key] = shown.between
        if asked.inf is not None:  # (a clip read in the call is no overflow warning: the Inf is the finding)
            clip = Clip(asked.inf, reading.module, reading.output_absmax)
            how, replayed = (CLIP_UNREPLAYED, None) if shown is None else (CLIP_NOT_AGAIN, count)
            return Overflow(reading, key, clipped=clip, replayed=replayed, how=how)
        return found if found is not None else self.overflow_known(reading, key)

    def overflow_known(self, reading: ModuleReading, key: Key) -> Overflow:
        """The near-overflow of ``key``'s block as localised (named at ``reading``'s block where it was not)."""
        inner = self.overflow_where.get(key)
        between = None if inner is None or inner.module else self.grown.get(key)  # "": its own forward built them
        return Overflow(reading, key, known=inner, between=between)


def replayed_how(by: str, earlier: bool = False) -> str:
    """How a module is named by a replay with full probes of the kept call, found by ``by`` (``"sentinel"``,
    ``"output check"``): this call's replay, or (``earlier``) one of an earlier call of the same debugger's (its
    replay memory). The one text of both checks (:mod:`..localize`, :mod:`..call_events`).

    >>> replayed_how("output check"), replayed_how("sentinel", earlier=True)
    ('output check -> replay with full probes', "sentinel -> an earlier call's replay")
    """
    return f"{by} -> an earlier call's replay" if earlier else f"{by} -> replay with full probes"


@dataclass(frozen=True)
class Source:
    """Where a call's NaN/Inf came from, as far as known without a replay: ``module`` (``""``: none named),
    ``how`` it was found, whether it is a ``consequence`` (its inputs were non-finite, or it was named before)."""

    module: str
    how: str
    consequence: bool
    between: dict[str, str] = field(default_factory=dict)
    near_max: tuple[ModuleReading, ModuleReading] | None = None
    """``(the module that made the finite values near the dtype's max that module overflowed on, module's
    reading)``: the cause, ``module``'s NaN/Inf its consequence (:func:`near_max_source`)."""
    dtype: str | None = None
    """The dtype ``module``'s output was read in (float16 under float16 autocast), where a reading showed it."""


@dataclass(frozen=True)
class Overflow:
    """A call's near-overflow: the ``reading`` that showed it (with full probes, where the component's own
    forward built it: ``between``) and what to do: ``replay`` that block, ``skip`` it (passed in this run),
    take the Inf a replay found ``clipped`` there (``how`` it was found; ``replayed``: the replay's reading count),
    or name the module ``known`` (None: ``reading``'s). ``clean``: the call showed no NaN/Inf (a replay looks
    for a clipped Inf only then)."""

    reading: ModuleReading
    key: Key | None = None
    """``(component, block)`` of a block-level reading (None: full probes, or a leaf: named as read)."""
    clean: bool = True
    replay: str | None = None
    skip: bool = False
    clipped: Clip | None = None
    known: ModuleReading | None = None
    between: dict[str, str] | None = None
    replayed: int | None = None
    how: str = replayed_how("sentinel")
    inf: ModuleReading | None = None
    """The sentinel's reading of the Inf this block was read clipping in the call (:func:`clipping_block`): the
    call's finding where the block's replay shows no clip (:meth:`ReplayMemory.overflow_shown`)."""


@dataclass(frozen=True)
class Decision:
    """What one call's checks do (:func:`decide`): ``clipped`` (full probes: an Inf a block clipped, the
    call's one finding); its NaN/Inf's ``source``, or the block to ``replay`` for it (neither: none to
    name); its near-``overflow`` (None: none)."""

    clipped: Clip | None = None
    source: Source | None = None
    replay: str | None = None
    overflow: Overflow | None = None
    failed: dict[str, Exception] = field(default_factory=dict)
    """The check whose decision raised (``"nonfinite"``, ``"overflow_risk"``) -> its error, for the caller to
    record under that check's guard: the other check is decided all the same (a failure in one costs no other)."""


NOTHING = Decision()


def decide(
    component: str,
    seen: checks.Suspects,
    readings: list[ModuleReading],
    *,
    memory: ReplayMemory,
    output_finite: bool,
    full: bool,
    leaf: Callable[[str, str], bool],
    received: Callable[[str, str], bool],
    unwatched: str | None,
    localize: bool,
    site: str,
    fraction: float,
    step: int | None = None,
) -> Decision:
    """Every replay one call of ``component`` calls for, from what its ``readings`` show (``seen``:
    :func:`~..checks.suspects`) and what ``memory`` holds. ``full``: read with full probes (they name the
    module: no replay); ``leaf(component, module)``: whether a module has none inside; ``received(component,
    site)``: whether the kept call was passed a NaN/Inf; ``unwatched``: how a NaN/Inf is found where no hook
    of ours saw the call (nothing kept to replay; None: one did); ``localize``: replays allowed; ``site``:
    the call site's prefix, replayed when no reading names a block; ``step``: the call's (a NaN/Inf after a
    clean call of a component named before is localised again). A check whose decision raises is handed
    back in :attr:`Decision.failed`, the other decided all the same: a failure in one check costs no other."""
    if seen is checks.NONE and output_finite:  # a clean call
        return NOTHING
    source, replay, overflow, failed, inf = None, None, None, {}, None
    try:
        clipped = clipped_producer(readings, "") if output_finite and full else None
        if clipped is not None and clipped.block and clipped.producer is seen.first_nonfinite:  # what a replay names
            return Decision(clipped=clipped)
        block = clipping_block(readings, fraction) if output_finite and not full else None
        # the Inf read, where the replay shows none or cannot run (only an Inf made there, its inputs finite or
        # unread: one given with its inputs was not); with localize off, the clip as read (no replay names it)
        made_inf = seen.first_nonfinite if seen.first_nonfinite is seen.producer else None
        if block is not None and not localize:  # no replay to name it: the clip read, where an Inf was made there
            read = made_inf is not None and at_dtype_max(block)  # (a block far below the max clipped nothing)
        else:  # its replay names the Inf it clipped (else: its own path, as no replay says)
            read = block is not None and _clip_read(component, block, memory, made_inf)
        if read:
            inf, seen = made_inf, checks.Suspects(None, None, block)
        if seen.first_nonfinite is not None or not output_finite:
            received = _once(received)  # (a host read of the kept call's arguments: once a call)
            asked = (memory, full, leaf, received, unwatched, localize, site, fraction, step)
            source, replay = _nonfinite(component, seen, readings, *asked)
    except Exception as error:  # (the caller's nonfinite guard records it)
        failed["nonfinite"] = error
    try:
        near, between = seen.overflow, None
        if near is None and full:  # what a replay names (overflow)
            near, between = overflow_between(readings, fraction) or (None, None)
        if near is not None:
            clean = seen.first_nonfinite is None and output_finite  # else the NaN/Inf is localised above
            overflow = _overflow(component, near, between, memory, full, leaf, clean, localize, inf)
            overflow = overflow if inf is None or overflow.clipped is not None else replace(overflow, inf=inf)
    except Exception as error:  # (the caller's overflow_risk guard records it)
        failed["overflow_risk"] = error
    return Decision(None, source, replay, overflow, failed)


ALREADY_REPORTED = "already reported"
"""How a component's NaN/Inf is found where the run named it before (a repeat: counted, not localised again)."""

UNLOCALISED = "sentinel (block level; localize is off, the call was not kept or its replay failed)"
"""How a block's NaN/Inf is named where no replay named the module inside it."""

CLIP_UNREPLAYED = "sentinel, its block's clip read in the call (the call was not kept or its replay failed)"
CLIP_NOT_AGAIN = "sentinel, its block's clip read in the call (the block's replay made no Inf again)"
CLIP_UNLOCALISED = "sentinel, its block's clip read in the call (localize is off)"
"""How an Inf a block clipped is named as the sentinel read it (:meth:`ReplayMemory.overflow_shown`)."""


def unwatched_text(component: str, step: int | None) -> str:
    """How a NaN/Inf from the first call of a component replaced during the pipeline's call was
    found: from its output alone, the call unwatched (the next one is hooked and localised)."""
    return (
        f"output check ({component} was replaced during the call, at step {step}: its first call ran "
        "before it was hooked, so no module inside it was watched; its next call's would be localised)"
    )


def _nonfinite(component, seen, readings, memory, full, leaf, received, unwatched, localize, site, fraction, step):
    """``(source, None)``, or ``(None, the block to replay)`` for a NaN/Inf in the call. A leaf a sentinel
    read, given values near its dtype's max, is replayed all the same: the module that made them is named."""
    if component in memory.reported and not _again(component, seen, memory, received, site, step):
        return Source("", ALREADY_REPORTED, False), None  # counted, not localised again
    if not readings and received(component, site):  # no replay needed to see that
        return Source("", "output check: its inputs were already non-finite", True), None
    bad, producer = seen.first_nonfinite, seen.producer
    if bad is not None and producer is None:
        return Source("", "full probes" if full else "sentinel", True), None
    inputs_known = producer is not None and producer.input_value is not None
    # a block sentinel reads outputs only: no replay needed for inputs passed in non-finite (none: asked above)
    if readings and not full and not inputs_known and received(component, site):
        return Source("", "sentinel: its inputs were already non-finite", True), None
    if full and producer is not None:
        where, near = between_modules(readings, producer.module), near_max_source(readings, producer, fraction)
        return Source(producer.module, "full probes", False, where, near, producer.dtype), None
    if inputs_known and leaf(component, producer.module):  # (given near-max values: who made them? a replay says)
        if not (localize and unwatched is None and (producer.input_dtype_max_fraction or 0.0) >= fraction):
            return Source(producer.module, "sentinel (a leaf module)", False, dtype=producer.dtype), None
    block, dtype = (producer.module, producer.dtype) if producer is not None else (site, None)
    if unwatched is not None:
        return Source(block, unwatched, False, dtype=dtype), None
    if localize:
        return None, block
    return Source(block, UNLOCALISED, False, dtype=dtype), None


def _once(received: Callable[[str, str], bool]) -> Callable[[str, str], bool]:
    """``received`` asked once a call: its answer kept for the call's later questions."""
    answers: dict[tuple[str, str], bool] = {}

    def asked(component: str, site: str) -> bool:
        if (component, site) not in answers:
            answers[(component, site)] = received(component, site)
        return answers[(component, site)]

    return asked


def _again(component, seen, memory, received, site, step) -> bool:
    """Whether a component whose NaN/Inf this run named made one again from finite arguments where it may
    be another origin: first seen at another reading's module, or after a clean call of it (a step after the
    user's callback cleaned the latents, FreeInit's next pass), or where it has two entries and no reading says
    whose this one is (A, B, then A: counted at A's). A NaN/Inf passed in (a host read, asked only then) and one
    in each call since are repeats: counted, not localised again (as are the calls right after one placed at an
    entry, :attr:`ReplayMemory.placed`, and any once the run's ``debug_timeout`` of replays is spent)."""
    producer, last = seen.producer, memory.last_step.get(component)
    moved = producer is not None and producer.module not in memory.made_in.get(component, ())
    unsure = producer is None and len(memory.entries.get(component, ())) > 1 and component not in memory.placed
    unsure = unsure and memory.seconds < memory.timeout
    seen_before = step is not None and component in memory.last_step
    resumed = seen_before and (last is None or step not in (last, last + 1))
    return (moved or unsure or resumed) and not received(component, site)


def _clip_read(component: str, block: ModuleReading, memory: ReplayMemory, inf: ModuleReading | None) -> bool:
    """Whether :func:`_overflow` reads the clip of ``block`` (clean, localising): this run holds it, replays the
    block now (not passed in nor tried this run, not localised before unless at the max, replays' time left), or
    tried its replay this run and the sentinel read the Inf made inside it (``inf``: the clip as read, again)."""
    key = (component, block.module)
    if key in memory.passed_in:
        return False
    if key in memory.tried:  # (a second call of it in a run: T5 under true CFG)
        return inf is not None
    at_max = at_dtype_max(block) and key not in memory.replayed_at_max
    again = (key not in memory.overflow_where or at_max) and memory.seconds < memory.timeout
    return key in memory.clipped or again


AT_MAX = 1000.0
"""How far below its dtype's largest value a block's output is still read as at the max: a clip's (T5 clamps a
float16 stream holding an Inf to ``finfo.max - 1000``); for a dtype whose largest is not far beyond it (fp8 e4m3:
448), only the largest itself."""


def at_dtype_max(reading: ModuleReading) -> bool:
    """Whether ``reading``'s finite output reached its dtype's largest value, within :data:`AT_MAX` (a clip's).

    >>> at_dtype_max(ModuleReading("block.0", 0, "float16", None, 64512.0, "float16"))  # T5's 65504 - 1000
    True
    >>> at_dtype_max(ModuleReading("block.0", 0, "float16", None, 64000.0, "float16"))
    False
    >>> at_dtype_max(ModuleReading("block.0", 0, "float8_e4m3fn", None, 230.0, "float8_e4m3fn"))  # (max 448)
    False
    """
    largest = dtype_max(getattr(torch, reading.dtype)) if reading.dtype and reading.output_finite else None
    if largest is None:
        return False
    near = largest - AT_MAX if largest > 32 * AT_MAX else largest  # (e4m3's max is 448: no margin)
    return (reading.output_absmax or 0.0) >= near


def _overflow(component, reading, between, memory, full, leaf, clean, localize, inf=None) -> Overflow:
    """What to do of the near-overflow ``reading``: named as read (full probes, a leaf), else by its block's
    replay, once for the debugger's life; once a run again at the max (:func:`at_dtype_max`; ``clean``: no NaN/Inf).
    A block whose replay could not run this run, read clipping the Inf ``inf`` made inside it, is that clip as read:
    its near-max value the clip's consequence, no warning of its own."""
    if full or leaf(component, reading.module):
        return Overflow(reading, between=between)
    key = (component, reading.module)
    if key in memory.passed_in:
        return Overflow(reading, key, skip=True)
    if key in memory.clipped and clean:
        clip, count = memory.clipped[key]
        return Overflow(reading, key, clipped=clip, replayed=count)
    if inf is not None and (key in memory.tried or not localize):
        how = CLIP_UNREPLAYED if localize else CLIP_UNLOCALISED
        return Overflow(reading, key, clipped=Clip(inf, reading.module, reading.output_absmax), how=how)
    at_max = clean and at_dtype_max(reading) and key not in memory.replayed_at_max
    if (key not in memory.overflow_where or at_max) and key not in memory.tried and localize:
        return Overflow(reading, key, clean, replay=reading.module)
    return memory.overflow_known(reading, key)


# -- where inside a module: a replay's readings (or a call's, read with full probes) ------------


def between_modules(replayed: list[ModuleReading], producer: str) -> dict[str, str]:
    """Where inside ``producer`` (a module of a replay, the component itself: ``""``) that made a
    NaN/Inf from finite inputs its own code made it, when no module inside it did: ``{"after": the
    last module inside it that returned before, "before": the outermost module inside it first given
    the NaN/Inf}`` (a Flux ControlNet's residual, added to the stream between two blocks in the
    transformer's forward, overflowing there); ``before`` alone when that module was the first to
    run (made before its modules), ``after`` alone (the last module to return) when none was given
    it (made where no module took it: after them); empty for a leaf."""
    found = _between(replayed, producer, lambda r: not r.input_finite)
    if found is None:
        prefix = producer + "." if producer else ""
        last = next((r for r in reversed(replayed) if r.module != producer and r.module.startswith(prefix)), None)
        return {"after": last.module} if last is not None else {}
    after, before = found
    return {"after": after.module, "before": before.module} if after is not None else {"before": before.module}


def overflow_between(replayed: list[ModuleReading], fraction: float) -> tuple[ModuleReading, dict[str, str]] | None:
    """Where a replayed component's own forward built near-overflow values between its modules, when
    every module took them in with its inputs (:func:`~..checks.overflow_producer` finds none): a Flux
    ControlNet's residuals, each below ``fraction``, added to the transformer's stream block after
    block. ``(a reading of the component, "", whose output is the values as the first module was given
    them, {"after": the module that returned before it, below fraction, "before": that module})``;
    None when they were given at the dtype's max or beyond (a fill: T5's additive attention mask in
    float16, the call's own argument), the module before was already at ``fraction``, or a module made
    them (or none reached it): the same answer for a replay's readings and a call's read with full probes."""
    if checks.overflow_producer(replayed, fraction) is not None or not checks.overflow_candidates(replayed, fraction):
        return None
    found = _between(replayed, "", lambda r: (r.input_dtype_max_fraction or 0.0) >= fraction)
    if found is None or found[0] is None:  # none given them, or the first module to run was: passed in
        return None
    after, before = found
    if (after.dtype_max_fraction or 0.0) >= fraction or not before.input_dtype_max_fraction < 1.0:
        return None
    grown = ModuleReading("", 0, before.dtype, after.output_value, before.input_value, before.input_dtype)
    return grown, {"after": after.module, "before": before.module}


def _between(replayed: list[ModuleReading], producer: str, given) -> tuple[ModuleReading | None, ModuleReading] | None:
    """``(the last module inside producer that returned before the first one given what ``given``
    tests (None: none did), the outermost module inside producer so given)``, or None when none was.
    Readings come in the order the modules returned (a block after its modules)."""
    prefix = producer + "." if producer else ""
    inside = [r for r in replayed if r.module != producer and r.module.startswith(prefix)]
    first = next((i for i, r in enumerate(inside) if given(r)), None)
    if first is None:
        return None
    taken = {r.module: r for r in reversed(inside[first:]) if given(r)}  # (each module's first such call)
    parts, depth = inside[first].module.split("."), len(producer.split(".")) if producer else 0
    ancestors = (".".join(parts[:n]) for n in range(depth + 1, len(parts) + 1))
    before = next(name for name in ancestors if name in taken)  # (the module itself at the latest)
    after = next((r for r in reversed(inside[:first]) if not r.module.startswith(before + ".")), None)
    return after, taken[before]


class Clip(NamedTuple):
    """An Inf a block clipped (:func:`clipped_producer`)."""

    producer: ModuleReading
    """The reading of the module whose output held the Inf, made from finite inputs."""
    block: str
    """The module that clipped it (its output finite again)."""
    value: float | None
    """What the block clipped it to, its output's abs-max as read (None: not read): Flux's blocks clip a float16
    stream to 65504, T5's to ``finfo.max - 1000`` (64504, stored as float16's 64512)."""

    def details(self) -> dict:
        """What the ``nonfinite`` anomaly at the producer says of the clip."""
        dtype = self.producer.dtype
        largest = dtype_max(getattr(torch, dtype)) if dtype else None
        return {"clipped_in": self.block, "dtype": dtype, "dtype_max": largest, "clipped_to": self.value}


def clipped_producer(replayed: list[ModuleReading], block: str) -> Clip | None:
    """``(producer, clipping block, the value it clipped to)``: the first module in a replay (of ``block``'s
    call, whose output was finite) whose output held Inf (no NaN: a clip keeps a NaN) from finite inputs, its
    innermost enclosing module whose output was finite again (the one that clipped it: Flux's fp16 blocks
    clip to +-65504) and that module's output abs-max; None when no module made an Inf. A half-precision
    reading's value is its abs-max: Inf exactly for an Inf without a NaN. An enclosing module is judged by its call
    that ran the producer, its first reading after it (readings come in the order modules returned):
    Helios calls its transformer twice a step, and a block finite in the first call did not clip the
    Inf its second call returned."""
    made = (r.input_finite and r.output_value is not None and math.isinf(r.output_value) for r in replayed)
    at = next((i for i, inf in enumerate(made) if inf), None)
    if at is None:
        return None
    producer = replayed[at]
    returned: dict[str, ModuleReading] = {}  # each module's first return after the producer: the call around it
    for r in replayed[at + 1 :]:
        returned.setdefault(r.module, r)
    parts = producer.module.split(".")
    enclosing = (".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1))
    clipped = next((returned[n] for n in enclosing if n in returned and returned[n].output_finite), None)
    return Clip(producer, block, None) if clipped is None else Clip(producer, clipped.module, clipped.output_absmax)


def clipping_block(readings: list[ModuleReading], fraction: float) -> ModuleReading | None:
    """A sentinel's reading of the block that clipped a residual projection's Inf, the two read in one call (T5's
    float16 clamp to 64512 under autocast): a finite reading at ``fraction`` of its dtype's max or beyond enclosing
    every non-finite one, each an Inf (a clip keeps a NaN); None otherwise. Its near-max value is the clip's
    consequence: the block's replay names the Inf's module (:func:`clipped_producer`), one error, no warning."""
    bad = [r for r in readings if not r.output_finite]
    inf = bool(bad) and all(r.output_value is not None and math.isinf(r.output_value) for r in bad)
    near = (r for r in readings if inf and r.output_finite and (r.dtype_max_fraction or 0.0) >= fraction)
    return next((r for r in near if all(b.module.startswith(r.module + ".") for b in bad)), None)


def nonfinite_replayed(
    replayed: list[ModuleReading], fraction: float
) -> tuple[ModuleReading | None, dict[str, str], tuple[ModuleReading, ModuleReading] | None] | None:
    """What the replay with full probes of a call whose output held a NaN/Inf shows: ``(module's reading, where
    inside it, what made the near-max values it overflowed on)``, the first module that made it from
    finite inputs (:func:`between_modules`; :func:`~.near_max.near_max_source` at ``fraction`` of the dtype's max:
    the same diagnosis as full probes read in the call); ``(None, {}, None)`` where the first module to
    hold it was given it (the call's inputs did); None where no module held one (the replay did not make
    it again)."""
    producer = checks.find_producer(replayed)
    if producer is not None:
        near = near_max_source(replayed, producer, fraction)
        return producer, between_modules(replayed, producer.module), near
    return (None, {}, None) if checks.first_nonfinite(replayed) is not None else None


@dataclass(frozen=True)
class OverflowReplayed:
    """What the replay with full probes of a block whose output came near its dtype's max shows
    (:func:`overflow_replayed`): one of ``clipped``, ``passed_in`` or ``made`` (None: the replay named none)."""

    clipped: Clip | None = None
    """A module made an Inf the block clipped to the max."""
    passed_in: bool = False
    """Every module took the near-max values in with its inputs: no module made an overflow."""
    made: ModuleReading | None = None
    """The module that made them; a reading of the component (module ``""``) where its own forward built
    them between its modules (``between``: :func:`overflow_between`)."""
    between: dict[str, str] | None = None


def overflow_replayed(
    replayed: list[ModuleReading], block: str, fraction: float, clean: bool, compiled: bool = False
) -> OverflowReplayed:
    """What the replay of ``block``'s call (``replayed``: its readings) shows of its near-overflow:
    an Inf the block clipped (looked for where the call's readings showed no NaN/Inf, ``clean``),
    else the module that made the values, as full probes would name it. Near-max values that every
    module took in with its inputs were brought by the call's own arguments (T5 in transformers 4.47
    adds the additive attention mask, float16's lowest value where a prompt is padded, into the
    position bias its blocks return): no module made an overflow, unless the component's own forward
    built them between its modules. ``compiled``: the call was a compiled component's, its eager replay not the
    values it computed (a hook the compiled code skipped, rounding apart): passed in is no module named (its output's
    warning, every call, no replay again), not the call's arguments' (their run's calls skipped, each run replayed)."""
    clipped = clipped_producer(replayed, block) if clean else None
    if clipped is not None:
        return OverflowReplayed(clipped=clipped)
    if checks.overflow_candidates(replayed, fraction) and checks.overflow_producer(replayed, fraction) is None:
        grown = overflow_between(replayed, fraction)
        if grown is None:
            return OverflowReplayed(passed_in=not compiled)
        return OverflowReplayed(made=grown[0], between=grown[1])
    return OverflowReplayed(made=checks.suspects(replayed, fraction).overflow)
