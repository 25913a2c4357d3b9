"""Training debugger: loss and gradient anomalies of a fine-tuning run, rank-aware under
Accelerate.  One concept per file: ``gradients`` (norms, non-finite parameters, backward
order), ``loss`` (spike detector, timestep buckets), ``distributed`` (the per-step collective,
Accelerate's flags and GradScaler), ``autograd`` (anomaly-mode localisation, numerical
gradient check), ``debugger`` (the class)."""

from .autograd import GradientCheckResult, check_gradients_numerically
from .debugger import TrainingDebugger

__all__ = ["TrainingDebugger", "check_gradients_numerically", "GradientCheckResult"]
