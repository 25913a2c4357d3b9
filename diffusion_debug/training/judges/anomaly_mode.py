"""Autograd anomaly mode, used sparingly: name the backward op that made a NaN/Inf and the
forward line that created it.

* :func:`localize_backward` — the cheap default: re-run one step's forward + backward under
  ``torch.autograd.detect_anomaly(check_nan=True)`` only after a step already went non-finite;
  the gradients of the watched parameters are saved before and restored after, so the user's
  step is unchanged.
* :func:`catch_nonfinite_backward` — the user's own forward + backward under anomaly mode; a
  NaN/Inf in backward is caught and described instead of raised.
* :class:`ProcessAnomalyMode` — anomaly mode for the whole process without ``check_nan``
  (``enable_autograd_anomaly``), and giving back the mode as it was.
* :func:`localization_anomaly` — the ``nonfinite`` anomaly for what anomaly mode found.

Limits: the closure must recompute the same loss (same batch, same noise); with dropout or other
randomness the replay can differ (it runs under ``torch.random.fork_rng``, so the random numbers it
draws do not advance the user's CPU and CUDA generators); the watched model and every DDP module
the closure calls replay under ``no_sync()`` so the replay's backward does not all-reduce.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ...errors import DiffusionDebugError
from ...probes import buffers_kept
from ...record import Anomaly, make_anomaly
from ...stats import cuda_devices
from ..measure import gradients

_OP = re.compile(r"Function '(\w+)' returned (nan|inf|NaN|Inf)[^.]* values in its (\d+)\w* output")
_TRACE = re.compile(r"Error detected in (\w+)\. Traceback of forward call that caused the error:\n(.*)", re.S)
_PACKAGE = str(Path(__file__).resolve().parents[2]) + os.sep
"""diffusion_debug's folder: a replay's frames in an anomaly mode traceback are ours, not the forward's."""
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)(?:\n\s+(.*))?')


def parse_anomaly(error_text: str, warning_texts: Sequence[str] = ()) -> dict[str, Any]:
    """The backward op, output index and forward frames from anomaly mode's error and warning.

    >>> parse_anomaly("Function 'DivBackward0' returned nan values in its 0th output.")["op"]
    'DivBackward0'
    """
    out: dict[str, Any] = {"error": error_text.strip().splitlines()[0] if error_text.strip() else ""}
    match = _OP.search(error_text)
    if match:
        out.update(op=match.group(1), value=match.group(2).lower(), output_index=int(match.group(3)))
    for text in warning_texts:
        trace = _TRACE.search(text)
        if trace and "forward_frames" not in out:  # the first: the op's (a reentrant checkpoint's follows it)
            out.setdefault("op", trace.group(1))
            body = trace.group(2).split("(Triggered internally")[0]
            frames = [
                {"file": f, "line": int(line), "function": fn, "code": (code or "").strip()}
                for f, line, fn, code in _FRAME.findall(body)
            ]
            ours = [i for i, frame in enumerate(frames) if frame["file"].startswith(_PACKAGE)]
            if ours:  # the replay's own frames: what its closure ran, or a reentrant checkpoint recomputed, follows
                frames = frames[ours[-1] + 1 :] or frames
            out["forward_frames"] = frames[-5:]
            outside = [fr for fr in frames if "/torch/" not in fr["file"]]  # a library's module (diffusers') next
            user = [fr for fr in outside if "/site-packages/" not in fr["file"]]
            last = (user or outside or frames or [None])[-1]
            if last:
                out["forward_line"] = f"{last['file']}:{last['line']} in {last['function']}" + (
                    f": {last['code']}" if last["code"] else ""
                )
    return out


@contextlib.contextmanager
def _saved_grads(params: Sequence[torch.Tensor]):
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class _Replays(threading.local):
    """The :func:`localize_backward` replays running in this thread (a replay runs in its caller's
    thread: another thread's forward meanwhile is the user's own)."""

    running = 0


_REPLAYS = _Replays()


def replaying() -> bool:
    """Whether a :func:`localize_backward` replay (the debugger's own forward and backward) is
    running in this thread: an out-of-memory error raised in it is no error of the user's step.
    Asked only when an error is on its way out, never on a clean step."""
    return _REPLAYS.running > 0


