"""A non-SD VAE's fp16 overflow is told the float32 decode that works on its pipeline, read from the pipeline's call
with ``ast`` (:func:`~diffusion_debug.diffusion.components.vae_details.call_facts`): ``pipe.vae.to(torch.float32)``
alone where the call casts its latents to the VAE's dtype on every path to ``self.vae.decode``; the latent-output
decode in float32 (or the pipeline in bfloat16) where it hands them uncast (Flux's: a float32 VAE there raises on the
float16 latents). Checked against every pipeline class of this diffusers that decodes in its call (the cases a
line-and-regex read got wrong, by name) and against what each tiny zoo pipeline's decode is handed when its VAE is
float32 and the rest float16; the Flux advice followed matches a float32 pipeline; a clean call reads no source."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from unittest import mock

import diffusers
import numpy as np
import pytest
import torch
from diffusion_helpers import plant

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import vae_details
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.flux import FLUX_CALL

# what a line-and-regex read of the source got wrong (diag36): a cast in a sibling force_upcast branch taken for the
# decode's; a cast through vae_dtype = self.vae.dtype, z.to(self.vae.dtype) or a call over several lines missed
CASES = {
    "StableDiffusionXLControlNetInpaintPipeline": False,
    "StableDiffusionXLControlNetUnionInpaintPipeline": False,
    "StableDiffusionXLControlNetXSPipeline": False,
    "WanVACEPipeline": True,
    "CosmosVideoToWorldPipeline": True,
    "Cosmos3OmniPipeline": True,
    "Ideogram4Pipeline": True,
    "JoyImageEditPlusPipeline": True,
    "HeliosPipeline": True,
    "HeliosPyramidPipeline": True,
    "HunyuanVideoFramepackPipeline": True,
    # and the ones the behaviour below shows, named
    "FluxPipeline": False,
    "StableDiffusion3Pipeline": False,
    "StableDiffusionXLPipeline": False,
    "StableDiffusionPipeline": False,
    "Lumina2Pipeline": False,
    "ChromaPipeline": False,
    "WanPipeline": True,
    "PixArtSigmaPipeline": True,
    "SanaPipeline": True,
    "AuraFlowPipeline": True,
    "StableDiffusionUpscalePipeline": True,
    "HunyuanVideoPipeline": True,
    "Cosmos2_5_TransferPipeline": True,  # its decode in a function made in the call
    "AnimateDiffPipeline": False,  # its decode in its decode_latents, read there
    "CogVideoXPipeline": False,
}


# whether the call reaches the VAE's encode (its input image's), read by following the call (before: from its
# parameters' names, which named a ControlNet's control image, SD upscale's low-res image concatenated to the latents
# and an image variation's CLIP input, and missed OmniGen's input_images and Stable Audio's initial audio)
ENCODES = {
    "StableDiffusionControlNetPipeline": False,
    "StableDiffusionUpscalePipeline": False,
    "StableDiffusionImageVariationPipeline": False,
    "WanPipeline": False,
    "OmniGenPipeline": True,
    "StableAudioPipeline": True,
    "WanImageToVideoPipeline": True,  # in prepare_latents
    "VisualClozeGenerationPipeline": True,  # three calls deep
    "HunyuanVideo15ImageToVideoPipeline": True,  # a static method given self.vae
    "AnyFlowPipeline": True,  # self.vae._encode
    "ZImageImg2ImgPipeline": True,
}


def decodes_in_call(cls: type) -> bool:
    """Whether the ``__call__`` ``cls`` runs calls ``self.vae.decode`` (read apart, by ``ast.walk``; once per class
    that defines it)."""
    return _owner_decodes(next((base for base in cls.__mro__ if "__call__" in vars(base)), None))


@functools.cache
def _owner_decodes(owner: type | None) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner.__call__)))
    except Exception:
        return False
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "decode"  # (before unparsing it)
        and ast.unparse(node.func) == "self.vae.decode"
        for node in ast.walk(tree)
    )


def test_every_pipeline_class_that_decodes_in_its_call_is_read_and_the_cases_regex_got_wrong_are_right():
    """All of this diffusers' pipeline classes whose call has a ``self.vae.decode`` are read as casting or not
    (none not known), and the named cases are as their calls are; so is whether the call reaches the VAE's encode."""
    classes = {}
    for name in dir(diffusers):
        if "Pipeline" in name:
            try:
                cls = getattr(diffusers, name)
            except Exception:  # (a pipeline whose optional dependency is missing)
                continue
            if isinstance(cls, type) and decodes_in_call(cls):
                classes[name] = cls
    found = {name: vae_details.call_facts(cls).casts_latents for name, cls in classes.items()}
    assert [name for name, casts in found.items() if casts is None] == []
    present = {name: casts for name, casts in CASES.items() if hasattr(diffusers, name)}
    assert {name: vae_details.call_facts(getattr(diffusers, name)).casts_latents for name in present} == present
    encodes = {name: vae_details.reaches_encode(cls) for name, cls in classes.items()}
    # read only where the call casts (the one advice that says it)
    assert {name: vae_details.call_facts(cls).input for name, cls in classes.items()} == {
        name: reaches and found[name] for name, reaches in encodes.items()
    }
    assert {name: encodes[name] for name in ENCODES if name in encodes} == {
        name: reads for name, reads in ENCODES.items() if hasattr(diffusers, name)
    }
    # Mochi's de-normalization said as an expression: no other call's read so (SDXL's mean and std are 4-D)
    assert [name for name, cls in classes.items() if vae_details.call_facts(cls).denormalized] == ["MochiPipeline"]
    if diffusers.__version__ == "0.42.1":  # (the floor's diffusers has fewer)
        assert (len(found), sum(found.values()), sum(encodes.values())) == (207, 83, 123)


