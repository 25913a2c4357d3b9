"""The stacks people run around a watched pipeline, each against a twin pipeline making the same
calls unwatched (bitwise equal images, no ``debugger_error``, nothing but the true scheduler
warning) and with a fault planted where it belongs named there: LoRA adapters loaded, mixed, fused,
unfused and unloaded between watched calls (peft); two pipelines sharing their components through
``from_pipe``, each watched by its own debugger, called in turn; the caches FasterCache, MagCache
and TaylorSeer, disabled and enabled again between watched calls; an exception raised in the
user's ``callback_on_step_end``, which reaches the user as raised, the next call unchanged; and
UniDiffuser's text decoder, called through its methods only."""

from __future__ import annotations

import contextlib
import traceback
import types

import diffusers
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

CONV = "up_blocks.1.resnets.0.conv2"
QUERY = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def cfg(tmp_path) -> DebugConfig:
    return DebugConfig(output_dir=str(tmp_path), log_level="error")


def call(pipe, **kwargs) -> torch.Tensor:
    kwargs.setdefault("num_inference_steps", 3)
    return pipe("a cat", generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images


def noisy(dbg) -> list[tuple]:
    """What a clean run must not have: a ``debugger_error``, an error or a warning other than the
    true one for 3 steps with leading spacing."""
    return [
        (a.kind, a.component, a.module, a.step)
        for a in dbg.report().anomalies
        if a.kind == "debugger_error" or (a.severity in ("error", "warning") and a.kind != "scheduler_config")
    ]


def errors(dbg) -> list[tuple]:
    return [(a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies if a.severity == "error"]


def lora_state_dict(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA for the tiny SD UNet's attention projections, in peft's key format."""
    generator = torch.Generator().manual_seed(seed)
    unet = tiny_pipeline("sd").unet
    found = {}
    for name, module in unet.named_modules():
        if name.endswith(("attn1.to_q", "attn1.to_k", "attn2.to_v", "attn1.to_out.0")):
            found[f"unet.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.1
            found[f"unet.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.1
    return found


def test_lora_loaded_mixed_fused_unfused_and_unloaded_between_watched_calls_changes_no_image(tmp_path):
    pytest.importorskip("peft")
    twin, pipe = tiny_pipeline("sd"), tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    changes = [
        lambda p: None,
        lambda p: p.load_lora_weights(lora_state_dict(0), adapter_name="one"),
        lambda p: (
            p.load_lora_weights(lora_state_dict(1), adapter_name="two"),
            p.set_adapters(["one", "two"], [0.5, 1.0]),
        ),
        lambda p: p.fuse_lora(lora_scale=0.7),
        lambda p: p.unfuse_lora(),
        lambda p: p.disable_lora(),
        lambda p: (p.enable_lora(), p.unload_lora_weights()),
    ]
    for change in changes:
        change(twin), change(pipe)
        expected = call(twin)
        with dbg:
            assert torch.equal(call(pipe), expected)
    assert noisy(dbg) == []
    pipe.load_lora_weights(lora_state_dict(0), adapter_name="faulty")
    lora_b = next(n for n, _ in pipe.unet.named_modules() if n.startswith(QUERY + ".lora_B."))
    with dbg, plant_nonfinite(pipe.unet.get_submodule(lora_b), from_call=1):
        call(pipe)
    assert errors(dbg) == [("nonfinite", "unet", lora_b, 1)]
    dbg.close()


def test_two_pipelines_sharing_components_through_from_pipe_each_watched_by_its_own_debugger(tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline

    text, twin = tiny_pipeline("sd"), tiny_pipeline("sd")
    image = torch.linspace(0, 1, 3 * 32 * 32).reshape(1, 3, 32, 32)
    images = {}
    for name, base in (("twin", twin), ("text", text)):
        img2img = StableDiffusionImg2ImgPipeline.from_pipe(base)
        img2img.set_progress_bar_config(disable=True)
        images[name] = (base, img2img)
    first = DiffusionModelDebugger(text, cfg(tmp_path / "text"))
    second = DiffusionModelDebugger(images["text"][1], cfg(tmp_path / "img2img"))
    for both in (False, True):  # the first pipeline watched, then both
        expected = (call(images["twin"][0]), call(images["twin"][1], image=image, strength=0.7))
        with first, second if both else contextlib.nullcontext():
            seen = (call(text), call(images["text"][1], image=image, strength=0.7))
        assert torch.equal(seen[0], expected[0]) and torch.equal(seen[1], expected[1])
        with second:  # the second alone: the first pipeline's debugger sees none of its calls
            assert torch.equal(call(images["text"][1], image=image, strength=0.7), expected[1])
    assert [(row["run"], row["step"]) for row in first.report().steps] == [(r, s) for r in (1, 2) for s in range(3)]
    assert [(row["run"], row["step"]) for row in second.report().steps] == [
        (r, s) for r in (1, 2, 3) for s in range(2)
    ]
    assert noisy(first) == [] and noisy(second) == []
    with first, second, plant_nonfinite(text.unet.get_submodule(CONV), from_call=1):  # shared: its img2img call
        call(images["text"][1], image=image, strength=0.7)
    assert errors(first) == [] and errors(second) == [("nonfinite", "unet", CONV, 1)]
    first.close(), second.close()


class Boom(Exception):
    pass


def test_an_exception_raised_in_the_users_callback_reaches_the_user_as_raised_and_the_next_call_is_unchanged(tmp_path):
    pipe = tiny_pipeline("sd")
    expected = call(pipe)
    raised = Boom("the user's")

    def callback(p, i, t, kwargs):
        if i == 1:
            raise raised
        return kwargs

    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        with pytest.raises(Boom) as caught:
            call(pipe, callback_on_step_end=callback)
        assert torch.equal(call(pipe), expected)
    assert caught.value is raised
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].name == "callback"
    assert not [f for f in frames if "diffusion_debug" in f.filename]  # nothing of ours between
    assert noisy(dbg) == []
    assert [(row["run"], row["step"]) for row in dbg.report().steps] == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    dbg.close()


def _faster_cache(pipe):
    from diffusers import FasterCacheConfig

    return FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 900),  # the first step computes: nothing cached yet
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.3,
        unconditional_batch_skip_range=2,
        unconditional_batch_timestep_skip_range=(-1, 900),
        tensor_format="BFCHW",
        is_guidance_distilled=True,
    )


def _mag_cache(pipe):
    from diffusers import MagCacheConfig

    return MagCacheConfig(threshold=0.5, num_inference_steps=4, mag_ratios=[1.0] * 4, retention_ratio=0.0)


def _taylor_seer(pipe):
    from diffusers import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1)


@pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")
@pytest.mark.parametrize("cache", [_faster_cache, _mag_cache, _taylor_seer], ids=["faster", "mag", "taylor_seer"])
def test_a_cache_disabled_and_enabled_again_between_watched_calls_changes_no_image_and_its_fault_is_named(
    tmp_path, cache
):
    twin, pipe = tiny_pipeline("flux"), tiny_pipeline("flux")
    kwargs = dict(num_inference_steps=4, output_type="pt", height=32, width=32)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for p in (twin, pipe):
        p.transformer.enable_cache(cache(p))
    for change in (None, "disable_cache", "enable_cache"):
        for p in (twin, pipe):
            if change == "disable_cache":
                p.transformer.disable_cache()
            elif change == "enable_cache":
                p.transformer.enable_cache(cache(p))
        expected = twin("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
        with dbg:
            assert torch.equal(pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images, expected)
    assert noisy(dbg) == []
    with dbg, plant_nonfinite(pipe.transformer.proj_out, from_call=2):
        pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs)
    assert errors(dbg) == [("nonfinite", "transformer", "proj_out", 2)]
    dbg.close()


def _unidiffuser():
    """A tiny UniDiffuser in text-to-image mode whose text latents are narrower than the CLIP's width, so
    that its call runs ``text_decoder.encode`` (a method: the decoder's ``forward`` is never called)."""
    from diffusers import (
        AutoencoderKL,
        DPMSolverMultistepScheduler,
        UniDiffuserModel,
        UniDiffuserPipeline,
        UniDiffuserTextDecoder,
    )
    from transformers import CLIPImageProcessor, CLIPTextModel, CLIPVisionConfig, CLIPVisionModelWithProjection

    from diffusion_debug.testing.text_encoders import clip_text_config, clip_tokenizer

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        projection_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        image_size=32,
        patch_size=4,
    )
    pipe = UniDiffuserPipeline(
        vae=AutoencoderKL(
            block_out_channels=(32, 64),
            down_block_types=["DownEncoderBlock2D"] * 2,
            up_block_types=["UpDecoderBlock2D"] * 2,
            sample_size=32,
        ),
        text_encoder=CLIPTextModel(clip_text_config()),
        image_encoder=CLIPVisionModelWithProjection(vision),
        clip_image_processor=CLIPImageProcessor(crop_size=32, size=32),
        clip_tokenizer=clip_tokenizer(),
        text_decoder=UniDiffuserTextDecoder(
            prefix_length=77,
            prefix_inner_dim=32,
            prefix_hidden_dim=16,
            vocab_size=64,
            n_positions=160,
            n_embd=32,
            n_layer=1,
            n_head=2,
        ),
        text_tokenizer=None,  # decodes generated text only: not in text-to-image mode
        unet=UniDiffuserModel(
            text_dim=16,
            clip_img_dim=32,
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            sample_size=16,
            patch_size=2,
        ),
        scheduler=DPMSolverMultistepScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.set_text_to_image_mode()
    return pipe


UNIDIFFUSER = pytest.mark.skipif(
    not hasattr(diffusers, "UniDiffuserPipeline"), reason="this diffusers has no UniDiffuser"
)


@pytest.fixture(scope="module")
def unidiffuser():
    """:func:`_unidiffuser`, in text-to-image mode (a test that changes its mode puts it back)."""
    return _unidiffuser()


@UNIDIFFUSER
def test_a_component_called_through_its_methods_is_watched_at_the_children_they_call(unidiffuser, tmp_path):
    """UniDiffuser's text decoder is called as ``text_decoder.encode`` (and ``generate_captions``), never
    through its ``forward``: a NaN its ``encode_prefix`` makes is named there (before: the pipeline's own
    code, ``no watched component made it``), and the image is bitwise the unwatched one."""
    twin, pipe = _unidiffuser(), unidiffuser
    kwargs = dict(num_inference_steps=2, guidance_scale=6.0, output_type="pt")
    expected = twin("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        assert torch.equal(pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images, expected)
    with plant_nonfinite(pipe.text_decoder.encode_prefix), dbg:
        pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs)
    assert errors(dbg) == [("nonfinite", "text_decoder", "encode_prefix", None)]
    dbg.close()


@UNIDIFFUSER
def test_a_component_called_after_the_denoising_loop_has_no_step(unidiffuser, tmp_path):
    """UniDiffuser's text mode decodes its text latents after the loop (``generate_captions`` runs
    ``decode_prefix``): a NaN made there is the call's, at no step, as a VAE decode's is (before: the
    loop's last step, 1). Policy ``raise`` stops the call there, before its 67 caption tokens."""
    from diffusion_debug import DiffusionDebugError

    pipe = unidiffuser
    pipe.set_text_mode()
    pipe.text_tokenizer = types.SimpleNamespace(eos_token_id=1)  # (not reached: raised before the captions)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    try:
        with plant_nonfinite(pipe.text_decoder.decode_prefix), dbg, pytest.raises(DiffusionDebugError):
            pipe(generator=torch.Generator().manual_seed(0), num_inference_steps=2)
    finally:
        pipe.set_text_to_image_mode()
        pipe.text_tokenizer = None
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    assert errors(dbg) == [("nonfinite", "text_decoder", "decode_prefix", None)]
    dbg.close()
