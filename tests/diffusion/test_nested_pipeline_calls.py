"""Two pipelines sharing their components (``from_pipe``), one called inside the other's call (from a
``callback_on_step_end``): each pipeline's debugger records its own pipeline's runs and steps only, as it
does when the two are called in turn. The other pipeline's call is not a run of the outer one's
debugger (its steps cut the outer run in two, and a NaN made in it was named in a run the outer
pipeline never made); its fp16 probes' readings are not the outer step's. The images, the user's
hooks on a shared UNet block (their order and their results) stay as without the debuggers."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

CONV = "up_blocks.1.resnets.0.conv2"
IMAGE = torch.linspace(0, 1, 3 * 32 * 32).reshape(1, 3, 32, 32)


def pipelines(dtype: torch.dtype):
    """A text-to-image pipeline and its img2img twin sharing every component (``from_pipe``)."""
    from diffusers import StableDiffusionImg2ImgPipeline

    base = tiny_pipeline("sd", dtype=dtype)
    img2img = StableDiffusionImg2ImgPipeline.from_pipe(base, dtype=dtype)  # (dtype: from_pipe casts to fp32)
    img2img.set_progress_bar_config(disable=True)
    return base, img2img


def text(pipe, **kwargs) -> torch.Tensor:  # 4 steps
    return pipe(
        "a cat", num_inference_steps=4, generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs
    )[0]


def image(pipe, **kwargs) -> torch.Tensor:  # 3 steps (strength 0.75 of 4)
    kwargs.update(image=IMAGE, strength=0.75, num_inference_steps=4, output_type="pt")
    return pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs)[0]


def inside(at: int, call, made: list):
    """A step-end callback that makes ``call()`` after step ``at`` (its image kept in ``made``)."""

    def callback(pipe, step, timestep, kwargs):
        if step == at:
            made.append(call())
        return kwargs

    return callback


def debugger(pipe, path) -> DiffusionModelDebugger:
    return DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(path), log_level="error"))


def said(dbg) -> list[tuple]:
    """Every error and ``debugger_error`` it recorded."""
    return [
        (a.kind, a.component, a.module, a.step, a.details.get("run"))
        for a in dbg.report().anomalies
        if a.severity == "error" or a.kind == "debugger_error"
    ]


def kandinsky_combined(dtype: torch.dtype):
    """A tiny KandinskyV22CombinedPipeline: the zoo's prior and decoder pipelines' components."""
    from diffusers import KandinskyV22CombinedPipeline

    prior = tiny_pipeline("kandinsky_prior", dtype=dtype)
    decoder = tiny_pipeline("kandinsky_decoder", dtype=dtype)
    parts = {"unet": decoder.unet, "scheduler": decoder.scheduler, "movq": decoder.movq}
    parts.update({f"prior_{name}": getattr(prior, name) for name in ("prior", "image_encoder", "text_encoder")})
    parts.update({f"prior_{name}": getattr(prior, name) for name in ("tokenizer", "scheduler", "image_processor")})
    pipe = KandinskyV22CombinedPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def runs(dbg) -> list[tuple[int, int]]:
    return [(row["run"], row["step"]) for row in dbg.report().steps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16: the sentinel's and full probes' queues
def test_a_pipeline_called_in_the_callback_of_another_is_no_run_of_the_outer_one_s_debugger(dtype, tmp_path):
    """Only the outer pipeline watched; a NaN made by the shared UNet in the inner call alone (a hook
    on during it): the outer run is clean and whole (4 steps of run 1), nothing named; the inner
    call's NaN reaches its image alone, as without the debugger."""
    base, img2img = pipelines(dtype)
    nan = {"on": False}

    def poisoned():
        nan["on"] = True
        try:
            return image(img2img)
        finally:
            nan["on"] = False

    base.unet.get_submodule(CONV).register_forward_hook(
        lambda module, args, output: torch.full_like(output, float("nan")) if nan["on"] else None
    )
    expected, unwatched_inner = text(base, callback_on_step_end=inside(1, poisoned, made := [])), made[0]
    dbg = debugger(base, tmp_path)
    with dbg:
        watched = text(base, callback_on_step_end=inside(1, poisoned, made := []))
    assert torch.equal(watched, expected) and torch.isnan(made[0]).any() and torch.isnan(unwatched_inner).any()
    assert runs(dbg) == [(1, step) for step in range(4)]
    assert said(dbg) == []
    dbg.close()