# the zoo kinds whose VAE decodes in the call (SD and SDXL's upcast advice stays theirs, and is checked the same)
ZOO = (
    "sd", "sdxl", "sd3", "img2img", "inpaint", "controlnet", "dit", "instruct_pix2pix", "t2i_adapter", "lcm",
    "lumina2", "flux", "flux_kontext", "flux_fill", "chroma", "sd_upscale", "pixart_sigma", "sana", "auraflow",
    "hunyuan_video", "wan22", "cogvideox",
)  # fmt: skip


CASTING = {"sd_upscale", "pixart_sigma", "sana", "auraflow", "hunyuan_video", "wan22"}


def zoo_call(kind: str) -> dict:
    """The keyword arguments of ``kind``'s tiny call (no generator, no step count)."""
    from diffusion_debug.testing import zoo, zoo_more, zoo_newer, zoo_video_audio

    calls = {kind: c[0] for family in (zoo, zoo_newer) for kind, c in family.ZOO_CALLS.items()}
    calls |= {kind: c[0] for family in (zoo_more, zoo_video_audio) for kind, c in family.CALLS.items()}
    calls |= {"flux": FLUX_CALL[0], "wan22": zoo_video_audio.WAN22_CALL}
    return calls[kind]() if kind in calls else {"prompt": "a cat"}


def handed_to_decode(pipe, call: dict) -> list[str]:
    """The dtypes ``pipe``'s decodes are handed with its VAE in float32 and the rest in float16 (its encode of an
    input image run by a float16 copy, as the float16 pipeline's; each decode then run on float32 latents)."""
    half = copy.deepcopy(pipe.vae)
    pipe.vae.to(torch.float32)
    seen, decode = [], pipe.vae.decode

    def recorded(z, *args, **kwargs):
        seen.append(str(z.dtype).removeprefix("torch."))
        return decode(z.float(), *args, **kwargs)

    pipe.vae.decode = recorded
    pipe.vae.encode = lambda x, *args, **kwargs: half.encode(x.half(), *args, **kwargs)
    with torch.no_grad():
        pipe(**call, num_inference_steps=1, generator=torch.Generator().manual_seed(0))
    return seen


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.skipif(bool(kind_missing(k)), reason="not here")) for k in ZOO]
)
def test_whether_the_call_casts_is_what_its_decode_is_handed_with_a_float32_vae_and_the_rest_float16(kind):
    """The behaviour: a float32 VAE in a float16 pipeline is handed float32 latents where the call casts them (the
    float32 VAE alone then decodes), float16 where it does not (and the float32 VAE alone raises); the T2I-Adapter's
    and CogVideoX's decode in their ``decode_latents``, read there."""
    pipe = tiny_pipeline(kind, dtype=torch.float16)
    casts = vae_details.call_facts(type(pipe)).casts_latents
    handed = handed_to_decode(pipe, zoo_call(kind))
    assert handed and set(handed) == {"float32" if casts else "float16"}
    # (session 36 measured the same: the float32 VAE alone raised on the others)
    assert casts is (kind in CASTING)


