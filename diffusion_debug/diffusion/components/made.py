"""The NaN/Inf values a watched component made, kept by identity: one the user passes back to a later call
(the ``prompt_embeds`` of ``pipe.encode_prompt``, the ``ip_adapter_image_embeds`` of
``pipe.prepare_ip_adapter_image_embeds``) is named at the component (and module) that made it, in the run that made
it, with the input as the way it came; not as the user's input.

Only on the NaN/Inf path, nothing on a clean call: as a watched component's NaN/Inf error is emitted, the outermost
frame of a method of the pipeline on the stack is kept (the method the user called: ``encode_prompt``, or
``__call__``), with the ids of its arguments then. Once it has returned (asked as the next run begins, at a look-up and
at detach), or as a ``__call__`` ends (its ``maybe_free_model_hooks``, where the code after it only returns what the
call made: :func:`returns_next`; a call's latents and images are not held past it), the tensors among its locals (what
it returned among them; in lists, tuples and dicts two levels deep) are kept weakly, each with its ``_version`` and
storage, and the frame is let go. A pipeline input found non-finite is looked up: the same tensor object, unchanged
since (version, storage), came from the maker; a clone or a tensor edited in place is a new value, the user's input.

Limits: the last :data:`LIMIT` makers are kept, by one debugger (another debugger's run is not looked in), and
forgotten by ``clear_debug_history``; a value the user computed from the maker's output is the user's; a component the
user called directly (not through a method of the pipeline), a method still running at detach and a Modular Diffusers
pipeline's output (held in its state, not in a local) are not followed; what the user passed is left out (the run's
``__call__`` arguments as it began; another method's arguments as the NaN/Inf was made). ``encode_prompt`` called by
the user is read as our wrapper of it returns, and a call the debugger's policy raises out of at the raise. The frame
of a method with no end of ours (a call that raised an exception not ours, another method the user called such as
``prepare_ip_adapter_image_embeds``, a ``ComponentsManager``'s pipelines, a ``__call__`` that computes after it frees
its models for the last time, or one that calls another pipeline method that frees them) is held until the next run, a
look-up or detach: its locals with it. One that frees them before its end too
(``StableDiffusionImageVariationPipeline``, before its VAE decode) is read as it frees them at its end.
"""

from __future__ import annotations

import dis
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...record import Anomaly, make_anomaly
from ..origins import running
from .inventory import watchable_kind

LIMIT = 4
"""Makers kept (the oldest let go first)."""
NOT_MADE = frozenset(("input", "pipeline", "scheduler", "callback", "", "model"))
"""Components of an origin that is no watched component's call."""
MADE_EARLIER = "made in an earlier run"
"""``details["localized_by"]`` of a NaN/Inf passed back to a later call (:func:`made_origin`)."""
_DEPTH = 60  # frames walked up from the emit


@dataclass
class Made:
    """One maker: its error (``component``, ``module``, ``step``, ``details["run"]``) and what its method returned."""

    anomaly: Any
    method: str
    """The pipeline method whose call made it (``encode_prompt``)."""
    frame: Any = None
    """That method's frame until it returned (its locals then read), then None."""
    passed: frozenset[int] = frozenset()
    tensors: list[tuple[weakref.ref, int, int]] = field(default_factory=list)
    """``(tensor, _version, data_ptr)`` of each tensor among the method's locals as it returned."""


