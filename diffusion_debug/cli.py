"""The ``diffusion-debug`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import math

    import torch

    from .probes import Probe, find_producer
    from .testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    target = "up_blocks.1.resnets.0.conv2"

    def plant(_, __, output):
        return torch.full_like(output, math.inf)

    fault = pipe.unet.get_submodule(target).register_forward_hook(plant)
    probe = Probe(pipe.unet, "full")
    with probe.attach():
        pipe("a photo of a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    fault.remove()
    producer = find_producer(probe.collect())
    print(f"planted Inf in unet {target}; probes name: unet {producer.module if producer else '(none)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-debug", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the built-in tiny pipeline under the debugger")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
