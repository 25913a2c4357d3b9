"""Two saved pipeline runs compared as far as their records allow (``diffusion-debug diff``): the
module readings of every component call (``modules.jsonl``, level ``extreme``), else the step rows;
the first divergence beyond the dtype's tolerance, made there or received, as a :class:`Comparison`.

In execution order: each component call's modules in the order they returned (a conv returns
before the resnet holding it), then the step's latents after ``scheduler.step``. A module whose
output drifts while its own inputs agreed made the drift; one whose inputs already differed
received it. Without module readings a step's denoiser output (its latent input agreed) or its
latents (the denoiser's output agreed: the scheduler) is the finest place the rows can name.

Limits: a reading is one number per tensor (a sum in fp32, an abs-max in fp16, bf16 and fp8), so
a change that keeps it is not seen, and an output that sums to about zero (a normalisation's)
reads as drifting far more than it does; runs in two dtypes are compared on their step rows only
(a sum and an abs-max are different measures). Nothing is replayed: two runs that drift apart only in
their inputs (another prompt) are "received" at the first call that took them. The first
pipeline call of each run is compared (``run --repeat`` records more).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...errors import DiffusionDebugError
from ...record import RunData, load_run, loads
from ...record.run_record import READINGS_FILE
from .comparison import Comparison, Divergence, StepDivergence
from .fingerprints import tolerance_for
from .pipelines import ranked_modules
from .replay import ModuleError, drifting_modules

STEP_STATS = ("mean", "std", "absmax", "l2")
"""What a step row keeps of a tensor, and what two rows are compared on."""
ROWS_ONLY = "step rows only: level extreme records each module"
TWO_DTYPES = "step rows only: a module's reading is a sum in fp32 and an abs-max in fp16, bf16 and fp8"


def _value(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)  # "nan", "inf", "-inf" as strict JSON keeps them
    except (TypeError, ValueError):
        return None


def scalar_error(a: Any, b: Any) -> float:
    """The relative gap between two recorded values (0.0 when equal or both missing; inf when one
    is missing or finite where the other is not).

    >>> scalar_error(100.0, 101.0), scalar_error("nan", "nan"), scalar_error(1.0, "inf")
    (0.009900990099009901, 0.0, inf)
    """
    x, y = _value(a), _value(b)
    if x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y)):
        return 0.0
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    return abs(x - y) / max(abs(x), abs(y), 1e-30)


def _stats_error(a: Any, b: Any) -> float:
    """Two step-row statistics of one tensor (``latents``, ``model_output``) compared."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return 0.0 if a == b else math.inf
    if a.get("shape") != b.get("shape"):
        return math.inf
    return max(scalar_error(a.get(k), b.get(k)) for k in STEP_STATS)


# -- the input: two run directories of one pipeline, checked before anything is compared ------------


def _run(path: Path, name: str) -> RunData:
    if not path.is_dir():
        raise DiffusionDebugError(f"{name} {str(path)!r} is not a run directory: no such directory.")
    run = load_run(path)
    kind = run.summary.get("kind")
    if kind != "diffusion":
        raise DiffusionDebugError(
            f"{name} {str(path)!r} is a {kind or 'unknown'} run; diff compares two pipeline runs (of `run`)."
        )
    return run


def first_call_steps(run: RunData) -> list[dict[str, Any]]:
    """The step rows of the run's first pipeline call."""
    rows = [r for r in run.steps if isinstance(r, dict) and isinstance(r.get("step"), int)]
    first = rows[0].get("run") if rows else None
    return [r for r in rows if r.get("run") == first]


def checked_runs(path_a: Path, path_b: Path) -> tuple[RunData, RunData]:
    """Both runs loaded, of one pipeline class and step count; else one sentence."""
    run_a, run_b = _run(Path(path_a), "RUN_A"), _run(Path(path_b), "RUN_B")
    pipes = [r.summary.get("pipeline") for r in (run_a, run_b)]
    if pipes[0] != pipes[1]:
        raise DiffusionDebugError(
            f"RUN_A ran {pipes[0] or 'an unnamed pipeline'} and RUN_B {pipes[1] or 'an unnamed pipeline'}: "
            "diff compares two runs of one pipeline."
        )
    counts = [len(first_call_steps(r)) for r in (run_a, run_b)]
    if counts[0] != counts[1]:
        raise DiffusionDebugError(
            f"RUN_A recorded {counts[0]} denoising steps and RUN_B {counts[1]}: diff compares runs of one step count."
        )
    return run_a, run_b


def _dtypes(run: RunData) -> list[torch.dtype]:
    found = []
    for component in (run.summary.get("components") or {}).values():
        name = component.get("dtype") if isinstance(component, dict) else None
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            found.append(dtype)
    return found


# -- the comparison ----------------------------------------------------------------------------------


def _calls(run: RunData) -> Iterator[dict[str, Any]]:
    """The run's first pipeline call's component calls from ``modules.jsonl``, one line at a time."""
    path = run.run_dir / READINGS_FILE
    first = None
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                call = loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut by a killed run
            if not isinstance(call, dict) or not isinstance(call.get("modules"), list):
                continue
            first = call.get("run") if first is None else first
            if call.get("run") != first:
                return
            yield call


