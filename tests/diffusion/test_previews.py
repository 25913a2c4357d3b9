"""Latent previews and the saved run directory."""

from __future__ import annotations

import io
import json

import torch
from diffusion_helpers import plant, run
from PIL import Image

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.previews import (
    SD_FACTORS,
    SDXL_BIAS,
    SDXL_FACTORS,
    PreviewBuffer,
    downsample,
    every,
    latent_space,
    latent_to_rgb,
    render_files,
    unpack_patches,
)


def _reject(name):
    raise ValueError(name)


def test_sd_preview_matches_the_linear_factors():
    latents = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    rgb = latent_to_rgb(latents, "sd")
    factors = torch.tensor(SD_FACTORS)
    expected = ((torch.einsum("chw,cr->rhw", latents[0], factors) + 1) / 2).clamp(0, 1)
    assert torch.allclose(rgb, expected)
    assert (
        latent_space(4, 0.18215) == "sd" and latent_space(4, 0.13025) == "sdxl" and latent_space(16, 1.5) == "generic"
    )
    generic = latent_to_rgb(torch.randn(1, 16, 4, 4), "generic")
    assert generic.shape == (3, 4, 4) and generic.min() >= 0 and generic.max() <= 1


def test_a_preview_makes_no_tensor_from_python_numbers_after_the_first():
    # on a GPU, torch.tensor(numbers, device=...) is a blocking copy: previews run at every step,
    # so the factors are made once per device (the second SDXL preview builds no tensor at all)
    latents = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    first = latent_to_rgb(latents, "sdxl")
    made = []
    real = torch.tensor
    torch.tensor = lambda *args, **kwargs: made.append(args) or real(*args, **kwargs)
    try:
        second = latent_to_rgb(latents, "sdxl")
    finally:
        torch.tensor = real
    assert made == [] and torch.equal(first, second)
    expected = (
        torch.einsum("chw,cr->rhw", latents[0], torch.tensor(SDXL_FACTORS)) + torch.tensor(SDXL_BIAS)[:, None, None]
    )
    assert torch.allclose(second, ((expected + 1) / 2).clamp(0, 1))


def test_preview_buffer_stays_bounded_and_spread():
    buffer = PreviewBuffer(4)
    for step in range(100):
        buffer.add(step, torch.zeros(3, 2, 2))
    steps = [s for s, _ in buffer.items]
    assert len(steps) <= 4 and steps[0] == 0 and steps[-1] >= 64
    files = render_files(buffer)
    assert Image.open(io.BytesIO(files["previews/strip.png"])).size[0] == 64 * len(steps)


def test_save_writes_a_strict_readable_run_directory(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    with dbg:
        run(pipe, steps=3)
    run_dir = dbg.report().save()
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=_reject)
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2]
    assert summary["components"]["unet"]["calls"] == 3
    events = [json.loads(line, parse_constant=_reject) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["type"] == "step"] == [0, 1, 2]
    assert (run_dir / "report.html").read_text().startswith("<!doctype html>")
    strip = Image.open(run_dir / "previews" / "strip.png")
    assert strip.size == (3 * 64, 64)
    gif = Image.open(run_dir / "previews" / "steps.gif")
    assert gif.n_frames == 3