def past_fp16(out):
    """An fp16 VAE's overflow: the conv's output scaled to 1e5, Inf in float16, finite in float32."""
    return (out.float() * (1e5 / out.detach().abs().amax().float())).to(out.dtype)


CONV = "decoder.up_blocks.0.resnets.0.conv2"
FLUX_DECODE = (
    "pipe.vae.decode((pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor) / "
    "pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).float()).sample"
)


FLUX_ADVICE = (
    "this pipeline hands the VAE its latents uncast, so pipe.vae.to(torch.float32) alone may fail on them: call the "
    'pipeline with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and decode them in '
    f"float32 ({FLUX_DECODE}; height, width: the call's, by default pipe.default_sample_size * "
    "pipe.vae_scale_factor), or run the whole pipeline in bfloat16 (pipe.to(torch.bfloat16))"
)


def watched(pipe, tmp_path, call, fault=True):
    """The output and the error anomalies of one watched call of ``pipe`` (``fault``: its VAE's ``CONV``
    overflowing float16)."""
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.get_submodule(CONV), 0 if fault else 10**9, past_fp16), dbg:
            out = pipe(**call, generator=torch.Generator().manual_seed(0))
        return out, [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()


def test_a_flux_fp16_vae_overflow_is_told_its_latents_decoded_in_float32_which_followed_matches_float32(tmp_path):
    """Flux's call hands the VAE its latents uncast: "pipe.vae.to(torch.float32)" alone (the advice before) raises
    on them. Told the latent-output decode as an expression for Flux (unpacked, unscaled, shifted, in float32), which
    followed as written gives a finite image equal to a float32 pipeline's within 2e-2 (the float16 transformer's
    rounding), the same fault planted; the whole pipeline in bfloat16, the other advice, is finite too."""
    call = {**FLUX_CALL[0](), "num_inference_steps": 1, "output_type": "np"}
    pipe = tiny_pipeline("flux", dtype=torch.float16)
    out, errors = watched(pipe, tmp_path / "fp16", call)
    assert np.isnan(out.images).all()
    assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", "vae", CONV)]
    assert {k: errors[0].details.get(k) for k in ("casts_latents", "latent_decode")} == {
        "casts_latents": False,
        "latent_decode": FLUX_DECODE,
    }
    assert errors[0].message == (f"vae.{CONV} produced NaN/Inf from finite inputs ({FLUX_ADVICE}).")
    pipe_32 = tiny_pipeline("flux")
    with plant(pipe_32.vae.get_submodule(CONV), 0, past_fp16):
        reference = pipe_32(**call, generator=torch.Generator().manual_seed(0)).images
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):  # the advice, followed
        latents = pipe(**{**call, "output_type": "latent"}, generator=torch.Generator().manual_seed(0)).images
        assert latents.dtype == torch.float16
        pipe.vae.to(torch.float32)
        with pytest.raises(RuntimeError):  # alone: float16 latents into float32 weights
            pipe(**call, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            named = {"pipe": pipe, "latents": latents, "height": call["height"], "width": call["width"]}
            image = eval(FLUX_DECODE, named)  # as the advice writes it
    image = pipe.image_processor.postprocess(image, output_type="np")
    assert np.isfinite(image).all() and np.abs(image - reference).max() < 2e-2
    pipe.to(torch.bfloat16)  # the other advice
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16):
        assert np.isfinite(pipe(**call, generator=torch.Generator().manual_seed(0)).images).all()


def test_a_clean_watched_call_reads_no_source_and_a_vae_anomaly_reads_its_class_once(tmp_path):
    """The call's source is read where a VAE anomaly's advice is built, once per class (both facts from that one
    read), never on a clean call (before: on each class's first watched call, clean or not)."""
    getsource = inspect.getsource
    read: list[str] = []

    def counted(obj):
        read.append(getattr(obj, "__qualname__", ""))
        return getsource(obj)

    call = {**FLUX_CALL[0](), "num_inference_steps": 1, "output_type": "np"}
    pipe = tiny_pipeline("flux", dtype=torch.float16)
    vae_details._READS.pop(type(pipe), None)
    with mock.patch.object(inspect, "getsource", counted):
        watched(pipe, tmp_path / "clean", call, fault=False)
        assert read == []
        watched(pipe, tmp_path / "fault", call)
        assert [name for name in read if name.endswith("__call__")] == ["FluxPipeline.__call__"]
        watched(pipe, tmp_path / "again", call)
        assert [name for name in read if name.endswith("__call__")] == ["FluxPipeline.__call__"]


