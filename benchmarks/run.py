"""Run every benchmark and write benchmarks/RESULTS.md.

python -m benchmarks.run            # full run on the mid-size UNet, and the user's path in fp16/bf16 (minutes)
python -m benchmarks.run --quick    # the same sections with fewer rounds and steps: rough figures, ~40% of the time
python -m benchmarks.run --smoke --out /tmp/results.md   # seconds; checks it all works
python -m benchmarks.user_path      # the fp16/bf16 section alone (benchmarks/user_path.py)
python -m benchmarks.pre_reduction  # apart (2 processes, 1-2 min): the pre-reduction check's cost per DDP step
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffusion_debug.testing import tiny_pipeline

from . import (
    call_cost,
    compiled,
    harness,
    inference,
    localisation,
    memory,
    op_counts,
    probe_overhead,
    training,
    transfers,
    user_path,
)
from .harness import machine
from .models import mid_pipeline, mid_unet

RESULTS = Path(__file__).with_name("RESULTS.md")
HISTORY = "<!-- history: kept by benchmarks.run -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models, few repetitions: checks, not figures")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps: rough figures, same sections")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the results (Markdown)")
    args = parser.parse_args(argv)

    with harness.smoke_warm_ups() if args.smoke else contextlib.nullcontext():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="diffusion-debug-bench-") as scratch:  # each make test ran one
        return _sections(args, scratch)


def _sections(args: argparse.Namespace, scratch: str) -> int:
    smoke, quick = args.smoke, args.quick and not args.smoke
    started = time.time()
    if smoke:
        pipe, unet, model_name, steps, repeats = tiny_pipeline("sd"), tiny_pipeline("sd").unet, "tiny", 2, 1
    else:
        pipe, unet, model_name, steps, repeats = mid_pipeline(), mid_unet(), "mid", 10, 7
    rounds = dict(probes=15, inference=15, training=10, fixed=200, local=3)  # the full run's
    if smoke:
        rounds = dict(probes=1, inference=repeats, training=1, fixed=1, local=1)
    elif quick:
        rounds = dict(probes=5, inference=5, training=4, fixed=40, local=1)
    sections: list[tuple[str, str]] = []

    def section(title: str, body: str) -> None:
        print(f"\n## {title}\n{body}", flush=True)
        sections.append((title, body))

    probes = probe_overhead.run(unet, repeats=rounds["probes"], size=8 if smoke else 32)
    section("Probes alone (one UNet forward)", probes.markdown())
    infer = inference.run(pipe, steps=steps, repeats=rounds["inference"], output_dir=scratch)
    section("Inference overhead", infer.markdown())
    if smoke:  # compiled.run is tested on the user's path's compiled part (tests/test_benchmarks.py)
        comp, graphs = None, None
        section("Compiled UNet", "Not run by a smoke run (dynamo's trace takes seconds).")
    else:
        comp, graphs = compiled.run(
            pipe, steps=steps, repeats=rounds["inference"], output_dir=scratch, backend="inductor"
        )
        section("Compiled UNet", comp.markdown() + "\n\n" + _code(graphs))
    train = training.run(unet, repeats=rounds["training"], output_dir=scratch, size=8 if smoke else 32)
    section("Training overhead", train.markdown())
    one_step = call_cost.one_step(tiny_pipeline("sd"))
    fixed = [
        call_cost.run(one_step, repeats=rounds["fixed"], output_dir=scratch, output_type=kind)
        for kind in ("latent", "pil")
    ]
    section("Fixed cost of a watched call", call_cost.markdown(fixed))
    if smoke:
        users = user_path.run(scratch, **user_path.SMOKE)
    else:
        users = user_path.run(scratch, quick=quick, **(user_path.QUICK if quick else {}))
    section("The user's path: fp16 and bf16 (CPU time)", users.markdown())
    reads = transfers.run(pipe, steps=steps, output_dir=scratch)
    section("Device-to-host transfers (default mode)", _code(reads))
    local = localisation.run(pipe, steps=max(steps, 3), repeats=rounds["local"], output_dir=scratch)
    section("Localisation cost", _code(local))
    rss = memory.peak_rss(model_name, steps, scratch, here=smoke)  # smoke: no Python started
    growth = memory.record_growth(200 if smoke else 10_000, scratch)  # smoke: it runs, 7 s less
    section("Memory", _code({"peak_rss_mb": rss, "record": growth}))
    ops = op_counts.run(tiny_pipeline("sd"), output_dir=scratch, smoke=smoke)
    section("Aten ops added per step (tiny SD pipeline, deterministic)", _code(ops))
    if torch.cuda.is_available() and not smoke:
        from . import gpu

        gpu_results = gpu.run(scratch)
        section("GPU (real size)", f"{torch.cuda.get_device_name()}\n\n" + gpu.markdown(gpu_results))
    else:
        section(
            "GPU (real size)",
            "Not measured here: no GPU on this machine. `python -m benchmarks.gpu` on a machine with CUDA "
            "(also run by `python -m benchmarks.run` there) measures SD1.5 size in fp16: plain, default, basic and "
            "full probes, the 1-step call, added syncs and ops per step, device checks, Accelerate fp16/bf16 "
            "training, offload and the inductor-compiled UNet. The last GPU figures: `benchmarks/RESULTS_GPU.md` "
            "and the history below.",
        )

    budgets = {
        **users.budgets(),
        "fp32 inference default <= 1.03x": infer.ratio("debugger default (sentinel)") <= 1.03,
        "fp32 full probes <= 1.15x": infer.ratio("debugger, full probes") <= 1.15,
        "training default <= 1.03x": train.ratio("TrainingDebugger default") <= 1.03,
        "one transfer per step": reads["added_reads_per_step"] <= 1.0 + 1e-9,
        "0 blocking reads per step": reads["added_blocking_reads_per_step"] == 0,
        **(
            {}
            if comp is None
            else {
                "compiled: watched <= 1.5x, no graph break or recompile": comp.ratio("watched") <= 1.5
                and graphs == {"added_graph_breaks": 0, "added_graphs": 0}
            }
        ),
        "<= 25 added ops per denoising step": ops["inference_default"]["added_ops_per_step"] <= 25,
    }
    header = [
        "# Benchmark results",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {machine()}",
        f"- command: `python -m benchmarks.run{' --smoke' if smoke else ' --quick' if quick else ''}`"
        f" ({time.time() - started:.0f} s)",
        "- model: "
        + (
            "tiny SD pipeline (smoke run: figures mean nothing)"
            if smoke
            else "mid-size SD pipeline, UNet ~18M parameters, 32x32 latents"
        ),
        "- method: one process, interleaved runs (A B C A B C ...), warm-up first; 'median s' is each case's"
        " median, 'paired ratio' the median over rounds of the case's time / that round's baseline time"
        " (a slow phase of the machine moves both sides alike); budgets are checked against the paired"
        " ratio, and the fixed cost against the median of the per-round differences; 'middle half of rounds'"
        " is the per-round ratios' first to third quartile: a verdict holds only if that range is on one side",
        "- configs: the user's defaults (events streamed to events.jsonl, warnings logged) unless a case's"
        " name says what it changes",
        "",
        "Budgets (DESIGN.md): " + ", ".join(f"{k}: {user_path.verdict(v)}" for k, v in budgets.items()),
    ]
    text = "\n".join(header) + "\n\n" + "\n\n".join(f"## {t}\n\n{b}" for t, b in sections) + "\n"
    if args.out.exists() and HISTORY in args.out.read_text():  # hand-kept notes survive a rerun
        text += "\n" + HISTORY + args.out.read_text().split(HISTORY, 1)[1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"\nwrote {args.out}")
    return 0


def _code(data: dict) -> str:
    return "```json\n" + json.dumps(data, indent=1, default=str) + "\n```"


if __name__ == "__main__":
    sys.exit(main())
