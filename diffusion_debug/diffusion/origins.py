"""Where a NaN/Inf came from when no watched module made it: a pipeline input (``latents=``,
``image=``, ``prompt_embeds=``, ``guidance_scale``...), the scheduler, or the pipeline's own
arithmetic between two components (classifier-free guidance between the denoiser and
``scheduler.step``), or a component's own state, which it gets back from its earlier calls (the
Wan VAE's ``feat_cache``, a ``past_key_values``): that is never an input nor the pipeline's code.

>>> import torch
>>> nonfinite_names({"latents": torch.tensor([1.0, float("nan")]), "guidance_scale": 7.5, "prompt": "a cat"})
['latents']

Each function takes plain values (the pipeline's call arguments, a component call's kept
arguments) and returns names or one :class:`~diffusion_debug.record.Anomaly`. These run only
after a NaN/Inf was seen (they read tensors on the host: one sync each, never per step).

Limits: a pipeline's inputs are read from its running ``__call__`` frame (the frame whose
``self`` is the pipeline) when the run starts (its first prompt encoding, ``set_timesteps`` or
encoder call), so a value the loop reassigns later (``latents``) or a callback returns is not
taken for the user's; an argument the pipeline reassigned before that first event is seen as
reassigned; a pipeline run through another method than ``__call__`` has no inputs to read; an
input is seen only as a tensor, a float, a numpy array or a list / tuple / dict of those (PIL
images cannot hold NaN). A NaN/Inf that first reaches the denoiser between two steps, while a step-end
callback was passed, is the callback's: the pipeline's own code between steps is rarely the cause then,
and is named only without a callback; between two FreeInit passes, only where the latents the callback
left were non-finite as the next pass began (FreeInit's re-noising, its own code, runs after it). A NaN/Inf
a component gets back through its own state is named at the component, not at the module that wrote it in an earlier
call (only the call being checked is kept); a module whose NaN/Inf reaches the call's output is
named at once, by the replay of that call. Values the user passed past the overflow warning's share
of their half-precision dtype's max (``latents=`` at 40000 in float16) are the input's too: the
near-overflow a component is given and the NaN/Inf that overflows from them later (in
``scheduler.step``, in the pipeline's own arithmetic) name the input, read only once a fault is seen.

Long because every origin a NaN/Inf can have outside a watched module (an input, the step-end
callback, the pipeline's code, the scheduler, a component's own state) is one rule, read here in order.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..record import Anomaly, make_anomaly, rebuilt

GUIDANCE_NAMES = ("guidance_scale", "image_guidance_scale", "guidance_rescale", "true_cfg_scale")
CALLBACK_NAMES = ("callback_on_step_end", "callback")  # the step-end callback (and its deprecated form)
MAX_DEPTH = 60  # frames walked up from a hook to the pipeline's __call__


def latents_left(frame: Any) -> Any:
    """Whether the ``latents`` of a running pipeline call's ``frame`` are all finite, as a 0-d tensor on their
    device (no host read; None where it holds no floating tensor of that name): taken as a run in the call
    begins (FreeInit's next pass, before its re-noising returns), what the last step-end callback left."""
    try:
        latents = frame.f_locals.get("latents")
    except Exception:  # (a frame that ended)
        return None
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        return None
    return torch.isfinite(latents.detach()).all()


def is_nonfinite(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a tensor, float, numpy array, or a list / tuple / dict of them) holds a NaN/Inf.
    Its own walk, not stats.nested's: floats and numpy arrays count, and a user's value is read only
    two levels and 64 items deep (each tensor read is a host sync)."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.numel() > 0 and not bool(torch.isfinite(value.detach()).all())
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > 2:
        return False
    if isinstance(value, (list, tuple)):
        return any(is_nonfinite(v, depth + 1) for v in value[:64])
    if isinstance(value, dict):
        return any(is_nonfinite(v, depth + 1) for v in list(value.values())[:64])
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None:
        try:
            import numpy as np

            return value.dtype.kind == "f" and not bool(np.isfinite(value).all())
        except Exception:  # an object array: not a numeric input
            return False
    return False


def near_max_share(value: Any) -> float:
    """The share of its dtype's largest value that a half-precision tensor ``value``'s abs-max reaches
    (0.0 for anything else, or a tensor holding NaN/Inf: that one is :func:`is_nonfinite`'s). A host read."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.float16, torch.bfloat16):
        return 0.0  # float8 too: its CPU abs-max is not implemented (an fp8 input is not what this warns of)
    if value.numel() == 0:
        return 0.0
    share = float(value.detach().abs().amax().float()) / torch.finfo(value.dtype).max
    return share if math.isfinite(share) else 0.0


def near_max_names(values: dict[str, Any], fraction: float) -> dict[str, float]:
    """The names whose half-precision tensor values reach ``fraction`` of their dtype's max -> that share."""
    shares = {name: near_max_share(value) for name, value in values.items()}
    return {name: share for name, share in shares.items() if share >= fraction}


def nonfinite_names(values: dict[str, Any]) -> list[str]:
    """The names whose values hold a NaN/Inf, in order."""
    return [name for name, value in values.items() if is_nonfinite(value)]


def _call_frames(max_depth: int = MAX_DEPTH):
    """The running pipelines' ``__call__`` frames, innermost first (every ``__call__``'s code noted)."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return
        if frame.f_code.co_name == "__call__":
            owner = frame.f_locals.get("self")
            cls = type(owner)  # class lookups: the instance's `components` property builds a dict
            # a DiffusionPipeline, or a Modular Diffusers ModularPipeline (no progress_bar of its own)
            pipeline_like = hasattr(cls, "progress_bar") or hasattr(cls, "update_components")
            PIPELINE_CODE[frame.f_code] = found = owner is not None and hasattr(cls, "components") and pipeline_like
            if found:
                yield owner, frame
        frame = frame.f_back


PIPELINE_CODE: dict[Any, bool] = {}  # per __call__ code met: a pipeline's (False: a modular block's, gone past)


class PipelineFrame:
    """Whether the code now running is a pipeline call that is not ``pipe``'s (one sharing its
    components, ``from_pipe``): the innermost pipeline call on the stack but its sub-pipelines' (a
    combined pipeline's prior) is another's, also inside ``pipe``'s call (from its step-end callback).
    Asked at every hook and wrapper of a call: the frame of ``pipe.__call__`` one walk finds is kept,
    and the later checks look for it on the stack without reading any frame's locals (``f_locals``
    copies a pipeline ``__call__``'s locals at each read, ~15 us on a CPU): found, with no pipeline's
    call above it but its sub-pipelines' (:attr:`parts`), ``pipe`` runs; else :meth:`walk` reads.
    :meth:`forget` lets the frame (and its locals) go when the call ends.

    >>> class Pipe:
    ...     components, progress_bar = {}, None
    ...     def __call__(self, check):
    ...         return check()
    >>> pipe, other = Pipe(), Pipe()
    >>> frames = PipelineFrame(pipe)
    >>> pipe(frames.runs_another_pipeline), other(frames.runs_another_pipeline), frames.runs_another_pipeline()
    (False, True, False)
    >>> pipe(lambda: other(frames.runs_another_pipeline))  # another pipeline called inside pipe's call
    True
    """

    def __init__(self, pipe: Any):
        self.pipe = pipe
        self.modular = hasattr(type(pipe), "update_components")  # a ModularPipeline (loop_may_follow asks it)
        self.frame: Any = None
        """The frame of ``pipe.__call__`` the last walk found (None: none), the busy check's to look for."""
        self.call = 0
        """Counts the frames the walks found: unchanged while they find the kept one (one call of ``pipe``, whatever
        its runs: AnimateDiff's FreeInit sets a second schedule in it), without holding a frame past its call."""
        self.parts: frozenset[tuple[int, Any]] = frozenset()  # sub-pipelines' calls in it: (id, code)
        self.inside = False  # another pipeline's call runs in pipe's (each check walks meanwhile)
        self.returned: Callable[[], None] | None = None  # called as pipe runs again after that call

    def runs_another_pipeline(self) -> bool:
        frame = self.frame
        if frame is not None:
            current, parts, inner = sys._getframe(1), self.parts, False  # where the walk starts
            for _ in range(MAX_DEPTH):
                if current is frame:
                    return self.walk() if inner or self.inside else False
                code = current.f_code
                if code.co_name == "__call__" and PIPELINE_CODE.get(code, True) and (id(current), code) not in parts:
                    inner = True  # a pipeline's call inside pipe's (or a __call__ not met yet)
                current = current.f_back
                if current is None:
                    break
            self.frame = None
        return self.walk()

    def walk(self) -> bool:
        """:meth:`runs_another_pipeline` read from every pipeline frame, keeping ``pipe``'s where it runs."""
        parts, pipe, other = [], self.pipe, False
        for owner, found in _call_frames():
            if owner is pipe:
                if found is not self.frame:
                    self.call += 1
                self.frame = found
                if other:
                    self.inside = True
                    return True
                if self.inside and self.returned is not None:  # back from another pipeline's call
                    self.returned()
                self.parts, self.inside = frozenset(parts), False
                return False
            other = other or not any(value is owner for value in getattr(pipe, "__dict__", {}).values())
            parts.append((id(found), found.f_code))
        return bool(parts)

    def forget(self) -> None:
        self.frame = None


