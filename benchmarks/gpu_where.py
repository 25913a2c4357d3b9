"""Where a watched call's time goes on a GPU: the Python stack of every blocking sync the debugger
adds (torch's sync debug mode, each warning's stack kept), and a profile of the host side
(cProfile) of a reused debugger's 1-step call and of a 20-step call, default config.

``python -m benchmarks.gpu_where`` on a CUDA machine (``--smoke``: the tiny pipeline on the CPU, no
sync stacks). Figures go to stdout; nothing is written but the debugger's run directories.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import traceback
import warnings

import torch

from diffusion_debug import DiffusionModelDebugger

from .gpu import make_setup, training_step


def stacks(run) -> collections.Counter:
    """The stacks (package and diffusers frames, innermost first) of the sync warnings ``run()``
    raises, counted."""
    found: collections.Counter = collections.Counter()

    def keep(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [
            f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()[:-1]
            if "diffusion_debug" in f.filename or "diffusers" in f.filename
        ]
        found[" <- ".join(reversed(frames[-5:]))] += 1

    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return found


def sync_stacks(setup, steps: int = 10) -> collections.Counter:
    """The sync stacks of a watched call (our frames are in them: diffusers' own syncs show too,
    under our patched methods)."""
    debugger = DiffusionModelDebugger(setup.pipe, setup.config())

    def watched():
        with debugger:
            setup.call(steps=steps)

    watched()  # warm-up
    seen = stacks(watched)
    debugger.close()
    return seen


def profile(run, repeats: int, limit: int = 30) -> str:
    run()  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        run()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats("diffusion_debug/", limit)  # before strip_dirs: by path
    stats.strip_dirs().sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_where", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    setup = make_setup(args.smoke)
    if setup.device == "cuda":
        print("## blocking syncs the watched 10-step call adds, by stack (innermost first)", flush=True)
        for stack, n in sorted(sync_stacks(setup).items(), key=lambda kv: -kv[1]):
            print(f"{n:4d}  {stack}", flush=True)
    from .call_cost import one_step

    pipe1 = one_step(setup.pipe)
    reused = DiffusionModelDebugger(pipe1, setup.config())

    def one_call():
        with reused:
            setup.call(pipe1, steps=1, guidance_scale=0.0)

    print("\n## cProfile: 10 one-step calls, reused debugger", flush=True)
    print(profile(one_call, 10), flush=True)
    print("\n## cProfile: 10 one-step calls, plain", flush=True)
    print(profile(lambda: setup.call(pipe1, steps=1, guidance_scale=0.0), 10, limit=15), flush=True)
    reused.close()
    debugger = DiffusionModelDebugger(setup.pipe, setup.config())

    def call():
        with debugger:
            setup.call()

    print("\n## cProfile: 2 default calls (20 steps)", flush=True)
    print(profile(call, 2), flush=True)
    debugger.close()
    step, training_debugger, title = training_step(setup, "no" if setup.smoke else "fp16")
    for _ in range(3):
        step(True)
    if setup.device == "cuda":
        print(f"\n## blocking syncs of 3 monitored steps, by stack ({title})", flush=True)
        for stack, n in sorted(stacks(lambda: [step(True) for _ in range(3)]).items(), key=lambda kv: -kv[1]):
            print(f"{n:4d}  {stack}", flush=True)
    print("\n## cProfile: 5 monitored training steps", flush=True)
    print(profile(lambda: step(True), 5), flush=True)
    training_debugger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
