"""A float64 numerical gradient check with a readable result: which input's backward is wrong, and
by how much.

Limits: meant for small inputs (the numerical Jacobian costs two calls per input element); a
module is checked on a float64 copy, the original is untouched.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn


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