def loop_may_follow(frames: PipelineFrame | None) -> bool:
    """Whether a pipeline call runs now whose denoising loop may still read what an encoder returns:
    ``frames``' pipeline's call (the one its busy check kept), or without ``frames`` (a
    ``ComponentsManager``, watched in whichever pipeline calls its components) the innermost pipeline
    call on the stack. A ``DiffusionPipeline``'s call runs a loop; a ``ModularPipeline``'s where its
    blocks hold one (Modular Diffusers' denoise loop, a ``LoopSequentialPipelineBlocks``), not one of
    text encoder blocks alone, whose caller takes what it returns as ``pipe.encode_prompt``'s does."""
    if frames is not None:
        if frames.frame is None:
            return False
        owner, modular = frames.pipe, frames.modular
    else:
        owner = next((found for found, _ in _call_frames()), None)
        modular = hasattr(type(owner), "update_components")
    if owner is None:
        return False
    if not modular:
        return True
    blocks = getattr(owner, "_blocks", None)
    try:  # asked at each encoder call of a modular pipeline: its blocks walked once (~0.1 ms for SDXL's)
        loops = _LOOPS.get(blocks)
        if loops is None:
            loops = _LOOPS[blocks] = _holds_loop(blocks)
    except TypeError:  # blocks that cannot be weakly referenced or hashed: walked every time
        loops = _holds_loop(blocks)
    return loops


