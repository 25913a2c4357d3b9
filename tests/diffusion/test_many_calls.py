"""A denoiser called more than twice a step (three-way guidance: the prompt, the negative prompt and a
style prompt, each its own UNet call; or two experts within one step): every call's output is
checked with the step, and a NaN/Inf made in the FIRST call is named at its module, at its step,
on that call's replay (not blamed on the guidance arithmetic that passed it on, nor on the call that
ran last). A custom loop on the tiny pipelines' own components, stepped by ``pipe.scheduler``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

CONV = "up_blocks.1.resnets.0.conv2"
PROMPTS = ("a photo of a cat", "", "an oil painting")  # one UNet call each, in this order


@pytest.fixture(scope="module")
def sd():
    return tiny_pipeline("sd")


def embeddings(pipe) -> list[torch.Tensor]:
    with torch.no_grad():
        return [pipe.encode_prompt(p, "cpu", 1, False)[0] for p in PROMPTS]


def guided(pipe, embeds: list[torch.Tensor], combine, steps: int = 3) -> torch.Tensor:
    """A UNet call a step for each of ``embeds``, in order, their outputs ``combine``d for the step."""
    scheduler = pipe.scheduler
    scheduler.set_timesteps(steps)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * scheduler.init_noise_sigma
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.scale_model_input(latents, t)
            outputs = [pipe.unet(x, t, encoder_hidden_states=e).sample for e in embeds]
            latents = scheduler.step(combine(outputs), t, latents).prev_sample
    return latents


def three_way(pipe, embeds: list[torch.Tensor], steps: int = 3) -> torch.Tensor:
    """Three UNet calls a step (prompt, negative prompt, style), combined as two guidance terms."""
    return guided(pipe, embeds, lambda o: o[1] + 5.0 * (o[0] - o[1]) + 2.0 * (o[2] - o[1]), steps)


def plant_in_call(unet: torch.nn.Module, embeds: torch.Tensor, timestep: float):
    """An Inf in ``CONV``'s output on the UNet call with ``embeds`` at ``timestep`` only, decided by
    the call's arguments (as a real fault is), so that a replay of the same call makes it again."""
    now = {}

    def before(module, args, kwargs):
        t = args[1] if len(args) > 1 else kwargs["timestep"]
        hit = torch.equal(kwargs["encoder_hidden_states"], embeds) and float(t) == timestep
        now["hit"] = hit

    def after(module, args, output):
        if now["hit"]:
            output = output.clone()
            output[0, 0, 0, 0] = float("inf")
            return output
        return None

    return [
        unet.register_forward_pre_hook(before, with_kwargs=True),
        unet.get_submodule(CONV).register_forward_hook(after),
    ]


def errors(report):
    return [(a.kind, a.component, a.module, a.step) for a in report.anomalies if a.severity == "error"]


def watched(pipe, tmp_path, loop):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        out = loop()
    dbg.close()
    return dbg.report(), out


@pytest.mark.parametrize("call", [0, 1, 2], ids=["first", "second", "third"])
def test_an_inf_in_any_of_three_calls_of_a_step_is_named_at_its_module_and_step(sd, tmp_path, call):
    embeds = embeddings(sd)
    sd.scheduler.set_timesteps(3)
    step1 = float(sd.scheduler.timesteps[1])
    handles = plant_in_call(sd.unet, embeds[call], step1)
    try:
        report, _ = watched(sd, tmp_path, lambda: three_way(sd, embeds))
    finally:
        for handle in handles:
            handle.remove()
    assert errors(report) == [("nonfinite", "unet", CONV, 1)]
    headline = next(a for a in report.anomalies if a.severity == "error")
    assert headline.message.startswith(f"unet.{CONV} produced NaN/Inf from finite inputs")
    assert headline.details["localized_by"] == "output check -> replay with full probes"
    assert "pipeline" not in {a.component for a in report.anomalies}  # not the guidance arithmetic


def test_a_clean_three_call_loop_is_quiet_and_its_latents_bitwise_the_unwatched_loop_s(sd, tmp_path):
    embeds = embeddings(sd)
    report, latents = watched(sd, tmp_path, lambda: three_way(sd, embeds))
    assert torch.equal(latents, three_way(sd, embeds))
    assert [a for a in report.anomalies if a.severity == "error" or a.kind == "overflow_risk"] == []
    assert [row["denoiser_calls"] for row in report.steps] == [3, 3, 3]


WAN_MODULE = "blocks.0.ffn.net.2"


@pytest.fixture(scope="module")
def wan22():
    from diffusion_debug.testing.features import kind_missing

    if kind_missing("wan22"):
        pytest.skip(str(kind_missing("wan22")))
    return tiny_pipeline("wan22")


def two_experts(pipe, steps: int = 2) -> torch.Tensor:
    """Both Wan 2.2 experts in every step (three calls: ``transformer`` on the prompt, then
    ``transformer_2`` on the prompt and on the negative prompt), their conditional outputs averaged."""
    with torch.no_grad():
        prompt, negative = pipe.encode_prompt("a cat", negative_prompt="", device="cpu")
        pipe.scheduler.set_timesteps(steps)
        channels = pipe.transformer.config.in_channels
        generator = torch.Generator().manual_seed(0)
        latents = pipe.prepare_latents(1, channels, 16, 16, 5, torch.float32, "cpu", generator)
        for t in pipe.scheduler.timesteps:
            kw = dict(hidden_states=latents, timestep=t.expand(1), return_dict=False)
            high = pipe.transformer(encoder_hidden_states=prompt, **kw)[0]
            low = pipe.transformer_2(encoder_hidden_states=prompt, **kw)[0]
            uncond = pipe.transformer_2(encoder_hidden_states=negative, **kw)[0]
            guided = uncond + 3.0 * ((high + low) / 2 - uncond)
            latents = pipe.scheduler.step(guided, t, latents, return_dict=False)[0]
    return latents