def _module_errors(x: dict[str, Any], y: dict[str, Any]) -> list[ModuleError]:
    """Per module call, in the order they returned, as far as both calls ran the same modules."""
    found = []
    for a, b in zip(x["modules"], y["modules"]):
        if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 5) or a[:2] != b[:2]:
            break
        found.append(ModuleError(str(a[0]), scalar_error(a[3], b[3]), scalar_error(a[4], b[4])))
    return found


def _key(call: dict[str, Any]) -> tuple:
    return call.get("component"), call.get("site"), call.get("step")


class _Walk:
    """Both runs' records in execution order, stopped at the first divergence."""

    def __init__(self, run_a: RunData, run_b: RunData, tolerance: float):
        self.rows = list(zip(first_call_steps(run_a), first_call_steps(run_b)))
        self.tolerance = tolerance
        self.next_row = 0
        denoisers = [
            name
            for name, c in (run_a.summary.get("components") or {}).items()
            if isinstance(c, dict) and c.get("role") == "denoiser"
        ]
        self.denoiser = denoisers[0] if denoisers else "denoiser"
        self.modules: tuple = ()
        self.model_output = True
        self.rows_only = ROWS_ONLY
        """Whether a step row's denoiser output is compared (no module readings of the denoiser)."""

    def timestep(self, step: int | None) -> float | None:
        row = next((a for a, _ in self.rows if a.get("step") == step), None) if step is not None else None
        return _value(row.get("timestep")) if row else None

    def rows_until(self, step: float) -> Divergence | None:
        """The step rows before ``step`` (all: inf): a step's latents (with its denoiser output first,
        when no module readings stand for it) beyond the tolerance."""
        while self.next_row < len(self.rows) and self.rows[self.next_row][0]["step"] < step:
            a, b = self.rows[self.next_row]
            self.next_row += 1
            where, timestep = a["step"], _value(a.get("timestep"))
            error = _stats_error(a.get("model_output"), b.get("model_output")) if self.model_output else 0.0
            if error > self.tolerance:
                return Divergence(self.denoiser, "", where, timestep, error, True, cause=self.rows_only)
            error = _stats_error(a.get("latents"), b.get("latents"))
            if error > self.tolerance:
                return Divergence("scheduler", "", where, timestep, error, True)
        return None

    def call(self, x: dict[str, Any], y: dict[str, Any]) -> Divergence | None:
        component, site, step = _key(x)
        timestep = self.timestep(step)
        if _key(x) != _key(y):
            seen = f"{y.get('component')}" + (f".{y.get('site')}" if y.get("site") else "")
            return Divergence(str(component), "", step, timestep, math.inf, True, cause=f"RUN_B called {seen} here")
        errors = _module_errors(x, y)
        # the first module that drifts on agreeing inputs made it; every module after it received it
        # (nothing was replayed on equal inputs: a later module's input reading may miss the drift)
        drifting = drifting_modules(errors, self.tolerance)
        first_made = next((i for i, (_, here) in enumerate(drifting) if here), len(drifting))
        drifting = [(m, here and i == first_made) for i, (m, here) in enumerate(drifting)]
        if len(errors) < min(len(x["modules"]), len(y["modules"])) and not drifting:
            return Divergence(str(component), "", step, timestep, math.inf, True, cause="other modules ran")
        if not drifting:
            return None
        self.modules = ranked_modules(str(component), errors, drifting)
        made = next((m for m, here in drifting if here), None)
        if made is not None:
            return Divergence(str(component), made.module, step, timestep, made.output_error, True)
        first = drifting[0][0]
        cause = "its inputs differed while every earlier record agreed (a call argument, or a value not recorded)"
        return Divergence(str(component), "", step, timestep, first.output_error, False, cause=cause)


def compare_run_dirs(path_a: str | Path, path_b: str | Path) -> Comparison:
    """Where two saved runs of one pipeline (``diffusion-debug run`` or ``report.save()``) first
    drift apart beyond the tolerance of their dtypes, as far as their records allow."""
    run_a, run_b = checked_runs(Path(path_a), Path(path_b))
    dtypes_a, dtypes_b = _dtypes(run_a), _dtypes(run_b)
    tolerance = tolerance_for(*dtypes_a, *dtypes_b)
    names = tuple(
        str(min(d, key=lambda t: t.itemsize, default="float32")).removeprefix("torch.") for d in (dtypes_a, dtypes_b)
    )
    walk = _Walk(run_a, run_b, tolerance)
    steps = tuple(
        StepDivergence(a["step"], _value(a.get("timestep")), _stats_error(a.get("latents"), b.get("latents")))
        for a, b in walk.rows
    )
    readings = all((r.run_dir / READINGS_FILE).is_file() for r in (run_a, run_b))
    if readings and names[0] != names[1]:  # one run's readings are sums, the other's abs-maxes
        readings, walk.rows_only = False, TWO_DTYPES
    # the denoiser's output from the rows where no readings of it stand for it (compiled: unprobed)
    walk.model_output = not readings or not any(c.get("component") == walk.denoiser for c in _calls(run_a))
    found = None
    for x, y in zip(_calls(run_a), _calls(run_b)) if readings else ():
        step = x.get("step")
        # the steps before this call: none before the loop, every one for a call after it (the VAE)
        before = step if isinstance(step, int) else math.inf if walk.next_row else -1
        found = walk.rows_until(before) or walk.call(x, y)
        if found:
            break
    found = found or walk.rows_until(math.inf)
    source = "the first diverging call, as recorded" if readings else "no call: no module readings compared"
    return Comparison(found, steps, walk.modules if found else (), tolerance, names, modules_from=source)
