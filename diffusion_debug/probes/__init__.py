"""The one hooks layer: everything the package attaches to a model goes through here.

One technique a file, in the manner of diffusers' ``hooks/``; each ``apply_x(...)`` returns a
:class:`ProbeHandle` whose ``remove()`` takes exactly its hooks off (idempotent; a context manager):

* :mod:`.readings`: per-module NaN/Inf and overflow readings (:func:`apply_probes`, :class:`Probe`,
  :func:`probe_call`), on the modules :mod:`.watched` picks, as :mod:`.module_reading` rows; abs-maxes
  taken together, one op for many outputs, by :mod:`.fused`;
* :mod:`.call_args`: the arguments and output of each call of a module, for a caller that keeps
  them or times the call (:func:`apply_call_args`);
* :mod:`.ranges`: a profiler ``record_function`` range per block (:func:`apply_ranges`);
* :mod:`.grad_order`: the order backward accumulates gradients in (:func:`apply_grad_order`);
* :mod:`.phase_marks`: a training forward began, backward reached the module (:func:`apply_phase_marks`).
* :mod:`.output_stats`: full statistics of every module's output, for a one-off inspection
  (:func:`apply_output_stats`);
* :mod:`.call_errors`: an error (out of memory) raised inside a module's call, on its way out
  (:func:`apply_call_errors`);
* :mod:`.kept_buffers`: a one-off call leaves the buffers as they were (:func:`buffers_kept`);
* :mod:`.copies`: a deep copy or a pickle of a watched module holds none of our hooks (:func:`copies.hold`).

Only torch's own hooks are used; ``.forward`` is never replaced. What runs inside a hook is tensor
code a compiler can trace (:mod:`.tracing`); values reach the host through :func:`stats.to_host`.
"""

from .call_args import CallArgsConfig, apply_call_args, call_hooks, forward_hooks
from .call_errors import CallErrorsConfig, apply_call_errors
from .grad_order import BackwardOrder, accumulates_compiled, apply_grad_order
from .handles import ProbeHandle, register_all
from .kept_buffers import buffers_kept
from .module_reading import find_producer
from .output_stats import ModuleOutput, OutputStats, apply_output_stats
from .phase_marks import apply_phase_marks
from .ranges import BlockRanges, apply_ranges
from .readings import (
    SIGNALS,
    ModuleReading,
    Probe,
    ProbeConfig,
    apply_probes,
    probe_call,
    probed_modules,
    probes_holding,
    readings_by_call,
    reset_probes,
)
from .tracing import compiling, in_backward
from .watched import GRANULARITIES, OVERFLOW_DTYPES, PASS_THROUGH, all_modules, sentinel_modules

__all__ = [
    "BackwardOrder",
    "BlockRanges",
    "CallArgsConfig",
    "CallErrorsConfig",
    "GRANULARITIES",
    "ModuleOutput",
    "ModuleReading",
    "OutputStats",
    "OVERFLOW_DTYPES",
    "PASS_THROUGH",
    "Probe",
    "ProbeConfig",
    "ProbeHandle",
    "SIGNALS",
    "all_modules",
    "apply_call_args",
    "apply_call_errors",
    "accumulates_compiled",
    "apply_grad_order",
    "apply_phase_marks",
    "apply_output_stats",
    "apply_probes",
    "apply_ranges",
    "buffers_kept",
    "call_hooks",
    "compiling",
    "in_backward",
    "find_producer",
    "forward_hooks",
    "probe_call",
    "probed_modules",
    "probes_holding",
    "readings_by_call",
    "register_all",
    "reset_probes",
    "sentinel_modules",
]