_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per modular pipeline blocks object: whether it holds a denoising loop (:func:`loop_may_follow`)."""


def _holds_loop(block: Any, depth: int = 0) -> bool:
    if block is None or depth > 8:
        return False
    if any(kind.__name__ == "LoopSequentialPipelineBlocks" for kind in type(block).__mro__):
        return True
    subs = getattr(block, "sub_blocks", None)
    return isinstance(subs, dict) and any(_holds_loop(sub, depth + 1) for sub in subs.values())


def running(frame: Any) -> bool:
    """Whether ``frame`` is on some thread's stack now, at any depth: its call has neither returned nor
    raised (a frame kept past its call is not, whatever its ``f_back``)."""
    for top in sys._current_frames().values():
        while top is not None:
            if top is frame:
                return True
            top = top.f_back
    return False


def pipeline_inputs(pipe: Any, found: Any = None) -> dict[str, Any]:
    """The arguments of the running ``pipe.__call__`` (from its frame, as they are now), with the
    guidance scales the pipeline stored on itself; empty when no such frame is on the stack.
    ``found``: that call's frame, given (a call that raised, from its traceback: no longer running)."""
    for owner, frame in () if found is not None else _call_frames():
        if owner is pipe:
            found = frame  # the outermost one: a pipeline calling itself keeps the user's arguments
    if found is None:
        return {}
    code = found.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = found.f_locals
    try:  # every argument bound (a running call's are, but for one it deleted): one C loop, no bytecode a name
        values = dict(zip(names, map(local.__getitem__, names)))
    except KeyError:
        values = {}
        for name in names:  # (a loop, not a comprehension: once a run)
            if name in local:
                values[name] = local[name]
    values.pop("self", None)
    if "kwargs" in local and isinstance(local["kwargs"], dict):
        for k, v in local["kwargs"].items():
            if k not in values:
                values[k] = v
    return {**values, **stored_guidance(pipe, values)}


