"""Tests for diffusion_debug.testing.pipelines: tiny offline pipelines."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from diffusion_debug.testing import TINY_KINDS, tiny_pipeline
from diffusion_debug.testing.features import SAME_NOISE_IN_HALF

# diffusers' EulerDiscreteScheduler.set_timesteps calls np.array() on a torch tensor, which numpy 2
# flags; it is upstream noise, not something this package does.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)

PROMPT = "a photo of a cat"
LONG_PROMPT = " ".join(["photo"] * 100)


def _run(pipe, **kwargs):
    kwargs.setdefault("num_inference_steps", 2)
    kwargs.setdefault("output_type", "np")
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), **kwargs).images


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def _tokenizers(pipe):
    return [t for t in (getattr(pipe, "tokenizer", None), getattr(pipe, "tokenizer_2", None)) if t is not None]


@pytest.fixture(scope="module")
def pipes():
    """One fp32 pipeline per kind, seed 0, shared by the tests of this module (read-only use)."""
    return {kind: tiny_pipeline(kind) for kind in TINY_KINDS}


@pytest.fixture(scope="module")
def images(pipes):
    """The default-size 2-step image of each kind."""
    return {kind: _run(pipe) for kind, pipe in pipes.items()}


# --------------------------------------------------------------------------------------------------
# Classes and structure
# --------------------------------------------------------------------------------------------------


def test_tiny_kinds_constant():
    assert TINY_KINDS == ("sd", "sdxl", "sd3")


def test_sd_classes(pipes):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    pipe = pipes["sd"]
    assert type(pipe) is StableDiffusionPipeline
    assert type(pipe.unet) is UNet2DConditionModel
    assert type(pipe.vae) is AutoencoderKL
    assert type(pipe.text_encoder) is CLIPTextModel
    assert type(pipe.tokenizer) is CLIPTokenizer
    assert type(pipe.scheduler) is DDIMScheduler
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    cfg = pipe.scheduler.config
    assert (cfg.beta_start, cfg.beta_end, cfg.beta_schedule) == (0.00085, 0.012, "scaled_linear")
    assert (cfg.prediction_type, cfg.steps_offset, cfg.timestep_spacing) == ("epsilon", 1, "leading")
    assert pipe.unet.config.cross_attention_dim == pipe.text_encoder.config.hidden_size


def test_sdxl_classes(pipes):
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    pipe = pipes["sdxl"]
    assert type(pipe) is StableDiffusionXLPipeline
    assert type(pipe.unet) is UNet2DConditionModel
    assert type(pipe.vae) is AutoencoderKL
    assert type(pipe.text_encoder) is CLIPTextModel
    assert type(pipe.text_encoder_2) is CLIPTextModelWithProjection
    assert type(pipe.tokenizer) is CLIPTokenizer and type(pipe.tokenizer_2) is CLIPTokenizer
    unet = pipe.unet.config
    assert unet.addition_embed_type == "text_time"
    assert unet.cross_attention_dim == (pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size)
    assert unet.projection_class_embeddings_input_dim == (
        pipe.text_encoder_2.config.projection_dim + 6 * unet.addition_time_embed_dim
    )
    assert pipe.vae.config.force_upcast is True


def test_sd3_classes(pipes):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    pipe = pipes["sd3"]
    assert type(pipe) is StableDiffusion3Pipeline
    assert type(pipe.transformer) is SD3Transformer2DModel
    assert type(pipe.vae) is AutoencoderKL
    assert type(pipe.text_encoder) is CLIPTextModelWithProjection
    assert type(pipe.text_encoder_2) is CLIPTextModelWithProjection
    assert type(pipe.tokenizer) is CLIPTokenizer and type(pipe.tokenizer_2) is CLIPTokenizer
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    assert type(pipe.scheduler) is FlowMatchEulerDiscreteScheduler
    vae = pipe.vae.config
    assert vae.latent_channels == 16 == pipe.transformer.config.in_channels
    assert vae.shift_factor is not None and vae.scaling_factor != 0.18215


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_sizes_are_tiny_but_structured(pipes, kind):
    pipe = pipes[kind]
    assert pipe.vae_scale_factor >= 2 and len(pipe.vae.config.block_out_channels) >= 2
    for name in ("text_encoder", "text_encoder_2"):
        enc = getattr(pipe, name, None)
        if enc is not None:
            assert enc.config.num_hidden_layers >= 2
            assert enc.config.max_position_embeddings == 77
    if kind != "sd3":
        down = pipe.unet.config.down_block_types
        assert len(down) >= 2 and all(t.startswith("CrossAttn") for t in down)
    for name, module in _modules(pipe).items():
        n_params = sum(p.numel() for p in module.parameters())
        assert 0 < n_params < 2_000_000, (name, n_params)


# --------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------


def _assert_same_weights(a, b):
    ma, mb = _modules(a), _modules(b)
    assert ma.keys() == mb.keys()
    for name in ma:
        sa, sb = ma[name].state_dict(), mb[name].state_dict()
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"{name}.{key}"


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_same_seed_same_weights_other_seed_differs(pipes, kind):
    _assert_same_weights(pipes[kind], tiny_pipeline(kind, seed=0))

    other = _modules(tiny_pipeline(kind, seed=1))
    for name, module in _modules(pipes[kind]).items():
        sa, sb = module.state_dict(), other[name].state_dict()
        differing = [k for k in sa if sa[k].is_floating_point() and not torch.equal(sa[k], sb[k])]
        # Every randomly initialised tensor differs; only constants (norm weights = 1, biases = 0,
        # position buffers) may coincide.
        assert len(differing) > len(sa) // 3, (name, len(differing), len(sa))


def test_text_encoders_of_one_pipeline_do_not_share_weights(pipes):
    # sd3 uses two encoders of the same class and config: they must still be distinct.
    pipe = pipes["sd3"]
    w1 = pipe.text_encoder.text_model.embeddings.token_embedding.weight
    w2 = pipe.text_encoder_2.text_model.embeddings.token_embedding.weight
    assert w1.shape == w2.shape and not torch.equal(w1, w2)


def test_global_rng_state_is_restored():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    tiny_pipeline("sd", seed=7)
    assert torch.equal(torch.get_rng_state(), before)


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_two_step_run_default_size(pipes, images, kind):
    image = images[kind]
    assert image.shape == (1, 32, 32, 3)  # default: sample_size 8 * vae_scale_factor 4
    assert image.dtype == np.float32
    assert np.isfinite(image).all()
    assert image.min() >= 0.0 and image.max() <= 1.0 and image.std() > 0.01
    assert np.array_equal(image, _run(pipes[kind]))


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_two_step_run_64px(pipes, kind):
    a = _run(pipes[kind], height=64, width=64)
    assert a.shape == (1, 64, 64, 3)
    assert np.isfinite(a).all()
    assert np.array_equal(a, _run(pipes[kind], height=64, width=64))


def test_different_seed_gives_different_image(images):
    assert not np.array_equal(images["sd"], _run(tiny_pipeline("sd", seed=1)))


@pytest.mark.skipif(not SAME_NOISE_IN_HALF, reason="this torch draws other noise in float16 than in float32")
def test_fp16_sd_runs_clean_on_cpu(images):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    for name, module in _modules(pipe).items():
        assert all(p.dtype == torch.float16 for p in module.parameters()), name
    image = _run(pipe)
    assert image.shape == (1, 32, 32, 3)
    assert np.isfinite(image).all()
    # A clean fp16 run: close to the fp32 run of the same weights (no overflow, no garbage). fp16 CPU
    # kernels differ between torch builds (one CUDA build's CPU path puts single pixels 0.9 away), so
    # the bound is on the median pixel, which garbage would move and a few odd pixels do not.
    assert float(np.median(np.abs(image - images["sd"]))) < 0.02


# --------------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """No hub access: offline mode on, and any attempt to open a network connection fails."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_save_and_load_round_trip(pipes, images, kind, tmp_path, offline):
    from diffusers import DiffusionPipeline

    pipe = pipes[kind]
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / "model_index.json").is_file()
    for name in ("tokenizer", "tokenizer_2"):
        if getattr(pipe, name, None) is not None:
            assert any((tmp_path / name).iterdir()), name

    # diffusers drops None components on save and then wants them passed back explicitly when
    # loading, unless they are optional; for SD3 without T5 that is text_encoder_3 / tokenizer_3.
    extra = {"text_encoder_3": None, "tokenizer_3": None} if kind == "sd3" else {}
    for loader in (type(pipe), DiffusionPipeline):
        loaded = loader.from_pretrained(tmp_path, **extra)
        loaded.set_progress_bar_config(disable=True)
        assert type(loaded) is type(pipe)
        if kind == "sd3":
            assert loaded.text_encoder_3 is None and loaded.tokenizer_3 is None
        assert loaded.tokenizer.model_max_length == 77
        _assert_same_weights(pipe, loaded)  # the weights are exact
        # The image is not bitwise: safetensors-loaded weights sit at other memory alignments, and
        # oneDNN/MKL (on AMD EPYC) picks other kernels by alignment, ~1e-6 apart after two steps.
        np.testing.assert_allclose(_run(loaded), images[kind], rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_truncates_long_prompts(pipes, kind):
    for tok in _tokenizers(pipes[kind]):
        assert tok.model_max_length == 77
        assert len(tok(LONG_PROMPT).input_ids) > 77
        ids = tok(LONG_PROMPT, truncation=True, max_length=77).input_ids
        assert len(ids) == 77
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_matches_text_encoder(pipes, kind):
    pipe = pipes[kind]
    encoders = [pipe.text_encoder, pipe.text_encoder_2] if kind != "sd" else [pipe.text_encoder]
    for tok, enc in zip(_tokenizers(pipe), encoders):
        assert len(tok) <= enc.config.vocab_size
        assert tok.eos_token_id == enc.config.eos_token_id
        assert max(tok.get_vocab().values()) < enc.config.vocab_size


def test_tokenizer_common_words_are_whole_tokens(pipes):
    tok = pipes["sd"].tokenizer
    tokens = tok.convert_ids_to_tokens(tok("A Photo of a cat, riding a horse!").input_ids)
    assert tokens == [
        "<|startoftext|>", "a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>", ",</w>",
        "riding</w>", "a</w>", "horse</w>", "!</w>", "<|endoftext|>",
    ]  # fmt: skip
    # Unknown words split into byte-level pieces, never into the unknown token.
    ids = tok("zyxw ünïcödé 123").input_ids
    assert tok.unk_token_id not in ids[1:-1]


def test_sd_pipeline_truncates_long_prompt(pipes):
    prompt_embeds, _ = pipes["sd"].encode_prompt(
        LONG_PROMPT, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False
    )
    assert prompt_embeds.shape == (1, 77, 32)
    assert torch.isfinite(prompt_embeds).all()


def test_sdxl_tokenizer_2_pads_like_real_sdxl(pipes):
    assert pipes["sdxl"].tokenizer.pad_token == "<|endoftext|>"
    assert pipes["sdxl"].tokenizer_2.pad_token == "!"


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_unknown_kind_raises_value_error_naming_valid_kinds():
    with pytest.raises(ValueError) as info:
        tiny_pipeline("wan")
    message = str(info.value)
    assert "'wan'" in message
    for kind in TINY_KINDS + ("flux", "svd", "dance_diffusion"):
        assert repr(kind) in message