def test_cogvideoxs_vae_is_told_its_own_decode_latents_in_float32_which_followed_decodes(tmp_path):
    """CogVideoX decodes in its ``decode_latents`` (permuted, unscaled), handed float16 latents: told that method
    on the latents in float32 after ``pipe.vae.to(torch.float32)``, which decodes them to finite frames equal to the
    float16 pipeline's own within 2e-2 (no fault: the same latents)."""
    from diffusion_debug.diffusion.components.vae_details import cast_details

    pipe = tiny_pipeline("cogvideox", dtype=torch.float16)
    assert cast_details(pipe) == {"casts_latents": False, "latent_decode": "pipe.decode_latents(latents.float())"}
    call = {**zoo_call("cogvideox"), "num_inference_steps": 1, "output_type": "latent"}
    latents = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    with torch.no_grad():
        own = pipe.decode_latents(latents)
        pipe.vae.to(torch.float32)  # the advice, followed
        frames = eval("pipe.decode_latents(latents.float())", {"pipe": pipe, "latents": latents})
    assert frames.dtype == torch.float32 and torch.isfinite(frames).all()
    assert (frames - own.float()).abs().max() < 2e-2


def test_flux_fills_advice_followed_in_the_order_it_says_gives_a_finite_image_and_kontext_is_told_no_expression(
    tmp_path,
):
    """Flux Fill encodes its input image (and masked image) with the VAE in the call: told the latent-output call
    first (the VAE as it is), then the float32 VAE and the decode. Followed step by step in the order the message
    says them (the steps found in its text), it gives a finite image (the advice before said the float32 VAE first:
    the call then raised in its float16 encode). Kontext's size is its input image's, resized: told the generic
    decode, no expression with a height and width it does not take."""
    call = {**zoo_call("flux_fill"), "num_inference_steps": 1}
    pipe = tiny_pipeline("flux_fill", dtype=torch.float16)
    _, errors = watched(pipe, tmp_path / "fill", {**call, "output_type": "pt"})
    assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", "vae", CONV)]
    message = errors[0].message
    assert message == f"vae.{CONV} produced NaN/Inf from finite inputs ({FLUX_ADVICE})."
    steps = {  # each step of the advice, where its text says it
        message.index('output_type="latent"'): "latents",
        message.index("then pipe.vae.to(torch.float32)"): "float32",
        message.index(f"({FLUX_DECODE}"): "decode",
    }
    latents = image = None
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16), torch.no_grad():
        for _, step in sorted(steps.items()):
            if step == "latents":
                out = pipe(**{**call, "output_type": "latent"}, generator=torch.Generator().manual_seed(0))
                latents = out.images
            elif step == "float32":
                pipe.vae.to(torch.float32)
            else:
                named = {"pipe": pipe, "latents": latents, "height": call["height"], "width": call["width"]}
                image = eval(FLUX_DECODE, named)
    assert image.dtype == torch.float32 and image.shape == (1, 3, 16, 16) and torch.isfinite(image).all()
    kontext = tiny_pipeline("flux_kontext", dtype=torch.float16)
    assert vae_details.cast_details(kontext) == {"casts_latents": False}
    _, errors = watched(kontext, tmp_path / "kontext", {**zoo_call("flux_kontext"), "num_inference_steps": 1})
    assert errors[0].message == (
        f"vae.{CONV} produced NaN/Inf from finite inputs (this pipeline hands the VAE its latents uncast, so "
        'pipe.vae.to(torch.float32) alone may fail on them: call the pipeline with output_type="latent" (its VAE as '
        "it is), then pipe.vae.to(torch.float32) and decode them in float32 (as its call does before its vae.decode, "
        "then .float()), or run the whole pipeline in bfloat16 (pipe.to(torch.bfloat16)))."
    )


