"""Stacks users run that no other test ran, each under one attach around every call (a served pipeline)
against a twin making the same calls unwatched: every output is the twin's, bit for bit, and the run is
quiet (no ``debugger_error``, no warning or error but the true scheduler warning). A Flux transformer's
attention projections fused and unfused between fp16 calls (``fuse_qkv_projections``: a ``to_qkv`` made,
then dropped); one pipeline moved fp32 -> fp16 -> fp32 -> bf16 -> fp32 between calls; diffusers' attention
backend set on a transformer (``set_attention_backend``, which also makes it the process's active one); a
call with ``output_type="latent"`` and the user's own ``vae.decode`` after it, fp16 under ``inference_mode``;
img2img at full strength in one step and at 0.3 of 4 steps (one step runs); the attach made inside
``torch.inference_mode`` and the next call outside it; diffusers' ``SDCFGCutoffCallback``, which drops the
unconditional half of the batch mid-call; attention sliced at ``"max"`` in fp16 with the VAE tiled, under
``inference_mode``; a callback that sets ``pipe._interrupt``; AnimateDiff's FreeNoise context windows."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_ATTENTION_BACKENDS
from diffusion_debug.testing.flux import FLUX_CALL


def sd_call(pipe, steps: int = 2, **kwargs) -> torch.Tensor:
    kwargs.setdefault("output_type", "pt")
    return pipe("a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs).images


def flux_call(pipe, steps: int = 2, **kwargs) -> torch.Tensor:
    call = {**FLUX_CALL[0](), **kwargs}
    return pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **call).images


def noisy(dbg) -> list[tuple]:
    return [
        (a.kind, a.component, a.module, a.step, a.message)
        for a in dbg.report().anomalies
        if a.kind == "debugger_error" or (a.severity in ("error", "warning") and a.kind != "scheduler_config")
    ]


def like_its_twin(
    tmp_path,
    make: Callable[[], Any],
    calls: list[Callable[[Any], torch.Tensor]],
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """``calls`` (each may change the pipeline first) on a twin unwatched and on a pipeline under one attach,
    each call within ``around()``: every output bitwise the twin's, a quiet run, and the same outputs after."""
    twin, pipe = make(), make()
    expected = []
    for call in calls:
        with around():
            expected.append(call(twin))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    seen = []
    with dbg:
        for call in calls:
            with around():
                seen.append(call(pipe))
    try:
        assert [torch.equal(a, b) for a, b in zip(seen, expected)] == [True] * len(calls)
        assert noisy(dbg) == []
    finally:
        dbg.close()


def test_a_flux_transformers_qkv_fused_and_unfused_between_fp16_calls(tmp_path):
    def fused(pipe):
        pipe.transformer.fuse_qkv_projections()
        return flux_call(pipe)

    def unfused(pipe):
        pipe.transformer.unfuse_qkv_projections()
        return flux_call(pipe)

    like_its_twin(tmp_path, lambda: tiny_pipeline("flux", dtype=torch.float16), [flux_call, fused, unfused])


def test_a_pipeline_moved_between_fp32_fp16_and_bf16_between_calls(tmp_path):
    def moved(dtype):
        def call(pipe):
            pipe.to(dtype)
            return sd_call(pipe)

        return call

    dtypes = (torch.float16, torch.float32, torch.bfloat16, torch.float32)
    like_its_twin(tmp_path, lambda: tiny_pipeline("sd"), [sd_call, *map(moved, dtypes)])


@pytest.mark.skipif(not HAS_ATTENTION_BACKENDS, reason="this diffusers has no attention backends")
@pytest.mark.parametrize("backend", ["native", "_native_math"])
def test_an_attention_backend_set_on_an_fp16_transformer(tmp_path, backend):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    def make():
        pipe = tiny_pipeline("flux", dtype=torch.float16)
        pipe.transformer.set_attention_backend(backend)
        return pipe

    active = _AttentionBackendRegistry._active_backend
    try:
        like_its_twin(tmp_path, make, [flux_call, flux_call])
    finally:
        _AttentionBackendRegistry.set_active_backend(active)


def test_latents_returned_then_decoded_by_the_user_fp16_under_inference_mode(tmp_path):
    def latent_then_decode(pipe):
        latents = sd_call(pipe, output_type="latent")
        decoded = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(decoded, output_type="pt")

    make = lambda: tiny_pipeline("sd", dtype=torch.float16)  # noqa: E731
    like_its_twin(tmp_path, make, [latent_then_decode, latent_then_decode], around=torch.inference_mode)


def test_img2img_at_full_strength_in_one_step_and_at_a_strength_that_leaves_one_step(tmp_path):
    image = torch.linspace(0, 1, 3 * 32 * 32).reshape(1, 3, 32, 32).half()
    calls = [
        lambda pipe: sd_call(pipe, 1, image=image, strength=1.0),
        lambda pipe: sd_call(pipe, 4, image=image, strength=0.3),
    ]
    like_its_twin(tmp_path, lambda: tiny_pipeline("img2img", dtype=torch.float16), calls)


def test_an_attach_made_inside_inference_mode_then_a_call_outside_it(tmp_path):
    twin, pipe = tiny_pipeline("sd", dtype=torch.float16), tiny_pipeline("sd", dtype=torch.float16)
    expected = sd_call(twin)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with torch.inference_mode(), dbg:
        inside = sd_call(pipe)
    with dbg:
        outside = sd_call(pipe)
    dbg.close()
    assert torch.equal(inside, expected) and torch.equal(outside, expected)
    assert noisy(dbg) == []


def test_diffusers_cfg_cutoff_callback_drops_the_unconditional_half_mid_call(tmp_path):
    from diffusers.callbacks import SDCFGCutoffCallback

    def cut(pipe):  # from step 1 on: the conditional half of the prompt embeddings, guidance off
        callback = SDCFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=1)
        return sd_call(pipe, 3, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["prompt_embeds"])

    like_its_twin(tmp_path, lambda: tiny_pipeline("sd"), [cut, cut])


def test_attention_sliced_at_max_in_fp16_and_vae_tiled_under_inference_mode(tmp_path):
    def make():  # tiles of 16 pixels (2 latents) a side: the 32x32 image is decoded in overlapping tiles
        pipe = tiny_pipeline("sd", dtype=torch.float16)
        pipe.enable_attention_slicing("max")
        pipe.vae.enable_tiling()
        pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = 16, 2
        return pipe

    like_its_twin(tmp_path, make, [sd_call, sd_call], around=torch.inference_mode)


def test_a_callback_that_sets_the_pipelines_interrupt_flag_then_a_full_call(tmp_path):
    def interrupt(pipe, step, timestep, kwargs):  # the steps after step 1 are skipped, the image decoded
        pipe._interrupt = pipe._interrupt or step == 1
        return kwargs

    cut = lambda pipe: sd_call(pipe, 4, callback_on_step_end=interrupt)  # noqa: E731
    like_its_twin(tmp_path, lambda: tiny_pipeline("sd"), [cut, sd_call])


def test_animatediff_free_noise_over_overlapping_context_windows(tmp_path):
    def make():
        pipe = tiny_pipeline("animatediff")
        pipe.enable_free_noise(context_length=2, context_stride=1)
        return pipe

    def call(pipe):
        kwargs = dict(num_frames=3, height=32, width=32, num_inference_steps=2, output_type="pt")
        return pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **kwargs).frames

    like_its_twin(tmp_path, make, [call, call])