class MadeNonfinite:
    """The makers of one debugger (see the module docstring); ``pending``: a kept frame not yet read."""

    def __init__(self) -> None:
        self.pipe: Any = None
        """The watched object: its methods' frames are kept (a ``ComponentsManager``: any pipeline's)."""
        self.made: list[Made] = []
        self.pending = False

    def remember(self, anomaly: Any, passed: dict[str, Any] | None = None) -> None:
        """``anomaly``, an error just emitted: a watched component's NaN/Inf (not one passed back, already named at
        its maker) keeps the outermost method of the pipeline on the stack (none on it: nothing to follow); what the
        user passed to the run (``passed``, the ``__call__``'s arguments as the run began) is never the maker's.
        A failure here (a frame or value this code did not foresee) forgets the makers: never the run's failure."""
        try:
            self._remember(anomaly, passed)
        except Exception:
            self.clear()

    def _remember(self, anomaly: Any, passed: dict[str, Any] | None) -> None:
        if anomaly.kind != "nonfinite" or anomaly.component in NOT_MADE:
            return
        if anomaly.details.get("localized_by") == MADE_EARLIER:
            return
        pipe, any_pipeline = self.pipe, watchable_kind(self.pipe) == "manager"
        found, frame = None, sys._getframe(1)
        for _ in range(_DEPTH):
            if frame is None:
                break
            code = frame.f_code  # (the debugger's own wrappers, a patched method's dispatcher, are passed over)
            if code.co_argcount and code.co_varnames[0] == "self" and not _ours(frame):
                owner = frame.f_locals.get("self")
                if owner is pipe or (any_pipeline and watchable_kind(owner) in ("pipeline", "modular")):
                    found = frame
            frame = frame.f_back
        if found is None:
            return
        code, local = found.f_code, found.f_locals
        given = frozenset(id(t) for t in _tensors(list((passed or {}).values())))
        if code.co_name != "__call__":  # a method the user called: its arguments (not yet reassigned: the call runs)
            names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
            given |= frozenset(id(t) for name in names for t in _tensors(local.get(name)))
        self.made.append(Made(anomaly, code.co_name, found, given))
        del self.made[:-LIMIT]
        self.pending = True

    def settle(self, *, drop_running: bool = False, ending: bool = False, raising: bool = False) -> None:
        """Each kept frame that has returned read (its tensors kept weakly) and let go; ``drop_running``: one still
        running let go too (detach: no frame, and no locals, held past it); ``ending``: asked from the pipeline's
        ``maybe_free_model_hooks``, the method that called it read as it is now (it returns next); ``raising``: the
        debugger's policy raises through this thread's stack, each running one on it read as it is now (it returns
        nothing) and let go at the raise, not held until the next run. A failure forgets the makers."""
        try:
            caller = _caller() if ending else None
            returning = caller is not None and returns_next(caller.f_code, caller.f_lasti)
            self._settle(drop_running, caller if returning else None, _stack() if raising else ())
        except Exception:
            self.clear()

    def _settle(self, drop_running: bool, ending: Any = None, unwound: Any = ()) -> None:
        pending = False
        for made in self.made:
            frame = made.frame
            if frame is None:
                continue
            if frame is not ending and frame not in unwound and running(frame):
                if drop_running:
                    made.frame = None
                else:
                    pending = True
                continue
            made.frame = None
            kept = []
            for value in list(frame.f_locals.values()):  # (every local: a pipeline's __call__ has more than 64)
                for tensor in _tensors(value, 1):
                    if id(tensor) not in made.passed:
                        kept.append((weakref.ref(tensor), *_stamp(tensor)))
            made.tensors = kept
        self.pending = pending

    def maker_of(self, values: dict[str, Any], names: list[str]) -> tuple[Made, list[str]] | None:
        """The latest maker of any of the non-finite inputs ``names`` (``values``: the run's inputs), with the names
        it made; None: each is a new value (the user's)."""
        if self.pending:
            self.settle()
        found = {}
        for name in names:
            indices = [index for index in map(self._index, _tensors(values.get(name))) if index is not None]
            if indices:
                found[name] = max(indices)
        if not found:
            return None
        latest = max(found.values())
        return self.made[latest], [name for name, index in found.items() if index == latest]

    def _index(self, tensor: torch.Tensor) -> int | None:
        for index in range(len(self.made) - 1, -1, -1):
            for ref, version, pointer in self.made[index].tensors:
                if ref() is tensor and _stamp(tensor) == (version, pointer):
                    return index
        return None

    def clear(self) -> None:
        self.made, self.pending = [], False


def made_origin(made: Made, passed_as: list[str], origin: Anomaly) -> Anomaly:
    """The one error for NaN/Inf a watched component made in an earlier run (``made``), passed back by the user as
    the inputs ``passed_as``, in place of the input ``origin`` (which names where it was first seen)."""
    maker = made.anomaly
    details = {
        "localized_by": MADE_EARLIER,
        "made_in": made.method,
        "passed_as": passed_as,
        "seen_in": origin.details.get("seen_in"),
        "seen_at_step": origin.step,
        "phase": maker.details.get("phase"),
    }
    if "run" in maker.details:
        details["run"] = maker.details["run"]
    if "weights_dtype" in maker.details:  # a float32 module's float16 output under autocast: the advice its error gave
        details.update(dtype=maker.details.get("dtype"), weights_dtype=maker.details["weights_dtype"])
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component=maker.component,
        module=maker.module,
        step=maker.step,
        timestep=maker.timestep,
        details=details,
    )


def _stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """``(_version, data_ptr)``: an inference tensor (made under ``torch.inference_mode``) has no version counter
    (-1: its storage alone tells; it cannot be edited in place outside inference mode)."""
    return (-1 if tensor.is_inference() else tensor._version), tensor.data_ptr()


def _caller() -> Any:
    """The first frame up the stack that is not this package's: the pipeline method whose call reached us."""
    frame = sys._getframe(2)
    while frame is not None and _ours(frame):
        frame = frame.f_back
    return frame


