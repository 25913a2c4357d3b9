"""Why did it break: the origin call replayed with one factor changed at a time.

From a repro bundle and the live component (:func:`explain_bundle`), the call that made the first
NaN/Inf is replayed as it was, then once per :func:`~diffusion_debug.diffusion.replay.factors.factors_for`
factor. Each replay says whether the output is finite, its largest finite |x| against the dtype's
largest value, and its time; :func:`verdict` names the smallest change that makes it finite, or
says that none does and which weights or inputs hold the NaN/Inf.

Every replay is isolated: one that changes the module runs on a copy, one that does not runs the
live module under ``torch.no_grad``, a forked RNG and its diffusers hook state put back after.

Limits: a replay re-runs one component call, not the pipeline: a fault that needs an earlier step
(a cache filled by the step before) shows only as far as the cache it replays from holds it:
``report.why()`` replays from the caching hooks' state as the bundled call began (the live debugger keeps
it; its tensors beyond ``KEPT_BYTES`` by weak reference), a bundle alone from the live cache (reset at a
call's end: a FasterCache that cannot take the call is replayed without, saying so). A replay of the live
compiled component runs the user's compiled graphs where their guards pass and eagerly elsewhere (its caching
hooks' callbacks or links swapped for the replay fail them): it compiles nothing, since a graph it added
counted toward the user's recompile limit (not before torch 2.6). A row's copy (caching off, another dtype)
runs eagerly, its note says so: compiled, it ran the user's own functions and its graphs were added to their
cache (a ``torch.compile`` wrapper's FasterCache ``new_forward`` reached its limit, and the user's next call
compiled again). A copy shares the user's
own forward hooks with the live module (a function is not copied): a hook that counts calls
counts the replays too.

Long because a why is one path read together: the call replayed as it was and per factor, the
verdict, a bundle's caches and timestep made replayable, and the files it writes.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ...config import DebugConfig
from ...probes import buffers_kept
from ...record import dumps, write_atomic
from ...stats import dtype_max, dtype_name, tensors_in
from ...stats.quantized import dequantized, is_quantized
from ..checks import find_producer
from ..components.autocast import autocast_as
from ..components.cache_hooks import Placement, hook_state_kept, lost_values, placement_kept
from ..components.cache_timestep import timestep_kept
from ..components.compiled import cached_graphs_only, eager, eager_module, replay_readings
from .copies import context_from_fields, copy_note, hook_groups, hooks_passed, isolated_copy
from .factors import (
    Factor,
    OriginCall,
    Variant,
    eager_factor,
    entered,
    factors_for,
    nonfinite_inputs,
    parameter_dtype,
    target,
    variant_note,
)
from .near_max import near_max_maker


@dataclass
class Replay:
    """One row of the table."""

    factor: str
    change: str
    finite: bool | None
    """None: the replay raised (``error``), or it cannot answer without compiling (``note``: a copy of a compiled
    component whose fault its eager code does not make, :func:`unanswered_eagerly`)."""
    max_abs: float | None = None
    """Largest finite |x| of the output."""
    dtype: str | None = None
    dtype_max: float | None = None
    time_s: float = 0.0
    rank: int = -1
    note: str = ""
    error: str = ""


@dataclass
class WhyResult:
    component: str
    module: str | None
    """The producer named by the as-is replay (full probes), None when none was named; where it made the
    NaN/Inf from finite values near the dtype's max, the module that made those
    (:func:`~.near_max.near_max_maker`), as the run names it."""
    step: int | None
    baseline: Replay
    replays: list[Replay]
    verdict: str
    fix: str | None = None
    """The factor of the smallest fix, None when no setting fixes it."""
    weights: str | None = None
    """The first module whose own weights hold NaN/Inf."""
    inputs: list[str] = field(default_factory=list)
    """The call's floating arguments that hold NaN/Inf."""
    note: str = ""
    """What the replays could not reproduce of the call ("" when nothing): one sentence."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """The table as Markdown, the as-is replay first."""
        lines = ["| factor | finite | max abs / dtype max | time (s) | note |", "|---|---|---|---|---|"]
        for row in [self.baseline, *self.replays]:
            unknown = "error" if row.error else "unanswered"
            finite = unknown if row.finite is None else ("yes" if row.finite else "no")
            peak = "-" if row.max_abs is None else f"{row.max_abs:.4g} / {row.dtype_max:.4g} ({row.dtype})"
            note = row.error or row.note
            lines.append(f"| {row.factor} | {finite} | {peak} | {row.time_s:.3f} | {note} |")
        return "\n".join(lines)

    def markdown(self) -> str:
        where = f"{self.component} {self.module or ''}".strip()
        where += f", step {self.step}" if self.step is not None else ""
        note = f"\n{self.note}\n" if self.note else ""
        return f"# why: {where}\n\n{self.table()}\n\n{self.verdict}\n{note}"

    def __str__(self) -> str:
        """``print(report.why())``: the table and the verdict (:meth:`markdown`), not the fields."""
        return self.markdown()


def _measure(output: Any) -> tuple[bool, float | None, str | None]:
    """Whether every floating tensor of ``output`` is finite; the largest finite |x| and its dtype."""
    finite, peak, dtype = True, None, None
    for t in tensors_in(output):
        if not t.is_floating_point() or not t.numel():
            continue
        values = t.detach().float()
        ok = values.isfinite()
        finite = finite and bool(ok.all())
        if bool(ok.any()):
            value = float(values.abs().where(ok, 0.0).amax())
            if peak is None or value > peak:
                peak, dtype = value, dtype_name(t.dtype)
    return finite, peak, dtype


def run_variant(call: OriginCall, variant: Variant, factor: str, change: str, rank: int = -1) -> Replay:
    module = target(variant.module, call.prefix)
    kept = hook_state_kept(eager_module(variant.module), call.context)  # the live hooks' state, or the copy's
    try:
        devices = [d.index or 0 for d in {p.device for p in module.parameters()} if d.type == "cuda"]
        with (
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            kept,
            buffers_kept(module),
            # the live module's: only the user's cached graphs; a copy's: eagerly (its graphs would be the user's)
            cached_graphs_only() if variant.live else eager(module),
            entered(variant.contexts),  # (inside: the eager row's force_eager holds)
            autocast_as(call.autocast if variant.autocast is None else variant.autocast, outside=True),  # as it ran
        ):
            start = time.perf_counter()
            output = module(*variant.args, **variant.kwargs)
            if devices:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
    except Exception as error:  # a factor the model refuses is a row, not a failed why
        return Replay(factor, change, None, rank=rank, error=f"{type(error).__name__}: {error}"[:200])
    finite, peak, dtype = _measure(output)
    limit = dtype_max(getattr(torch, dtype)) if dtype else None
    return Replay(factor, change, finite, peak, dtype, limit, round(elapsed, 4), rank, variant_note(call, variant))


def _replay_factor(call: OriginCall, factor: Factor) -> Replay:
    change = factor.change.replace("{component}", call.component)  # the row names the component too
    try:
        variant = factor.build(call)
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"[:200]
        return Replay(factor.name, change, None, rank=factor.rank, error=reason)
    return run_variant(call, variant, factor.name, change, factor.rank)


def module_with_nonfinite_weights(module: nn.Module, first: str | None = None) -> str | None:
    """The module whose own parameters or buffers hold NaN/Inf: ``first`` when it does, else the
    first in module order (None when every weight is finite). A quantized weight (torchao, GGUF,
    bitsandbytes, quanto) is read as the values its layer computes with, its scales included."""
    names = dict(module.named_modules())
    order = ([first] if first in names else []) + list(names)
    for name in order:
        owner = names[name]
        own = list(owner.parameters(recurse=False)) + list(owner.buffers(recurse=False))
        if any((t.is_floating_point() or is_quantized(t)) and not _all_finite(t, owner) for t in own):
            return name
    return None


def _all_finite(tensor: torch.Tensor, owner: nn.Module | None = None) -> bool:
    """Whether every value is finite; one-byte floats (fp8 storage of layerwise casting, which has
    no ``isfinite`` for most of its kinds) are widened first, quantized weights dequantized."""
    values = dequantized(tensor, owner).detach()  # (detach first would drop a bitsandbytes weight's scales)
    if not values.is_floating_point():  # (an 8-bit bitsandbytes weight whose scales are not found)
        return True
    return bool((values.float() if values.dtype.itemsize == 1 else values).isfinite().all())


def _storage_dtype(module: nn.Module, name: str | None) -> str | None:
    """How ``name``'s own weights are stored when not in the dtype it computes in: ``quantized, as
    <class>`` (torchao, GGUF, bitsandbytes, quanto), or the fp8 dtype of layerwise casting (None
    when they are stored as they compute)."""
    if name is None:
        return None
    own = list(module.get_submodule(name).parameters(recurse=False))
    quantized = [type(p).__name__ for p in own if is_quantized(p)]
    if quantized:
        return f"quantized, as {quantized[0]}"
    narrow = [p.dtype for p in own if p.dtype.itemsize == 1]
    return dtype_name(narrow[0]) if narrow else None


def verdict(
    component: str,
    baseline: Replay,
    replays: list[Replay],
    weights: str | None,
    inputs: list[str],
    storage: str | None = None,
    guider_hooks: dict[str, list[str]] | None = None,
) -> str:
    """One sentence: the smallest change that makes the call finite, or why none does (``storage``:
    the one-byte dtype the faulty weights are stored in, by diffusers' layerwise casting, or
    ``quantized, as <class>`` for quantized weights;
    ``guider_hooks``: the hooks a guider placed for the call only that the replay ran without)."""
    if baseline.finite is None:
        return (
            f"nothing can be concluded: the replay of {component} as it was failed ({baseline.error}), "
            "so no change can be judged against it"
        )
    if baseline.finite and guider_hooks:
        placed = "; ".join(f"{', '.join(hooks)} on {module or component}" for module, hooks in guider_hooks.items())
        return (
            f"the replay of {component} is finite: the call ran with hooks a guider placed on its layers for that "
            f"call only ({placed}), which a repro bundle cannot hold; call report.why() while the pipeline and "
            "its guider are at hand"
        )
    if baseline.finite:
        return (
            f"the replay of {component} is finite: the fault does not reproduce with these weights and inputs "
            "(a live run: pass the model it came from)"
        )
    fixes = [r for r in replays if r.finite and r.factor != "finite inputs"]
    if fixes:
        best = min(fixes, key=lambda r: r.rank)
        others = [r.factor for r in fixes if r is not best]
        also = f" (also finite: {', '.join(others)})" if others else ""
        change = best.change.replace("{component}", component)
        return f"smallest fix: {change} ({best.factor}) makes {component} finite{also}"
    with_finite_inputs = next((r for r in replays if r.factor == "finite inputs"), None)
    if inputs and (weights is None or (with_finite_inputs and with_finite_inputs.finite)):
        named = ", ".join(inputs)
        return f"no setting fixes it: the inputs {named} of {component} hold NaN/Inf (the module is not at fault)"
    if weights is not None:
        stored = (
            f" (stored {storage}: check the checkpoint or the quantization that made them)"
            if storage and storage.startswith("quantized")
            else f" (stored in {storage}: load them without layerwise casting and check them)"
            if storage
            else ""
        )
        return f"no setting fixes it: the weights of {component} {weights or '(its own)'} hold NaN/Inf{stored}"
    failed = [r for r in replays if r.finite is None and r.error]  # (a copy refused: GGUF's and quanto's weights)
    none = "no setting that could be replayed fixes it" if failed else "no setting fixes it"
    untried = f"; {', '.join(r.factor for r in failed)} could not be replayed ({failed[0].error})" if failed else ""
    if with_finite_inputs and with_finite_inputs.finite:
        return (
            f"{none}: these input values make {component} non-finite; "
            f"other finite values of the same statistics do not{untried}"
        )
    return f"{none}: {component} makes NaN/Inf from finite weights and inputs{untried}"


REPLAY_TIME_FACTOR = 10.0
"""The as-is replay may take this many times the run's own call of the component (its recorded
``mean_time_s``) before ``why`` stops: a bundle's inputs larger than the run's call made would
otherwise make each of the many replays that much longer."""
REPLAY_TIME_FLOOR_S = 2.0
"""The least time the as-is replay is given, whatever the run's call took (a first call warms up)."""


