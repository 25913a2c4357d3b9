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


# -- a call that raised: its frame (its locals) let go by report() ---------------------------------------


def test_report_lets_go_of_a_raised_calls_frame_and_its_latents(tmp_path):
    """The busy check keeps the running call's ``__call__`` frame; a call that raised and was caught kept
    it (and its latents, embeddings) until the debugger's next hook or detach, so a user's ``except``
    that dropped everything and asked for the report still held the call's tensors."""
    pipe = tiny_pipeline("sd")
    made = {}

    def raises(pipe, step, timestep, values):
        if step == 1:
            made["latents"] = weakref.ref(values["latents"])
            raise RuntimeError("stopped by the user")
        return values

    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        with pytest.raises(RuntimeError):
            run(pipe, steps=3, callback_on_step_end=raises)
        report = dbg.report()
        gc.collect()
        assert made["latents"]() is None
        assert [row["step"] for row in report.steps] == [0, 1]
        assert [row["step"] for row in dbg.report().steps] == [0, 1]  # the same run, ended once
        run(pipe, steps=2)  # the next call: a run of its own
        try:
            run(pipe, steps=3, callback_on_step_end=raises)
        except RuntimeError:
            dbg.report()  # asked in the handler: its exception holds the frame (the detach may see it raised on)
        dbg.report()  # after it: let go
        gc.collect()
        assert made["latents"]() is None
    assert dbg.get_summary()["runs"] == 3
