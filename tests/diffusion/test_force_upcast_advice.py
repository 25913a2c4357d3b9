"""``vae.config.force_upcast`` is advice only where the pipeline's ``__call__`` reads it (SDXL's family): SD 1.5's
``StableDiffusionPipeline`` never does, so its fp16 VAE is told the float32 decode SDXL's pipelines make, made by
the user, and following it gives a finite image (a video pipeline's with its ``decode_latents``); where it is not
known (a ComponentsManager watched), both fixes are said; a bfloat16 VAE (float32's range) is told no dtype holds
more."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import ANY_FP16_VAE, SD_FP16_VAE, SDXL_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_MODULAR

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
    """Read once per class (kept weakly) from the source of the ``__call__`` it runs: SDXL's and SD upscale's read
    it, SD 1.5's does not; a subclass keeping its parent's ``__call__`` is its parent's, one overriding it over a
    base that reads it (it may defer to ``super()``; before: False, told as fact), one without a source and a
    ComponentsManager (no ``__call__``; before: False) are not known: None; an error reading it is None too."""
    import gc
    import tokenize
    from unittest import mock

    import diffusers
    from diffusers.modular_pipelines import ComponentsManager

    from diffusion_debug.diffusion.components import vae_details

    class Kept(diffusers.StableDiffusionXLPipeline):
        pass

    class Deferring(diffusers.StableDiffusionXLPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    class OwnOverSd(diffusers.StableDiffusionPipeline):
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
        Deferring: None,
        OwnOverSd: False,
        made["Sourceless"]: None,
        object: None,
    }
    for _ in range(2):
        assert {cls: vae_details.reads_force_upcast(object.__new__(cls)) for cls in classes} == classes
    assert vae_details.reads_force_upcast(ComponentsManager()) is None
    assert set(classes) <= set(vae_details._READS)
    del Kept, classes
    gc.collect()
    assert not any(cls.__name__ == "Kept" for cls in vae_details._READS)  # (not held: a class made in a loop)

    class Broken(diffusers.StableDiffusionPipeline):  # no source to tokenize (tokenize.TokenError escaped)
        def __call__(self):
            return None

    class Blocks:  # a Modular pipeline whose blocks' sub_blocks is a list (AttributeError on .values() escaped)
        blocks = type("Seq", (), {"sub_blocks": [object()]})()

    with mock.patch.object(vae_details.inspect, "getsource", side_effect=tokenize.TokenError("EOF")):
        assert vae_details.reads_force_upcast(object.__new__(Broken)) is None
    assert vae_details.reads_force_upcast(Blocks()) is None  # (object: no __call__ of its own: not known)


def test_an_sd15_fp16_vae_overflow_is_told_a_float32_decode_that_works_not_force_upcast(tmp_path):
    """The tiny SD VAE's config has ``force_upcast=True`` and its fp16 overflow still makes a NaN image:
    ``StableDiffusionPipeline`` never reads the flag, which the advice named (before: "keep the VAE in float32
    (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) or use an fp16-fixed VAE such as
    madebyollin/sdxl-vae-fp16-fix"). ``pipe.vae.to(torch.float32)`` alone fails on its float16 latents, SDXL's VAE
    is another latent space; the latents decoded in float32, as the advice says, give a finite image."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    assert pipe.vae.config.force_upcast is True
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        images, errors = errors_of(pipe, tmp_path)
        assert np.isnan(images).all()
        assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", "vae", CONV)]
        assert errors[0].message == f"vae.{CONV} produced NaN/Inf from finite inputs ({SD_FP16_VAE})."
        assert errors[0].details["reads_force_upcast"] is False
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


def test_an_animatediff_fp16_vae_overflow_is_told_its_pipelines_decode_latents_which_takes_its_5d_latents(tmp_path):
    """AnimateDiff reads no ``force_upcast`` and its latents are 5-D video latents: the SD 1.5 recipe's
    ``pipe.vae.decode(latents.float() / scaling_factor)`` raised on them (conv2d wants 4-D); its own
    ``decode_latents`` takes them, and in float32 decodes them finite."""
    pipe = tiny_pipeline("animatediff", dtype=torch.float16)
    call = dict(prompt="a cat", num_frames=2, height=32, width=32, num_inference_steps=1)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.get_submodule(CONV), 0, past_fp16), dbg:
            pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
        errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()
    assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", "vae", CONV)]
    assert errors[0].message == (
        f"vae.{CONV} produced NaN/Inf from finite inputs (this pipeline does not read vae.config.force_upcast "
        "(SDXL's do): pipe.vae.to(torch.float32); where the call then fails in the VAE (its float16 latents or input "
        'image), instead call it with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and '
        "decode them with pipe.decode_latents(latents.float()))."
    )
    latents = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    pipe.vae.to(torch.float32)  # the advice, followed
    with torch.no_grad(), plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        video = pipe.decode_latents(latents.float())
    assert (latents.dim(), video.dtype) == (5, torch.float32) and video.isfinite().all()