def explain(
    call: OriginCall,
    step: int | None = None,
    reference_s: float | None = None,
    placement: Placement = (),
    guider_hooks: dict[str, list[str]] | None = None,
    overflow_fraction: float = DebugConfig.overflow_fraction,
) -> WhyResult:
    """Replay ``call`` as it was, then with each applicable factor changed alone. ``reference_s``:
    the run's own time for one call of the component; an as-is replay slower than
    :data:`REPLAY_TIME_FACTOR` times it (at least :data:`REPLAY_TIME_FLOOR_S`) stops ``why`` with
    one DiffusionDebugError before any other replay. ``placement``: the hooks the component's
    registries held as the call began (a guider's layer hooks), held again through every replay (a
    copy is made with them); ``guider_hooks``: those the call had, by name, for the verdict of a
    replay without them (from a bundle alone); ``overflow_fraction``: the run's, for the near-max maker
    (:func:`~.near_max.near_max_maker`) named as the run named it."""
    with placement_kept(placement), _as_it_ran(call):
        return _explain(call, step, reference_s, None if placement else guider_hooks, overflow_fraction)


@contextlib.contextmanager
def _as_it_ran(call: OriginCall):
    """A VAE call the pipeline ran upcast (SDXL's ``force_upcast``: the fp16 VAE cast to float32 for
    the decode, then back) is replayed as it ran: the live VAE's half-precision weights and buffers
    in float32 while ``why`` runs (its latents are float32, the VAE half again), each then given back its
    own half-precision storage (the same tensors, data pointers and aliases as before; no cast that could
    fail in the ``finally``). The cost: that storage is held while ``why`` runs (the half-precision
    VAE's size; a float32 copy would peak as high). Limits: diffusers < 0.36's ``upcast_vae`` kept
    ``post_quant_conv``, ``conv_in`` and the mid block in float16, so the latents the decode was given are
    float16 and this does not apply: the decode is replayed all in float16 (its up blocks ran in
    float32); the live VAE is float32 meanwhile (a call from another thread sees it so)."""
    module = eager_module(call.module)
    given = next((t.dtype for t in tensors_in((call.args, call.kwargs)) if t.is_floating_point()), None)
    half = (torch.float16, torch.bfloat16)
    if not call.vae or given != torch.float32 or parameter_dtype(module) not in half:
        yield
        return
    tensors = [*module.parameters(), *module.buffers()]
    kept = [(t, t.data) for t in tensors if t.dtype in half and not is_quantized(t)]
    try:
        for t, data in kept:
            t.data = data.to(torch.float32)
        yield
    finally:
        for t, data in kept:
            t.data = data


