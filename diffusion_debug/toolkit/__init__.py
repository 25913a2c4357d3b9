"""Helpers used on their own, beside the two debuggers, between runs (layer 5, over stats and probes):

* :mod:`.tensors`: :func:`analyze_tensor`, one tensor at a glance (one pass, one transfer);
* :mod:`.models`: :func:`analyze_model` (each parameter and module, weights and gradients),
  :func:`check_gradient_explosion`, :func:`check_gradient_vanishing`;
* :mod:`.inspect`: :func:`inspect_model`, one forward with every module probed.

The verb says what a helper does (stable names, DESIGN.md): ``analyze_*`` reads what it is given
and returns its statistics; ``inspect_*`` runs the model once to watch it; ``check_*`` applies a
threshold and returns the offenders.
"""

from .inspect import ModelInspection, inspect_model
from .models import ModelAnalysis, ParameterAnalysis, analyze_model, check_gradient_explosion, check_gradient_vanishing
from .tensors import TensorAnalysis, analyze_tensor

__all__ = [
    "ModelAnalysis",
    "ModelInspection",
    "ParameterAnalysis",
    "TensorAnalysis",
    "analyze_model",
    "analyze_tensor",
    "check_gradient_explosion",
    "check_gradient_vanishing",
    "inspect_model",
]