def test_z_image_img2imgs_advice_followed_the_float32_vae_fails_in_its_encode_then_bfloat16_matches_float32(tmp_path):
    """Z-Image img2img casts its latents to the VAE's dtype and reaches ``self.vae.encode`` (its input image):
    told the float32 VAE, and bfloat16 where its encode then fails. Followed in that order, the same fault planted:
    the float32 VAE raises in the encode of the float16 image, and the whole pipeline in bfloat16 gives a finite
    image equal to a float32 pipeline's within 3e-2 (measured 1.3e-2: bfloat16's rounding)."""
    from diffusion_debug.testing.zoo_recent import ZOO_CALLS

    call = {**ZOO_CALLS["z_image_img2img"][0](), "num_inference_steps": 1, "output_type": "np"}
    pipe = tiny_pipeline("z_image_img2img", dtype=torch.float16)
    _, errors = watched(pipe, tmp_path, call)
    assert [(a.kind, a.component, a.module, a.details["input_image"]) for a in errors] == [
        ("nonfinite", "vae", CONV, True)
    ]
    assert errors[0].message == (
        f"vae.{CONV} produced NaN/Inf from finite inputs (keep the VAE in float32: pipe.vae.to(torch.float32) (this "
        "pipeline casts its latents to the VAE's dtype; where its encode of the input image or video then fails on "
        "float16, run the whole pipeline in bfloat16 (pipe.to(torch.bfloat16))))."
    )
    with plant(pipe.vae.get_submodule(CONV), 0, past_fp16), torch.no_grad():
        pipe.vae.to(torch.float32)  # the advice, followed
        with pytest.raises(RuntimeError, match="Half"):  # its encode: the float16 image into float32 weights
            pipe(**call, generator=torch.Generator().manual_seed(0))
        pipe.to(torch.bfloat16)
        images = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    reference = tiny_pipeline("z_image_img2img")
    with plant(reference.vae.get_submodule(CONV), 0, past_fp16), torch.no_grad():
        reference = reference(**call, generator=torch.Generator().manual_seed(0)).images
    assert np.isfinite(images).all() and np.abs(images - reference).max() < 3e-2


MOCHI_DECODE = (
    "pipe.vae.decode(latents.float() * torch.tensor(pipe.vae.config.latents_std, device=latents.device).view(1, -1, "
    "1, 1, 1) / pipe.vae.config.scaling_factor + torch.tensor(pipe.vae.config.latents_mean, device=latents.device)"
    ".view(1, -1, 1, 1, 1)).sample"
)


def channel_past_fp16(out):
    """The output's first channel past float16's max (7e4): Inf in float16, finite in float32."""
    wide = out.float().clone()
    wide[:, 0] = 7e4
    return wide.to(out.dtype)