def _explain(
    call: OriginCall,
    step: int | None,
    reference_s: float | None,
    guider_hooks: dict[str, list[str]] | None,
    fraction: float,
) -> WhyResult:
    baseline = run_variant(call, Variant(call.module, call.args, call.kwargs), "as it was", "nothing")
    if reference_s is not None:
        _check_time(call.component, baseline.time_s, reference_s)
    try:
        with hook_state_kept(eager_module(call.module), call.context), autocast_as(call.autocast, outside=True):
            readings = replay_readings(target(call.module, call.prefix), call.args, call.kwargs, call.prefix)
    except Exception:  # the as-is row shows the error; the table is still worth having
        readings = []
    producer = find_producer(readings)
    # made from another module's near-max values: that module, as the run named it (at the run's fraction)
    near = near_max_maker(readings, producer, fraction) if producer else None
    module = (near or producer).module if producer else None
    replays = unanswered_eagerly(call, baseline, [_replay_factor(call, factor) for factor in factors_for(call)])
    weights = module_with_nonfinite_weights(eager_module(call.module), module)
    inputs = nonfinite_inputs(call)
    storage = _storage_dtype(eager_module(call.module), weights)
    sentence = verdict(call.component, baseline, replays, weights, inputs, storage, guider_hooks)
    reproduced = baseline.finite is False  # None: the as-is replay failed, so nothing is a fix
    fixes = [r for r in replays if reproduced and r.finite and r.factor != "finite inputs"]
    fix = min(fixes, key=lambda r: r.rank).factor if fixes else None
    return WhyResult(call.component, module, step, baseline, replays, sentence, fix, weights, inputs)


