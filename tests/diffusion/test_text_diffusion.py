"""Text diffusion (LLaDA2, diffusion_debug.testing.text_diffusion): a loop unlike the image pipelines'.
The language model ``model`` is the denoiser, the latents are token ids, and the scheduler's
``timestep`` restarts in every block (and stays put in its editing steps). Asserted: bitwise equal
sequences, one row per step of the loop that runs (the step numbers the pipeline itself passes to
``callback_on_step_end``), a quiet clean run (no Gaussian check on token ids), and an Inf planted at
step 1 named once, at its component, module and step, its repeats at later steps folded under it."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.diffusion import checks
from diffusion_debug.diffusion.components.inventory import find_components
from diffusion_debug.record import make_anomaly
from diffusion_debug.stats import tensor_stats
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.text_diffusion import LLADA2_CALL

pytestmark = pytest.mark.skipif(bool(kind_missing("llada2")), reason=str(kind_missing("llada2")))

MODULE = "model.layers.0.mlp.down_proj"  # inside the denoiser, a Linear called once a step
# 2 blocks of 4 tokens, every token committed at once (threshold 0), then editing steps whose
# scheduler timestep stays at 1: the scheduler sees 0, 1, 1, 1 in each block
EDITING = {"threshold": 0.0, "editing_threshold": 1e-6, "max_post_steps": 2}


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("llada2")


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), log_level="error", **kwargs)


def call(pipe, steps=2, callback=None, **extra):
    kwargs = {**LLADA2_CALL(), **extra}
    if callback is not None:
        kwargs["callback_on_step_end"] = callback
    return pipe(**kwargs, num_inference_steps=steps, generator=torch.Generator().manual_seed(0)).sequences


def hooks(pipe):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pipe.model.modules())


def loop_steps(pipe, **extra):
    """(step, timestep) as the pipeline passes them to callback_on_step_end: the naive reference."""
    seen = []

    def callback(_pipe, step, timestep, kwargs):
        seen.append((step, float(timestep)))
        return {}

    return call(pipe, callback=callback, **extra), seen


def test_the_language_model_is_the_denoiser(pipe):
    assert [(c.name, c.role) for c in find_components(pipe)] == [("model", "denoiser")]


def test_clean_run_is_bitwise_equal_quiet_and_has_a_row_per_step(pipe, tmp_path, caplog):
    before = hooks(pipe)
    plain, seen = loop_steps(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with caplog.at_level("INFO", logger="diffusion_debug"), dbg:
        watched = call(pipe)
    assert hooks(pipe) == before
    assert torch.equal(plain, watched)
    report = dbg.report()
    assert report.anomalies == [], [a.to_dict() for a in report.anomalies]
    assert not [r.message for r in caplog.records if "denoiser" in r.message]
    assert seen == [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]  # the scheduler's timestep restarts per block
    assert [(row["step"], row["timestep"]) for row in report.steps] == seen
    # the latents are the active block's token ids; the model output the logits over the window
    assert [row["latents"]["dtype"] for row in report.steps] == ["int64"] * 4
    assert [row["model_output"]["shape"] for row in report.steps] == [[1, 8, len(pipe.tokenizer)]] * 2 + [
        [1, 12, len(pipe.tokenizer)]
    ] * 2
    assert report.components["model"]["calls"] == 4
    dbg.close()


def test_editing_steps_are_numbered_by_the_loop_that_runs(pipe, tmp_path):
    plain, seen = loop_steps(pipe, **EDITING)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = call(pipe, **EDITING)
    assert torch.equal(plain, watched)
    assert seen == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 0.0), (5, 1.0), (6, 1.0), (7, 1.0)]
    report = dbg.report()
    assert [(row["step"], row["timestep"]) for row in report.steps] == seen
    assert report.anomalies == [], [a.to_dict() for a in report.anomalies]
    dbg.close()


@pytest.mark.parametrize("extra", [{}, EDITING], ids=["blocks", "editing"])
def test_inf_planted_at_step_1_is_one_anomaly_at_its_step(pipe, tmp_path, extra):
    before, layer = hooks(pipe), pipe.model.get_submodule(MODULE)
    with plant_nonfinite(layer, from_call=1):  # counts its own calls: planted afresh for each run
        plain, seen = loop_steps(pipe, **extra)
    with plant_nonfinite(layer, from_call=1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            watched = call(pipe, **extra)
    assert hooks(pipe) == before
    assert torch.equal(plain, watched)
    report = dbg.report()
    (anomaly,) = report.anomalies  # the repeats at steps 2, 3, ... are folded into it
    assert anomaly is report.headline
    assert (anomaly.kind, anomaly.severity) == ("nonfinite", "error")
    assert (anomaly.component, anomaly.module) == ("model", MODULE)
    assert (anomaly.step, anomaly.timestep) == seen[1] == (1, 1.0)
    assert anomaly.details["count"] == len(seen) - 1 and anomaly.details["last_step"] == len(seen) - 1
    assert anomaly.message == (
        f"model.{MODULE} produced NaN/Inf from finite inputs (check its dtype, inputs and weights; try float32 "
        "or bfloat16)."
    )
    assert [row["step"] for row in report.steps] == [step for step, _ in seen]
    dbg.close()


def test_policy_raise_stops_at_the_planted_step(pipe, tmp_path):
    with plant_nonfinite(pipe.model.get_submodule(MODULE), from_call=1):
        with pytest.raises(DiffusionDebugError) as raised:
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise")):
                call(pipe)
    anomaly = raised.value.anomaly
    assert (anomaly.kind, anomaly.component, anomaly.module, anomaly.step) == ("nonfinite", "model", MODULE, 1)


def test_an_inf_that_makes_the_sampling_raise_is_named_at_its_step(pipe, tmp_path):
    # with temperature > 0 the scheduler samples with torch.multinomial, which raises on NaN
    # probabilities: scheduler.step never returns, yet the step's denoiser output was seen
    layer, sampled = pipe.model.get_submodule(MODULE), {"temperature": 1.0}
    with plant_nonfinite(layer, from_call=1), pytest.raises(RuntimeError) as plain:
        call(pipe, **sampled)
    with plant_nonfinite(layer, from_call=1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with pytest.raises(RuntimeError) as watched, dbg:
            call(pipe, **sampled)
    assert str(watched.value) == str(plain.value)  # the user's error, unchanged
    report = dbg.report()
    (anomaly,) = report.anomalies
    assert (anomaly.kind, anomaly.component, anomaly.module, anomaly.step) == ("nonfinite", "model", MODULE, 1)
    assert [row["step"] for row in report.steps] == [0]  # step 1 made no row: its scheduler.step raised
    dbg.close()


def test_an_error_found_after_the_call_raised_is_not_raised_by_the_next_call(pipe, tmp_path):
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise"))
    with plant_nonfinite(pipe.model.get_submodule(MODULE), from_call=1), pytest.raises(RuntimeError):
        with dbg:
            call(pipe, temperature=1.0)  # the pipeline's own error, before policy raise could act
    (anomaly,) = dbg.report().anomalies
    assert (anomaly.component, anomaly.module, anomaly.step) == ("model", MODULE, 1)
    with dbg:
        call(pipe)  # clean: no DiffusionDebugError for the earlier call's fault
    assert [row["step"] for row in dbg.report().steps][-4:] == [0, 1, 2, 3]
    dbg.close()


def test_token_ids_get_no_gaussian_check():
    # a naive reference: the same values as floats are far off a unit Gaussian, as ids they are not checked
    ids = torch.tensor([[3, 90, 7, 51]])
    kwargs = dict(expected_std=1.0, tolerance=3.0, step=0, timestep=0.0, previous_l2=1.0)
    assert [a.kind for a in checks.latent_divergence(tensor_stats(ids.float()), **kwargs)] == ["latent_divergence"]
    assert checks.latent_divergence(tensor_stats(ids), **kwargs) == []


def test_a_step_without_a_known_denoiser_is_named_in_words():
    anomaly = make_anomaly(
        "nonfinite", component="", module="", step=1, details={"localized_by": "output check", "phase": "denoise"}
    )
    assert anomaly.message == (
        "The model output passed to scheduler.step held NaN/Inf, and no watched component is known as the "
        "denoiser that made it; check the model the pipeline calls in its loop (its dtype, inputs and weights)."
    )


def test_a_pipeline_without_a_known_denoiser_says_its_scheduler_records_the_steps(tmp_path, caplog):
    from diffusers import DDIMScheduler, DiffusionPipeline

    class Net(torch.nn.Module):  # no diffusers or transformers class: role "other"
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class Loop(DiffusionPipeline):
        def __init__(self, net, scheduler):
            super().__init__()
            self.register_modules(net=net, scheduler=scheduler)

        def __call__(self, latents, steps=2):
            self.scheduler.set_timesteps(steps)
            for t in self.scheduler.timesteps:
                latents = self.scheduler.step(self.net(latents), t, latents).prev_sample
            return latents

    torch.manual_seed(0)
    pipe = Loop(Net(), DDIMScheduler())
    plain = pipe(torch.ones(1, 4))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with caplog.at_level("WARNING", logger="diffusion_debug"), dbg:
        watched = pipe(torch.ones(1, 4))
    assert torch.equal(plain, watched)
    (note,) = [r.getMessage() for r in caplog.records if "denoiser" in r.getMessage()]
    assert note == (
        "diffusion-debug: Loop has no component known as its denoiser (no UNet, transformer, prior or text "
        "diffusion model): DDIMScheduler.step records a row per step from what it is given, and each component is "
        "checked call by call, apart from the steps."
    )
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    dbg.close()
