"""The tree memo's per-attach test, A/B in one process: a reused debugger's 1-step call whose attach
reads its trees' dict version tags (:mod:`diffusion_debug.diffusion.components.tree_tags`) against
the same call whose attach walks every module of every component (:func:`~diffusion_debug.diffusion.
components.structure.tree_key`, as before cost32), each on a pipeline of its own (the second a deep
copy), in the mirrored rounds of :mod:`.call_control` with the components' compute taken out; the
walking debugger's calls run with the tag reader switched off (``tree_tags.READ = None``: its memo
keeps no tags, so each attach walks). Also times the two tests alone on the pipeline's trees.
``python -m benchmarks.tree_walk [fp16|fp32|bf16] [--rounds N]``."""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
import timeit
from typing import Any, Callable

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import tree_tags
from diffusion_debug.diffusion.components.structure import tree_key

from .call_control import Controlled, compute_clock, controlled_rounds
from .call_cost import one_step
from .harness import CLOCKS, Comparison, machine

TAGS, WALK = "reused, tags read", "reused, every tree walked"


def alone(pipe: Any, number: int = 200) -> dict[str, float]:
    """CPU microseconds of each test over the pipeline's components (the fewest of 5 repeats)."""
    roots = [pipe.text_encoder, pipe.unet, pipe.vae]
    tags = [tree_tags.tree_tags(tree_key(root)[1]) for root in roots]
    if any(found is None for found in tags):
        return {}
    tests = {
        "walk (tree_key)": lambda: [tree_key(root) for root in roots],
        "tags (unchanged)": lambda: [tree_tags.unchanged(root, found) for root, found in zip(roots, tags)],
    }
    clock = time.process_time
    return {
        name: 1e6 * min(timeit.repeat(test, number=number, repeat=5, timer=clock)) / number
        for name, test in tests.items()
    }


def run(pipe: Any, *, repeats: int, output_dir: str, label: str, clock: str = "cpu", warmup: int = 4) -> Controlled:
    now, spent, seen = CLOCKS[clock], [0.0, 0.0], set()
    result = Controlled(f"1-step {label} call, output_type='pil'", clock=clock)
    twin = copy.deepcopy(pipe)
    reader = tree_tags.READ
    with compute_clock(pipe, spent, now, seen, twins=(twin,)):
        debuggers = {
            TAGS: DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir)),
            WALK: DiffusionModelDebugger(twin, DebugConfig(output_dir=output_dir)),
        }

        def called(target: Any) -> Callable[[], None]:
            def call() -> None:
                target(
                    "a photo of a cat",
                    num_inference_steps=1,
                    output_type="pil",
                    generator=torch.Generator().manual_seed(0),
                )

            return call

        def watched(name: str) -> Callable[[], None]:
            debugger = debuggers[name]
            plain = called(debugger.pipe)

            def call() -> None:
                tree_tags.READ = reader if name == TAGS else None
                try:
                    with debugger:
                        plain()
                finally:
                    tree_tags.READ = reader

            return call

        cases = {"plain": called(pipe), TAGS: watched(TAGS), WALK: watched(WALK)}
        try:
            controlled_rounds(result, cases, debuggers, TAGS, now, spent, seen, repeats=repeats, warmup=warmup)
        finally:
            for debugger in debuggers.values():
                debugger.close()
    return result


def main(argv: list[str] | None = None) -> int:
    from diffusion_debug.testing import tiny_pipeline

    from .user_path import DTYPES

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tree_walk", description=__doc__.splitlines()[0])
    parser.add_argument("dtype", nargs="?", choices=list(DTYPES), default="fp16")
    parser.add_argument("--rounds", type=int, default=120)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {machine()}\n")
    pipe = one_step(tiny_pipeline("sd", dtype=DTYPES[args.dtype]))
    pipe.set_progress_bar_config(disable=True)
    print("tests alone, us a call over text_encoder + unet + vae:", {k: round(v, 1) for k, v in alone(pipe).items()})
    started = time.time()
    found = run(pipe, repeats=args.rounds, output_dir=tempfile.mkdtemp(), label=f"tiny SD {args.dtype}")
    print(found.markdown())
    table = found.comparison("adjusted")
    against = Comparison("tags against walk", {WALK: table.times[WALK], TAGS: table.times[TAGS]}, table.clock)
    low, high = against.added_ms_interval(TAGS)
    print(
        f"\ntags minus walk, compute taken out: {against.added_ms(TAGS):+.3f} ms (95% interval {low:+.3f} to "
        f"{high:+.3f}), {len(table.times[TAGS])} rounds, {time.time() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