UNANSWERED = (
    "unanswered: the fault is made by the compiled code alone (eager (not compiled) is finite) and this copy runs "
    "eagerly; compiling a copy would add graphs to the user's compiled cache"
)


def unanswered_eagerly(call: OriginCall, baseline: Replay, replays: list[Replay]) -> list[Replay]:
    """``replays`` with the rows of a compiled component's copies unanswered (finite None, the note
    :data:`UNANSWERED`) where the fault is the compiled code's alone: the as-is replay non-finite, the eager
    one finite. Each copy runs eagerly (:func:`~.copies.isolated_copy`), so its finite output tells nothing
    of the change ("would bfloat16 fix the compiled call?"), and answering would compile a copy into the
    user's cache. Where the eager code makes the fault too, a copy's row answers for the eager code, and its
    note says it ran eagerly."""
    copied = copy_note(call.module)
    eager_row = next((r for r in replays if r.factor == eager_factor().name), None)
    if not copied or baseline.finite is not False or eager_row is None or eager_row.finite is not True:
        return replays
    return [replace(r, finite=None, note=UNANSWERED) if copied in r.note else r for r in replays]


def _check_time(component: str, took_s: float, reference_s: float) -> None:
    from ...errors import DiffusionDebugError

    budget = max(REPLAY_TIME_FLOOR_S, REPLAY_TIME_FACTOR * reference_s)
    if took_s > budget:
        raise DiffusionDebugError(
            f"the bundle's {component} call took {took_s:.3g} s to replay, over {budget:.3g} s "
            f"({REPLAY_TIME_FACTOR:g}x the run's own call, {reference_s:.3g} s): its inputs are larger than "
            "the run's call made, so why stopped before the factor replays."
        )


