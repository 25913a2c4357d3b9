"""Training debugger: loss and gradient anomalies of a fine-tuning run, rank-aware under
Accelerate. The folders are the features, from the bottom floor up:

- ``measure/``: what a rank measures on its device in a step (gradient and update norms, the
  loss, sharded parameters, the optimizer's state) and the one transfer to the host;
- ``hangs/``: naming a hang before the collective's watchdog fires;
- ``judges/``: measured values in, anomalies out (loss spikes and trends, gradients, modules,
  samples, a run that does not learn, cause before consequence);
- ``ranks/``: what the ranks exchange each step, and whether their replicas agree;
- ``step/``: one monitored step's state, which steps read the per-module figures, its outputs and
  the policy at its end;
- the face: ``debugger`` (the class), ``monitor`` (the per-step pipeline), ``watched_models``,
  ``signatures`` (wrong calls answered up front), ``failures`` (the debugger's own errors),
  ``oom_watch``, ``reporting`` and ``gradcheck``.
"""

from .debugger import TrainingDebugger
from .gradcheck import GradientCheckResult, check_gradients_numerically

__all__ = ["TrainingDebugger", "check_gradients_numerically", "GradientCheckResult"]
