"""An A/B of the SD1.5-shaped Accelerate training step (``benchmarks.user_path``'s training rows) between
this checkout's debugger and another checkout's, in one process:
``python -m benchmarks.training_ab BASE_CHECKOUT [--precision fp16|bf16] [--clip 1.0] [--rounds 40]``.

Three twins of the proxy's UNet (``benchmarks.training.accelerate_steps``): plain, watched by the other
checkout's package (imported as ``diffusion_debug_base`` through a link in a temporary folder), watched
by this one; the order rotates every round, after :data:`WARM_UP` rounds past the per-module figures'
first steps; thread CPU time. Printed: each watched step's paired ratio to the plain one (median, middle
half), this checkout's paired ratio to the other's, and the monitor call alone (median of the per-round
differences). On a shared machine the step's ratio resolves about a point at 40 rounds; the monitor call
resolves a tenth of a millisecond. Without a clip by default: the rows where the debugger takes the norms
itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.training.step.detail import DETAIL_FIRST

from . import training
from .models import sd15_shaped_pipeline

WARM_UP = DETAIL_FIRST + 2
"""Untimed rounds: past the first monitored steps, which read every per-module figure."""


def _base_package(checkout: str, folder: str) -> Any:
    """The other checkout's ``diffusion_debug``, imported as ``diffusion_debug_base`` through a link in
    ``folder`` (which must outlive the run: the package imports its submodules lazily)."""
    os.symlink(Path(checkout).resolve() / "diffusion_debug", Path(folder) / "diffusion_debug_base")
    sys.path.insert(0, folder)
    return importlib.import_module("diffusion_debug_base")


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 4], statistics.median(ordered), ordered[(3 * n) // 4]


def run(checkout: str, precision: str = "fp16", clip: float | None = None, rounds: int = 40) -> str:
    with tempfile.TemporaryDirectory(prefix="training-ab-") as folder:  # the link and both run folders
        try:
            return _run(checkout, folder, precision, clip, rounds)
        finally:
            if folder in sys.path:
                sys.path.remove(folder)


def _run(checkout: str, folder: str, precision: str, clip: float | None, rounds: int) -> str:
    torch.set_num_threads(1)
    base = _base_package(checkout, folder)
    out = folder
    twins = [sd15_shaped_pipeline(torch.float32).unet.train() for _ in range(3)]
    steps = training.accelerate_steps(twins, precision, device="cpu", size=8, context_len=77, max_grad_norm=clip)
    debuggers = {
        "base": base.TrainingDebugger(
            steps[1].model, accelerator=steps[1].accelerator, config=base.DebugConfig(output_dir=f"{out}/a")
        ),
        "this": TrainingDebugger(
            steps[2].model, accelerator=steps[2].accelerator, config=DebugConfig(output_dir=f"{out}/b")
        ),
    }
    monitor: dict[str, list[float]] = {name: [] for name in debuggers}
    for name, debugger in debuggers.items():  # the monitor call alone, timed on the instance
        debugger.monitor_training_step = _timed(debugger.monitor_training_step, monitor[name])
    cases: dict[str, Callable[[], None]] = {
        "plain": steps[0],
        "base": lambda: steps[1](debuggers["base"]),
        "this": lambda: steps[2](debuggers["this"]),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases)
    try:
        for i in range(WARM_UP + rounds):
            order = order[1:] + order[:1]
            for name in order:
                start = time.thread_time()
                cases[name]()
                if i >= WARM_UP:
                    times[name].append(time.thread_time() - start)
    finally:
        for debugger in debuggers.values():
            debugger.close()
        training.reset_accelerate()
    lines = [f"{precision}, clip {clip}, {rounds} rounds, load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    lines.append(f"plain: median {statistics.median(times['plain']) * 1e3:.1f} ms")
    for name in debuggers:
        low, mid, high = _quartiles([w / p for w, p in zip(times[name], times["plain"])])
        calls = monitor[name][WARM_UP:]
        lines.append(
            f"{name}: paired {mid:.3f}x ({low:.3f}-{high:.3f}), monitor {statistics.median(calls) * 1e3:.2f} ms"
        )
    low, mid, high = _quartiles([b / a for a, b in zip(times["base"], times["this"])])
    lines.append(f"this / base: paired {mid:.3f}x ({low:.3f}-{high:.3f})")
    differences = [b - a for a, b in zip(monitor["base"][WARM_UP:], monitor["this"][WARM_UP:])]
    low, mid, high = _quartiles(differences)
    lines.append(f"monitor, this - base: {mid * 1e3:+.2f} ms ({low * 1e3:+.2f} to {high * 1e3:+.2f})")
    return "\n".join(lines)


def _timed(call: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            into.append(time.thread_time() - start)

    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(  # the whole docstring: its first line stops mid-sentence
        prog="python -m benchmarks.training_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", help="the other checkout (a worktree at the base commit)")
    parser.add_argument("--precision", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--clip", type=float, default=None, help="max_grad_norm (default: no clip)")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    print(run(args.base, args.precision, args.clip, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
