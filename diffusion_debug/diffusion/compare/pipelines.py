"""``compare_pipelines``: two setups of a pipeline, the same call and seed; the first component,
step and module where they drift apart, and whether it was made there or received.

At most three calls of each pipeline (here two of A; one of B, two where the diverging call runs
under diffusers' caching hooks) and one replayed component call of each. Only fingerprints are kept,
and the inputs of one component call (A's first diverging call, copied during A's second call) for the
replay on equal inputs, with each side's caching hooks' context and state and its pipeline's
``current_timestep`` (a ``current_timestep_callback`` reads it) as that call began (B's taken in its
second call): each side replays the call its own cache made.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ...core.instance_methods import MISSING
from ...errors import DiffusionDebugError
from ..components.inventory import watchable_kind
from .comparison import Comparison, Divergence, ModuleDivergence, StepDivergence
from .fingerprints import errors_of, tolerance_for
from .recording import SCHEDULER, Event, record_call
from .replay import ModuleError, drifting_modules, module_errors, replay

MODULES_SHOWN = 20


def _check(pipe_a: Any, pipe_b: Any, a: Any, b: Any, seed: Any, call_kwargs: dict) -> None:
    for name, pipe in (("pipe_a", pipe_a), ("pipe_b", pipe_b)):
        if watchable_kind(pipe) != "pipeline":
            raise DiffusionDebugError(
                f"compare_pipelines needs two diffusers DiffusionPipelines; {name} is a {type(pipe).__name__}."
            )
    for name, change in (("a", a), ("b", b)):
        if not (change is None or isinstance(change, dict) or callable(change)):
            raise DiffusionDebugError(
                f"compare_pipelines: {name}= takes a dict of call arguments or a callable that changes the "
                f"pipeline and returns its undo, not a {type(change).__name__}."
            )
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DiffusionDebugError(f"compare_pipelines: seed= takes an int, not a {type(seed).__name__}.")
    if "generator" in call_kwargs:
        raise DiffusionDebugError(
            "compare_pipelines makes a fresh generator from seed= for each call; leave generator= out."
        )


def _same(x: Any, y: Any) -> bool:
    if x is y:
        return True
    try:
        return bool(x == y)
    except Exception:  # a tensor of several elements, or an object that cannot say
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)


def _differing_arguments(a: Any, b: Any) -> list[str]:
    """The call arguments the two sides' dicts give differently (a callable change gives none)."""
    a, b = (x if isinstance(x, dict) else {} for x in (a, b))
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not _same(a[k], b[k]))


def _first_gap(events_a: list[Event], events_b: list[Event], tolerance: float) -> tuple[int, float] | None:
    for i, (x, y) in enumerate(zip(events_a, events_b)):
        if (x.kind, x.component, x.site) != (y.kind, y.component, y.site):
            return i, float("inf")
        error = errors_of(x.output, y.output)
        if error > tolerance:
            return i, error
    if len(events_a) != len(events_b):
        return min(len(events_a), len(events_b)), float("inf")
    return None


def _inputs_differ(x: Event, y: Event, tolerance: float) -> bool:
    if x.inputs.keys() != y.inputs.keys():
        return True
    return any(errors_of((f,), (y.inputs[name],)) > tolerance for name, f in x.inputs.items())


def _steps(events_a: list[Event], events_b: list[Event]) -> tuple[StepDivergence, ...]:
    pairs = zip([e for e in events_a if e.kind == "step"], [e for e in events_b if e.kind == "step"])
    return tuple(StepDivergence(x.step, x.timestep, errors_of(x.output, y.output)) for x, y in pairs)


def _added(m: ModuleDivergence) -> float:
    """The error a module added to what it received (0.0 when its inputs were already non-finite)."""
    return m.relative_error - m.input_error if math.isfinite(m.input_error) else 0.0


def _replayed(
    pipe_a: Any,
    pipe_b: Any,
    a: Any,
    b: Any,
    call_kwargs: dict,
    seed: int,
    index: int,
    x: Event,
    y: Event,
    tolerance: float,
) -> tuple[float | None, list, tuple[ModuleDivergence, ...], str]:
    """A's call ``index`` (event ``x``; ``y`` is B's) replayed on its own kept inputs by both sides: the output error
    given equal inputs, the drifting module calls (each with whether it made its drift), the
    modules ranked by the error each added, and the side ("A" or "B") whose second call did not reach
    that call again ("" when both did; then nothing is replayed: B's cache as the call began is unknown,
    and a cached call replayed outside its cache context fails in diffusers, which is not the cause)."""
    again = record_call(pipe_a, a, call_kwargs, seed, keep=index)
    if not _same_call(again, index, x):  # A's second call did not reach that call again (it is not deterministic)
        return None, [], (), "A"
    b_again = record_call(pipe_b, b, call_kwargs, seed, keep=index) if y.caches else None
    if b_again is not None and not _same_call(b_again, index, y):  # (an interrupted loop: the VAE's call there)
        return None, [], (), "B"
    hooks_b = b_again.kept_hooks if b_again is not None else (None, None)
    timestep_b = b_again.kept_timestep if b_again is not None else MISSING
    out_a, readings_a = replay(
        pipe_a, a, x.component, x.site, again.kept, x.dtypes, True, again.kept_hooks, again.kept_timestep
    )
    out_b, readings_b = replay(pipe_b, b, x.component, x.site, again.kept, y.dtypes, True, hooks_b, timestep_b)
    errors = module_errors(readings_a, readings_b)
    drifting = drifting_modules(errors, tolerance)
    return errors_of(out_a, out_b), drifting, ranked_modules(x.component, errors, drifting), ""


