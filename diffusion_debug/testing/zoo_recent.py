"""Tiny, offline image pipelines of the families users run that the older zoo modules lack (the video
and audio ones are :mod:`~diffusion_debug.testing.zoo_recent_video`'s): SDXL with perturbed-attention
guidance (``StableDiffusionXLPAGPipeline``: a third batch part through swapped attention processors),
SDXL with a ControlNet-Union, FLUX.2 [klein] (a Qwen3 text encoder, the FLUX.2 transformer and VAE),
Bria 3.2, Marigold depth (an image in, a depth map out), Z-Image img2img, HiDream-I1 (four text
encoders, a mixture-of-experts transformer), Lumina-Next and HunyuanImage 2.1 (guided through diffusers'
guiders).

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("flux2_klein")).__name__
'Flux2KleinPipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo_latest.ZOO_CALLS` does. Sizes follow diffusers' fast tests
(``tests/pipelines/pag``, ``controlnet_union``, ``flux2``, ``bria``, ``marigold``, ``z_image``,
``hidream_image``, ``lumina``, ``hunyuan_image_21``).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`). The T5 tokenizer is the
offline unigram one of :mod:`~diffusion_debug.testing.text_encoders`; the Qwen3 (FLUX.2 [klein]), Llama
(HiDream) and Gemma (Lumina) read :func:`~.text_encoders.qwen_tokenizer`'s byte ids, which have no BOS:
Lumina's call passes a negative prompt of its own (an empty one would be no token at all).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .stable_diffusion import Make, build_sdxl
from .text_encoders import WORDS, qwen_tokenizer, t5_encoder_config, t5_tokenizer
from .zoo_latest import ZOO_CALLS as LATEST_CALLS
from .zoo_latest import build_z_image, qwen3_chat

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = (
    "sdxl_pag",
    "sdxl_controlnet_union",
    "flux2_klein",
    "bria",
    "marigold_depth",
    "z_image_img2img",
    "hidream",
    "lumina",
    "hunyuan_image21",
)


def frames(count: int, size: int) -> list:
    """``count`` RGB frames of ``size`` pixels a side, each its own colour."""
    from PIL import Image

    return [Image.new("RGB", (size, size), (40 * (i % 6), 90, 160)) for i in range(count)]


def image() -> torch.Tensor:
    """A 32x32 RGB image in [0, 1], as a tensor (a control image, an image to edit)."""
    return torch.linspace(0.0, 1.0, 3 * 32 * 32).reshape(1, 3, 32, 32)


#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "sdxl_pag": (lambda: {"prompt": "a cat", "guidance_scale": 5.0, "pag_scale": 3.0}, ("latents",)),
    "sdxl_controlnet_union": (
        lambda: {"prompt": "a cat", "control_image": [image()], "control_mode": [0], "guidance_scale": 5.0},
        ("latents",),
    ),
    "flux2_klein": (
        lambda: {
            "prompt": "a cat",
            "height": 16,
            "width": 16,
            "max_sequence_length": 32,
            "text_encoder_out_layers": (1,),
        },
        ("latents",),
    ),
    "bria": (lambda: {"prompt": "a cat", "height": 16, "width": 16, "max_sequence_length": 16}, ("latents",)),
    "marigold_depth": (lambda: {"image": image(), "processing_resolution": 0}, ("image",)),
    "z_image_img2img": (  # Z-Image's call, with an image at full strength (both steps run)
        lambda: {
            **LATEST_CALLS["z_image"][0](),
            "image": torch.linspace(0.0, 1.0, 3 * 16 * 16).reshape(1, 3, 16, 16),
            "strength": 1.0,
        },
        ("image", "latents"),
    ),
    "hidream": (lambda: {"prompt": "a cat", "height": 32, "width": 32, "guidance_scale": 5.0}, ("latents",)),
    "hunyuan_image21": (lambda: {"prompt": "a cat", "height": 16, "width": 16}, ("latents",)),
    # a negative prompt of its own: the byte tokenizer adds no BOS, so "" is no token and its mean pooling 0 / 0
    "lumina": (
        lambda: {"prompt": "a cat", "negative_prompt": "bad", "height": 16, "width": 16, "guidance_scale": 5.0},
        ("latents",),
    ),
}


def build_sdxl_pag(make: Make) -> dict[str, Any]:
    """The tiny SDXL of :mod:`~diffusion_debug.testing.stable_diffusion`, PAG applied to its mid block."""
    return {**build_sdxl(make), "pag_applied_layers": ["mid"]}


def build_sdxl_controlnet_union(make: Make) -> dict[str, Any]:
    """The tiny SDXL and a ``ControlNetUnionModel`` of its UNet's shape (diffusers' fast test's)."""
    from diffusers import ControlNetUnionModel

    components = build_sdxl(make)
    unet = components["unet"].config
    controlnet = make(
        "controlnet",
        lambda: ControlNetUnionModel(
            block_out_channels=unet.block_out_channels,
            layers_per_block=unet.layers_per_block,
            in_channels=4,
            down_block_types=unet.down_block_types,
            conditioning_embedding_out_channels=(16, 32, 32),  # / 4, as the tiny VAE
            attention_head_dim=unet.attention_head_dim,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=unet.addition_time_embed_dim,
            transformer_layers_per_block=1,
            projection_class_embeddings_input_dim=unet.projection_class_embeddings_input_dim,
            cross_attention_dim=unet.cross_attention_dim,
            norm_num_groups=unet.norm_num_groups,
            num_trans_channel=32,  # its control-type transformer, as wide as the first block
            num_trans_head=2,
            num_proj_channel=32,
        ),
    )
    components.pop("force_zeros_for_empty_prompt")
    return {**components, "controlnet": controlnet}