_RETURNING = frozenset(
    (
        "LOAD_CONST",
        "BUILD_TUPLE",
        "KW_NAMES",
        "PRECALL",
        "PUSH_NULL",
        "CACHE",
        "NOP",
        "NOT_TAKEN",
        "POP_TOP",
        "TO_BOOL",
        "EXTENDED_ARG",  # (3.10: a jump's argument over 255)
    )
    + ("RETURN_VALUE", "RETURN_CONST", "JUMP_FORWARD", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE")
    + ("POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE")
)
"""Opcodes that make no value of their own: what a pipeline's ``__call__`` runs after freeing its models, where it
only returns what it made (``(image,)`` or ``StableDiffusionPipelineOutput(images=image)``)."""
_RETURNS_NEXT: dict[tuple[Any, int | None], bool] = {}


def returns_next(code: Any, offset: int | None = None) -> bool:
    """Whether ``code`` calls ``maybe_free_model_hooks`` once (or, given ``offset``, the frame's ``f_lasti`` as it
    calls it: at that call, the last of several, as ``StableDiffusionImageVariationPipeline`` frees before its VAE
    decode and at its end), and after it only returns its locals, in a tuple or a ``*Output`` class (every diffusers
    pipeline ending as Stable Diffusion's does): its locals as the call frees its models are what it returns. Read once
    a code object and offset (only on the NaN/Inf path)."""
    known = _RETURNS_NEXT.get((code, offset))
    if known is None:
        ops = list(dis.get_instructions(code))
        at = [i for i, op in enumerate(ops) if op.argval == "maybe_free_model_hooks"]
        if offset is not None:  # the one whose call holds offset (a call's last code unit: its inline caches')
            at = [i for i in at if any(_holds(ops, j, offset) for j in range(i, min(i + 8, len(ops))))]
        calls = [i for i, op in enumerate(ops[at[0] :]) if op.opname.startswith("CALL")] if len(at) == 1 else []
        known, outputs = bool(calls), 0  # output classes loaded and not called yet
        for op in _run_after(ops, at[0] + calls[0] + 1) if calls else ():
            if op.opname == "LOAD_GLOBAL" and str(op.argval).endswith("Output"):
                outputs += 1
            elif op.opname.startswith("CALL"):
                outputs -= 1
                known = known and outputs >= 0  # only an output class is called
            elif not (op.opname.startswith("LOAD_FAST") or op.opname in _RETURNING or _cell_local(op, code)):
                known = False
        _RETURNS_NEXT[code, offset] = known
    return known


def _cell_local(op: Any, code: Any) -> bool:
    """Whether ``op`` loads a local of ``code`` that a closure holds (a cell: ``LOAD_DEREF`` before 3.12 inlined
    comprehensions; Marigold's pipelines return their ``prediction`` so)."""
    return op.opname == "LOAD_DEREF" and op.argval in code.co_cellvars


_JUMPS = frozenset(dis.hasjrel + dis.hasjabs)
_ENDS = frozenset(("RETURN_VALUE", "RETURN_CONST", "RERAISE", "RAISE_VARARGS"))
_GOES = frozenset(("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE", "JUMP"))


def _run_after(ops: list, start: int) -> list:
    """The instructions of ``ops`` a call can run from ``start`` on, by its jumps, in code order; not the
    exception handlers' (Python 3.12 puts them after the last return: a ``with`` block's, an inlined
    comprehension's), which run only for an error."""
    where = {op.offset: index for index, op in enumerate(ops)}
    found: set[int] = set()
    todo = [start]
    while todo:
        index = todo.pop()
        while index < len(ops) and index not in found:
            found.add(index)
            op = ops[index]
            if op.opcode in _JUMPS and op.argval in where:
                todo.append(where[op.argval])
            if op.opname in _ENDS or op.opname in _GOES:
                break
            index += 1
    return [ops[index] for index in sorted(found)]


def _stack() -> list:
    """The frames on this thread's stack (what an exception raised here unwinds, unless caught)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _holds(ops: list, index: int, offset: int) -> bool:
    """Whether ``ops[index]`` is a call whose code units (its inline caches with it) hold ``offset``."""
    end = ops[index + 1].offset if index + 1 < len(ops) else offset + 1
    return ops[index].opname.startswith("CALL") and ops[index].offset <= offset < end


def _ours(frame: Any) -> bool:
    return str(frame.f_globals.get("__name__", "")).startswith("diffusion_debug.")


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The floating tensors in ``value`` (a tensor, or a list, tuple or dict of them, two levels deep, 64 items)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif depth <= 2 and isinstance(value, (list, tuple)):
        for item in value[:64]:
            yield from _tensors(item, depth + 1)
    elif depth <= 2 and isinstance(value, dict):
        for item in list(value.values())[:64]:
            yield from _tensors(item, depth + 1)
