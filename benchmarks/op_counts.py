"""Aten ops the debuggers add per denoising step and per training step, and the hooks torch runs
for a watched call: deterministic counts.

At real size on a GPU the pipeline is launch-bound, so every op the debugger adds costs wall time
(DESIGN.md's budget: at most 25 added ops per denoising step in default mode at SD1.5 topology in
fp16), and every hook host time. Ops are counted with ``diffusion_debug.op_count`` (a
TorchDispatchMode; views excluded); hooks as the package's functions that ``nn.Module``'s call
runs (:func:`hook_calls`).

Per step means the difference between a run of ``long`` and one of ``short`` steps, divided by
the step difference: what happens once per pipeline call (prompt encoding, VAE decode, static
checks, the report) cancels out.

Long because every count the op, hook and Python-call pins read (inference, a reused call,
training, a paced run's average) is here, over one counting and one per-step difference.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import tempfile
import types
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

import diffusion_debug
from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.diffusion.components.sentinel_pace import SENTINEL_EVERY, SENTINEL_PHASES
from diffusion_debug.op_count import added_ops, count_aten_ops
from diffusion_debug.training.step.detail import DETAIL_FIRST


def _count(run: Callable[[], Any]) -> Counter[str]:
    with count_aten_ops() as ops:
        run()
    return ops.counts


def _per_step(short: Counter[str], long: Counter[str], steps: int) -> Counter[str]:
    return Counter({op: (long[op] - short.get(op, 0)) / steps for op in long if long[op] != short.get(op, 0)})


def _region(pipe: Any, autocast: torch.dtype | None) -> Any:
    """The user's ``with torch.autocast(device, dtype=autocast)`` around each call (a region of its own: autocast's
    cache of cast weights is emptied as it closes, so no call finds the weights another one cast), or nothing."""
    return contextlib.nullcontext() if autocast is None else torch.autocast(pipe.device.type, dtype=autocast)


def inference_ops(
    pipe: Any,
    config: DebugConfig,
    *,
    short: int = 2,
    long: int = 6,
    first: int = 1,
    autocast: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Ops per denoising step of ``pipe`` plain and under a debugger with ``config``. ``first``: the steps of the
    uncounted first call (PixArt's default scheduler cannot run 1); ``autocast``: each call (and its debugger's
    attach) under ``torch.autocast`` to that dtype; ``kwargs``: the call's other arguments (a PixArt's size; its
    prompt in place of the default)."""
    kwargs.setdefault("prompt", "a photo of a cat")
    kwargs.setdefault("output_type", "np")

    def call(steps: int) -> Callable[[], Any]:
        def run() -> None:
            with _region(pipe, autocast):
                pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs)

        return run

    def watched(steps: int) -> Callable[[], Any]:
        debugger = DiffusionModelDebugger(pipe, config)

        def run() -> None:
            with _region(pipe, autocast), debugger:
                pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs)
            debugger.close()

        return run

    plain = _per_step(_count(call(short)), _count(call(long)), long - short)
    # the pipeline's first watched call reads its once-per-image components with full probes: made
    # first, uncounted, so that both counted calls take the later calls' path and only steps differ
    watched(first)()
    debugged = _per_step(_count(watched(short)), _count(watched(long)), long - short)
    added = added_ops(debugged, plain)
    return {
        "plain_ops_per_step": sum(plain.values()),
        "added_ops_per_step": sum(debugged.values()) - sum(plain.values()),
        "added_by_op": dict(added.most_common()),
    }


def run_average_ops(
    pipe: Any, config: DebugConfig, *, steps: int = 20, read: int = SENTINEL_EVERY, **kwargs: Any
) -> dict[str, Any]:
    """Added ops a denoising step averaged over a ``steps``-step run, which a paced sentinel reads at its first
    steps (0, 1) and every ``SENTINEL_EVERY``-th: steps 2 to ``steps - 1`` counted as :func:`inference_ops` counts
    them (a ``steps``-step call against a 2-step one), steps 0 and 1 each as step ``read`` (read too: a
    ``read + 1``-step call against a ``read``-step one, so that the once-a-call ops cancel out). ``kwargs``:
    :func:`inference_ops`'."""
    later = inference_ops(pipe, config, short=2, long=steps, **kwargs)
    step = inference_ops(pipe, config, short=read, long=read + 1, **kwargs)
    reads = 2 * step["added_ops_per_step"]
    return {
        "added_ops_per_step": (later["added_ops_per_step"] * (steps - 2) + reads) / steps,
        "read_step_ops": step["added_ops_per_step"],
        "later_steps_ops": later["added_ops_per_step"],
        "read_step_by_op": step["added_by_op"],
    }