def tiny_flux2_vae():
    """FLUX.2's VAE at one block of 4 channels and a 1-channel latent (FLUX.2 klein's; Ideogram 4's in tests)."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_flux2_klein(make: Make) -> dict[str, Any]:
    """FLUX.2 [klein] (diffusers' fast test): one dual-stream and one single-stream block, the FLUX.2
    VAE of one block (1 latent channel), a 2-layer Qwen3 of width 16 over the byte tokenizer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    tokenizer, text = qwen3_chat()
    transformer = make(
        "transformer",
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4],
            guidance_embeds=False,
        ),
    )
    vae = make("vae", tiny_flux2_vae)
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": make("text_encoder", lambda: Qwen3ForCausalLM(text)),
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
    }


def build_bria(make: Make) -> dict[str, Any]:
    """Bria 3.2 (diffusers' fast test): a ``BriaTransformer2DModel`` of one dual and one single block,
    an ``AutoencoderKL`` of one block (scale factor 1), a one-layer T5 of width 32."""
    from diffusers import AutoencoderKL, BriaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: BriaTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=None,
            axes_dims_rope=[0, 4, 4],
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderKL(
            act_fn="silu",
            block_out_channels=(32,),
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D"],
            latent_channels=4,
            sample_size=32,
            shift_factor=0,
            scaling_factor=0.13025,
            use_post_quant_conv=True,
            use_quant_conv=True,
            force_upcast=False,
        ),
    )
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
        "transformer": transformer,
        "vae": vae,
        "image_encoder": None,
        "feature_extractor": None,
    }


def build_marigold_depth(make: Make) -> dict[str, Any]:
    """Marigold depth (diffusers' fast test): a UNet that reads the image's and the depth's latents
    (8 channels in), the tiny SD VAE and CLIP (the empty prompt's embedding), an LCM scheduler."""
    from diffusers import LCMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    from .stable_diffusion import vae
    from .text_encoders import clip_text_config, clip_tokenizer

    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=32,
            in_channels=8,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
        ),
    )
    scheduler = LCMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type="v_prediction",
        set_alpha_to_one=False,
        steps_offset=1,
        beta_schedule="scaled_linear",
        clip_sample=False,
        thresholding=False,
        timestep_spacing="trailing",
    )
    return {
        "unet": unet,
        "scheduler": scheduler,
        "vae": make("vae", vae),
        "text_encoder": make("text_encoder", lambda: CLIPTextModel(clip_text_config())),
        "tokenizer": clip_tokenizer(),
        "prediction_type": "depth",
        "scale_invariant": True,
        "shift_invariant": True,
    }