def explain_bundle(
    bundle_dir: str | os.PathLike,
    component: nn.Module,
    *,
    unhooked: dict[str, nn.Module] | None = None,
    reference_s: float | None = None,
    placement: Placement = (),
) -> WhyResult:
    """:func:`explain` on a saved repro bundle's call, with ``component`` (the live or loaded
    component the bundle came from: bundles hold no weights); ``unhooked``: see
    :attr:`~diffusion_debug.diffusion.replay.factors.OriginCall.unhooked`; ``placement``: the bundled
    call's hooks as it began, when the live pipeline is at hand (bundles hold no hooks). A ``call_prefix`` that
    names no submodule of ``component`` is one DiffusionDebugError, as ``replay`` says it."""
    from ...errors import DiffusionDebugError
    from .bundle import bundle_fraction, bundled_autocast, bundled_timestep, load_call, uncached_note

    meta, args, kwargs = load_call(bundle_dir, component)
    prefix = meta.get("call_prefix") or ""
    try:
        target(component, prefix)
    except AttributeError:  # e.g. "__class__.__init__": get_submodule refuses what is not a module
        raise DiffusionDebugError(
            f"meta.json field 'call_prefix' names {prefix[:80]!r}, which {type(component).__name__} does not have."
        ) from None
    vae = prefix in ("decoder", "encoder")
    context = context_from_fields(meta.get("cache_context"))
    named = meta.get("guider_hooks")  # a crafted file is data: names only
    named = named if isinstance(named, dict) else {}
    guider_hooks = {str(k): [str(h) for h in v] for k, v in named.items() if isinstance(v, list)}
    fraction = bundle_fraction(meta)
    with timestep_kept(eager_module(component), bundled_timestep(meta)) as replayable:  # the callbacks put back after
        with _uncached(component, placement) if not replayable else contextlib.nullcontext(component) as replayed:
            call = OriginCall(
                meta["component"], replayed, prefix, tuple(args), dict(kwargs), vae, context, dict(unhooked or {})
            )
            call.autocast = bundled_autocast(meta)  # (the user's `with torch.autocast` has closed since)
            result = explain(call, meta.get("step"), reference_s, placement, guider_hooks, fraction)
        failed = result.baseline.error if replayable and result.baseline.finite is None else ""
        if failed and "caching" in hook_groups(eager_module(component)):
            # a live cache that cannot take this call (FasterCache's, reset at the call's end): without it
            with _uncached(component, placement) as replayed:
                uncached = replace(call, module=replayed)
                result = explain(uncached, meta.get("step"), reference_s, placement, guider_hooks, fraction)
            result.note = uncached_note(meta["component"], failed)
    if not replayable:
        result.note = uncached_note(meta["component"])
    if replayed is not component and (eagerly := copy_note(component)):  # (_uncached's copy: never compiled)
        result.note += f"; it was replayed on a copy without them: {eagerly}"
    return result


@contextlib.contextmanager
def _uncached(component: nn.Module, placement: Placement) -> Iterator[nn.Module]:
    """``component`` without its caching hooks for the block: passed through in place (:func:`~.copies.hooks_passed`;
    each row's copy leaves them off), never a copy held beside the rows' own (a 12B transformer's weights three
    times over); a copy without them where a guider's placement moves hooks (re-registered, they would act) or
    the hooks cannot be passed."""
    with hooks_passed(eager_module(component), "caching") if not placement else contextlib.nullcontext(False) as ok:
        yield component if ok else isolated_copy(component, drop_hooks="caching")


