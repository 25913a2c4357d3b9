"""One denoising step under ``torch.profiler``: a Chrome trace, a CUDA memory snapshot, the top modules.

:class:`StepProfiler` is driven by the pipeline's own ``callback_on_step_end``: it starts at the end
of step ``step - 1`` (for step 0: at the first call of a loop component, after the prompt encoding)
and stops at the end of ``step``, so the window holds one denoising step — the denoiser's calls,
the scheduler and what the debugger adds.
While it runs, each component and each of its blocks (the children of the component, with
``ModuleList``/``ModuleDict`` opened one level: ``unet.down_blocks.0``, ``transformer.transformer_blocks.3``)
is wrapped in a ``record_function`` range named after it, so the trace and the summary's ``modules``
say which block the time went to. Nothing is hooked outside the window.

Files, in the run directory: ``profile-step<N>.json`` (open it in https://ui.perfetto.dev or
chrome://tracing) and, on CUDA, ``memory-step<N>.pickle`` (the allocations recorded during the step,
pickled as ``torch.cuda.memory._dump_snapshot`` writes them; open it at https://pytorch.org/memory_viz).
:meth:`StepProfiler.finish` returns the summary entry.

Limits: the pipeline must take ``callback_on_step_end`` (diffusers' pipelines of the last two years
do); times are those of a profiled step, which runs slower than an unprofiled one; on CUDA a
module's time is the device time of the kernels launched inside its range; CUDA memory-history
recording is switched off when the step ends (also one the caller had started); with policy
``stop`` or an error inside the step, diffusers skips the step-end callback and the trace runs on
to the end of the call.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType

from ..probes import CallArgsConfig, ProbeHandle, apply_call_args, apply_ranges, register_all
from ..record import write_atomic
from ..record.messages import counted

TOP = 12
"""Rows kept in the summary for modules and for aten ops."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def takes_step_callback(pipe: Any) -> bool:
    """Whether the pipeline's ``__call__`` accepts ``callback_on_step_end``."""
    import inspect

    try:
        return "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
    except (TypeError, ValueError):
        return False


