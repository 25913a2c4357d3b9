"""What the pre-reduction check costs per training step (issue 46), on 2 CPU processes: the tiny SD
UNet's watched DDP step (noise MSE, backward, ``monitor_training_step``, AdamW) with the check that
reads each rank's local gradients before DDP's all-reduce, and without it.

    python -m benchmarks.pre_reduction               # 2 processes, 24 interleaved rounds (1-2 min)
    python -m benchmarks.pre_reduction --repeats 3   # seconds; checks it works

The debugger has no switch for the check (it is on wherever DDP runs on a power-of-two number of
ranks with no comm hook of its own), so "off" is a second debugger built with
``PreReductionCheck.attach`` made to attach nothing, inside this benchmark only: its model keeps
DDP's built-in all-reduce, and the step's row says "not checked". Everything else is the same (two
identical prepared copies, each watched by a default-config TrainingDebugger, stepped in turn, the
order swapped every round). Per rank: the median over rounds of the per-round difference (on - off),
wall (``perf_counter``) and CPU time of the process (``process_time``: every thread, gloo's
included), relative to the "off" step's median; and the aten ops the check adds per step (the whole
step counted with ``diffusion_debug.op_count``, on minus off: deterministic; one ``aminmax`` per
DDP bucket). Beside them, the check's own kernels timed alone on this rank's bucket sizes (200
times): a floor for the step's figure, precise where the step's difference is within the noise. DDP only: FSDP2's
check is not measured here (no FSDP2 benchmark path yet).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

from diffusion_debug.op_count import added_ops, count_aten_ops
from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env, free_port, run_launch
from diffusion_debug.training.measure.pre_reduction import PreReductionCheck

ROOT = Path(__file__).resolve().parents[1]
CASES = ("check off", "check on")


@contextmanager
def check_left_off() -> Iterator[None]:
    """A TrainingDebugger made inside attaches no pre-reduction check (this benchmark's switch)."""
    with mock.patch.object(PreReductionCheck, "attach", classmethod(lambda cls, models: cls())):
        yield


def batch(unet: torch.nn.Module, seed: int, size: int) -> dict[str, torch.Tensor]:
    """One noise-prediction batch of 2 for ``unet`` (the same inputs as benchmarks.training_ranks)."""
    g = torch.Generator().manual_seed(seed)
    config = unet.config
    latents = torch.randn(2, config.in_channels, size, size, generator=g)
    return {
        "latents": latents,
        "noise": torch.randn(latents.shape, generator=g),
        "context": torch.randn(2, 8, config.cross_attention_dim, generator=g),
        "timesteps": torch.randint(0, 1000, (2,), generator=g),
    }


def stepper(model: Any, optimizer: Any, tdbg: Any, data: dict, backward: Callable[[Any], None]) -> Callable[[], None]:
    """One watched training step of ``model`` (the step number counts on)."""
    count = [0]

    def step() -> None:
        out = model(data["latents"] + data["noise"], data["timesteps"], encoder_hidden_states=data["context"]).sample
        loss = F.mse_loss(out, data["noise"])
        backward(loss)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=count[0], timesteps=data["timesteps"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        count[0] += 1

    return step


def ops_per_step(steps: dict[str, Callable[[], None]], counted: int = 2) -> dict[str, Any]:
    """The aten ops a whole step makes, per case, over ``counted`` steps after the ones already run;
    and what "check on" adds to "check off" per step (views excluded)."""
    totals: dict[str, Counter[str]] = {}
    for name, step in steps.items():
        with count_aten_ops() as ops:
            for _ in range(counted):
                step()
        totals[name] = ops.counts
    on, off = totals["check on"], totals["check off"]
    return {
        "ops_per_step_off": sum(off.values()) / counted,
        "added_ops_per_step": (sum(on.values()) - sum(off.values())) / counted,
        "added_by_op": {op: n / counted for op, n in added_ops(on, off).most_common()},
        "fewer_by_op": {op: n / counted for op, n in added_ops(off, on).most_common()},
    }


def job(output_dir: str, repeats: int, warmup: int, size: int) -> None:
    """One rank (``--job``): prints ``RESULT <json>`` with this rank's figures."""
    from accelerate import Accelerator

    from diffusion_debug import DebugConfig, TrainingDebugger
    from diffusion_debug.testing import tiny_pipeline

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    unet = tiny_pipeline("sd").unet
    data = batch(unet, rank, size)
    steps, debuggers = {}, {}
    for name in CASES:
        model = type(unet).from_config(unet.config)
        model.load_state_dict(unet.state_dict())
        model.train()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-6))
        config = DebugConfig(output_dir=output_dir, run_name=f"bench-pre-reduction-{name.split()[-1]}")
        if name == "check off":
            with check_left_off():
                tdbg = TrainingDebugger(model, accelerator=accelerator, config=config)
        else:
            tdbg = TrainingDebugger(model, accelerator=accelerator, config=config)
        debuggers[name] = tdbg
        steps[name] = stepper(model, optimizer, tdbg, data, accelerator.backward)
    checked = {name: tdbg._pre_reduction.watching for name, tdbg in debuggers.items()}
    if checked != {"check off": False, "check on": True}:
        raise SystemExit(f"the check is not switched as asked: {checked}")

    def timed(name: str) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        steps[name]()
        return time.perf_counter() - wall, time.process_time() - cpu

    for _ in range(warmup):
        for name in CASES:
            steps[name]()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for round_ in range(repeats):
        for name in CASES if round_ % 2 == 0 else CASES[::-1]:  # neither case always goes first
            times[name].append(timed(name))
    ops = ops_per_step(steps)
    alone = check_alone(bucket_sizes(debuggers["check on"]._pre_reduction, steps["check on"]))
    summaries = {name: tdbg.get_summary() for name, tdbg in debuggers.items()}
    for tdbg in debuggers.values():
        tdbg.close()
    line = {
        "rank": rank,
        "figures": figures(times),
        "ops": ops,
        "check_alone": alone,
        "anomaly_counts": {name: s.get("anomaly_counts") or {} for name, s in summaries.items()},
        "pre_reduction_check": {name: s.get("pre_reduction_check") for name, s in summaries.items()},
    }
    sys.stdout.write(f"RESULT {json.dumps(line)}\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()


def figures(times: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Medians of the "off" step and of the per-round differences (on - off), wall and CPU, in ms."""
    out = {}
    for clock, i in (("wall", 0), ("cpu", 1)):
        off = [t[i] for t in times["check off"]]
        diffs = [on[i] - o[i] for on, o in zip(times["check on"], times["check off"])]
        base, added = statistics.median(off), statistics.median(diffs)
        q = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [added, added, added]
        out |= {
            f"{clock}_off_ms": round(base * 1e3, 2),
            f"{clock}_added_ms": round(added * 1e3, 3),
            f"{clock}_added_middle_half_ms": [round(q[0] * 1e3, 3), round(q[2] * 1e3, 3)],
            f"{clock}_relative": round(added / base, 4),
        }
    return out


def bucket_sizes(check: PreReductionCheck, step: Callable[[], None]) -> list[int]:
    """The elements of each bucket the check reads in one ``step``."""
    sizes: list[int] = []
    add = check.add
    check.add = lambda buffer: (sizes.append(buffer.numel()), add(buffer))[1]  # type: ignore[method-assign]
    try:
        step()
    finally:
        del check.add
    return sizes


def check_alone(sizes: list[int], repeats: int = 200) -> dict[str, Any]:
    """The check's own work per step timed alone (median of ``repeats``, ms): one ``add`` per bucket
    of ``sizes`` elements (float32) and the step's ``take``. Not the hook's path around it (DDP's
    Python hook in place of its built-in copy), which only the step's difference holds."""
    buffers = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
    check, zero = PreReductionCheck(), torch.zeros((), dtype=torch.float64)
    check.watching = True

    def once() -> None:
        for buffer in buffers:
            check.add(buffer)
        check.take(zero)

    for _ in range(5):
        once()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        once()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {
        "bucket_elements": sizes,
        "wall_ms": round(statistics.median(wall) * 1e3, 3),
        "cpu_ms": round(statistics.median(cpu) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pre_reduction", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", type=int, default=32, help="latent height and width")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        job(args.job, args.repeats, args.warmup, args.size)
        return 0
    accelerate = accelerate_launcher()
    if accelerate is None:
        raise SystemExit("the accelerate launcher is not installed")
    out = tempfile.mkdtemp(prefix="diffusion-debug-pre-reduction-")
    cmd = [accelerate, "launch", "--config_file", str(ROOT / "configs" / "accelerate_2cpu.yaml")]
    cmd += ["--num_processes", str(args.processes), "--main_process_port", str(free_port())]
    cmd += [str(Path(__file__).resolve()), "--job", out]
    cmd += ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--size", str(args.size)]
    started = time.perf_counter()
    done = run_launch(cmd, cpu_launch_env(ROOT), ROOT, timeout=540)
    ranks = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if len(ranks) != args.processes:
        print(f"{len(ranks)} of {args.processes} ranks reported:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return 1
    result = {
        "processes": args.processes,
        "repeats": args.repeats,
        "latents": f"2x4x{args.size}x{args.size}",
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