def write_why(run_dir: str | os.PathLike, result: WhyResult) -> Path:
    """``why.json`` and ``why.md`` in the run directory; returns the Markdown file."""
    run_dir = Path(run_dir)
    write_atomic(run_dir / "why.json", dumps(result.to_dict(), indent=1))
    write_atomic(run_dir / "why.md", result.markdown())
    return run_dir / "why.md"


def origin_bundle(anomalies: list[Any]) -> tuple[str, str] | None:
    """``(component, bundle path relative to the run)`` of the run's origin: the first anomaly
    with a repro bundle (the debugger saves one, for the run's first error)."""
    found = next((a for a in anomalies if isinstance(a.details.get("bundle"), str)), None)
    return (found.component, found.details["bundle"]) if found else None


def bundle_in_run(run_dir: str | os.PathLike, bundle: str) -> Path:
    """The folder of a bundle the run names (``bundles/<name>``), checked to lie inside the run
    directory: a run directory is self-contained, so an absolute path, a ``..`` or a symlink that
    leads out of it (to its folder or its files) is one DiffusionDebugError, and nothing is read."""
    from ...errors import DiffusionDebugError

    refused = DiffusionDebugError(
        f"the run's repro bundle {bundle[:200]!r} is outside the run directory: "
        "a run directory is self-contained, so why reads no bundle from elsewhere."
    )
    path = Path(bundle)
    if path.is_absolute() or ".." in path.parts:
        raise refused
    folder = Path(run_dir) / path
    try:
        root = Path(run_dir).resolve()
        read = (folder, folder / "meta.json", folder / "inputs.safetensors")
        if not all(p.resolve().is_relative_to(root) for p in read):
            raise refused
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, a symlink loop
        raise refused from None
    return folder


def explain_run(
    run_dir: str | os.PathLike,
    anomalies: list[Any],
    pipe: Any,
    unhooked: dict[str, nn.Module] | None = None,
    reference_s: float | None = None,
    placement: Placement = (),
    raised_states: dict | None = None,
    began_states: dict | None = None,
) -> WhyResult:
    """:func:`explain_bundle` on the run's origin with the pipeline's component; writes
    ``why.json`` and ``why.md`` into ``run_dir``. The bundle must lie inside ``run_dir``
    (:func:`bundle_in_run`); ``reference_s`` bounds the replays (:func:`explain`); ``placement``:
    the origin call's hooks as it began (the live debugger's, :func:`explain`); ``raised_states``: the
    caches a call ended by policy ``raise`` left, by component (reset since, as the call's end would);
    ``began_states``: the bundled call's hooks' state as it began, by component (the live debugger's): the
    replays run from it, that call as it ran (from the raised call's state, where the began one holds none or
    lost a tensor it replaced: :func:`~..components.cache_hooks.hook_state_kept`), and the component's
    hooks are as before afterwards."""
    from ...errors import DiffusionDebugError
    from .bundle import lost_state_note

    origin = origin_bundle(anomalies)
    if origin is None:
        raise DiffusionDebugError(
            "why needs the repro bundle of the run's first NaN/Inf error; this run saved none "
            "(no error at a component call, repro_bundle is off, or the bundle could not be made: a debugger_error "
            "says why)."
        )
    name, bundle = origin
    component = getattr(pipe, name, None) if name.isidentifier() else None
    if not isinstance(component, nn.Module):
        raise DiffusionDebugError(f"The pipeline has no component {name[:80]!r} to replay the bundle on.")
    folder = bundle_in_run(run_dir, bundle)
    left, began = ((states or {}).get(component) for states in (raised_states, began_states))
    lost = lost_values(began if began is not None else left)
    with hook_state_kept(component, None, left), hook_state_kept(component, None, began):
        result = explain_bundle(folder, component, unhooked=unhooked, reference_s=reference_s, placement=placement)
    if lost:
        result.note = "; ".join(filter(None, [result.note, lost_state_note(name, lost)]))
    write_why(run_dir, result)
    if (Path(run_dir) / "summary.json").is_file():  # a saved run: its report links to the table
        from ...report import write_html

        write_html(run_dir)
    return result
