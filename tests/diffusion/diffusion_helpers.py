"""Helpers for the DiffusionModelDebugger tests: run a tiny pipeline, plant a fault."""

from __future__ import annotations

import torch

PROMPT = "a photo of a cat"


def run(pipe, steps: int = 3, **kwargs):
    kwargs.setdefault("output_type", "np")
    prompt = kwargs.pop("prompt", PROMPT)
    return pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs).images


def plant(module: torch.nn.Module, from_call: int, make=None):
    """Forward hook that replaces ``module``'s output from its ``from_call``-th call (0-based) on;
    returns the hook handle.  Default: every element +inf."""
    calls = {"n": 0}
    make = make or (lambda out: torch.full_like(out, float("inf")))

    def hook(mod, args, output):
        n = calls["n"]
        calls["n"] += 1
        if n >= from_call:
            return make(output)
        return None

    return module.register_forward_hook(hook)