def test_mochis_vae_is_told_its_calls_denormalization_which_followed_matches_a_float32_pipeline(tmp_path):
    """Mochi hands its VAE float16 latents de-normalized by the VAE config's mean and std: it was told the generic
    "as its call does before its vae.decode". Told that de-normalization as an expression, which followed as written
    (the latent output with the VAE as it is, then the float32 VAE), the same fault planted (a channel past float16's
    max: scaling the whole output saturates the frames, which then differ by the transformer's rounding's sign flips),
    decodes finite frames equal to a float32 pipeline's within 1e-2 (measured 7e-4)."""
    conv = "decoder.up_blocks.2.resnets.0.conv1.conv"
    call = {**zoo_call("mochi"), "num_inference_steps": 2}  # (its schedule divides by half the steps)
    pipe = tiny_pipeline("mochi", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
    try:
        with plant(pipe.vae.get_submodule(conv), 0, channel_past_fp16), dbg:
            frames = pipe(**call, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
        errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    finally:
        dbg.close()
    assert frames.isnan().all()
    assert [(a.kind, a.component, a.module, a.details["latent_decode"]) for a in errors] == [
        ("nonfinite", "vae", conv, MOCHI_DECODE)
    ]
    assert f"decode them in float32 ({MOCHI_DECODE}), or run the whole pipeline in bfloat16" in errors[0].message
    with plant(pipe.vae.get_submodule(conv), 0, channel_past_fp16), torch.no_grad():  # the advice, followed
        latents = pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
        pipe.vae.to(torch.float32)
        video = eval(MOCHI_DECODE, {"pipe": pipe, "latents": latents, "torch": torch})
    video = pipe.video_processor.postprocess_video(video, output_type="pt")
    reference = tiny_pipeline("mochi")
    with plant(reference.vae.get_submodule(conv), 0, channel_past_fp16), torch.no_grad():
        reference = reference(**call, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert (latents.dtype, video.dtype) == (torch.float16, torch.float32) and reference.std() > 0.05
    assert video.isfinite().all() and (video - reference).abs().max() < 1e-2


class _CastingCogVideoX(diffusers.CogVideoXPipeline):
    """CogVideoX's call, its ``decode_latents`` overridden to cast the latents to the VAE's dtype."""

    def decode_latents(self, latents):
        return self.vae.decode(latents.to(self.vae.dtype)).sample


def test_a_subclass_that_keeps_the_call_is_read_through_its_own_override_of_the_method_that_decodes():
    """The call is the parent's, the method it hands its latents is the subclass's: read there (before: the
    parent's, not cast, whatever the override does)."""
    assert vae_details.call_facts(diffusers.CogVideoXPipeline).casts_latents is False
    assert vae_details.call_facts(_CastingCogVideoX).casts_latents is True


def _made_by_exec(base: type, method: str) -> type:
    """A subclass of ``base`` made by ``exec`` (as in a notebook cell), overriding ``method`` alone: no source."""
    space = {"base": base}
    exec(f"class Mine(base):\n    def {method}(self, *args, **kwargs):\n        return 0\n", space)
    return space["Mine"]


def test_a_method_whose_source_cannot_be_read_leaves_the_cast_reading_and_the_advice_as_its_parents():
    """A subclass made by ``exec`` that overrides a method the call calls: that method reads as no source, the rest
    as the parent's (before: inspect.getsource's OSError, shared with the encode reading's, made the cast not known,
    and Flux's advice lost its latent-output recipe); one that overrides where the encode is reads as no encode."""
    flux = _made_by_exec(diffusers.FluxPipeline, "_get_t5_prompt_embeds")
    wan = _made_by_exec(diffusers.WanPipeline, "_get_t5_prompt_embeds")
    i2v = _made_by_exec(diffusers.WanImageToVideoPipeline, "prepare_latents")
    assert vae_details.call_facts(flux) == vae_details.call_facts(diffusers.FluxPipeline)
    assert vae_details.call_facts(flux)[:2] == (False, False)
    assert vae_details.call_facts(wan) == vae_details.call_facts(diffusers.WanPipeline)
    assert vae_details.call_facts(wan)[:2] == (False, True)
    facts = vae_details.call_facts(diffusers.WanImageToVideoPipeline), vae_details.call_facts(i2v)
    assert [(fact.casts_latents, fact.input) for fact in facts] == [(True, True), (True, False)]


class _EncodeBase(diffusers.DiffusionPipeline):
    def prepare_latents(self, image):
        return self._prepare(image)

    def _prepare(self, image):
        return self._encode_vae_image(image)

    def _encode_vae_image(self, image):
        return self.vae.encode(image).latent_dist.sample()


class _MetDeepFirst(_EncodeBase):
    """Its call reaches ``prepare_latents`` three calls deep first (through ``outer`` and ``middle``), where the
    encode two calls further is past the reading's depth, then directly, where it is within it."""

    def outer(self):
        return self.middle()

    def middle(self):
        return self.prepare_latents(None)

    def __call__(self, image=None):
        self.outer()
        latents = self.prepare_latents(image)
        return self.vae.decode(latents.to(self.vae.dtype)).sample


def test_a_method_met_deep_first_is_read_again_where_the_call_meets_it_shallower():
    """``prepare_latents`` met first at the depth where its own calls are not followed, then in the call itself:
    read again there, it reaches the encode (before: read once, at the first depth, the encode missed)."""
    facts = vae_details.call_facts(_MetDeepFirst)
    assert (facts.casts_latents, facts.input) == (True, True)
    assert vae_details.reaches_encode(_MetDeepFirst) is True


def test_sd_img2imgs_advice_falls_back_to_the_latent_output_with_the_vae_as_it_is_then_decodes_finite():
    """SD 1.5 img2img reads no ``force_upcast`` and encodes its input image in float16: the float32 VAE first
    raises in that encode (the fallback before said to call with output_type="latent" after it, which raised the
    same); the advice's route, the latent output with the VAE as it is and then the float32 VAE, decodes finite."""
    from diffusion_helpers import SD_FP16_VAE

    assert SD_FP16_VAE.index('output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32)') > 0
    call = {**zoo_call("img2img"), "num_inference_steps": 2}
    pipe = tiny_pipeline("img2img", dtype=torch.float16)
    assert vae_details.upcast_details(pipe) == {"reads_force_upcast": False}
    with torch.no_grad():
        latents = pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)).images
        pipe.vae.to(torch.float32)
        with pytest.raises(RuntimeError):  # the float32 VAE first: the float16 input image into float32 weights
            pipe(**call, generator=torch.Generator().manual_seed(0))
        image = pipe.vae.decode(latents.float() / pipe.vae.config.scaling_factor).sample
    assert image.dtype == torch.float32 and torch.isfinite(image).all()