def _same_call(recording: Any, index: int, event: Event) -> bool:
    """Whether ``recording`` kept a call at ``index`` and it is ``event``'s (component, site and step)."""
    if recording.kept is None:
        return False
    kept = recording.events[index]
    return (kept.component, kept.site, kept.step) == (event.component, event.site, event.step)


def ranked_modules(component: str, errors: list[ModuleError], drifting: list) -> tuple[ModuleDivergence, ...]:
    """The modules whose output error exceeds their input error: those that made a drift first,
    then by the error each added (at most :data:`MODULES_SHOWN`)."""
    made = {m.module for m, here in drifting if here}
    ranked = sorted(
        (
            ModuleDivergence(component, m.module, m.output_error, m.input_error, m.module in made)
            for m in errors
            if m.output_error > m.input_error
        ),
        key=lambda m: (not m.made_here, -_added(m)),
    )
    return tuple(ranked[:MODULES_SHOWN])


def compare_pipelines(
    pipe_a: Any, pipe_b: Any, *, seed: int = 0, a: Any = None, b: Any = None, **call_kwargs: Any
) -> Comparison:
    """Call both pipelines with ``call_kwargs`` and a fresh ``torch.Generator().manual_seed(seed)``,
    and return where their outputs first drift apart beyond the dtype's tolerance.

    ``a`` / ``b``: a dict of call arguments for that side, or a callable ``change(pipe) -> undo``
    applied around that side's calls (so ``compare_pipelines(pipe, pipe, b=...)`` toggles a setting
    on one pipeline and leaves it as it was).
    """
    _check(pipe_a, pipe_b, a, b, seed, call_kwargs)
    rec_a = record_call(pipe_a, a, call_kwargs, seed)
    rec_b = record_call(pipe_b, b, call_kwargs, seed)
    names = tuple(
        str(min(r.dtypes, key=lambda d: d.itemsize, default="float32")).removeprefix("torch.") for r in (rec_a, rec_b)
    )
    tolerance = tolerance_for(*rec_a.dtypes, *rec_b.dtypes)
    steps = _steps(rec_a.events, rec_b.events)
    gap = _first_gap(rec_a.events, rec_b.events, tolerance)
    if gap is None:
        modules: tuple[ModuleDivergence, ...] = ()
        if names[0] != names[1]:  # equal within the looser dtype: still rank the modules by the error each adds
            first = next((i for i, e in enumerate(rec_a.events) if e.kind == "call" and e.step is not None), None)
            if first is not None:
                with contextlib.suppress(Exception):  # a ranking that cannot be made leaves the verdict as it is
                    modules = _replayed(
                        pipe_a,
                        pipe_b,
                        a,
                        b,
                        call_kwargs,
                        seed,
                        first,
                        rec_a.events[first],
                        rec_b.events[first],
                        tolerance,
                    )[2]
        return Comparison(None, steps, modules, tolerance, names)
    index, error = gap
    x = rec_a.events[index] if index < len(rec_a.events) else rec_b.events[index]
    y = rec_b.events[index] if index < len(rec_b.events) else x
    arguments = _differing_arguments(a, b)
    origin = ("input", ", ".join(arguments)) if arguments else (SCHEDULER, "")
    if (x.kind, x.component, x.site) != (y.kind, y.component, y.site) or x.kind == "step":
        # the latents a scheduler step made (its inputs agreed: every earlier event did), or a call
        # made in one setup and not the other (a cache skipping a component)
        component, module = origin if x.kind == "step" else (y.component, "")
        return Comparison(Divergence(component, module, x.step, x.timestep, error, True), steps, (), tolerance, names)

    if x.caches != y.caches:  # a cache on one side only: it changed this call (a replay cannot re-run its state)
        side, caches = ("B", y.caches) if y.caches else ("A", x.caches)
        cause = f"diffusers caching hook {', '.join(caches)} on {side} only"
        return Comparison(
            Divergence(x.component, "", x.step, x.timestep, error, True, cause=cause), steps, (), tolerance, names
        )
    try:
        replayed, drifting, modules, unreached = _replayed(
            pipe_a, pipe_b, a, b, call_kwargs, seed, index, x, y, tolerance
        )
    except Exception as exc:  # the replay of a component on kept inputs failed: say so, keep what was found
        cause = f"replay failed: {type(exc).__name__}: {exc}"[:300]
        return Comparison(
            Divergence(x.component, "", x.step, x.timestep, error, True, cause=cause), steps, (), tolerance, names
        )
    seen = x.component + (f".{x.site}" if x.site else "")
    if replayed is None or replayed > tolerance:  # made there: the first module that drifts on agreeing inputs
        first = next((m for m, made in drifting if made), None)
        module, error = (first.module, first.output_error) if first else ("", error)
        cause = f"{unreached}'s second call did not reach this call again: not deterministic" if unreached else ""
        divergence = Divergence(x.component, module, x.step, x.timestep, error, True, cause=cause)
    elif _inputs_differ(x, y, tolerance):
        # received: its inputs differed while every earlier component call agreed
        component, module = origin if arguments or x.step is not None else (seen, "")
        divergence = Divergence(component, module, x.step, x.timestep, error, component != seen, seen_in=seen)
    else:  # equal inputs, equal replays, different calls: the component's own state (a cache hook)
        divergence = Divergence(x.component, "", x.step, x.timestep, error, True)
    return Comparison(divergence, steps, modules, tolerance, names)
