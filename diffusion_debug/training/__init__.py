"""Training debugger: loss and gradient anomalies of a fine-tuning run, rank-aware under
Accelerate. One concept per file: ``debugger`` (the class: API and lifecycle), ``monitor`` (the
per-step pipeline), ``step_vector`` (one rank's row of the per-step collective, by slot name),
``checks`` (gathered rows in, anomalies out), ``rank_desync`` (whether the replicas' checksums
agree), ``local_judging`` (what only this rank knows, added to the judged step), ``causes`` (cause
before consequence, within a step and across steps), ``updates`` (the update the optimizer applied,
read from the weights), ``step_results`` (counts,
the step's info, record row and tracker scalars), ``gradients`` (norms, non-finite parameters, backward order,
module-norm bookkeeping), ``loss`` (spike detector, timestep buckets, the step's accumulated loss),
``ranks`` (rank, world size, collectives), ``optimizer_state`` (what is read from the optimizer,
GradScaler and Accelerator), ``anomaly_mode`` (naming the backward op that made a NaN),
``gradcheck`` (numerical gradient check); naming a hang before the watchdog: ``liveness`` (where this rank
is), ``side_channel`` (the process group's store), ``stall_watch`` (the watcher thread, stacks, ending the
job), ``stalls`` (positions in, the stall's pattern and sentence out).
"""

from .debugger import TrainingDebugger
from .gradcheck import GradientCheckResult, check_gradients_numerically

__all__ = ["TrainingDebugger", "check_gradients_numerically", "GradientCheckResult"]
