"""Tiny, randomly initialised, fully offline diffusers pipelines for tests and examples.

:func:`tiny_pipeline` builds a *real* diffusers pipeline (``StableDiffusionPipeline``,
``StableDiffusionXLPipeline`` or ``StableDiffusion3Pipeline``) whose components are the real
diffusers / transformers classes, constructed from very small configs with random weights. Nothing
is downloaded: the CLIP tokenizers are built from a small byte-level BPE vocabulary written to a
temporary directory at run time.

Use it to exercise code that hooks, wraps, saves, loads or runs a pipeline -- the code path is the
same as for a real checkpoint -- in a second or two on a CPU.

Limits:

* The weights are random, so the images are noise and the text conditioning means nothing. Only
  properties that do not depend on trained weights (shapes, dtypes, finiteness, determinism, call
  order, timing structure) are meaningful.
* The configs are tiny (hidden sizes of 32-64, one or two layers per block, a VAE that scales by 4
  rather than 8), so numerical behaviour such as fp16 overflow in a real model does not carry over:
  the fp16 runs of these pipelines are clean and can serve as a baseline for planted faults.
* The tokenizer knows only a few whole words; every other word is split into byte-level pieces
  (never into unknown tokens). ``model_max_length`` is 77 like the real CLIP tokenizer, so long
  prompts are truncated as they are with a real checkpoint.
* ``sd3`` has no T5 encoder (``text_encoder_3=None``, ``tokenizer_3=None``); the pipeline uses
  zeros in its place, as the real pipeline does when loaded without T5. ``save_pretrained`` works
  for every kind, but diffusers only reloads a saved ``sd3`` pipeline when the missing T5 parts are
  passed back: ``from_pretrained(path, text_encoder_3=None, tokenizer_3=None)``.
* Images are 32x32 pixels by default; other sizes must be multiples of 8.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging as _std_logging
import os
import tempfile
from typing import Any, Iterator

import torch

__all__ = ["TINY_KINDS", "tiny_pipeline"]

#: The pipeline kinds :func:`tiny_pipeline` can build.
TINY_KINDS = ("sd", "sdxl", "sd3")

# The real CLIP limit; prompts longer than this are truncated by the pipelines.
_MODEL_MAX_LENGTH = 77
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"

# Words that get a single whole-word token. Anything else is split into byte-level pieces.
_WORDS = (
    "a an the of in on at with and or to for by from is it this that "
    "photo picture painting drawing image portrait landscape render sketch "
    "cat dog horse bird fish person man woman child astronaut robot car house tree flower "
    "sky sea mountain city street forest river beach snow sun moon night day "
    "red blue green yellow black white orange purple pink brown "
    "big small old new beautiful cute dark bright high quality detailed realistic "
    "riding sitting standing running style art digital oil watercolor blurry ugly bad"
).split()

# Pixel size of the default image: sample_size (in latent pixels) * vae_scale_factor (4).
_SAMPLE_SIZE = 8
_VAE_BLOCKS = (32, 32, 64)  # three blocks -> vae_scale_factor 4


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level mapping from each of the 256 bytes to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """A small CLIP-style BPE vocabulary: every byte (alone and word-final), the whole words of
    ``_WORDS`` and the pieces leading to them, then ``<|startoftext|>`` and ``<|endoftext|>`` as the
    two highest ids (as in real CLIP).

    The merges are learnt as BPE learns them (repeatedly merge the most frequent adjacent pair), so
    encoding one of ``_WORDS`` with them gives a single whole-word token.
    """
    chars = list(_bytes_to_unicode().values())
    tokens: list[str] = chars + [c + "</w>" for c in chars]
    seen = set(tokens)
    words = [list(w[:-1]) + [w[-1] + "</w>"] for w in dict.fromkeys(_WORDS)]
    merges: list[str] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for pieces in words:
            for pair in zip(pieces, pieces[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))  # deterministic tie-break
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in seen:  # ("ab", "c") and ("a", "bc") give the same token
            tokens.append(merged)
            seen.add(merged)
        for pieces in words:
            i = 0
            while i < len(pieces) - 1:
                if (pieces[i], pieces[i + 1]) == best:
                    pieces[i : i + 2] = [merged]
                i += 1
    tokens += [_BOS, _EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


_VOCAB, _MERGES = _vocab_and_merges()
_VOCAB_SIZE = len(_VOCAB)


def _tiny_tokenizer(pad_token: str = _EOS):
    """A ``CLIPTokenizer`` loaded from vocab.json + merges.txt written to a temporary directory."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="diffusion_debug_tok_") as tmp:
        with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(_VOCAB, f, ensure_ascii=False)
        with open(os.path.join(tmp, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(_MERGES) + "\n")
        tok = CLIPTokenizer.from_pretrained(
            tmp,
            model_max_length=_MODEL_MAX_LENGTH,
            bos_token=_BOS,
            eos_token=_EOS,
            unk_token=_EOS,
            pad_token=pad_token,
        )
    # The loaded tokenizer keeps everything in memory; don't point at the deleted directory.
    tok.name_or_path = "diffusion_debug/tiny-clip-tokenizer"
    return tok


# --------------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------------


def _clip_config(*, projection_dim: int = 32, hidden_act: str = "quick_gelu"):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MODEL_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        bos_token_id=_VOCAB[_BOS],
        eos_token_id=_VOCAB[_EOS],
        pad_token_id=_VOCAB[_EOS],
    )