@pytest.mark.skipif(not HAS_MODULAR, reason="this diffusers has no modular pipelines")
@pytest.mark.parametrize("watched", ["pipe", "manager"])
def test_a_modular_sdxl_pipeline_watched_through_its_components_manager_is_not_told_the_flag_is_not_read(
    tmp_path, watched
):
    """A ComponentsManager watched has no ``__call__`` of its own, which read as "does not read": its Modular SDXL
    pipeline, which does, was told "this pipeline does not read vae.config.force_upcast". Not known there, both
    fixes are said; the pipeline watched itself is told the flag."""
    from diffusers.modular_pipelines import ComponentsManager
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    components = {k: v for k, v in tiny_pipeline("sdxl", dtype=torch.float16).components.items() if v is not None}
    components["vae"].register_to_config(force_upcast=False)
    manager = ComponentsManager()
    for name, component in components.items():
        manager.add(name, component)
    pipe = StableDiffusionXLAutoBlocks().init_pipeline(components_manager=manager)
    pipe.update_components(**components)
    target = manager if watched == "manager" else pipe
    dbg = DiffusionModelDebugger(target, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.get_submodule(CONV), 0, past_fp16), dbg:
            pipe(
                prompt="a cat", num_inference_steps=1, height=32, width=32, generator=torch.Generator().manual_seed(0)
            )
        errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()
    reads, advice = (None, ANY_FP16_VAE) if watched == "manager" else (True, SDXL_FP16_VAE)
    assert [(a.kind, a.module, a.details["reads_force_upcast"]) for a in errors] == [("nonfinite", CONV, reads)]
    assert errors[0].message == f"vae.{CONV} produced NaN/Inf from finite inputs ({advice})."