def stored_guidance(pipe: Any, values: dict[str, Any]) -> dict[str, float]:
    """The guidance scales the pipeline stored on itself (``pipe._guidance_scale``) and ``values`` lacks."""
    found = {}
    for name in GUIDANCE_NAMES:
        stored = vars(pipe).get(f"_{name}")
        # numpy's numbers too (a float or int asked first: numbers.Real is an ABC, slow to ask)
        if (
            stored is not None  # (none stored: no ABC asked)
            and name not in values
            and (isinstance(stored, (float, int)) or isinstance(stored, numbers.Real))
        ):
            found[name] = float(stored)
    return found


@dataclass
class RunInputs:
    """What the user passed to one pipeline run, taken when the run starts (references, no copy,
    no tensor op), and what the run has said since about the latents between steps."""

    pipe: Any = None
    passed: dict[str, Any] | None = None
    """The ``__call__`` arguments as passed; None: not taken (read from the frame when asked)."""
    latents_finite: bool | None = None
    """Whether the last recorded step's new latents were finite (None before the first step)."""
    before: tuple[int, int] | None = None
    """A run begun in the call of the run before (FreeInit's next pass): ``(that run, its last step)``, whose
    step-end callback ran last before this run's step 0 (``latents_finite`` carried from that step)."""
    left: Any = None
    """Such a run's: whether the latents that step's callback left were finite, as this run began (before
    FreeInit's own code re-noised them): a 0-d tensor (:func:`latents_left`), read on a fault only; None: unknown."""
    dirtied: bool = False
    """Whether a recorded step's new latents held a NaN/Inf in this call (this run or one before it in the call):
    an origin's reached them, and a step-end callback may have removed it since (:func:`cleaned_away`)."""

    @classmethod
    def capture(cls, pipe: Any) -> "RunInputs":
        return cls(pipe, pipeline_inputs(pipe))

    def values(self) -> dict[str, Any]:
        """The passed values with the guidance scales the pipeline stored on itself."""
        if self.pipe is None:
            return {}
        passed = self.passed if self.passed is not None else pipeline_inputs(self.pipe)
        return {**passed, **stored_guidance(self.pipe, passed)}

    @property
    def callback(self) -> str | None:
        """The name of the step-end callback the user passed, if any."""
        passed = self.passed or {}
        return next((name for name in CALLBACK_NAMES if passed.get(name) is not None), None)

    def callback_step(self, step: int | None) -> tuple[int | None, int] | None:
        """``(run, step)`` (run None: this one) of the step-end callback that last ran on finite latents before it."""
        if step is None or self.callback is None or not self.latents_finite:
            return None
        if step == 0 and self.left is not None and bool(self.left):  # finite as the pass ended: FreeInit's code
            return None
        return (None, step - 1) if step else self.before

    def nonfinite(self) -> list[str]:
        """The names of the passed values (and the guidance scales) that hold a NaN/Inf."""
        return nonfinite_names(self.values())

    def near_max(self, fraction: float) -> dict[str, float]:
        """The passed half-precision tensors at ``fraction`` of their dtype's max or beyond -> that share."""
        return near_max_names(self.values(), fraction)

    def guidance(self) -> list[str]:
        """The guidance scales (passed or stored on the pipeline) that are not finite."""
        values = self.values()
        return nonfinite_names({k: values[k] for k in GUIDANCE_NAMES if k in values})