def _vae(**overrides: Any):
    from diffusers import AutoencoderKL

    kwargs: dict[str, Any] = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(_VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(_VAE_BLOCKS),
        block_out_channels=_VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=_SAMPLE_SIZE * 2 ** (len(_VAE_BLOCKS) - 1),
        scaling_factor=0.18215,
    )
    kwargs.update(overrides)
    return AutoencoderKL(**kwargs)


def _component_seed(seed: int, kind: str, name: str) -> int:
    """A seed for one component, derived from (seed, kind, name) so that components of one pipeline
    (e.g. the two CLIP encoders) do not share weights and different seeds give different weights."""
    digest = hashlib.sha256(f"{int(seed)}:{kind}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _build_sd(make) -> dict[str, Any]:
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            sample_size=_SAMPLE_SIZE,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        ),
    )
    vae = make("vae", _vae)
    text_encoder = make("text_encoder", lambda: CLIPTextModel(_clip_config()))
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )
    return dict(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_tiny_tokenizer(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_sdxl(make) -> dict[str, Any]:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    hidden, projection, time_dim = 32, 32, 8
    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            sample_size=_SAMPLE_SIZE,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            # The UNet sees the penultimate hidden states of both encoders, concatenated.
            cross_attention_dim=2 * hidden,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            norm_num_groups=32,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            # Pooled text_encoder_2 output + 6 micro-conditioning values (sizes, crop, target).
            projection_class_embeddings_input_dim=projection + 6 * time_dim,
        ),
    )
    vae = make("vae", lambda: _vae(scaling_factor=0.13025, force_upcast=True))
    text_encoder = make("text_encoder", lambda: CLIPTextModel(_clip_config()))
    text_encoder_2 = make(
        "text_encoder_2",
        lambda: CLIPTextModelWithProjection(_clip_config(projection_dim=projection, hidden_act="gelu")),
    )
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
        interpolation_type="linear",
    )
    return dict(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=_tiny_tokenizer(),
        tokenizer_2=_tiny_tokenizer(pad_token="!"),  # the real SDXL tokenizer_2 pads with "!"
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
    )


