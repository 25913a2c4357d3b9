"""diffusion/pipeline_patches.py: instance-attribute wrappers removed exactly, and what the
debugger reads from scheduler.step / set_timesteps / encode_prompt calls."""

from __future__ import annotations

import inspect

import torch

from diffusion_debug.diffusion.pipeline_patches import (
    AttributePatch,
    MethodPatch,
    patch_pipeline,
    prompt_texts,
    read_scheduler_step,
    read_set_timesteps,
)
from diffusion_debug.testing import tiny_pipeline


class Owner:
    def greet(self, name: str, *, loud: bool = False) -> str:
        return name.upper() if loud else name


def test_method_patch_wraps_keeps_the_signature_and_removes_exactly():
    owner = Owner()
    patch = MethodPatch(owner, "greet", lambda original: lambda *a, **k: "<" + original(*a, **k) + ">")
    assert owner.greet("cat", loud=True) == "<CAT>"
    assert inspect.signature(owner.greet) == inspect.signature(Owner().greet)  # diffusers inspects it
    patch.remove()
    patch.remove()  # idempotent
    assert "greet" not in vars(owner) and owner.greet("cat") == "cat"
    mine = lambda name, **k: "mine"  # noqa: E731 - a user's own instance attribute is put back
    owner.greet = mine
    MethodPatch(owner, "greet", lambda original: original).remove()
    assert vars(owner)["greet"] is mine


def test_attribute_patches_undo_in_reverse_order():
    owner = Owner()
    first, second = AttributePatch(owner, "_interrupt", True), AttributePatch(owner, "_interrupt", True)
    second.remove()
    first.remove()
    assert "_interrupt" not in vars(owner)
    owner._interrupt = False
    AttributePatch(owner, "_interrupt", True).remove()
    assert owner._interrupt is False


def test_patch_pipeline_reports_the_calls_and_skips_them_while_busy():
    pipe = tiny_pipeline("sd")
    scheduler = pipe.scheduler
    seen, busy = [], {"now": False}
    patches = patch_pipeline(
        pipe,
        busy=lambda: busy["now"],
        on_step=lambda args, kwargs, output, index: seen.append(("step", index)),
        on_set_timesteps=lambda args, kwargs: seen.append(
            ("set_timesteps", read_set_timesteps(pipe.scheduler, args, kwargs))
        ),
        on_encode_prompt=lambda signature, args, kwargs: seen.append(("encode_prompt", args[0])),
    )
    try:
        pipe("a cat", num_inference_steps=2, output_type="latent", generator=torch.Generator().manual_seed(0))
        busy["now"] = True
        pipe.scheduler.set_timesteps(3)
    finally:
        for patch in patches:
            patch.remove()
    assert [kind for kind, _ in seen] == ["encode_prompt", "set_timesteps", "step", "step"]
    assert seen[0][1] == "a cat" and seen[2][1] is None  # EulerDiscrete's step_index starts unset
    steps, first, init_noise_sigma = seen[1][1]
    scheduler.set_timesteps(2)
    assert steps == 2 and first == float(scheduler.timesteps[0]) and init_noise_sigma == scheduler.init_noise_sigma
    assert "step" not in vars(pipe.scheduler) and "encode_prompt" not in vars(pipe)


def test_read_scheduler_step_finds_the_sigmas_of_the_step():
    pipe = tiny_pipeline("sdxl")  # EulerDiscreteScheduler: sigmas
    scheduler = pipe.scheduler
    scheduler.set_timesteps(3)
    sample = torch.randn(1, 4, 8, 8)
    output = torch.randn(1, 4, 8, 8)
    result = scheduler.step(output, scheduler.timesteps[0], sample)
    inputs = read_scheduler_step(scheduler, (output, scheduler.timesteps[0], sample), {}, result, None)
    assert inputs.latents is result.prev_sample and inputs.denoiser_output is output
    assert inputs.pred_original_sample is result.pred_original_sample and inputs.batch == 1
    assert float(inputs.sigma) == float(scheduler.sigmas[0]) and float(inputs.sigma_next) == float(scheduler.sigmas[1])


def test_prompt_texts_per_tokenizer_and_role():
    pipe = tiny_pipeline("sdxl")
    signature = inspect.signature(pipe.encode_prompt)
    texts = list(prompt_texts(pipe, signature, ("a cat",), {"negative_prompt": ["blurry", "dark"]}))
    assert [(t.tokenizer_name, t.role, t.index, t.text) for t in texts] == [
        ("tokenizer", "prompt", 0, "a cat"),
        ("tokenizer", "negative_prompt", 0, "blurry"),
        ("tokenizer", "negative_prompt", 1, "dark"),
        ("tokenizer_2", "prompt", 0, "a cat"),
        ("tokenizer_2", "negative_prompt", 0, "blurry"),
        ("tokenizer_2", "negative_prompt", 1, "dark"),
    ]
    assert {t.max_length for t in texts} == {77}