def localize_backward(
    closure: Callable[[], Any],
    params: Sequence[torch.Tensor],
    model: Any = None,
    timeout: float | None = None,
    on_error: Callable[[RuntimeError], None] | None = None,
) -> dict[str, Any]:
    """Re-run ``closure()`` (forward + loss) and its backward under anomaly mode; return what
    it found: ``op`` (e.g. ``'DivBackward0'``), ``forward_line``, ``forward_frames``, or
    ``found: False`` when the replay stayed finite (with ``error`` when it failed: an OOM, any
    RuntimeError that is not anomaly mode's, handed to ``on_error`` too, not kept: its frames
    hold the replay's tensors, unless ``on_error`` raises it, ``strict=True``; any other error is
    raised). ``.grad`` of ``params``, the random number generators (CPU, and the CUDA devices of
    ``params`` and the current one) and the buffers of ``model`` (BatchNorm's running statistics)
    are restored. A reentrant gradient checkpoint refuses a backward into ``params`` alone: the replay
    then runs again with a plain backward, every leaf it reaches given back its gradient (the leaves of
    the graph, of ``model`` and of the modules the checkpoints recompute; limit: a leaf of another model
    called only inside a checkpointed function keeps the replay's gradient)."""
    started = time.perf_counter()
    no_sync = getattr(model, "no_sync", None) if model is not None else None
    with (
        _saved_grads(params),
        buffers_kept(model) if hasattr(model, "modules") else contextlib.nullcontext(),
        no_sync() if callable(no_sync) else contextlib.nullcontext(),
        _every_ddp_unsynced(),
    ):
        result = _replay(closure, params, model, list(params), on_error)
        if result is None:  # a reentrant checkpoint in the graph
            result = _replay(closure, params, model, None, on_error)
    result["seconds"] = round(time.perf_counter() - started, 4)
    if timeout is not None and result["seconds"] > timeout:
        result["note"] = f"the replay took {result['seconds']:.1f}s, over debug_timeout={timeout}s"
    return result


_DDP = torch.nn.parallel.DistributedDataParallel


@contextlib.contextmanager
def _every_ddp_unsynced() -> Iterator[None]:
    """Every DDP module the replay's closure calls (in this thread) runs under its ``no_sync()``,
    entered as it is called, before its forward prepares the reducer: a plain backward (a reentrant
    checkpoint's) reaches the leaves of every model the closure runs, and a reducer other than the
    watched model's (a DDP-wrapped text encoder trained beside it) would all-reduce on a rank whose
    replay went past it while another's stopped at the NaN: a hang. The flag by which a forward under
    ``no_sync()`` skips the next forward's buffer broadcast is put back too: the user's next forward
    syncs as it would have. A DDP module compiled whole is found by its ``_orig_mod``."""
    thread, seen = threading.get_ident(), set()
    with contextlib.ExitStack() as stack:

        def unsynced(module: torch.nn.Module, args: Any) -> None:
            ddp = getattr(module, "_orig_mod", module)
            if threading.get_ident() != thread or not isinstance(ddp, _DDP) or id(ddp) in seen:
                return  # another thread's forward is the user's own
            seen.add(id(ddp))
            stack.callback(setattr, ddp, "require_forward_param_sync", ddp.require_forward_param_sync)
            stack.enter_context(ddp.no_sync())

        with register_module_forward_pre_hook(unsynced):
            yield


_REENTRANT = "torch.utils.checkpoint is incompatible with"
"""torch's error for a backward given ``inputs=`` that reaches a reentrant checkpoint."""


def _replay(
    closure: Callable[[], Any],
    params: Sequence[torch.Tensor],
    model: Any,
    into: list[torch.Tensor] | None,
    on_error: Callable[[RuntimeError], None] | None,
) -> dict[str, Any] | None:
    """One replay of :func:`localize_backward`, its backward into ``into`` (None: a plain one, every
    leaf's gradient put back); None when a reentrant checkpoint refused ``into``."""
    result: dict[str, Any] = {"found": False}
    with (
        torch.random.fork_rng(devices=cuda_devices(list(params))),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        _REPLAYS.running += 1
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                loss = closure()
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"the closure must return the loss tensor, not {type(loss).__name__}")
                if not torch.isfinite(loss.detach()).all():
                    result["loss_nonfinite"] = True
                # into the watched parameters only (their gradients are put back after): a
                # plain backward would add a second gradient to every other leaf, unwatched
                # models included
                if into is not None:
                    loss.backward(inputs=into)
                else:
                    with _saved_grads(_leaves(loss, model)):
                        loss.backward()
        except RuntimeError as error:  # anomaly mode's, naming the op; else the replay failed (an OOM)
            if into is not None and _REENTRANT in str(error):
                return None
            parsed = parse_anomaly(str(error), [str(w.message) for w in caught])
            if "op" in parsed:
                result = {**result, "found": True, **parsed}
            else:
                result = {**result, "error": f"{type(error).__name__}: {parsed['error']}"}
                if on_error is not None:
                    on_error(error)
        finally:
            _REPLAYS.running -= 1
    return result