def _build_sd3(make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    hidden, projection = 32, 32
    transformer = make(
        "transformer",
        lambda: SD3Transformer2DModel(
            sample_size=_SAMPLE_SIZE,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            # CLIP hidden states of both encoders are concatenated (and padded to this width).
            joint_attention_dim=2 * hidden,
            caption_projection_dim=32,
            pooled_projection_dim=2 * projection,
            pos_embed_max_size=32,  # latents up to 64x64 (256 px)
        ),
    )
    vae = make(
        "vae",
        lambda: _vae(
            latent_channels=16,
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )
    text_encoder = make("text_encoder", lambda: CLIPTextModelWithProjection(_clip_config(projection_dim=projection)))
    text_encoder_2 = make(
        "text_encoder_2",
        lambda: CLIPTextModelWithProjection(_clip_config(projection_dim=projection, hidden_act="gelu")),
    )
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_tiny_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=_tiny_tokenizer(pad_token="!"),
        text_encoder_3=None,
        tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )


def _build_zoo(kind: str, make) -> dict[str, Any]:
    """The components of one of :data:`~diffusion_debug.testing.zoo.ZOO_KINDS` or
    :data:`~diffusion_debug.testing.zoo_video_audio.KINDS`."""
    from . import zoo, zoo_video_audio

    if kind == "flux":
        return zoo_video_audio.build_flux(make, _WORDS, _clip_config(hidden_act="gelu"), _tiny_tokenizer())
    if kind == "svd":
        return zoo_video_audio.build_svd(make)
    if kind == "dance_diffusion":
        return zoo_video_audio.build_dance_diffusion(make)
    if kind in ("img2img", "inpaint", "controlnet", "animatediff"):
        sd = _build_sd(make)
        if kind == "controlnet":
            return zoo.build_controlnet(make, sd)
        if kind == "animatediff":
            return zoo.build_animatediff(make, sd)
        return sd
    if kind == "kandinsky_prior":
        return zoo.build_kandinsky_prior(make, _clip_config(projection_dim=32), _tiny_tokenizer())
    if kind == "kandinsky_decoder":
        return zoo.build_kandinsky_decoder(make)
    if kind == "pixart":
        return zoo.build_pixart(make, make("vae", _vae), _WORDS)
    return zoo.build_dit(make, make("vae", _vae))


_BUILDERS = {"sd": _build_sd, "sdxl": _build_sdxl, "sd3": _build_sd3}


@contextlib.contextmanager
def _quiet_construction() -> Iterator[None]:
    """Lower diffusers / transformers logging to errors while components are constructed."""
    import diffusers
    import transformers

    old = (diffusers.logging.get_verbosity(), transformers.logging.get_verbosity())
    diffusers.logging.set_verbosity(_std_logging.ERROR)
    transformers.logging.set_verbosity(_std_logging.ERROR)
    try:
        yield
    finally:
        diffusers.logging.set_verbosity(old[0])
        transformers.logging.set_verbosity(old[1])


def tiny_pipeline(
    kind: str = "sd",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Build a tiny randomly initialised diffusers pipeline, fully offline.

    Args:
        kind: ``"sd"`` (``StableDiffusionPipeline``), ``"sdxl"`` (``StableDiffusionXLPipeline``)
            or ``"sd3"`` (``StableDiffusion3Pipeline``, without T5); see :data:`TINY_KINDS`. Also
            one of :data:`~diffusion_debug.testing.zoo.ZOO_KINDS` (img2img, inpaint, controlnet,
            animatediff, kandinsky_prior, kandinsky_decoder, pixart, dit; their call arguments
            in :data:`~diffusion_debug.testing.zoo.ZOO_CALLS`), or flux, svd, dance_diffusion
            (:data:`~diffusion_debug.testing.zoo_video_audio.CALLS`).
        seed: weights are a function of ``seed`` (and ``kind``) alone: the same seed gives bitwise
            identical weights, a different seed different ones. The global torch RNG state is left
            as it was.
        dtype: dtype of every model component (e.g. ``torch.float16``; it runs on CPU).
        device: device the components are moved to.

    Returns:
        The pipeline, with a progress bar disabled. Its default image size is 32x32 pixels
        (``sample_size`` 8 latent pixels times ``vae_scale_factor`` 4); ``height``/``width`` must be
        multiples of 8 (sd, sdxl: the UNet halves the latents once; sd3: patch size 2).

    Raises:
        ValueError: ``kind`` is not one of :data:`TINY_KINDS`, ``ZOO_KINDS`` or the video/audio kinds.
    """
    from . import zoo, zoo_video_audio

    if kind not in _BUILDERS and kind not in zoo.ZOO_KINDS and kind not in zoo_video_audio.KINDS:
        valid = ", ".join(map(repr, TINY_KINDS + zoo.ZOO_KINDS + zoo_video_audio.KINDS))
        raise ValueError(f"Unknown tiny pipeline kind {kind!r}; valid kinds are: {valid}.")

    def make(name: str, factory):
        torch.manual_seed(_component_seed(seed, kind, name))
        module = factory()
        return module.to(device=device, dtype=dtype).eval()

    with torch.random.fork_rng(devices=[]), _quiet_construction():
        # Imported here, quietly: importing the pipelines makes transformers warn about optional
        # image-processor backends (torchvision) that these pipelines never use.
        from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

        if kind in zoo.ZOO_KINDS:
            pipe = zoo.pipeline_class(kind)(**_build_zoo(kind, make))
        elif kind in zoo_video_audio.KINDS:
            pipe = zoo_video_audio.pipeline_class(kind)(**_build_zoo(kind, make))
        else:
            pipeline_cls = {
                "sd": StableDiffusionPipeline,
                "sdxl": StableDiffusionXLPipeline,
                "sd3": StableDiffusion3Pipeline,
            }[kind]
            pipe = pipeline_cls(**_BUILDERS[kind](make))
    pipe.set_progress_bar_config(disable=True)
    return pipe