def call_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A component call's arguments by parameter name (``arg0``... where the signature says none)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}


def input_origin(
    names: list[str],
    *,
    seen_in: str,
    step: int | None,
    timestep: float | None,
    phase: str,
    near_max: dict[str, float] | None = None,
) -> Anomaly:
    """The one error for NaN/Inf passed to the pipeline as its inputs ``names``, or (``near_max``: name ->
    share of its dtype's max) made in ``seen_in`` from the near-max values they held."""
    details = {"localized_by": "pipeline inputs", "inputs": names, "seen_in": seen_in, "phase": phase}
    if near_max:
        details["near_max"] = near_max[names[0]]
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="input",
        module=names[0],
        step=step,
        timestep=timestep,
        details=details,
    )


def near_max_input(
    near_max: dict[str, float], *, seen_in: str, step: int | None, timestep: float | None, phase: str
) -> Anomaly:
    """The one error for NaN/Inf made in ``seen_in`` from finite values the user passed near their dtype's max."""
    return input_origin(list(near_max), seen_in=seen_in, step=step, timestep=timestep, phase=phase, near_max=near_max)


def raised_call_frame(pipe: Any, trace: Any) -> Any:
    """The frame of the outermost ``pipe.__call__`` in the traceback ``trace`` (None: the exception
    did not pass through a call of ``pipe``)."""
    while trace is not None:
        if trace.tb_frame.f_code.co_name == "__call__" and trace.tb_frame.f_locals.get("self") is pipe:
            return trace.tb_frame
        trace = trace.tb_next
    return None


def raised_origin(names: list[str], pipe: Any, error: BaseException, *, step: int | None) -> Anomaly:
    """The one error for NaN/Inf passed to the pipeline as ``names`` that no component received:
    ``pipe``'s own code raised ``error`` first (WanImageToVideoPipeline's image processor raises
    ValueError on a NaN ``image`` before the image encoder runs), which goes on unchanged."""
    anomaly = input_origin(names, seen_in=f"{type(pipe).__name__}.__call__", step=step, timestep=None, phase="call")
    return rebuilt(anomaly, details={**anomaly.details, "raised": type(error).__name__})  # (its message too)


def between_origin(
    arguments: list[str],
    *,
    seen_in: str,
    step: int | None,
    timestep: float | None,
    phase: str,
    passes: tuple[int, bool] | None = None,
) -> Anomaly:
    """The one error for NaN/Inf that reached ``seen_in`` (as ``arguments``) from no watched
    component and no input: the pipeline's own code made it between two calls; ``passes``: ``(the run
    before, whether the pipeline's FreeInit is on)`` where it reached the first step of a run in that run's
    call (FreeInit's re-noising between two passes)."""
    details = {"localized_by": "call arguments", "arguments": arguments, "seen_in": seen_in, "phase": phase}
    if passes is not None:
        details.update(between_passes=[passes[0], passes[0] + 1], free_init=passes[1])
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="pipeline",
        module="",
        step=step,
        timestep=timestep,
        details=details,
    )


def unwatched_origin(
    replaced: list[str], since: int | None, *, seen_in: str, timestep: float | None, phase: str
) -> Anomaly:
    """The one error for NaN/Inf that reached ``seen_in`` after ``replaced`` (components, the
    scheduler among them) were put on the pipeline during the call at step ``since``, where no hook
    of the debugger's ran in their steps: it came from them, not found where."""
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="pipeline",
        module="",
        step=since,
        timestep=timestep,
        details={"localized_by": "replaced during the call", "replaced": replaced, "seen_in": seen_in, "phase": phase},
    )