def test_pixart_sigmas_sd_vae_is_told_the_float32_vae_alone_which_followed_matches_a_float32_pipeline(tmp_path):
    """PixArt-Sigma reads no ``force_upcast`` but decodes ``latents.to(self.vae.dtype)``: its SD VAE's fp16 overflow
    was told SD 1.5's recipe (the float32 VAE, then the latent output where the call fails, which it never does
    here). Told ``pipe.vae.to(torch.float32)`` alone, as another VAE in a casting pipeline is; followed, the same
    fault planted, the image is finite and equal to a float32 pipeline's within 1e-2 (measured 1.7e-3: the float16
    transformer's rounding)."""
    from diffusion_debug.testing.zoo_more import CALLS

    call = {**CALLS["pixart_sigma"][0](), "num_inference_steps": 1, "output_type": "np"}
    pipe = tiny_pipeline("pixart_sigma", dtype=torch.float16)
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
        try:
            with dbg:
                images = pipe(**call, generator=torch.Generator().manual_seed(0)).images
            errors = [a for a in dbg.report().anomalies if a.severity == "error"]
        finally:
            dbg.close()
        assert np.isnan(images).all()
        assert [(a.kind, a.module, a.details["reads_force_upcast"], a.details["casts_latents"]) for a in errors] == [
            ("nonfinite", CONV, False, True)
        ]
        assert errors[0].message == (
            f"vae.{CONV} produced NaN/Inf from finite inputs (keep the VAE in float32: pipe.vae.to(torch.float32) "
            "(this pipeline casts its latents to the VAE's dtype))."
        )
        pipe.vae.to(torch.float32)  # the advice, followed
        images = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    reference = tiny_pipeline("pixart_sigma")
    with plant(reference.vae.get_submodule(CONV), 0, past_fp16):
        reference = reference(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(images).all() and np.abs(images - reference).max() < 1e-2


def test_sd_upscales_vae_is_told_force_upcast_which_works_but_not_sdxls_fp16_fixed_vae(tmp_path):
    """SD x4 upscale's pipeline reads ``force_upcast``, but its VAE (scaling factor 0.08333) is no SDXL VAE: it was
    offered madebyollin/sdxl-vae-fp16-fix, another latent space. Told the flag alone, which, set, decodes the same
    latents to a finite image equal to the float32 VAE's within 1e-3."""
    from diffusion_debug.testing.zoo_more import CALLS

    pipe = tiny_pipeline("sd_upscale", dtype=torch.float16)
    pipe.vae.register_to_config(force_upcast=False)
    call = CALLS["sd_upscale"][0]()
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        images, errors = errors_of(pipe, tmp_path / "off", **call)
        assert np.isnan(images).all()
        assert [(a.kind, a.module, a.details["reads_force_upcast"]) for a in errors] == [("nonfinite", CONV, True)]
        assert "sdxl_vae" not in errors[0].details
        assert errors[0].message == (
            f"vae.{CONV} produced NaN/Inf from finite inputs (keep the VAE in float32 for the decode "
            "(vae.config.force_upcast=True: this pipeline then upcasts the VAE and the latents))."
        )
        pipe.vae.config.force_upcast = True  # the advice, followed
        images, errors = errors_of(pipe, tmp_path / "on", **call)
        assert np.isfinite(images).all() and not errors
        pipe.vae.to(torch.float32)  # the reference: the VAE float32 throughout (this pipeline casts its latents)
        reference = run(pipe, steps=1, **call)
    assert np.abs(images - reference).max() < 1e-3


def test_animatediff_video2video_reads_force_upcast_for_its_encode_alone_so_its_decode_is_told_not_read(tmp_path):
    """AnimateDiff video2video reads ``force_upcast`` in ``prepare_latents``: the VAE upcast for the encode of the
    input video and cast back before the denoising, so the decode runs in float16 whatever the flag. Counted as not
    read (the decode's advice): with the flag set its fp16 decode's overflow still makes a NaN video, and the advice
    told, its ``decode_latents`` in float32, decodes the same latents finite."""
    from diffusers import AnimateDiffVideoToVideoPipeline
    from PIL import Image

    from diffusion_debug.diffusion.components.vae_details import upcast_details

    pipe = AnimateDiffVideoToVideoPipeline(**tiny_pipeline("animatediff", dtype=torch.float16).components)
    assert pipe.vae.config.force_upcast is True and upcast_details(pipe) == {
        "reads_force_upcast": False,
        "decode_latents": True,
    }
    video = [Image.new("RGB", (32, 32), (40 * i, 90, 160)) for i in range(2)]
    call = dict(prompt="a cat", video=video, height=32, width=32, num_inference_steps=2, strength=0.5)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.get_submodule(CONV), 0, past_fp16), dbg:
            frames = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np").frames
        errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()
    assert np.isnan(frames).all()  # the flag set: the decode was not upcast
    assert [(a.kind, a.module, a.details["reads_force_upcast"]) for a in errors] == [("nonfinite", CONV, False)]
    assert errors[0].message.endswith("decode them with pipe.decode_latents(latents.float())).")
    latents = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="latent").frames
    assert pipe.vae.dtype == torch.float16  # (cast back after the encode's upcast)
    pipe.vae.to(torch.float32)  # the advice, followed
    with torch.no_grad(), plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        decoded = pipe.decode_latents(latents.float())
    assert decoded.dtype == torch.float32 and decoded.isfinite().all()
