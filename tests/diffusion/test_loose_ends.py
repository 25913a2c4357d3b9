"""Loose ends of earlier sessions: what the debugger keeps of a user's pipeline after it is done
with it (a kept report, a debugger dropped while attached, a call that raised), a NaN/Inf made
between two modules of a component named at a readable place, and two threads each watching its
own pipeline."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", **kwargs)


def inf_from(module):
    """A hook making ``module``'s output Inf on every call (its handle)."""
    return module.register_forward_hook(lambda m, a, output: torch.full_like(output, float("inf")))


# -- a debugger never keeps a user's pipeline alive ------------------------------------------------------


def test_a_kept_report_lets_its_pipeline_go_and_why_then_says_so(tmp_path):
    """The report's ``why()`` replays on the live pipeline: it held the pipeline (and every component)
    for as long as the user kept the report. Held weakly now; once the pipeline is gone ``why()`` says
    to replay from the run directory."""
    pipe = tiny_pipeline("sd")
    gone = weakref.ref(pipe)
    handle = inf_from(pipe.unet.conv_in)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2)
    handle.remove()
    report = dbg.report()
    run_dir = report.save()
    del pipe, dbg, handle
    gc.collect()
    assert gone() is None
    with pytest.raises(DiffusionDebugError) as raised:
        report.why()
    assert str(raised.value) == (
        "why() replays on the pipeline this report was made of, which is gone; "
        f"run `diffusion-debug why {run_dir}` to replay on the pipeline the run directory names."
    )


def test_a_stop_policy_debugger_dropped_while_attached_lets_its_pipeline_go(tmp_path):
    """Policy ``stop`` sets ``pipe._interrupt`` through a patch that a class-level dict of stacks held
    (with its owner) until detach: a debugger dropped while attached kept its pipeline for ever."""
    pipe = tiny_pipeline("sd")
    gone = weakref.ref(pipe)
    handle = inf_from(pipe.unet.conv_in)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="stop"))
    dbg.attach()
    run(pipe, steps=2)
    assert vars(pipe)["_interrupt"] is True
    del pipe, dbg, handle
    gc.collect()
    assert gone() is None