def scheduler_origin(
    *,
    denoiser: str,
    model_output_finite: bool,
    sample_finite: bool,
    guidance: list[str],
    step: int | None,
    timestep: float | None,
    scheduler: str,
    near_max: dict[str, float] | None = None,
) -> Anomaly:
    """The one error for latents that became non-finite in a step whose denoiser output was
    finite: a non-finite guidance input, the guidance arithmetic, values the user passed near their
    dtype's max (``near_max``) that ``scheduler.step`` overflowed, or ``scheduler.step`` itself."""
    if guidance:
        return input_origin(guidance, seen_in="the guidance step", step=step, timestep=timestep, phase="guidance")
    if near_max and model_output_finite and sample_finite:
        return near_max_input(near_max, seen_in=f"{scheduler}.step", step=step, timestep=timestep, phase="scheduler")
    if not model_output_finite:
        return make_anomaly(
            kind="nonfinite",
            severity="error",
            component="pipeline",
            module="guidance",
            step=step,
            timestep=timestep,
            details={"localized_by": "scheduler.step arguments", "phase": "guidance", "denoiser": denoiser},
        )
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="scheduler",
        module="step",
        step=step,
        timestep=timestep,
        details={
            "localized_by": "scheduler.step arguments",
            "phase": "scheduler",
            "scheduler": scheduler,
            "sample_finite": sample_finite,
        },
    )


def settle(anomaly: Anomaly, origin: Anomaly | None) -> tuple[Anomaly, Anomaly | None]:
    """``(anomaly as it is to be emitted, the run's origin after it)``: the run's first NaN/Inf
    error becomes its origin, a later one a warning pointing at it."""
    if anomaly.severity != "error":
        return anomaly, origin
    if origin is None:
        return anomaly, anomaly
    return (anomaly if anomaly is origin else downstream(anomaly, origin)), origin


def downstream(anomaly: Anomaly, origin: Anomaly) -> Anomaly:
    """``anomaly`` as a warning that points at the run's one error ``origin`` by its ``where()``
    (its kind's builder words it from ``details["origin"]``)."""
    return rebuilt(anomaly, severity="warning", details={**anomaly.details, "origin": origin.where()})


def callback_origin(callback: str, ended: tuple[int | None, int], *, seen_in: str, step: int, phase: str) -> Anomaly:
    """The one error for NaN/Inf that the user's step-end ``callback`` put into the loop: the latents
    ``scheduler.step`` returned at the step it ``ended`` (:meth:`RunInputs.callback_step`) were finite,
    and what ``seen_in`` received at ``step`` was not."""
    run, made = ended
    details = {"localized_by": "step-end callback", "seen_in": seen_in, "seen_at_step": step, "phase": phase}
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="callback",
        module=callback,
        step=made,
        timestep=None,
        details=details if run is None else {**details, "run": run, "seen_in_next_pass": True},
    )


def callback_again(
    inputs: RunInputs, origin: Anomaly, received: Callable[[], list[str]], *, seen_in: str, step: int | None
) -> Anomaly | None:
    """The error for NaN/Inf the step-end callback put into the loop after the run's ``origin`` elsewhere was
    cleaned (a module's NaN the callback turned finite, then its own): ``seen_in``, named before, received it
    at ``step`` though ``scheduler.step`` returned finite latents at the step before (``received()``: the call's
    non-finite arguments, a host read asked last). None where the callback is the origin already, or not it."""
    ended = inputs.callback_step(step)
    if ended is None or (origin.component, origin.module) == ("callback", inputs.callback) or not received():
        return None
    return callback_origin(inputs.callback, ended, seen_in=seen_in, step=step, phase="denoise")