def build_hidream(make: Make) -> dict[str, Any]:
    """HiDream-I1 (diffusers' fast test): a mixture-of-experts ``HiDreamImageTransformer2DModel`` (one
    dual and one single block, 4 routed experts, 2 active), a one-block VAE, two CLIP encoders with
    projection, a one-layer T5 and a 2-layer Llama of width 16 whose layers 0 and 1 it reads."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImageTransformer2DModel
    from transformers import CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM, T5EncoderModel

    from .text_encoders import clip_text_config, clip_tokenizer

    t5, llama = t5_tokenizer(WORDS), qwen_tokenizer()
    transformer = make(
        "transformer",
        lambda: HiDreamImageTransformer2DModel(
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_channels=[32, 16],
            text_emb_dim=64,
            num_routed_experts=4,
            num_activated_experts=2,
            axes_dims_rope=(4, 2, 2),
            max_resolution=(32, 32),
            llama_layers=(0, 1),
        ),
    )
    text = LlamaConfig(
        vocab_size=len(llama),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=llama.pad_token_id,
    )

    def clip():
        config = clip_text_config(projection_dim=32, hidden_act="gelu")
        config.max_position_embeddings = 128  # HiDream pads its CLIP prompts to 128 tokens
        return CLIPTextModelWithProjection(config)

    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": make("vae", lambda: AutoencoderKL(scaling_factor=0.3611, shift_factor=0.1159)),
        "text_encoder": make("text_encoder", clip),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": make("text_encoder_2", clip),
        "tokenizer_2": clip_tokenizer(),
        "text_encoder_3": make("text_encoder_3", lambda: T5EncoderModel(t5_encoder_config(t5))),
        "tokenizer_3": t5,
        "text_encoder_4": make("text_encoder_4", lambda: LlamaForCausalLM(text)),
        "tokenizer_4": llama,
        "transformer": transformer,
        # it scales every image to the area of its default size (128 latent pixels a side): 16 here
        "__pipeline_attributes__": {"default_sample_size": 16},
    }


def build_lumina(make: Make) -> dict[str, Any]:
    """Lumina-Next (diffusers' fast test): a ``LuminaNextDiT2DModel`` of 2 layers (width 4), the default
    one-block ``AutoencoderKL``, a 2-layer Gemma of width 8 over the byte tokenizer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, LuminaNextDiT2DModel
    from transformers import GemmaConfig, GemmaForCausalLM

    tokenizer = qwen_tokenizer()
    text = GemmaConfig(
        vocab_size=len(tokenizer),
        head_dim=2,
        hidden_size=8,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        num_key_value_heads=4,
        pad_token_id=tokenizer.pad_token_id,
    )
    transformer = make(
        "transformer",
        lambda: LuminaNextDiT2DModel(
            sample_size=4,
            patch_size=2,
            in_channels=4,
            hidden_size=4,
            num_layers=2,
            num_attention_heads=1,
            num_kv_heads=1,
            multiple_of=16,
            ffn_dim_multiplier=None,
            norm_eps=1e-5,
            learn_sigma=True,
            qk_norm=True,
            cross_attention_dim=8,
            scaling_factor=1.0,
        ),
    )
    return {
        "transformer": transformer,
        "vae": make("vae", AutoencoderKL),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": make("text_encoder", lambda: GemmaForCausalLM(text)),
        "tokenizer": tokenizer,
    }


def build_hunyuan_image21(make: Make) -> dict[str, Any]:
    """HunyuanImage 2.1 (diffusers' fast test): one dual and one single block, its 8x VAE of widths
    32 and 64, a 2-layer Qwen2.5-VL of width 32 and a 2-layer ByT5 encoder, CFG through diffusers'
    adaptive projected guiders (plain CFG for 2 steps: the projection starts at step 2)."""
    from diffusers import AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImageTransformer2DModel
    from diffusers.guiders import AdaptiveProjectedMixGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLForConditionalGeneration, T5Config, T5EncoderModel

    from .qwenimage import qwen25vl_config

    qwen = qwen25vl_config(512)  # text alone: no logits over 152,064 ids for its 1,000-token padding
    qwen.text_config.hidden_size = qwen.text_config.intermediate_size = qwen.hidden_size = 32
    qwen.text_config.rope_scaling["mrope_section"] = [2, 2, 4]
    qwen.vision_config.hidden_size = qwen.vision_config.intermediate_size = qwen.vision_config.out_hidden_size = 32
    byt5 = T5Config(
        d_model=32,
        d_kv=4,
        d_ff=16,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        vocab_size=256,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
    )
    transformer = make(
        "transformer",
        lambda: HunyuanImageTransformer2DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=(1, 1),
            guidance_embeds=False,
            text_embed_dim=32,
            text_embed_2_dim=32,
            rope_axes_dim=(4, 4),
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderKLHunyuanImage(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(32, 64, 64, 64),
            layers_per_block=1,
            scaling_factor=0.476986,
            spatial_compression_ratio=8,
            sample_size=128,
        ),
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder": make("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(qwen)),
        "text_encoder_2": make("text_encoder_2", lambda: T5EncoderModel(byt5)),
        "tokenizer": qwen_tokenizer(),
        "tokenizer_2": ByT5Tokenizer(),
        "guider": AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=2),
        "ocr_guider": AdaptiveProjectedMixGuidance(adaptive_projected_guidance_start_step=3),
        # it pads every prompt to 1,000 tokens; its template and the prompt fit in 192 of the byte tokenizer's
        "__pipeline_attributes__": {"tokenizer_max_length": 192},
    }


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "sdxl_pag": ("StableDiffusionXLPAGPipeline", build_sdxl_pag),
    "sdxl_controlnet_union": ("StableDiffusionXLControlNetUnionPipeline", build_sdxl_controlnet_union),
    "flux2_klein": ("Flux2KleinPipeline", build_flux2_klein),
    "bria": ("BriaPipeline", build_bria),
    "marigold_depth": ("MarigoldDepthPipeline", build_marigold_depth),
    "z_image_img2img": ("ZImageImg2ImgPipeline", build_z_image),
    "hidream": ("HiDreamImagePipeline", build_hidream),
    "lumina": ("LuminaPipeline", build_lumina),
    "hunyuan_image21": ("HunyuanImagePipeline", build_hunyuan_image21),
}
