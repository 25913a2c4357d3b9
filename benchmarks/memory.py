"""Memory: peak RSS of a pipeline run with and without the debugger (each in its own process,
since peak RSS only grows), and the Python memory held after 1,000 ... 10,000 monitored steps
(tracemalloc): bounded means it stops growing once the ring buffers are full (history_size,
1,000 steps by default)."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger

_CHILD = """
import json, resource, sys, torch
from diffusion_debug import DebugConfig, DiffusionModelDebugger
from benchmarks.models import mid_pipeline
from diffusion_debug.testing import tiny_pipeline
pipe = mid_pipeline() if sys.argv[1] == "mid" else tiny_pipeline("sd")
run = lambda: pipe("a cat", num_inference_steps=int(sys.argv[2]), generator=torch.Generator().manual_seed(0))
for case in sys.argv[3].split(","):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if case == "debugger":
        with DiffusionModelDebugger(pipe, DebugConfig(output_dir=sys.argv[4], run_name="bench-memory")):
            run()
    else:
        run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"case": case, "peak_rss_mb": peak, "peak_before_call_mb": before}))
"""
CASES = ("plain", "debugger")


def peak_rss(model: str, steps: int, output_dir: str, *, one_process: bool = False) -> dict:
    """Peak RSS (MB) of one pipeline call, plain and debugged, each in its own process (both at
    once: peak RSS is per process, so running them side by side changes neither). ``one_process``
    (``benchmarks.run --smoke``: it runs, the figures mean nothing): both calls in one process, one
    after the other, one Python started and one pipeline made rather than two; the debugged call's
    peak is then at least the plain one's."""
    groups = [",".join(CASES)] if one_process else list(CASES)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, model, str(steps), cases, output_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cases in groups
    ]
    out = {}
    for cases, child in zip(groups, children):
        stdout, stderr = child.communicate(timeout=900)
        if child.returncode != 0:
            raise RuntimeError(f"the {cases} memory run failed: {stderr[-2000:]}")
        for line in stdout.strip().splitlines()[-len(cases.split(",")) :]:
            found = json.loads(line)
            out[found.pop("case")] = found
    return out


def _retained_bytes(monitor, steps: int) -> list[int]:
    tracemalloc.start()
    sizes = []
    try:
        for step in range(steps):
            monitor(step)
            if step + 1 in (1_000, 2_000, 5_000, steps):
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    return sizes


def record_growth(steps: int, output_dir: str) -> dict:
    config = DebugConfig(output_dir=output_dir, run_name="bench-record-training")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(4, 8)

    def train_step(step):
        loss = model(x).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()

    from diffusion_debug.testing import tiny_pipeline

    dbg = DiffusionModelDebugger(tiny_pipeline("sd"), config.replace(run_name="bench-record-diffusion"))
    latents = torch.randn(1, 4, 8, 8)

    def diffusion_step(step):
        dbg.monitor_diffusion_step(step, latents, timestep=999 - step % 1000)

    training = _retained_bytes(train_step, steps)
    diffusion = _retained_bytes(diffusion_step, steps)
    return {
        "steps": steps,
        "sampled_at_steps": sorted({n for n in (1_000, 2_000, 5_000, steps) if n <= steps}),
        "training_bytes": training,
        "diffusion_bytes": diffusion,
    }
