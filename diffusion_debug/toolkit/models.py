"""``analyze_model``, ``check_gradient_explosion``, ``check_gradient_vanishing``: the weights and
gradients of a model, each parameter and each module, with the bad ones named.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> _ = torch.nn.init.constant_(model[0].weight, 1.0), torch.nn.init.zeros_(model[0].bias)
>>> _ = torch.nn.init.constant_(model[1].weight, 100.0), torch.nn.init.zeros_(model[1].bias)
>>> model(torch.ones(1, 2)).sum().backward()
>>> check_gradient_explosion(model, threshold=10.0)
['0.weight', '0.bias']
>>> check_gradient_vanishing(model, threshold=1e-6)
[]
>>> analysis = analyze_model(model)
>>> analysis.exploding, round(analysis.modules["0"].grad_norm, 1)
(['0.weight', '0.bias'], 244.9)

Every parameter's weight and gradient statistics are queued on their devices and reach the host
in ONE transfer per device. A module's figures are over every parameter below it (``""`` is the
whole model): norms combine as the root of the sum of squares, counts add up.

A quantized weight (torchao, GGUF, bitsandbytes, quanto) is measured in the values its layer
computes with (:func:`~diffusion_debug.stats.quantized.dequantized`).

Limits: a parameter shared by two modules is listed once, under its first name; a parameter
without ``requires_grad`` or whose ``.grad`` is None has no gradient statistics and is never
exploding or vanishing; a non-finite gradient counts as exploding (and is also in ``nonfinite``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..stats import TensorStats, collect, measure
from ..stats.quantized import parameter_values

EXPLOSION_THRESHOLD = 10.0
"""Per-parameter gradient L2 norm above which a gradient is exploding (the seed documents' value)."""
VANISHING_THRESHOLD = 1e-6
"""Per-parameter gradient L2 norm below which a gradient is vanishing."""


@dataclass(frozen=True)
class ParameterAnalysis:
    """One parameter: its weight's statistics and, when it has one, its gradient's."""

    name: str
    weight: TensorStats
    grad: TensorStats | None

    @property
    def grad_norm(self) -> float | None:
        """L2 norm of the gradient (``inf`` when it holds NaN/Inf; None without a gradient)."""
        if self.grad is None:
            return None
        return (self.grad.l2 or 0.0) if self.grad.is_finite else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight.to_dict(), "grad": None if self.grad is None else self.grad.to_dict()}


@dataclass
class ModuleAnalysis:
    """The parameters below one module, together."""

    parameters: int = 0
    """Number of elements."""
    weight_norm: float = 0.0
    grad_norm: float | None = None
    weight_nonfinite: int = 0
    grad_nonfinite: int = 0
    weight_absmax: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ModelAnalysis:
    """What :func:`analyze_model` found; the lists name parameters in registration order."""

    parameters: dict[str, ParameterAnalysis]
    modules: dict[str, ModuleAnalysis]
    nonfinite: list[str] = field(default_factory=list)
    """Parameters whose weight or gradient holds NaN/Inf."""
    exploding: list[str] = field(default_factory=list)
    vanishing: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "parameters": {name: p.to_dict() for name, p in self.parameters.items()},
            "modules": {name: m.to_dict() for name, m in self.modules.items()},
            "nonfinite": self.nonfinite,
            "exploding": self.exploding,
            "vanishing": self.vanishing,
            "thresholds": self.thresholds,
        }

    def __repr__(self) -> str:
        return (
            f"ModelAnalysis({len(self.parameters)} parameters, nonfinite={self.nonfinite[:5]}, "
            f"exploding={self.exploding[:5]}, vanishing={self.vanishing[:5]})"
        )


def analyze_model(
    model: nn.Module,
    explosion_threshold: float = EXPLOSION_THRESHOLD,
    vanishing_threshold: float = VANISHING_THRESHOLD,
) -> ModelAnalysis:
    """Per-parameter and per-module statistics of ``model``'s weights and gradients."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"analyze_model takes a torch.nn.Module, not {type(model).__name__}.")
    explosion_threshold = _threshold("explosion_threshold", explosion_threshold)
    vanishing_threshold = _threshold("vanishing_threshold", vanishing_threshold)
    named = list(model.named_parameters())
    grads = [p.grad if p.requires_grad else None for _, p in named]
    values = parameter_values(model)  # (a quantized weight's values, dequantized as each is measured)
    pending = [measure(p.detach()) for _, p in values] + [measure(g) for g in grads if g is not None]
    measured = iter(collect(pending))
    weights = [next(measured) for _ in named]
    grad_stats = [next(measured) if g is not None else None for g in grads]
    parameters = {name: ParameterAnalysis(name, w, g) for (name, _), w, g in zip(named, weights, grad_stats)}
    analysis = ModelAnalysis(
        parameters,
        _modules(parameters),
        thresholds={"explosion": explosion_threshold, "vanishing": vanishing_threshold},
    )
    for name, p in parameters.items():
        if not p.weight.is_finite or (p.grad is not None and not p.grad.is_finite):
            analysis.nonfinite.append(name)
        norm = p.grad_norm
        if norm is not None and norm > explosion_threshold:
            analysis.exploding.append(name)
        elif norm is not None and norm < vanishing_threshold:
            analysis.vanishing.append(name)
    return analysis


def _threshold(name: str, value: Any) -> float:
    """A gradient-norm threshold as a float: a real number (numpy's too), not a bool, NaN or negative."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, not {value!r}.")
    return float(value)


def _modules(parameters: dict[str, ParameterAnalysis]) -> dict[str, ModuleAnalysis]:
    """Each module prefix (and ``""``) with the parameters below it combined on the host."""
    squares: dict[str, list[float]] = {}
    modules: dict[str, ModuleAnalysis] = {}
    for name, p in parameters.items():
        parts = name.split(".")[:-1]
        for prefix in [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]:
            m = modules.setdefault(prefix, ModuleAnalysis())
            sums = squares.setdefault(prefix, [0.0, 0.0])
            m.parameters += p.weight.numel
            sums[0] += (p.weight.l2 or 0.0) ** 2
            m.weight_nonfinite += p.weight.nonfinite
            m.weight_absmax = max(m.weight_absmax, p.weight.absmax or 0.0)
            if p.grad is not None:
                sums[1] += (p.grad.l2 or 0.0) ** 2
                m.grad_nonfinite += p.grad.nonfinite
                m.grad_norm = 0.0
    for prefix, m in modules.items():
        m.weight_norm = math.sqrt(squares[prefix][0])
        if m.grad_norm is not None:
            m.grad_norm = math.inf if m.grad_nonfinite else math.sqrt(squares[prefix][1])
    return modules


def check_gradient_explosion(model: nn.Module, threshold: float = EXPLOSION_THRESHOLD) -> list[str]:
    """Names of the parameters whose gradient L2 norm exceeds ``threshold`` (or holds NaN/Inf)."""
    return analyze_model(model, explosion_threshold=threshold, vanishing_threshold=0.0).exploding


def check_gradient_vanishing(model: nn.Module, threshold: float = VANISHING_THRESHOLD) -> list[str]:
    """Names of the parameters whose gradient L2 norm is below ``threshold``."""
    return analyze_model(model, explosion_threshold=math.inf, vanishing_threshold=threshold).vanishing