def labelled_blocks(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(label, module)`` for a component and its blocks, containers opened one level.

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Tanh()]))
    >>> [label for label, _ in labelled_blocks("net", model)]
    ['net', 'net.0', 'net.1.0', 'net.1.1']
    """
    blocks = [(name, module)]
    for child_name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            blocks += [(f"{name}.{child_name}.{inner}", grandchild) for inner, grandchild in child.named_children()]
        else:
            blocks.append((f"{name}.{child_name}", child))
    return blocks


class StepProfiler:
    """Profiles denoising step ``step`` of the next pipeline call; see the module docstring.

    Use: ``profiler.begin()`` before the call, ``callback_on_step_end=profiler.callback`` in it,
    ``profiler.finish()`` after it (also when it raised: what was profiled is still written).
    """

    def __init__(
        self,
        step: int,
        components: dict[str, nn.Module],
        run_dir: Path,
        device: torch.device,
        loop: list[nn.Module] = (),
    ):
        self.step = step
        self.run_dir = Path(run_dir)
        self.device = device
        self.cuda = device.type == "cuda"
        self._blocks = [block for name, module in components.items() for block in labelled_blocks(name, module)]
        self._loop = list(loop)  # the components that run every step (denoiser, controlnet): step 0 starts at them
        self._profiler: torch.profiler.profile | None = None
        self._snapshot: Any = None
        self._starters = ProbeHandle()  # step 0: at the loop's first call
        self._ranges = ProbeHandle()  # the blocks' ranges, while the window is open
        self._started = 0.0
        self._wall_ms: float | None = None
        self._done = False
        self._steps_seen = 0

    def begin(self) -> None:
        """Before the call: step 0 starts at the first call of a component of the loop (after the
        prompt encoding), or at once when none is known."""
        if self.step != 0:
            return
        if not self._loop:
            self._start()
            return

        def start_at_the_loop(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._starters.remove()
            self._start()
            for label, block in self._blocks:  # hooks added now miss this call's start: open its range here
                if block is module and self._ranges.state is not None:
                    self._ranges.state.enter(label, module)

        config = CallArgsConfig(before=start_at_the_loop)
        self._starters = register_all(lambda: (apply_call_args(module, config) for module in self._loop))

    def callback(self, pipe: Any, index: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``callback_on_step_end``: returns the pipeline's tensors untouched."""
        self._steps_seen = max(self._steps_seen, int(index) + 1)
        if self._done:
            return callback_kwargs
        if index == self.step - 1:
            self._start()
        elif index == self.step and self._profiler is not None:
            self._stop()
        return callback_kwargs

    def _start(self) -> None:
        if self._profiler is not None or self._done:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
            torch.cuda.synchronize(self.device)
        self._ranges = apply_ranges(self._blocks)
        self._profiler = torch.profiler.profile(activities=activities, profile_memory=True)
        self._profiler.start()
        self._started = time.perf_counter()

    def _stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._wall_ms = (time.perf_counter() - self._started) * 1e3
        if self.cuda:  # the snapshot of this step's allocations; recording ends with the step
            try:
                self._snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        self._ranges.remove()  # also ends a range a forward that raised left open
        assert self._profiler is not None
        self._profiler.stop()
        self._done = True

    def finish(self) -> dict[str, Any]:
        """Stop if still running, write the files, and return the summary's ``profile`` entry."""
        entry: dict[str, Any] = {"step": self.step, "device": "cuda" if self.cuda else "cpu"}
        if self._profiler is None:
            self._starters.remove()  # step 0's, when the loop never ran
            entry["note"] = f"step {self.step} was not reached (the pipeline ran {counted(self._steps_seen, 'step')})"
            return entry
        if not self._done:
            self._stop()
            entry["note"] = (
                "the profiled step did not end (an error, or policy stop): the trace runs on to the end of the call"
            )
        entry["wall_ms"] = round(self._wall_ms or 0.0, 3)
        entry["trace"] = self._write_trace()
        entry["memory_snapshot"] = self._write_snapshot() if self.cuda else None
        if not self.cuda:
            entry["memory_note"] = "no CUDA memory snapshot: the pipeline ran on the CPU"
        entry.update(top_rows(self._profiler, {label for label, _ in self._blocks}, self.cuda))
        return entry

    def _write_trace(self) -> str:
        name = f"profile-step{self.step}.json"
        assert self._profiler is not None
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / name
            self._profiler.export_chrome_trace(str(path))
            write_atomic(self.run_dir / name, path.read_bytes())
        return name

    def _write_snapshot(self) -> str:
        """The step's snapshot, pickled as ``torch.cuda.memory._dump_snapshot`` writes it."""
        import pickle

        name = f"memory-step{self.step}.pickle"
        write_atomic(self.run_dir / name, pickle.dumps(self._snapshot))
        return name


def _time_us(event: Any, names: tuple[str, ...]) -> float:
    """The first of ``names`` the event has (torch before 2.4 calls device time ``cuda_time``)."""
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def top_rows(profiler: torch.profiler.profile, labels: set[str], cuda: bool) -> dict[str, Any]:
    """The labelled modules by total time and the aten ops by self time, in milliseconds: device
    time on CUDA, CPU time otherwise. Only the host-side rows count (on CUDA a range also has a
    GPU-side row of the same name, which would list each module twice)."""
    total = ("device_time_total", "cuda_time_total") if cuda else ("cpu_time_total",)
    own = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    host = [e for e in profiler.key_averages() if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU]
    modules = sorted((e for e in host if e.key in labels), key=lambda e: _time_us(e, total), reverse=True)
    ops = sorted((e for e in host if e.key.startswith("aten::")), key=lambda e: _time_us(e, own), reverse=True)
    return {
        "time": "device" if cuda else "cpu",
        "modules": [
            {"name": e.key, "calls": e.count, "total_ms": round(_time_us(e, total) / 1e3, 3)} for e in modules[:TOP]
        ],
        "ops": [{"name": e.key, "calls": e.count, "self_ms": round(_time_us(e, own) / 1e3, 3)} for e in ops[:TOP]],
    }