def cleaned_away(inputs: RunInputs, origin: Anomaly | None, component: str) -> bool:
    """Whether another component's ``origin`` may have been removed from the loop: its NaN/Inf reached the
    latents (``inputs.dirtied``), so a later call of ``component`` given finite arguments (asked by the caller)
    shows that something cleaned it, and ``component``'s own NaN/Inf is not that origin's consequence. Never for
    an Inf a block clipped or a NaN/Inf made from near-max values (``clipped_in``, ``near_max``,
    ``overflowed_in``): the values it left are finite but carry it, and finite arguments prove nothing.

    Limit: the arguments read are the kept call's, at its call site (the VAE's ``decoder``): a NaN/Inf the
    component makes before that call, outside it (the SD VAE's ``post_quant_conv``, run by ``vae.decode``
    ahead of the decoder), reaches the decoder as non-finite arguments and stays a warning pointing at the
    earlier origin, though the callback had cleaned it.

    >>> made = between_origin(["sample"], seen_in="unet", step=1, timestep=None, phase="denoise")
    >>> cleaned_away(RunInputs(dirtied=True), made, "vae"), cleaned_away(RunInputs(), made, "vae")
    (True, False)
    >>> made.details["clipped_in"] = "conv_out"  # (an Inf the block clipped: finite latents that carry it)
    >>> cleaned_away(RunInputs(dirtied=True), made, "vae")
    False
    """
    if origin is None or origin.component == component or not inputs.dirtied:
        return False
    return not any(key in origin.details for key in ("clipped_in", "near_max", "overflowed_in"))


def state_origin(state: list[str], *, component: str, step: int | None, timestep: float | None, phase: str) -> Anomaly:
    """The one error for NaN/Inf that ``component`` got back through its own ``state`` (a cache
    that its earlier calls filled, ``feat_cache``): one of its modules made it in an earlier call."""
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component=component,
        module="",
        step=step,
        timestep=timestep,
        details={"localized_by": "its own state", "arguments": state, "phase": phase},
    )


def explain_received(
    component: str,
    received: list[str],
    state: list[str],
    inputs: RunInputs,
    *,
    step: int | None,
    timestep: float | None,
    phase: str,
    fraction: float = 1.0,
) -> Anomaly:
    """The origin of a NaN/Inf that ``component`` received while no watched module had made one:
    a non-finite value the user passed, the user's step-end callback (the previous step's latents
    were finite), a value the user passed at ``fraction`` of its dtype's max or beyond that the
    pipeline's code overflowed, the pipeline's own code (``received``: its non-finite arguments), else the
    component itself, through its own ``state`` (the non-finite arguments it gets back from its
    earlier calls, which are never the pipeline's)."""
    bad_inputs = inputs.nonfinite()
    if bad_inputs:
        return input_origin(bad_inputs, seen_in=component, step=step, timestep=timestep, phase=phase)
    ended = inputs.callback_step(step) if phase == "denoise" else None
    if ended is not None:
        return callback_origin(inputs.callback, ended, seen_in=component, step=step, phase=phase)
    if state and not received:
        return state_origin(state, component=component, step=step, timestep=timestep, phase=phase)
    near_max = inputs.near_max(fraction)  # (a fault's path: host reads)
    if near_max:
        return near_max_input(near_max, seen_in=component, step=step, timestep=timestep, phase=phase)
    passes = None  # the first step of a run in the call of the run before (FreeInit's next pass)
    if step == 0 and inputs.before is not None and inputs.before[0] is not None:
        passes = (inputs.before[0], bool(getattr(inputs.pipe, "free_init_enabled", False)))
    return between_origin(received, seen_in=component, step=step, timestep=timestep, phase=phase, passes=passes)


def explain_latents(
    sample: Any,
    model_output: Any,
    inputs: RunInputs,
    *,
    denoiser: str,
    scheduler: str,
    step: int | None,
    timestep: float | None,
    fraction: float = 1.0,
) -> Anomaly:
    """The origin of latents that became non-finite in a step whose denoiser output was finite,
    from that ``scheduler.step`` call's ``sample`` and ``model_output`` and the run's inputs (those
    at ``fraction`` of their dtype's max or beyond: the input's)."""
    ended = inputs.callback_step(step)
    if ended is not None and is_nonfinite(sample):
        return callback_origin(inputs.callback, ended, seen_in="scheduler.step", step=step, phase="scheduler")
    return scheduler_origin(
        denoiser=denoiser,
        model_output_finite=not is_nonfinite(model_output),
        sample_finite=not is_nonfinite(sample),
        guidance=inputs.guidance(),
        step=step,
        timestep=timestep,
        scheduler=scheduler,
        near_max=inputs.near_max(fraction),
    )