def test_nonfinite_run_saves_strict_json_and_a_bundle_that_replays(pipes, tmp_path):
    from diffusion_debug.diffusion import replay

    pipe = pipes["sd"]
    name = "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"
    with plant(pipe.unet.get_submodule(name), 1):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
        with dbg:
            run(pipe, steps=3)
        run_dir = dbg.report().save()
        json.loads((run_dir / "summary.json").read_text(), parse_constant=_reject)
        (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
        assert anomaly.module == name
        bundle = run_dir / anomaly.details["bundle"]
        meta = json.loads((bundle / "meta.json").read_text(), parse_constant=_reject)
        assert (meta["component"], meta["step"], meta["module"], meta["class"]) == (
            "unet",
            1,
            name,
            "UNet2DConditionModel",
        )
        assert meta["dtypes"]["args.0"] == "float32" and meta["versions"]["torch"] == torch.__version__
        result = replay(bundle, pipe.unet)  # the planted fault is still there: the replay finds it
    assert result["module"] == name and result["output_finite"] is False
    clean = replay(bundle, pipe.unet)  # without the fault the same inputs give a finite output
    assert clean["module"] is None and clean["output_finite"] is True


def test_vae_and_latent_previews_share_one_downsample():
    image = torch.rand(3, 256, 192)
    assert tuple(downsample(image, 128).shape) == (3, 128, 96)
    assert downsample(image, 512) is image
    latents = torch.randn(1, 4, 200, 100)
    assert tuple(latent_to_rgb(latents, latent_space(4, None)).shape) == (3, 128, 64)


def test_every_is_the_preview_schedule():
    assert [s for s in range(12) if every(5)(s)] == [0, 5, 10]
    assert not any(every(0)(s) or every(None)(s) for s in range(12))


def test_video_preview_is_a_frame_strip_and_audio_a_grey_map():
    from diffusion_debug.diffusion.previews import MAX_FRAMES, Previews, channels_first

    video = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # AnimateDiff: (B, C, F, H, W)
    strip = latent_to_rgb(video, "sd")
    assert strip.shape == (3, 8, 24)
    assert torch.allclose(strip[:, :, 8:16], latent_to_rgb(video[:, :, 1], "sd"))  # frame 1 second
    svd = video.transpose(1, 2).contiguous()  # StableVideoDiffusion: (B, F, C, H, W)
    assert torch.equal(channels_first(svd, 4), video) and torch.equal(channels_first(video, 4), video)
    long = latent_to_rgb(torch.randn(1, 4, 12, 8, 8), "sd")
    assert long.shape[-1] == MAX_FRAMES * 8
    audio = latent_to_rgb(torch.randn(1, 2, 1000), "generic")  # DanceDiffusion-like (B, C, L)
    assert audio.shape[0] == 3 and audio.shape[-1] == 128 and 0 <= audio.min() and audio.max() <= 1
    previews = Previews()
    for step, latents in enumerate((video, svd, torch.randn(1, 2, 64))):
        previews.add_latents(step, latents, None)
    assert len(previews) == 3 and "previews/strip.png" in previews.files()


def test_flux_packed_latents_unpack_as_the_pipeline_does():
    # the reference is diffusers' own FluxPipeline._unpack_latents (a 256 x 256 image, VAE factor 8:
    # a 32 x 32 latent image of 16 channels packed as 16 x 16 patches of 64 values)
    from diffusers import FluxPipeline

    from diffusion_debug.diffusion.previews import Previews

    packed = torch.randn(2, 16 * 16, 64, generator=torch.Generator().manual_seed(0))
    unpacked = unpack_patches(packed, 16)
    assert torch.equal(unpacked, FluxPipeline._unpack_latents(packed, 256, 256, 8))
    # the preview is the unpacked image's, not a grey map of the packed sequence
    previews = Previews()
    vae = type("Vae", (), {"config": type("Config", (), {"latent_channels": 16, "scaling_factor": 0.3611})()})()
    previews.add_latents(0, packed, vae)
    (image,) = [image for _, image in previews.latent_previews()]
    assert torch.equal(image, latent_to_rgb(unpacked, "generic"))
    assert unpack_patches(packed, 4) is packed and unpack_patches(packed[:, :255], 16).shape == (2, 255, 64)


def test_a_step_keeps_its_first_latents_in_one_op_and_the_report_makes_their_preview():
    """A step's preview costs one op (a copy of its first image's latents); the preview made when
    the report is built is the one the step's latents give, even after the pipeline changed them."""
    from diffusion_debug.diffusion.previews import MAX_FRAMES, Previews
    from diffusion_debug.op_count import count_aten_ops

    g = torch.Generator().manual_seed(0)
    image, video = torch.randn(2, 4, 16, 16, generator=g).half(), torch.randn(1, 4, 12, 8, 8, generator=g)
    expected = [latent_to_rgb(image, "sd"), latent_to_rgb(video, "sd")]
    previews = Previews()
    with count_aten_ops() as ops:
        previews.add_latents(0, image, None)
        previews.add_latents(1, video, None)
    assert ops.counts == {"aten.clone.default": 2}, ops.counts
    image.mul_(0), video.fill_(float("nan"))  # what a callback may do to the latents after the step
    kept = [item.latents for _, item in previews.latents.items]
    assert [tuple(k.shape) for k in kept] == [(1, 4, 16, 16), (1, 4, MAX_FRAMES, 8, 8)]
    made = previews.latent_previews()
    assert [step for step, _ in made] == [0, 1] and all(torch.equal(a, b) for (_, a), b in zip(made, expected))
    assert previews.latent_previews()[0][1] is made[0][1]  # made once
    assert "previews/strip.png" in previews.files()