def _leaves(loss: torch.Tensor, model: Any) -> list[torch.Tensor]:
    """The leaves a plain backward of ``loss`` accumulates into: its graph's, and the trainable
    parameters of ``model`` and of every module a reentrant checkpoint recomputes (their leaves
    are not in the graph: the checkpoint's backward makes its own)."""
    leaves: dict[int, torch.Tensor] = {}
    modules = [model] if isinstance(model, torch.nn.Module) else []
    seen, nodes = set(), [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad's leaf
        if variable is not None:
            leaves[id(variable)] = variable
        run = getattr(node, "run_function", None)  # CheckpointFunction's: a module or its bound method
        owner = run if isinstance(run, torch.nn.Module) else getattr(run, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            modules.append(owner)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    for module in modules:
        leaves.update((id(p), p) for p in module.parameters() if p.requires_grad)
    return list(leaves.values())


@dataclass
class CaughtAnomaly:
    """What :func:`catch_nonfinite_backward` caught: nothing (``found is None``) or the op."""

    found: dict[str, Any] | None = None
    error: RuntimeError | None = None


@contextlib.contextmanager
def catch_nonfinite_backward() -> Iterator[CaughtAnomaly]:
    """Run the enclosed forward and backward under ``detect_anomaly(check_nan=True)``; a NaN/Inf
    in backward is caught into the yielded :class:`CaughtAnomaly` (any other error propagates).
    The user's own warnings raised inside are given back; anomaly mode's own are dropped."""
    result = CaughtAnomaly()
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    yield result
            except RuntimeError as error:
                found = {"found": True, **parse_anomaly(str(error), [str(w.message) for w in caught])}
                if "op" not in found:
                    raise
                result.found, result.error = found, error
    finally:
        _reemit(caught)  # outside the recorder: the user's own warnings are not swallowed


def _reemit(caught: list) -> None:
    """Give back the warnings caught while anomaly mode ran, except anomaly mode's own."""
    for w in caught:
        text = str(w.message)
        if "Anomaly Detection has been enabled" in text or "Traceback of forward call" in text:
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def localization_anomaly(found: dict[str, Any], step: int | None, rank: int, **details: Any) -> Anomaly:
    """The ``nonfinite`` anomaly for what anomaly mode found (``found`` as returned by
    :func:`localize_backward` or caught by :func:`catch_nonfinite_backward`).

    >>> print(localization_anomaly({"found": True, "op": "DivBackward0", "value": "nan"}, 3, 0).message)
    Autograd anomaly mode: DivBackward0 returned nan values: fix that op's inputs (e.g. a division by
    zero or the log of 0).
    """
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="model",
        step=step,
        rank=rank,
        details={"localization": found, **details},
    )


class ProcessAnomalyMode:
    """Anomaly mode for the whole process *without* ``check_nan`` (``enable_autograd_anomaly``):
    every op keeps its forward traceback, so an error raised in the user's own backward names the
    forward line (slow), but a NaN does not raise in their loop: it is recorded at the next
    monitored step. Naming the backward op that made a NaN is :func:`localize_backward`'s
    (``closure=``) and :func:`catch_nonfinite_backward`'s (``TrainingDebugger.anomaly_mode``).
    :meth:`remove` (the debugger's ``detach()``, or its collection) gives back the mode as it
    was; idempotent."""

    def __init__(self) -> None:
        self.previous: tuple[bool, bool] | None = None

    def enable(self) -> None:
        if self.previous is None:
            self.previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        torch.set_anomaly_enabled(True, False)

    def remove(self) -> None:
        previous, self.previous = self.previous, None
        if previous is not None:
            torch.set_anomaly_enabled(*previous)


class Localization:
    """A ``TrainingDebugger``'s replays under anomaly mode that the user asks for (a base of it, as
    ``core.Lifecycle`` is): recorded through its ``sink`` at its last monitored step
    (``_steps.history.previous_step``) and rank (``_ctx``), over its watched ``params``."""

    def localize(self, closure: Callable[[], torch.Tensor]) -> dict[str, Any]:
        """Re-run ``closure`` (forward + loss) and its backward under autograd anomaly mode;
        the gradients are restored afterwards. Returns ``op`` (the backward function that made
        the NaN/Inf) and ``forward_line`` when found (``found: False`` otherwise), and records a
        ``nonfinite`` anomaly when it found one. Local to this process (no collective)."""
        found = localize_backward(closure, self.params.params, self.watched.replay_target, self.config.debug_timeout)
        if found.get("found"):
            self.sink.emit(localization_anomaly(found, self._steps.history.previous_step, self._ctx.rank))
        return found

    @contextlib.contextmanager
    def anomaly_mode(self) -> Iterator[None]:
        """Run the enclosed forward and backward under ``torch.autograd.detect_anomaly(check_nan=True)``.

        When backward reports a NaN/Inf: ``autograd_anomaly_mode="detect"`` records a
        ``nonfinite`` anomaly (op and forward line) and zeroes the gradients so the following
        ``optimizer.step()`` adds nothing; ``"warn"`` also warns; ``"raise"`` raises
        DiffusionDebugError. Slow: every op keeps its forward traceback.
        """
        with catch_nonfinite_backward() as caught:
            yield
        if caught.found is None:
            return
        step = self._steps.history.previous_step
        anomaly = localization_anomaly(caught.found, step, self._ctx.rank, source="anomaly_mode")
        self.sink.emit(anomaly)
        mode = self.config.autograd_anomaly_mode
        if mode == "raise":
            raise DiffusionDebugError(anomaly.message, anomaly=anomaly, run_dir=self.record.run_dir) from caught.error
        gradients.zero_gradients(self.params)
        if mode == "warn":
            warnings.warn(anomaly.message, RuntimeWarning, stacklevel=3)