@contextlib.contextmanager
def held_bytes(limit: int) -> Iterator[None]:
    """The probes made inside flush what they hold at ``limit`` bytes (:class:`~diffusion_debug.probes.fused.
    HeldAbsmax`; :data:`~diffusion_debug.probes.fused.HELD_BYTES` scaled as a tiny model's tensors are to the real
    one's: the real model's flushes a step, which a tiny one reaches only so)."""
    from diffusion_debug.probes import readings

    made = readings.HeldAbsmax
    readings.HeldAbsmax = functools.partial(made, limit)
    try:
        yield
    finally:
        readings.HeldAbsmax = made


def call_ops(pipe: Any, config: DebugConfig, *, steps: int = 1) -> dict[str, Any]:
    """Aten ops a reused debugger adds to a ``steps``-step call of ``pipe`` (``output_type="pil"``,
    the pipeline's default) once its first call is behind it: what 1-step and served pipelines pay
    on every request, beside :func:`inference_ops`' per-step figure."""
    debugger = DiffusionModelDebugger(pipe, config)

    def plain() -> None:
        pipe("a photo of a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0))

    def watched() -> None:
        with debugger:
            plain()

    try:
        watched()  # the first call (full probes on the components called once per image)
        debugged, alone = _count(watched), _count(plain)
    finally:
        debugger.close()
    return {
        "added_ops_per_call": sum(debugged.values()) - sum(alone.values()),
        "added_by_op": dict(added_ops(debugged, alone).most_common(8)),
    }


def qualname(code: Any) -> str:
    """``code``'s qualified name: its ``co_qualname`` (3.11+); on 3.10, which has none, that of the package's
    function made from it, found once among the loaded modules of ``diffusion_debug`` (a nested function's by
    its maker's code: ``Probe._reader.<locals>.hook``), else its ``co_name``."""
    found = getattr(code, "co_qualname", None)
    if found is None:
        found = _QUALNAMES.get(code)
        if found is None and len(sys.modules) != _QUALNAMES.get("modules"):  # (a module imported since)
            _QUALNAMES.clear()
            _QUALNAMES.update(_package_qualnames(), modules=len(sys.modules))
            found = _QUALNAMES.get(code)
    return found or code.co_name


_QUALNAMES: dict[Any, Any] = {}


def _package_qualnames() -> dict[Any, str]:
    """The qualified names of the code objects of ``diffusion_debug``'s loaded modules (Python 3.10)."""
    found: dict[Any, str] = {}
    functions, seen = [], set()
    todo = [module for name, module in list(sys.modules.items()) if name.split(".")[0] == "diffusion_debug"]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        for value in list(vars(item).values()):
            value = getattr(value, "__func__", value)  # (a staticmethod's or classmethod's function)
            if isinstance(value, property):
                functions += [f for f in (value.fget, value.fset, value.fdel) if f is not None]
            elif isinstance(value, type) and value.__module__.startswith("diffusion_debug"):
                todo.append(value)
            elif isinstance(value, types.FunctionType):
                functions.append(value)
                while hasattr(value, "__wrapped__"):  # (functools.wraps: the wrapped function too)
                    value = value.__wrapped__
                    functions.append(value)
    codes = [(f.__code__, f.__qualname__) for f in functions if isinstance(f, types.FunctionType)]
    found.update(codes)
    while codes:  # nested functions, lambdas and comprehensions, named by the code that makes them
        code, name = codes.pop()
        # (as CPython's compiler names them: ``<locals>`` under a function's or a lambda's code, not under a
        # comprehension's nor a class body's, which is not optimized)
        function = code.co_flags & 1 and code.co_name not in ("<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and const not in found:
                found[const] = f"{name}{'.<locals>' if function else ''}.{const.co_name}"
                codes.append((const, found[const]))
    return found


READINGS = "probe readings"
"""The key under which :func:`hook_calls` counts the probes' readings of module calls."""


def hook_calls(run: Callable[[], Any]) -> Counter[str]:
    """What torch ran of the package as module hooks during ``run()``: each function of
    ``diffusion_debug`` called from ``nn.Module``'s call (forward pre-hooks and hooks, a global hook
    armed for a call), by qualified name; and under :data:`READINGS` the probes' readings of a
    module call (``Probe._read``, or the fused sentinel's ``Probe._read_output``, which hands what
    it does not read itself to ``_read``: counted once; or an armed probe's process-wide hook,
    ``Probe._reader``'s, for a watched module, which also hands some calls to ``_read``). Nothing run
    by a garbage collection is counted: one the interpreter starts inside a module's call runs the
    package's finalizers (a closed debugger's weakref callbacks, ``__del__``) with that call's frame as
    their caller (a CI run counted 4 of a pipeline collected in a later pipeline's call as its hooks)."""
    package, module_call = os.path.dirname(diffusion_debug.__file__), torch.nn.modules.module.__file__
    counts: Counter[str] = Counter()
    reads, handing = ("Probe._read", "Probe._read_output"), ("Probe._read_output", "Probe._reader.<locals>.hook")
    armed = "Probe._reader.<locals>.hook"
    collecting = [False]

    def collection(phase: str, info: dict[str, int]) -> None:
        collecting[0] = phase == "start"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not collecting[0] and frame.f_code.co_filename.startswith(package):
            caller, name = frame.f_back, qualname(frame.f_code)
            if caller is not None and caller.f_code.co_filename == module_call:
                counts[name] += 1
            if name in reads and (caller is None or qualname(caller.f_code) not in handing):
                counts[READINGS] += 1
            elif name == armed and (here := frame.f_locals)["get"](id(here["module"])) is not None:
                counts[READINGS] += 1  # a watched module's call (the hook passes others on)

    previous = sys.getprofile()
    gc.callbacks.append(collection)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
        gc.callbacks.remove(collection)
    return counts


def inference_hooks(
    pipe: Any,
    config: DebugConfig,
    *,
    short: int = 1,
    long: int = 3,
    autocast: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Hooks torch runs (and probe readings taken) for a call of ``pipe`` watched by a reused
    debugger, once its first call (full probes on the components called once per image) is behind
    it: per call of ``short`` steps, and per step (the difference to a ``long``-step call). Both
    counted calls are runs that read every group of sentinels (the debugger's 2nd, twice: its pace set
    back a run): an fp16 UNet's step 0, the fp16 VAE's and text encoder's calls: a 1-step call's count
    is that of a call reading all, the most a call runs (from the 3rd on each group reads runs of its own,
    1 in 4: ``components.sentinel_pace``; on tiny SD the UNet's 7, the VAE's 5, the text encoder's 2).
    ``kwargs``: the call's other arguments (a Flux's size; its prompt in place of the default); ``autocast``: as
    :func:`inference_ops` takes it."""
    debugger = DiffusionModelDebugger(pipe, config)
    kwargs.setdefault("prompt", "a photo of a cat")

    def call(steps: int) -> Callable[[], None]:
        def run() -> None:
            with _region(pipe, autocast), debugger:
                pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs)

        return run

    first = hook_calls(call(short))
    one = hook_calls(call(short))
    debugger._steps.probes.pace.runs = 1  # run 2 again: every group read (``components.sentinel_pace``)
    more = hook_calls(call(long))
    debugger.close()
    measures = one.pop(READINGS, 0), more.pop(READINGS, 0)
    first.pop(READINGS, 0)
    return {
        "first_call_hooks": sum(first.values()),
        "hooks_per_call": sum(one.values()),
        "hooks_per_step": (sum(more.values()) - sum(one.values())) / (long - short),
        "measures_per_call": measures[0],
        "measures_per_step": (measures[1] - measures[0]) / (long - short),
        "by_hook": dict(one.most_common()),
        "first_by_hook": dict(first.most_common()),
    }


def python_calls(run: Callable[[], Any], sites: Counter[str] | None = None, builtins: list[int] | None = None) -> int:
    """Python function calls (frames: the package's, torch's, the pipeline's) made during ``run()``;
    each counted in ``sites`` too when given, by ``file:line:qualified name`` of its code; ``builtins``
    (``[0]``): also counts there the calls Python code makes into C functions (``sys.setprofile``'s
    ``c_call``: ``isinstance``, ``getattr``, ``dict.get``, a tensor method), the per-call work that adds
    no frame. The cyclic
    collector is run before and kept off during ``run()``: a collection the interpreter starts at a
    moment set by allocations elsewhere runs finalizers (a closed debugger's weakref callbacks,
    ``__del__``) whose calls would be counted as the run's (what :func:`hook_calls` guards against by
    counting nothing a collection runs; here, where every call counts, no collection runs at all)."""
    calls = [0]
    c_calls = builtins if builtins is not None else [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1
        elif event == "c_call":
            c_calls[0] += 1

    def profile_sites(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1
            code = frame.f_code
            sites[f"{code.co_filename}:{code.co_firstlineno}:{qualname(code)}"] += 1
        elif event == "c_call":
            c_calls[0] += 1

    previous, collecting = sys.getprofile(), gc.isenabled()
    gc.collect()
    gc.disable()
    sys.setprofile(profile if sites is None else profile_sites)
    try:
        run()
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()
    return calls[0]


def added_python_calls(
    pipe: Any, config: DebugConfig, *, warmup: int = 2, sites: bool = False, read: bool = False
) -> dict[str, Any]:
    """The Python calls a debugger reused with ``with dbg:`` adds to a 1-step call of ``pipe``
    (trailing spacing, :func:`~.call_cost.one_step`; PIL output), once ``warmup`` watched calls
    (the first one's full probes) are behind it: the watched call's minus the plain call's, the
    fewest of three each. On a CPU at tiny size most of a watched call's fixed cost is this Python;
    the count is the same from one run to the next (for one set of versions), where a time is not.
    ``added`` is of a call whose step 0 an fp16 UNet's sentinel does not read, nor the fp16 VAE's and
    text encoder's sentinels their calls (the debugger's 4th, three times: its pace set back a run
    before each; ``components.sentinel_pace`` reads each group on runs of its own, and 1 call in 4 of a
    served pipeline reads none); ``read``: also ``added_read_by_group``, per group of sentinels
    (``SENTINEL_PHASES``), of the call that reads that group alone (the 5th: the UNet's step 0; the 6th:
    the VAE's; the 7th: the text encoder's), the fewer of two each, and ``added_read``, the most of
    them. In fp32 and bf16 all are the same path.
    ``sites``: also ``added_by_site``, the functions whose calls differ (watched minus plain, of the
    two counted calls of ``added``), to name what moved a count: a process-wide change shows there by name.
    ``added_builtins``: the calls into C functions (:func:`python_calls`' ``builtins``) the counted calls of
    ``added`` differ by: an ``isinstance``/``getattr``/``dict.get`` chain added per call or per hook makes no
    frame, and moves this count alone."""
    from .call_cost import one_step

    pipe = one_step(pipe)
    debugger = DiffusionModelDebugger(pipe, config)
    pace = debugger._steps.probes.pace  # (its run count set: the run to count next)

    def plain() -> None:
        pipe("a photo of a cat", num_inference_steps=1, output_type="pil", generator=torch.Generator().manual_seed(0))

    def watched() -> None:
        with debugger:
            plain()

    def counted(run: Callable[[], Any]) -> tuple[int, Counter[str] | None, int]:
        found: Counter[str] | None = Counter() if sites else None
        builtins = [0]
        return python_calls(run, found, builtins), found, builtins[0]

    def fewest(*counts: tuple[int, Counter[str] | None, int]) -> tuple[int, Counter[str] | None, int]:
        # the fewest of three: a timed event (a flush, a memory sample) or the garbage collector
        # can land in one call and add thousands of calls that are not its fixed cost
        return min(counts, key=lambda pair: pair[0])

    try:
        for _ in range(warmup):  # the pipeline's own first calls are in them too: no plain one apart
            watched()
        unwatched, plain_sites, plain_builtins = fewest(*[counted(plain) for _ in range(3)])
        not_read = []
        for _ in range(3):  # run 4 (no group read), three times
            pace.runs = SENTINEL_EVERY - 1
            not_read.append(counted(watched))
        read_runs: dict[str, list[int]] = {}
        for group, phase in SENTINEL_PHASES.items() if read else ():
            for _ in range(2):  # the group's own run (5, 6, 7), twice
                pace.runs = SENTINEL_EVERY + phase - 1
                read_runs.setdefault(group, []).append(counted(watched)[0])
        seen, watched_sites, watched_builtins = fewest(*not_read)
    finally:
        debugger.close()
    out: dict[str, Any] = {"plain": unwatched, "watched": seen, "added": seen - unwatched}
    out["added_builtins"] = watched_builtins - plain_builtins
    if read:
        out["added_read_by_group"] = {group: min(counts) - unwatched for group, counts in read_runs.items()}
        out["added_read"] = max(out["added_read_by_group"].values())
    if sites:
        watched_sites.subtract(plain_sites)
        out["added_by_site"] = {site: n for site, n in sorted(watched_sites.items()) if n}
    return out


def step_python_calls(
    pipe: Any, config: DebugConfig, *, short: int, long: int, sites: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """The Python calls a reused debugger adds per denoising step of ``pipe`` over steps ``short``
    to ``long - 1`` of a run: a ``long``-step call's added calls (watched minus plain) minus a
    ``short``-step call's, the fewest of three each, divided by ``long - short``. A step's
    deferred read (its row, its checks) comes with it: the short call reads its last step as the
    call ends. On a GPU a watched step's cost is host time, most of it these calls and the ops'
    launches (:func:`inference_ops`). The VAE decodes (``output_type="np"``): its first call's full
    probes are behind the counted calls, as a user's are. ``sites``: also ``added_by_site``, by
    function, per step. ``kwargs``: the call's other arguments."""
    debugger = DiffusionModelDebugger(pipe, config)
    kwargs.setdefault("prompt", "a photo of a cat")

    def plain(steps: int) -> Callable[[], None]:
        return lambda: pipe(
            num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="np", **kwargs
        )

    def watched(steps: int) -> Callable[[], None]:
        def run() -> None:
            with debugger:
                plain(steps)()

        return run

    def fewest(run: Callable[[], Any]) -> tuple[int, Counter[str]]:
        counted = [(python_calls(run, found), found) for found in (Counter() if sites else None for _ in range(3))]
        return min(counted, key=lambda pair: pair[0])

    try:
        for _ in range(2):  # the first call's full probes behind it
            plain(short)()
            watched(short)()
        counts = {
            (kind, steps): fewest(run(steps))
            for kind, run in (("plain", plain), ("watched", watched))
            for steps in (short, long)
        }
    finally:
        debugger.close()
    span = long - short
    added = (counts["watched", long][0] - counts["plain", long][0]) - (
        counts["watched", short][0] - counts["plain", short][0]
    )
    out: dict[str, Any] = {"added_per_step": added / span}
    if sites:
        found = Counter(counts["watched", long][1])
        found.subtract(counts["plain", long][1])
        found.subtract(counts["watched", short][1])
        found.update(counts["plain", short][1])
        out["added_by_site"] = {site: n / span for site, n in sorted(found.items()) if n}
    return out


def training_ops(model: torch.nn.Module, *, steps: int = 4, size: int = 8, output_dir: str | None = None) -> dict:
    """Ops one ``monitor_training_step`` adds to a UNet training step (default config), its run written
    into ``output_dir`` or into a scratch folder removed after."""
    if output_dir is None:
        with tempfile.TemporaryDirectory(prefix="diffusion-debug-ops-") as scratch:
            return training_ops(model, steps=steps, size=size, output_dir=scratch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, model.config.in_channels, size, size, generator=g)
    context = torch.randn(2, 8, model.config.cross_attention_dim, generator=g)
    timesteps = torch.randint(0, 1000, (2,), generator=g)
    debugger = TrainingDebugger(model, config=DebugConfig(output_dir=output_dir))
    losses = []
    for _ in range(2):  # warm-up: the first monitored steps read the weights, learn the backward order
        loss = F.mse_loss(model(latents, timesteps, encoder_hidden_states=context).sample, latents)
        loss.backward()
        debugger.monitor_training_step(loss, optimizer=optimizer, timesteps=timesteps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    counts: Counter[str] = Counter()
    for _ in range(steps):
        loss = F.mse_loss(model(latents, timesteps, encoder_hidden_states=context).sample, latents)
        loss.backward()
        with count_aten_ops() as ops:
            debugger.monitor_training_step(loss, optimizer=optimizer, timesteps=timesteps)
        counts.update(ops.counts)
        losses.append(loss.item())
        optimizer.step()  # a clean run: the weights move (a loop that never steps is one that does not learn)
        optimizer.zero_grad(set_to_none=True)
    debugger.close()
    return {
        "parameters": sum(1 for p in model.parameters() if p.requires_grad),
        "added_ops_per_step": sum(counts.values()) / steps,
        "added_by_op": dict(Counter({k: v / steps for k, v in counts.items()}).most_common(12)),
    }


def run(pipe: Any, *, output_dir: str, smoke: bool = False) -> dict[str, Any]:
    """The op counts of default mode (level advanced) and of level basic, per denoising step, and
    of the default TrainingDebugger per training step (smoke: the default mode only). The counts
    with the user's dtypes (fp16, bf16, and at SD1.5 topology) are :mod:`benchmarks.user_path`'s."""
    out = {"inference_default": inference_ops(pipe, DebugConfig(output_dir=output_dir))}
    if not smoke:
        basic = DebugConfig(level="basic", output_dir=output_dir)
        out["inference_basic"] = inference_ops(pipe, basic)
        out["training_default"] = training_ops(pipe.unet, output_dir=output_dir)
    return out


PLAIN_WARMUP = 2
"""The plain twin's untimed steps before :func:`training_python_calls` counts one (its first steps
make AdamW's state and the GradScaler's; the watched twin takes ``warmup``, past the per-module figures)."""


def training_python_calls(
    model: torch.nn.Module,
    *,
    precision: str = "fp16",
    warmup: int = DETAIL_FIRST + 1,
    max_grad_norm: float | None = None,
) -> dict[str, int]:
    """The Python calls a ``TrainingDebugger`` (default config, events streamed) adds to one
    Accelerate training step of ``model`` (``benchmarks.training.AccelerateStep``, on the CPU:
    ``precision`` fp16 takes a GPU's path by hand) once ``warmup`` monitored steps are behind it
    (by default the first steps, which read the per-module figures, and the first scheduled one
    after them: the steps counted are the ones off the schedule, ``training.step.detail``):
    a monitored step's calls minus a plain step's (its twin past :data:`PLAIN_WARMUP` steps), the
    fewest of three each; and the aten ops it adds (``added_ops_per_step``,
    :func:`benchmarks.training.added_ops`). The plain step trains
    a twin (a deep copy) no debugger ever watched, as ``benchmarks.training.plain_vs_watched``
    times them; both clip at ``max_grad_norm`` as diffusers' scripts do (None: no clip). On a GPU a
    monitored step's cost is host time, most of it these calls and launches."""
    import copy

    from . import training

    twins = [model, copy.deepcopy(model)]
    steps = training.accelerate_steps(
        twins, precision, device="cpu", size=8, context_len=77, max_grad_norm=max_grad_norm
    )
    scratch = tempfile.TemporaryDirectory(prefix="diffusion-debug-calls-")
    debugger = TrainingDebugger(
        steps[1].model, accelerator=steps[1].accelerator, config=DebugConfig(output_dir=scratch.name)
    )
    try:
        for i in range(warmup):
            if i < PLAIN_WARMUP:  # a plain step has no schedule: past its first-use costs, each is the same
                steps[0]()
            steps[1](debugger)
        ops = training.added_ops(steps, debugger)  # first: the step after it keeps the update sketch's blocks
        plain = min(python_calls(steps[0]) for _ in range(3))
        watched = min(python_calls(lambda: steps[1](debugger)) for _ in range(3))
    finally:
        debugger.close()
        training.reset_accelerate()
        scratch.cleanup()
    return {"plain": plain, "watched": watched, "added": watched - plain, **ops}
