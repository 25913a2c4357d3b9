"""Record size at scale (issue 22): ``summary.json`` of the same clean run on 1 process and on 8 CPU
processes (gloo, ``accelerate launch``), default ``history_size``, html off. The bound: the 8-rank
summary covers as many steps as the 1-rank one and is at most 4x its size.

    python -m benchmarks.record_size                  # 1,000 steps, 1 and 8 processes (minutes)
    python -m benchmarks.record_size --steps 50       # seconds; checks it works

The loop is the clean scenario of tests/training/multiprocess_job.py (a 4-8-1 MLP, SGD, a batch of 8
per rank), copied here so that a benchmark does not import the tests. Sizes, not times: the wall time
is printed for planning only. Judged by what the job saved (an 8-process gloo job sometimes exits 1
at its very end whatever the debugger does).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env, free_port

ROOT = Path(__file__).resolve().parents[1]


def clean_loop(tdbg, model, optimizer, steps: int, rank: int, backward) -> None:
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        x = torch.randn(8, 4, generator=generator)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        backward(loss)
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def one_process(output_dir: Path, steps: int) -> Path:
    from diffusion_debug import DebugConfig, TrainingDebugger

    model, optimizer = _model()
    with TrainingDebugger(model, config=DebugConfig(output_dir=str(output_dir))) as tdbg:
        clean_loop(tdbg, model, optimizer, steps, 0, lambda loss: loss.backward())
        return tdbg.report().save(html=False)


def job(output_dir: str, steps: int) -> None:
    """One rank of the launched run (``--job``): main saves first, then every other rank flushes."""
    from accelerate import Accelerator

    from diffusion_debug import DebugConfig, TrainingDebugger

    accelerator = Accelerator(cpu=True)
    model, optimizer = _model()
    model, optimizer = accelerator.prepare(model, optimizer)
    tdbg = TrainingDebugger(model, accelerator=accelerator, config=DebugConfig(output_dir=output_dir))
    clean_loop(tdbg, model, optimizer, steps, accelerator.process_index, accelerator.backward)
    if accelerator.is_main_process:
        print(f"RUN_DIR {tdbg.report().save(html=False)}", flush=True)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        tdbg.report().save(html=False)
    accelerator.wait_for_everyone()
    tdbg.close()


def launched(output_dir: Path, steps: int, processes: int, timeout: float) -> tuple[Path | None, str]:
    """The run directory the ``processes``-rank launch saved (None if none), and its stderr's tail."""
    accelerate = accelerate_launcher()
    if accelerate is None:
        raise SystemExit("the accelerate launcher is not installed")
    cmd = [accelerate, "launch", "--config_file", str(ROOT / "configs" / "accelerate_2cpu.yaml")]
    cmd += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
    cmd += [str(Path(__file__).resolve()), "--job", str(output_dir), "--steps", str(steps)]
    env = cpu_launch_env(ROOT)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        tail = done.stderr[-3000:]
    except subprocess.TimeoutExpired as error:
        tail = f"stopped after {timeout:.0f} s: {(error.stderr or b'')[-3000:]!r}"
    runs = sorted(output_dir.glob("run-*"))
    return (runs[0] if runs and (runs[0] / "summary.json").is_file() else None), tail


def describe(run_dir: Path) -> dict:
    """What a summary.json covers: its size, the steps of its rows, rank rows, anomalies by kind."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    rows = summary.get("steps", [])
    main_steps = sorted({r["step"] for r in rows if r.get("rank", 0) == 0})
    return {
        "bytes": path.stat().st_size,
        "rows": len(rows),
        "steps_covered": len(main_steps),
        "first_step": main_steps[0] if main_steps else None,
        "last_step": main_steps[-1] if main_steps else None,
        "rows_of_other_ranks": sum(r.get("rank", 0) != 0 for r in rows),
        "anomalies": dict(collections.Counter(a["kind"] for a in summary.get("anomalies", []))),
        "run_dir_bytes": sum(p.stat().st_size for p in run_dir.iterdir() if p.is_file()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.record_size", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds for the launch")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        job(args.job, args.steps)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="diffusion-debug-record-size-"))
    started = time.perf_counter()
    single = describe(one_process(out / "one", args.steps))
    single_s = time.perf_counter() - started
    started = time.perf_counter()
    run_dir, tail = launched(out / f"ranks{args.processes}", args.steps, args.processes, args.timeout)
    many_s = time.perf_counter() - started
    if run_dir is None:
        print(f"the {args.processes}-process launch saved no summary.json:\n{tail}", file=sys.stderr)
        return 1
    many = describe(run_dir)
    result = {
        "steps": args.steps,
        "processes": args.processes,
        "one_process": {**single, "wall_s": round(single_s, 1)},
        f"{args.processes}_processes": {**many, "wall_s": round(many_s, 1)},
        "size_ratio": round(many["bytes"] / single["bytes"], 3),
        "same_steps_covered": many["steps_covered"] == single["steps_covered"],
        "within_4x": many["bytes"] <= 4 * single["bytes"],
        "output": str(out),
    }
    print(json.dumps(result, indent=1))
    return 0 if result["same_steps_covered"] and result["within_4x"] else 2


if __name__ == "__main__":
    sys.exit(main())