def test_two_debuggers_of_from_pipe_pipelines_called_inside_each_other_record_their_own_runs(tmp_path):
    """fp16 (the UNet's sentinel paced: its hooks taken out and put back, per debugger): each pipeline
    called inside the other's call, twice; a forward pre-hook and two forward hooks of the user's on a
    sentinel block (the second changes the output) run in their order with the same results; each
    debugger records its pipeline's runs alone, in the order they began; a NaN made in the inner call
    is named by the inner pipeline's debugger at its module, step and run, by the outer one's nowhere.
    Detaching one leaves the other watching; after both, the user's hooks are all that is left."""
    seen: dict[str, list] = {"watched": [], "twin": []}
    pairs = {}
    for name in seen:
        base, img2img = pipelines(torch.float16)
        block, log = base.unet.get_submodule("up_blocks.1"), seen[name]
        block.register_forward_pre_hook(lambda module, args, log=log: log.append("pre"))
        block.register_forward_hook(lambda module, args, output, log=log: log.append("first"))
        block.register_forward_hook(lambda module, args, output, log=log: (log.append("second"), output * 0.5)[1])
        pairs[name] = (base, img2img, list(block._forward_hooks.values()), list(block._forward_pre_hooks.values()))

    def both(base, img2img) -> list[torch.Tensor]:
        made: list[torch.Tensor] = []
        outer = [
            text(base, callback_on_step_end=inside(1, lambda: image(img2img), made)),
            image(img2img, callback_on_step_end=inside(0, lambda: text(base), made)),
        ]
        return outer + made

    expected = both(*pairs["twin"][:2]) + both(*pairs["twin"][:2])
    base, img2img, user_hooks, user_pre_hooks = pairs["watched"]
    block = base.unet.get_submodule("up_blocks.1")
    first, second = debugger(base, tmp_path / "text"), debugger(img2img, tmp_path / "img2img")
    with first, second:
        images = both(base, img2img) + both(base, img2img)
    assert all(torch.equal(a, b) for a, b in zip(images, expected)) and seen["watched"] == seen["twin"]
    # run 1: the text call; run 2: the text call inside the img2img call (2 runs a pass)
    assert runs(first) == [(run, step) for run in (1, 2, 3, 4) for step in range(4)]
    assert runs(second) == [(run, step) for run in (1, 2, 3, 4) for step in range(3)]
    assert said(first) == [] and said(second) == []
    assert list(block._forward_hooks.values()) == user_hooks  # both detached: the user's, in their order
    assert list(block._forward_pre_hooks.values()) == user_pre_hooks

    fault = {"on": False}
    conv = base.unet.get_submodule(CONV)
    handle = conv.register_forward_hook(lambda m, a, o: torch.full_like(o, float("nan")) if fault["on"] else None)

    def poisoned():
        fault["on"] = True
        try:
            return image(img2img)
        finally:
            fault["on"] = False

    with first, second:
        text(base, callback_on_step_end=inside(2, poisoned, []))
    assert said(first) == []
    assert said(second) == [("nonfinite", "unet", CONV, 0, 5)]
    handle.remove()
    with first:  # the second detached: the first watches alone, its hooks in
        with second:
            pass
        text(base)
    assert runs(first)[-4:] == [(6, step) for step in range(4)] and said(first) == []
    assert (
        list(block._forward_hooks.values()) == user_hooks and list(block._forward_pre_hooks.values()) == user_pre_hooks
    )
    first.close(), second.close()


def test_a_combined_pipeline_s_sub_pipelines_calls_are_its_own_run(tmp_path):
    """KandinskyV22CombinedPipeline calls its ``prior_pipe`` and ``decoder_pipe`` (held as attributes)
    inside its own call: one run of the combined pipeline's debugger (the decoder's 3 steps), not
    another pipeline's call; fp16 (the paced sentinels); the images as without the debugger; a NaN made
    by the decoder's UNet is named at its module, step and run."""
    pipe = kandinsky_combined(torch.float16)
    nan = {"on": False}
    pipe.unet.get_submodule("up_blocks.0").register_forward_hook(
        lambda module, args, output: torch.full_like(output, float("nan")) if nan["on"] else None
    )

    def call() -> torch.Tensor:
        kwargs = {"num_inference_steps": 3, "prior_num_inference_steps": 2, "height": 32, "width": 32}
        return pipe("a cat", generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images

    expected = call()
    dbg = debugger(pipe, tmp_path)
    with dbg:
        watched = call()
    assert torch.equal(watched, expected)
    assert runs(dbg) == [(1, step) for step in range(3)]
    nan["on"] = True
    with dbg:
        call()
    assert said(dbg) == [("nonfinite", "unet", "up_blocks.0", 0, 2)]
    dbg.close()


def test_a_float32_combined_pipeline_under_float16_autocast_and_inference_mode_is_unchanged_and_quiet(tmp_path):
    """KandinskyV22CombinedPipeline in float32 under ``torch.autocast(float16)`` and ``torch.inference_mode``, end to
    end, the debugger attached outside the autocast region (its probes decided again as the run begins): its prior's
    streams are float16 there (its ``proj_in`` runs under autocast; told at its first call, its block list's end then
    read every step), its UNet paced as a UNet. Three calls under one attach are each bitwise the unwatched call, and
    nothing is said but the tiny random MoVQ's truths (decoded pixels outside [-1, 1]; the latents' spread), which a
    float32 run outside autocast says as well."""
    pipe = kandinsky_combined(torch.float32)

    def call() -> torch.Tensor:
        kwargs = {"num_inference_steps": 2, "prior_num_inference_steps": 3, "height": 32, "width": 32}
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
            return pipe("a cat", generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images

    expected = call()
    dbg = debugger(pipe, tmp_path)
    try:
        with dbg:
            watched = [call() for _ in range(3)]
        anomalies = dbg.report().anomalies
    finally:
        dbg.close()
    assert [torch.equal(image, expected) for image in watched] == [True] * 3
    assert said(dbg) == []
    truths = {"vae_saturation", "scheduler_config"}  # what a float32 run outside autocast says as well
    assert [(a.kind, a.component, a.module) for a in anomalies if a.kind not in truths] == []
