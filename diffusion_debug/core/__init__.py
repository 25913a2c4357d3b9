"""What both debuggers share, above the record and the report (layer 5).

* :class:`AnomalySink` — every anomaly of a run passes through it once: folded with its repeats,
  recorded, logged, warned about (policy ``warn``) and queued for the policy; a measurement of the
  debugger's own that fails becomes a ``debugger_error`` (one ``details`` layout).
* :data:`POLICY_TABLE`, :func:`apply_policy`, :func:`check_policy` — one meaning for each policy
  on both sides: a row per policy, acting through the small :class:`PolicyTarget` interface of
  each debugger's private policy target (never the user's debugger object itself).
* :func:`open_run` — the run directory and its record, named and created in one place.
* :class:`Lifecycle` — ``attach()`` returns a handle, ``detach()`` can be undone by a later
  ``attach()``, ``close()`` is final; ``with debugger:`` attaches and detaches, and
  ``@debugger.watch`` does the same around each call of a function.
* :class:`DebugReport` — the live view of a run that ``save()`` turns into a run directory.
* :func:`release` — what ``close()`` gives back.
* :mod:`.out_of_memory` — a ``torch.OutOfMemoryError`` in a watched call recorded (component, step,
  figures, remedies), then re-raised unchanged; :mod:`.memory_files` — ``debugger.memory_snapshot(name)``.

The policies, the same for both debuggers (an anomaly of severity ``error`` triggers them):

=========  ======================================================================================
``record`` record it, nothing else
``warn``   also a Python ``RuntimeWarning`` for every anomaly at or above ``warn_severity``
``skip``   training: zero this step's gradients so ``optimizer.step()`` adds nothing from the
           batch; a pipeline has no optimizer step to skip, so inference rejects it up front
``raise``  save the run directory, then raise :class:`DiffusionDebugError`
``stop``   inference: interrupt the denoising loop (pipelines with ``_interrupt``; raise where
           there is none); training: set ``should_stop`` for the loop to end
=========  ======================================================================================
"""

from .lifecycle import DebugReport, Lifecycle, open_run, release
from .policies import POLICY_TABLE, Policy, PolicyTarget, apply_policy, check_policy, policy_error
from .sink import AnomalySink, debugger_failure, mark_raised, raised_by_debugger

__all__ = [
    "POLICY_TABLE",
    "AnomalySink",
    "DebugReport",
    "Lifecycle",
    "Policy",
    "PolicyTarget",
    "apply_policy",
    "check_policy",
    "debugger_failure",
    "mark_raised",
    "policy_error",
    "raised_by_debugger",
    "open_run",
    "release",
]
