"""Training overhead on 2 CPU processes (issue 22): the tiny SD UNet's training step (noise-prediction
MSE, DDP backward, AdamW) plain vs watched by TrainingDebugger (default config: its per-step
all_reduce and the stall watch's side channel included), under ``accelerate launch``.

    python -m benchmarks.training_ranks               # 2 processes, 40 interleaved repetitions
    python -m benchmarks.training_ranks --repeats 3   # seconds; checks it works

Two identical models (same weights, each prepared by Accelerate), stepped in turn within each process
(plain, watched, plain, watched, ...) after a warm-up; per rank the median of each and their ratio,
against the training budget of DESIGN.md (<= 1.03x). Each rank runs one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env, free_port

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 1.03  # DESIGN.md: training, default mode


def job(output_dir: str, repeats: int, warmup: int) -> None:
    """One rank (``--job``): prints ``TIMES <json>`` with this rank's step times of each case."""
    import statistics

    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator

    from diffusion_debug import DebugConfig, TrainingDebugger
    from diffusion_debug.testing import tiny_pipeline

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    unet = tiny_pipeline("sd").unet
    cases = {}
    for name in ("plain", "TrainingDebugger default"):
        model = type(unet).from_config(unet.config)
        model.load_state_dict(unet.state_dict())
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        cases[name] = list(accelerator.prepare(model, optimizer))
    watched, optimizer = cases["TrainingDebugger default"]
    config = DebugConfig(output_dir=output_dir, run_name="bench-training-ranks")
    tdbg = TrainingDebugger(watched, accelerator=accelerator, config=config)
    g = torch.Generator().manual_seed(rank)
    size, channels = unet.config.sample_size, unet.config.in_channels
    latents = torch.randn(2, channels, size, size, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    context = torch.randn(2, 8, unet.config.cross_attention_dim, generator=g)
    timesteps = torch.randint(0, 1000, (2,), generator=g)
    counts = {name: 0 for name in cases}

    def step(name: str) -> float:
        model, optimizer = cases[name]
        start = time.perf_counter()
        loss = F.mse_loss(model(latents + noise, timesteps, encoder_hidden_states=context).sample, noise)
        accelerator.backward(loss)
        if name != "plain":
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=counts[name], timesteps=timesteps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts[name] += 1
        return time.perf_counter() - start

    for _ in range(warmup):
        for name in cases:
            step(name)
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name in cases:
            times[name].append(step(name))
    medians = {name: statistics.median(t) for name, t in times.items()}
    anomalies = tdbg.get_summary().get("anomaly_counts") or {}
    tdbg.close()
    parameters = sum(p.numel() for p in unet.parameters())
    line = {"rank": rank, "medians": medians, "parameters": parameters, "anomaly_counts": anomalies}
    sys.stdout.write(f"TIMES {json.dumps(line)}\n")
    sys.stdout.flush()
    accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        job(args.job, args.repeats, args.warmup)
        return 0
    accelerate = accelerate_launcher()
    if accelerate is None:
        raise SystemExit("the accelerate launcher is not installed")
    out = tempfile.mkdtemp(prefix="diffusion-debug-training-ranks-")
    cmd = [accelerate, "launch", "--config_file", str(ROOT / "configs" / "accelerate_2cpu.yaml")]
    cmd += ["--num_processes", str(args.processes), "--main_process_port", str(free_port())]
    cmd += [str(Path(__file__).resolve())]
    cmd += ["--job", out, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    env = cpu_launch_env(ROOT)
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    ranks = [json.loads(line[len("TIMES ") :]) for line in done.stdout.splitlines() if line.startswith("TIMES ")]
    if len(ranks) != args.processes:
        print(f"{len(ranks)} of {args.processes} ranks reported:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return 1
    rows = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        plain, watched = r["medians"]["plain"], r["medians"]["TrainingDebugger default"]
        rows.append({"rank": r["rank"], "plain_s": plain, "watched_s": watched, "ratio": watched / plain})
    worst = max(row["ratio"] for row in rows)
    result = {
        "processes": args.processes,
        "repeats": args.repeats,
        "unet_parameters": ranks[0]["parameters"],
        "ranks": rows,
        "anomaly_counts": [r["anomaly_counts"] for r in ranks],
        "worst_ratio": round(worst, 4),
        "budget": BUDGET,
        "within_budget": worst <= BUDGET,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
