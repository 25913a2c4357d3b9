"""Wrap a diffusers pipeline: run it exactly as usual, then read what every step did.

python examples/wrap_pipeline.py                              # built-in tiny pipeline
python examples/wrap_pipeline.py --model ./my-pipeline --steps 30 --dtype float16
"""

import argparse

import torch
from diffusers import DiffusionPipeline

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local diffusers pipeline directory (default: the tiny built-in one)")
    parser.add_argument("--prompt", default="a photo of an astronaut riding a horse")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--output-dir", default="debug_output")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    if args.model:
        pipe = DiffusionPipeline.from_pretrained(args.model, dtype=dtype)  # torch_dtype= before diffusers 0.40
    else:
        pipe = tiny_pipeline("sd", dtype=dtype)
    pipe.to("cuda" if torch.cuda.is_available() else "cpu")

    debugger = DiffusionModelDebugger(pipe, DebugConfig(level="advanced", output_dir=args.output_dir))
    with debugger:  # hooks on while the pipeline runs, gone afterwards
        image = pipe(args.prompt, num_inference_steps=args.steps, generator=torch.Generator().manual_seed(0)).images[0]

    report = debugger.report()
    last = report.steps[-1]
    print(f"{len(report.steps)} steps; last latent std {last['latents']['std']:.3f}; image {image.size}")
    for anomaly in report.anomalies:
        print(f"{anomaly.severity:7} {anomaly.kind:18} {anomaly.where()}: {anomaly.message}")
    run_dir = report.save()
    print(f"report: {run_dir / 'report.html'}")
    return report


if __name__ == "__main__":
    main()
