"""Pipeline-first calls get one clear TypeError naming the right call; the
decorator form ``@dbg.watch`` records the steps of each call and detaches after it."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger


def hook_count(pipe) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pipe.unet.modules())


@pytest.fixture
def dbg(pipes, tmp_path):
    debugger = DiffusionModelDebugger(pipes["sd"], DebugConfig(output_dir=str(tmp_path)))
    yield debugger
    debugger.close()


def test_monitor_diffusion_step_in_the_seed_order_names_the_right_call(dbg, pipes):
    with pytest.raises(TypeError) as caught:
        dbg.monitor_diffusion_step(pipes["sd"], 0, torch.zeros(1, 4, 8, 8))
    assert str(caught.value) == (
        "monitor_diffusion_step takes the step first: the pipeline was given to DiffusionModelDebugger(pipe, ...); "
        "call dbg.monitor_diffusion_step(step, latents, timestep=timestep)."
    )
    with pytest.raises(TypeError, match=r"^monitor_diffusion_step needs the step as an integer, not str; call dbg"):
        dbg.monitor_diffusion_step("0", torch.zeros(1, 4, 8, 8))
    with pytest.raises(DiffusionDebugError, match="needs the latents as a torch.Tensor, not list"):
        dbg.monitor_diffusion_step(0, [0.0])
    assert dbg.report().steps == [] and not dbg.report().anomalies  # nothing recorded, no debugger_error


def test_analyze_diffusion_pipeline_with_the_pipeline_names_the_right_call(dbg, pipes):
    with pytest.raises(TypeError) as caught:
        dbg.analyze_diffusion_pipeline(pipes["sd"])
    assert str(caught.value) == (
        "analyze_diffusion_pipeline takes no arguments: the debugger analyses the pipeline it was given "
        "(DiffusionModelDebugger(pipe, ...)); call dbg.analyze_diffusion_pipeline()."
    )
    assert dbg.analyze_diffusion_pipeline()["total_parameters"] > 0


def test_watch_records_each_call_and_detaches_after_it_also_on_an_exception(dbg, pipes):
    pipe = pipes["sd"]

    @dbg.watch
    def generate(steps, fail=False):
        assert dbg.attached
        images = run(pipe, steps=steps)
        if fail:
            raise ValueError("after the pipeline")
        return images

    assert generate(2).shape[0] == 1
    assert not dbg.attached and hook_count(pipe) == 0 and "step" not in vars(pipe.scheduler)
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    with pytest.raises(ValueError, match="after the pipeline"):
        generate(3, fail=True)
    assert not dbg.attached and hook_count(pipe) == 0 and "step" not in vars(pipe.scheduler)
    assert [row["step"] for row in dbg.report().steps] == [0, 1, 0, 1, 2]
    run(pipe, steps=1)  # detached: not recorded
    assert len(dbg.report().steps) == 5