def test_an_inf_in_the_first_expert_of_a_step_that_ran_both_is_named_at_its_module(wan22, tmp_path):
    """The step's last call is ``transformer_2``'s: the Inf of ``transformer``'s call before it is
    still named there, on that expert's replay."""
    wan22.scheduler.set_timesteps(2)
    step1 = float(wan22.scheduler.timesteps[1])
    now = {}
    handles = [
        wan22.transformer.register_forward_pre_hook(
            lambda m, args, kwargs: now.update(hit=float(kwargs["timestep"][0]) == step1), with_kwargs=True
        ),
        wan22.transformer.get_submodule(WAN_MODULE).register_forward_hook(
            lambda m, args, out: out.index_fill(0, torch.tensor([0]), float("inf")) if now["hit"] else None
        ),
    ]
    try:
        report, _ = watched(wan22, tmp_path, lambda: two_experts(wan22))
    finally:
        for handle in handles:
            handle.remove()
    assert errors(report) == [("nonfinite", "transformer", WAN_MODULE, 1)]
    headline = next(a for a in report.anomalies if a.severity == "error")
    assert headline.details["localized_by"] == "output check -> replay with full probes"
    assert [(row["denoiser_calls"], row["denoiser"]) for row in report.steps] == [(3, "transformer_2")] * 2


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_past_eight_unstepped_denoiser_calls_only_the_last_output_is_held(sd, tmp_path):
    """A custom loop stepped by a scheduler that is not ``pipe.scheduler`` (no step seen): past
    ``MAX_UNSTEPPED_CALLS`` each call is checked on its own, so the outputs before it are let go
    (the last stays for a ``monitor_diffusion_step`` row); nothing is held after detach."""
    embeds = embeddings(sd)[0]
    dbg = DiffusionModelDebugger(sd, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    outputs = []
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with dbg, torch.no_grad():
        for _ in range(12):
            out = sd.unet(latents, 10, encoder_hidden_states=embeds).sample
            outputs.append(weakref.ref(out))
            del out
        gc.collect()
        alive_attached = [i for i, ref in enumerate(outputs) if ref() is not None]
    gc.collect()
    assert alive_attached == [11]
    assert [ref() for ref in outputs] == [None] * 12
    (event,) = [e for e in dbg.record.events if e["type"] == "unstepped_denoiser_calls"]
    assert event["calls"] == 9
    dbg.close()


def averaged(pipe, embeds: list[torch.Tensor]) -> torch.Tensor:
    """A UNet call a step for each of ``embeds`` (one embedding, shifted), averaged: with ten, more
    calls than a step's held outputs (``MAX_UNSTEPPED_CALLS``): from the ninth on each is checked on
    its own."""
    return guided(pipe, embeds, lambda outputs: torch.stack(outputs).mean(0))


@pytest.mark.parametrize("calls, call", [(6, 0), (10, 0), (10, 7), (10, 9)])
def test_an_inf_in_any_call_of_a_many_call_step_is_named_at_its_module_and_step_not_blamed_on_the_pipeline(
    sd, tmp_path, calls, call
):
    """Six calls: only the last four calls of a step were kept (a slice from a negative start cut
    the held list's front), so the first call's Inf was replayed on another call and not named.
    Ten: the first eight outputs were let go unchecked as the ninth call began to be checked on its
    own, and the first call's Inf was blamed on the pipeline's code at the next step (its input);
    the calls checked on their own (the ninth on, and the eight held before it) had step None, though
    the loop is at step 1 of a schedule set on ``pipe.scheduler``."""
    first = embeddings(sd)[0]
    embeds = [first + 0.01 * k for k in range(calls)]
    sd.scheduler.set_timesteps(3)
    handles = plant_in_call(sd.unet, embeds[call], float(sd.scheduler.timesteps[1]))
    try:
        report, _ = watched(sd, tmp_path, lambda: averaged(sd, embeds))
    finally:
        for handle in handles:
            handle.remove()
    assert errors(report)[0] == ("nonfinite", "unet", CONV, 1)
    assert "pipeline" not in {a.component for a in report.anomalies}
    assert not [a for a in report.anomalies if a.kind == "debugger_error"]


def test_a_clean_ten_call_loop_is_quiet_and_its_latents_bitwise_the_unwatched_loop_s(sd, tmp_path):
    first = embeddings(sd)[0]
    embeds = [first + 0.01 * k for k in range(10)]
    report, latents = watched(sd, tmp_path, lambda: averaged(sd, embeds))
    assert torch.equal(latents, averaged(sd, embeds))
    noisy = ("overflow_risk", "debugger_error")
    assert [a for a in report.anomalies if a.severity == "error" or a.kind in noisy] == []
    assert [row["step"] for row in report.steps] == [0, 1, 2]
