"""``vae.config.force_upcast`` is advice only where the pipeline's ``__call__`` reads it (SDXL's family): SD 1.5's
``StableDiffusionPipeline`` never does, so its fp16 VAE is told the float32 decode SDXL's pipelines make, made by
the user, and following it gives a finite image; a bfloat16 VAE (float32's range) is told no dtype holds more."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, SDXL_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

CONV = "decoder.up_blocks.0.resnets.0.conv2"


def past_fp16(out):
    """An fp16 VAE's overflow: the conv's output scaled to 1e5, Inf in float16, finite in float32."""
    return (out.float() * (1e5 / out.detach().abs().amax().float())).to(out.dtype)


def errors_of(pipe, tmp_path, **call):
    """The images and the error anomalies of one watched 1-step call of ``pipe``."""
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with dbg:
            images = run(pipe, steps=1, **call)
        return images, [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()


def test_whether_a_pipeline_reads_force_upcast_is_decided_by_the_call_its_class_runs():
    """Read once per class from the source of the ``__call__`` it runs: SDXL's and SD upscale's read it, SD 1.5's
    does not; a subclass keeping its parent's ``__call__`` is its parent's, one overriding it (deferring to
    ``super()`` too) or without a source is taken as not reading it."""
    import diffusers

    from diffusion_debug.diffusion.components import upcast

    class Kept(diffusers.StableDiffusionXLPipeline):
        pass

    class Deferring(diffusers.StableDiffusionXLPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    made: dict = {}
    source = "class Sourceless(Base):\n    def __call__(self):\n        return self.vae.config.force_upcast\n"
    exec(compile(source, "<made>", "exec"), {"Base": diffusers.StableDiffusionXLPipeline}, made)
    classes = {
        diffusers.StableDiffusionPipeline: False,
        diffusers.StableDiffusionXLPipeline: True,
        diffusers.StableDiffusionUpscalePipeline: True,
        Kept: True,
        Deferring: False,
        made["Sourceless"]: False,
        object: False,
    }
    upcast._call_reads_force_upcast.cache_clear()
    for _ in range(2):
        assert {cls: upcast.reads_force_upcast(object.__new__(cls)) for cls in classes} == classes
    assert upcast._call_reads_force_upcast.cache_info()[:2] == (len(classes), len(classes))  # hits, misses


def test_an_sd15_fp16_vae_overflow_is_told_a_float32_decode_that_works_not_force_upcast(tmp_path):
    """The tiny SD VAE's config has ``force_upcast=True`` and its fp16 overflow still makes a NaN image:
    ``StableDiffusionPipeline`` never reads the flag, which the advice named (before: "keep the VAE in float32
    (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) or use an fp16-fixed VAE such as
    madebyollin/sdxl-vae-fp16-fix"). ``pipe.vae.to(torch.float32)`` alone fails on the float16 latents, SDXL's VAE
    is another latent space; the float32 decode of the pipeline's latents the advice spells out gives a finite
    image."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    assert pipe.vae.config.force_upcast is True
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        images, errors = errors_of(pipe, tmp_path)
        assert np.isnan(images).all()
        assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", "vae", CONV)]
        assert errors[0].message == f"vae.{CONV} produced NaN/Inf from finite inputs ({SD_FP16_VAE})."
        assert "reads_force_upcast" not in errors[0].details
        pipe.vae.to(torch.float32)  # the advice, followed
        try:
            with pytest.raises(RuntimeError):  # float16 latents into float32 weights
                run(pipe, steps=1)
            latents = run(pipe, steps=1, output_type="latent")
            with torch.no_grad():
                image = pipe.vae.decode(latents.float() / pipe.vae.config.scaling_factor).sample
        finally:
            pipe.vae.to(torch.float16)
    assert (latents.dtype, image.dtype) == (torch.float16, torch.float32)
    assert image.isfinite().all()


def test_an_sdxl_fp16_vae_overflow_is_told_force_upcast_which_its_pipeline_reads_and_which_works(tmp_path):
    """``StableDiffusionXLPipeline`` reads ``force_upcast``: its fp16 VAE's overflow names it (and the fp16-fixed
    SDXL VAE), and set, the same call decodes in float32 to a finite image."""
    pipe = tiny_pipeline("sdxl", dtype=torch.float16)
    pipe.vae.register_to_config(force_upcast=False)
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        images, errors = errors_of(pipe, tmp_path / "off")
        assert np.isnan(images).all()
        assert [(a.kind, a.module, a.details["reads_force_upcast"]) for a in errors] == [("nonfinite", CONV, True)]
        assert errors[0].message == f"vae.{CONV} produced NaN/Inf from finite inputs ({SDXL_FP16_VAE})."
        pipe.vae.config.force_upcast = True  # the advice, followed
        images, errors = errors_of(pipe, tmp_path / "on")
    assert np.isfinite(images).all() and not errors
    assert pipe.vae.dtype == torch.float16  # cast back after the decode


def test_a_bfloat16_vaes_flat_image_is_told_its_range_is_float32s_not_an_fp16_vaes_fix(tmp_path):
    """A bfloat16 VAE with no autocast: its flat image read "run the VAE in float32: pipe.vae.to(torch.float32)",
    fp16's advice, though float32 holds no more than bfloat16."""
    pipe = tiny_pipeline("sd", dtype=torch.bfloat16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.decoder, 0, lambda out: out * 0 + 3.0), dbg:
            run(pipe, steps=1)
        (flat,) = [a for a in dbg.report().anomalies if a.kind == "constant_image"]
    finally:
        dbg.close()
    assert (flat.details["vae_dtype"], "vae_autocast" in flat.details) == ("bfloat16", False)
    assert flat.message == (
        "1 decoded image(s) are a single flat colour; vae ran in bfloat16, whose range is float32's, so this is no "
        "overflow of a narrow dtype: check the latents' scaling factor, the latents reaching it (the step table) and "
        "its weights."
    )
