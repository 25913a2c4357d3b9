"""Autograd anomaly mode, used sparingly: name the backward op that made a NaN/Inf and the
forward line that created it, and a float64 numerical gradient check with a readable result.

The cheap default (:func:`localize_backward`) re-runs one step's forward + backward under
``torch.autograd.detect_anomaly(check_nan=True)`` only after a step already went non-finite;
the gradients of the watched parameters are saved before and restored after, so the user's
step is unchanged.  Limits: the closure must recompute the same loss (same batch, same noise);
with dropout or other randomness the replay can differ (it runs under ``torch.random.fork_rng``,
so the random numbers it draws do not advance the user's CPU and CUDA generators); a model
wrapped in DDP replays under ``no_sync()`` so the replay's backward does not all-reduce.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..stats import cuda_devices

_OP = re.compile(r"Function '(\w+)' returned (nan|inf|NaN|Inf)[^.]* values in its (\d+)\w* output")
_TRACE = re.compile(r"Error detected in (\w+)\. Traceback of forward call that caused the error:\n(.*)", re.S)
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
        if trace:
            out.setdefault("op", trace.group(1))
            body = trace.group(2).split("(Triggered internally")[0]
            frames = [
                {"file": f, "line": int(line), "function": fn, "code": (code or "").strip()}
                for f, line, fn, code in _FRAME.findall(body)
            ]
            out["forward_frames"] = frames[-5:]
            user = [fr for fr in frames if "/torch/" not in fr["file"] and "/site-packages/" not in fr["file"]]
            last = (user or frames or [None])[-1]
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


def localize_backward(
    closure: Callable[[], Any],
    params: Sequence[torch.Tensor],
    model: nn.Module | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Re-run ``closure()`` (forward + loss) and its backward under anomaly mode; return what
    it found: ``op`` (e.g. ``'DivBackward0'``), ``forward_line``, ``forward_frames``, or
    ``found: False`` when the replay stayed finite. ``.grad`` of ``params`` and the random number
    generators (CPU, and the CUDA devices of ``params`` and the current one) are restored."""
    started = time.perf_counter()
    no_sync = getattr(model, "no_sync", None) if model is not None else None
    result: dict[str, Any] = {"found": False}
    with (
        _saved_grads(params),
        torch.random.fork_rng(devices=cuda_devices(list(params))),
        no_sync() if callable(no_sync) else contextlib.nullcontext(),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    loss = closure()
                    if isinstance(loss, (tuple, list)):
                        loss = loss[0]
                    if not isinstance(loss, torch.Tensor):
                        raise TypeError(f"the closure must return the loss tensor, not {type(loss).__name__}")
                    if not torch.isfinite(loss.detach()).all():
                        result["loss_nonfinite"] = True
                    loss.backward()
            except RuntimeError as error:
                texts = [str(w.message) for w in caught]
                result = {**result, "found": True, **parse_anomaly(str(error), texts)}
    result["seconds"] = round(time.perf_counter() - started, 4)
    if timeout is not None and result["seconds"] > timeout:
        result["note"] = f"the replay took {result['seconds']:.1f}s, over debug_timeout={timeout}s"
    return result


# -- numerical gradient check -------------------------------------------------------------


@dataclass
class GradientCheckResult:
    """Outcome of :func:`check_gradients_numerically`."""

    ok: bool
    max_abs_error: list[float]
    """Per input: max |analytical - numerical| over the Jacobian."""
    max_rel_error: list[float]
    """Per input: max |analytical - numerical| / max(|numerical|, atol)."""
    failed_input: int | None
    """Index of the first input whose gradient disagrees (None when ok)."""
    message: str
    gradcheck_passed: bool = True
    details: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok


def check_gradients_numerically(
    fn_or_module: Callable[..., Any] | nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
) -> GradientCheckResult:
    """Compare analytical gradients with central finite differences, in float64.

    Runs ``torch.autograd.gradcheck(..., raise_exception=False)`` and, for the error figures,
    its own comparison: the analytical Jacobian from ``torch.autograd.functional.jacobian``
    against a central-difference Jacobian, per input. A module is cast to float64 on a copy
    (the original is untouched). Meant for small inputs: the numerical Jacobian costs two calls
    per input element.

    >>> check_gradients_numerically(torch.sin, torch.randn(3)).ok
    True
    """
    import copy

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(
        (
            x.detach().to(torch.float64).requires_grad_(True)
            if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x
        )
        for x in inputs
    )
    fn = fn_or_module
    if isinstance(fn_or_module, nn.Module):
        fn = copy.deepcopy(fn_or_module).to(torch.float64)

    def flat_output(*args):
        out = fn(*args)
        if isinstance(out, (tuple, list)):
            out = torch.cat([o.reshape(-1) for o in out if isinstance(o, torch.Tensor)])
        return out.reshape(-1)

    differentiable = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            passed = bool(
                torch.autograd.gradcheck(flat_output, inputs, eps=eps, atol=atol, rtol=rtol, raise_exception=False)
            )
        except Exception as error:  # e.g. a backward that raises
            passed = False
            gradcheck_error = f"{type(error).__name__}: {error}"
        else:
            gradcheck_error = None

    abs_errors, rel_errors = [], []
    failed = None
    for i in differentiable:

        def of_input(x, i=i):
            args = list(inputs)
            args[i] = x
            return flat_output(*args)

        x0 = inputs[i].detach()
        try:
            analytical = torch.autograd.functional.jacobian(of_input, x0).reshape(-1, x0.numel())
        except Exception as error:
            abs_errors.append(float("inf"))
            rel_errors.append(float("inf"))
            failed = i if failed is None else failed
            gradcheck_error = gradcheck_error or f"{type(error).__name__}: {error}"
            continue
        numerical = torch.empty_like(analytical)
        flat = x0.reshape(-1)
        with torch.no_grad():
            for j in range(flat.numel()):
                plus, minus = flat.clone(), flat.clone()
                plus[j] += eps
                minus[j] -= eps
                numerical[:, j] = (of_input(plus.reshape(x0.shape)) - of_input(minus.reshape(x0.shape))) / (2 * eps)
        diff = (analytical - numerical).abs()
        abs_err = float(diff.max()) if diff.numel() else 0.0
        rel_err = float((diff / numerical.abs().clamp(min=atol)).max()) if diff.numel() else 0.0
        abs_errors.append(abs_err)
        rel_errors.append(rel_err)
        bad = not bool((diff <= atol + rtol * numerical.abs()).all())
        if bad and failed is None:
            failed = i

    ok = passed and failed is None
    if ok:
        message = (
            f"Analytical gradients match finite differences for all {len(differentiable)} input(s) "
            f"(max abs error {max(abs_errors, default=0.0):.3g})."
        )
    else:
        if failed is None:
            failed = differentiable[0] if differentiable else None
        where = f"input {failed}" if failed is not None else "the function"
        err = abs_errors[differentiable.index(failed)] if failed in differentiable else float("nan")
        message = (
            f"The analytical gradient of {where} disagrees with finite differences (max abs error {err:.3g}, "
            f"atol={atol}, rtol={rtol}): check that input's backward formula."
        )
    details = {"differentiable_inputs": differentiable, "eps": eps, "atol": atol, "rtol": rtol}
    if gradcheck_error:
        details["gradcheck_error"] = gradcheck_error
    return GradientCheckResult(ok, abs_errors, rel_errors, None if ok else failed, message, passed, details)
