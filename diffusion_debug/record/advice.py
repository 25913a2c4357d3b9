"""The advice a message about values near or past their dtype's largest ends with, chosen by the dtype the module
ran in: a half dtype's overflow (a wider dtype, the VAE's own fixes), bfloat16's or float32's (no wider dtype helps:
the values are wrong), and the ``torch.autocast`` a module of another dtype ran under (what autocast computes in is
what to change, not the weights' dtype). Pure: strings from an anomaly's details (``record/inference_messages.py``).
"""

from __future__ import annotations

from typing import Any

FP16_FIX_VAE = "madebyollin/sdxl-vae-fp16-fix"


def names_autocast(dtype: str | None, autocast: str | None) -> bool:
    """Whether :func:`vae_advice` of a VAE whose weights are ``dtype`` under an ``autocast`` to that dtype name opens
    with the autocast it ran under: one of another dtype than its weights' (what it computes in is the autocast's),
    or bfloat16's, whose range is float32's (a float32 VAE would compute in bfloat16 under it too).

    >>> names_autocast("float32", "float16"), names_autocast("bfloat16", "bfloat16")
    (True, True)
    >>> names_autocast("float16", "float16"), names_autocast(None, "float16"), names_autocast("float16", None)
    (False, False, False)
    """
    return dtype is not None and autocast is not None and (autocast != dtype or autocast == "bfloat16")


def vae_advice(
    component: str = "vae",
    sd_vae: bool = False,
    dtype: str | None = None,
    autocast: str | None = None,
    *,
    upcast: bool | None = None,
    video: bool = False,
    sdxl: bool = False,
    casts: bool | None = None,
    decode: str | None = None,
    encodes: bool = False,
    subject: str = "it",
    check: str = "its weights and inputs",
    finite: str = "they",
) -> str:
    """How to keep the VAE-role ``component`` out of float16 overflow. ``force_upcast`` belongs to the AutoencoderKL
    of Stable Diffusion and SDXL (``sd_vae``, read in ``details["sd_vae"]``) in a pipeline whose ``__call__`` reads
    it (``upcast``: ``details["reads_force_upcast"]``, :func:`~diffusion_debug.diffusion.components.vae_details.\
reads_force_upcast`: SDXL's family, not SD 1.5's ``StableDiffusionPipeline``; None: not known, both said), as does
    the fp16-fixed VAE (offered for SDXL's VAE alone, ``sdxl``: ``details["sdxl_vae"]``; SD 1.5's and SD x4
    upscale's are other latent spaces); where it is not read, the float32 decode is the
    user's own (``pipe.vae.to(torch.float32)``: alone where the call casts its latents, ``casts``, as PixArt-Sigma's
    does, the fp16-fixed VAE offered too; it may fail on float16 latents the pipeline does not cast: then
    the latents decoded in float32; ``video``: with the pipeline's ``decode_latents``, 5-D video latents being no
    ``vae.decode``'s). Another VAE (Flux's, a video VAE such as ``AutoencoderKLWan``) is kept in float32 as the
    pipeline's call takes it (``casts``: ``details["casts_latents"]``, :func:`~diffusion_debug.diffusion.components.\
vae_details.cast_details`): ``pipe.vae.to(torch.float32)`` alone where the call casts its latents to the VAE's dtype
    (Wan's, PixArt-Sigma's; ``encodes``: ``details["input_image"]``, a call that takes an input image, whose encode
    is not read: the whole pipeline in bfloat16 where it fails); where it hands them uncast (Flux's, SD3's: the
    float32 VAE may raise on them), the latent output of a call with the VAE as it is (the float32 VAE before the
    call raises in the float16 encode of an image-conditioned one's input: Flux Fill's, Kontext's, SD3 img2img's),
    then decoded in float32 by the user (``decode``: ``details["latent_decode"]``, the expression for that pipeline,
    where one says it) or the whole pipeline in bfloat16; not known (None), in float32 or bfloat16,
    and one not called ``vae`` (Kandinsky's ``movq``) is named as it is. One that ran in float32 (SDXL's fp16 VAE under
    ``force_upcast`` too) or bfloat16 (float32's range: no wider dtype holds more) is told so: no dtype advice fits it;
    but under a ``torch.autocast`` of another dtype than its weights' (``autocast``: the dtype it computed in,
    :func:`names_autocast`) it did not: the autocast is said, and float16's advice holds where its weights are finite,
    whatever their dtype (``force_upcast`` is said where an SD VAE's float32 weights may be its doing). ``subject``
    (what ran), ``check`` (what to check where the dtype is no cause) and ``finite`` (what of it must be finite): a
    flat image's message says them its own way.

    >>> vae_advice("vae")
    'keep the VAE in float32 or bfloat16: pipe.vae.to(torch.float32)'
    >>> vae_advice("vae", casts=True)
    "keep the VAE in float32: pipe.vae.to(torch.float32) (this pipeline casts its latents to the VAE's dtype)"
    >>> vae_advice("vae", casts=True, encodes=True).split("; ")[1]
    'where its encode of the input image or video then fails on float16, run the whole pipeline in bfloat16 \
(pipe.to(torch.bfloat16)))'
    >>> scaled = "pipe.vae.decode((latents / pipe.vae.config.scaling_factor).float())"
    >>> print(vae_advice("vae", casts=False, decode=scaled))
    this pipeline hands the VAE its latents uncast, so pipe.vae.to(torch.float32) alone may fail on them: call the \
pipeline with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and decode them in float32 \
(pipe.vae.decode((latents / pipe.vae.config.scaling_factor).float())), or run the whole pipeline in bfloat16 \
(pipe.to(torch.bfloat16))
    >>> vae_advice("vae", True, upcast=False, casts=True)  # PixArt-Sigma's SD VAE: no force_upcast read, cast
    "keep the VAE in float32: pipe.vae.to(torch.float32) (this pipeline casts its latents to the VAE's dtype)"
    >>> vae_advice("vae", True, upcast=True, sdxl=True)
    'keep the VAE in float32 for the decode (vae.config.force_upcast=True: this pipeline then upcasts the VAE and \
the latents), or use an fp16-fixed VAE such as madebyollin/sdxl-vae-fp16-fix'
    >>> vae_advice("vae", True, upcast=True)  # SD x4 upscale's: its VAE has no fp16-fixed version
    'keep the VAE in float32 for the decode (vae.config.force_upcast=True: this pipeline then upcasts the VAE and \
the latents)'
    >>> print(vae_advice("vae", True, upcast=False))
    this pipeline does not read vae.config.force_upcast (SDXL's do): pipe.vae.to(torch.float32); where the call \
then fails in the VAE (its float16 latents or input image), instead call it with output_type="latent" (its VAE as \
it is), then pipe.vae.to(torch.float32) and decode the latents cast to float32
    >>> print(vae_advice("vae", True))
    keep the VAE in float32 for the decode: vae.config.force_upcast=True where the pipeline reads it (SDXL's do), \
otherwise pipe.vae.to(torch.float32); where the call then fails in the VAE (its float16 latents or input image), \
instead call it with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and decode the \
latents cast to float32
    >>> vae_advice("vae", True, dtype="bfloat16")
    "it ran in bfloat16, whose range is float32's, so this is no overflow of a narrow dtype: check its weights and \
inputs"
    >>> vae_advice("movq", dtype="float16")
    'keep movq in float32 (pipe.movq.to(torch.float32))'
    >>> vae_advice("movq", dtype="float32")
    'it ran in float32, so this is no half-precision overflow: check its weights and inputs'
    >>> vae_advice("vae", True, dtype="bfloat16", autocast="float16")
    'it ran under float16 autocast (its weights are bfloat16, so their dtype does not change what it computes in): \
check its weights and inputs; if they are finite, autocast to bfloat16 instead (torch.autocast(..., \
dtype=torch.bfloat16)) or run vae outside autocast'
    >>> vae_advice("vae", dtype="bfloat16", autocast="bfloat16")
    "it ran under bfloat16 autocast (its weights are bfloat16 too), whose range is float32's, so this is no overflow \
of a narrow dtype: check its weights and inputs"

    Under float16 autocast in its own float16, upcasting it alone would not change what it computes in:

    >>> vae_advice("movq", dtype="float16", autocast="float16")
    'keep movq in float32 (pipe.movq.to(torch.float32)), decoded outside the float16 autocast (which computes a \
float32 movq in float16 too)'
    """
    if names_autocast(dtype, autocast):  # (a NaN weight's, or no module's output read: no autocast named)
        weights = f"its weights are {dtype}" + (" too" if dtype == autocast else "")
        if autocast != "float16":
            return (
                f"{subject} ran under {autocast} autocast ({weights}), whose range is float32's, so this is no "
                f"overflow of a narrow dtype: check {check}"
            )
        read = "neither their dtype nor force_upcast changes" if sd_vae and upcast and dtype == "float32" else None
        return (
            f"{subject} ran under float16 autocast ({weights}, so {read or 'their dtype does not change'} what it "
            f"computes in): check {check}; if {finite} are finite, autocast to bfloat16 instead "
            f"(torch.autocast(..., dtype=torch.bfloat16)) or run {component} outside autocast"
        )
    if dtype == "float32":
        return f"{subject} ran in float32, so this is no half-precision overflow: check {check}"
    if dtype == "bfloat16":  # (no autocast: one is named above) float32 holds no more than bfloat16
        wide = "whose range is float32's, so this is no overflow of a narrow dtype"
        return f"{subject} ran in bfloat16, {wide}: check {check}"
    outside, named = "", "VAE" if component == "vae" else component
    if autocast == "float16":  # its weights float16 too: upcast alone, it would still compute in float16
        outside = f", decoded outside the float16 autocast (which computes a float32 {named} in float16 too)"
    if component != "vae":
        return f"keep {component} in float32 (pipe.{component}.to(torch.float32)){outside}"
    bf16 = "run the whole pipeline in bfloat16 (pipe.to(torch.bfloat16))"
    if casts and (not sd_vae or upcast is False):  # (an SD VAE's too where no force_upcast is read: PixArt-Sigma's)
        cast = "this pipeline casts its latents to the VAE's dtype"
        if encodes:  # (its encode of the input image or video not read: it may hand the float32 VAE a float16 image)
            cast += f"; where its encode of the input image or video then fails on float16, {bf16}"
        fixed = f", or use an fp16-fixed VAE such as {FP16_FIX_VAE}" if sdxl else ""
        return f"keep the VAE in float32: pipe.vae.to(torch.float32) ({cast}){outside}{fixed}"
    if not sd_vae and casts is False:
        how = f"({decode})" if decode else "(as its call does before its vae.decode, then .float())"
        if "height" in (decode or ""):
            how = f"({decode}; height, width: the call's, by default pipe.default_sample_size * pipe.vae_scale_factor)"
        return (  # (the VAE cast after the call: one that encodes an input image encodes it in float16, as before)
            "this pipeline hands the VAE its latents uncast, so pipe.vae.to(torch.float32) alone may fail on them: "
            'call the pipeline with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and '
            f"decode them in float32 {how}{outside}, or {bf16}"
        )
    if not sd_vae:
        return f"keep the VAE in float32 or bfloat16: pipe.vae.to(torch.float32){outside}"
    if upcast:
        fixed = f", or use an fp16-fixed VAE such as {FP16_FIX_VAE}" if sdxl else ""
        return (
            "keep the VAE in float32 for the decode (vae.config.force_upcast=True: this pipeline then upcasts the VAE "
            f"and the latents){outside}{fixed}"
        )
    decode = "them with pipe.decode_latents(latents.float())" if video else "the latents cast to float32"
    own = (  # the upcast SDXL's pipelines make, made by the user (SD 1.5's pipeline hands float16 latents to the VAE)
        "pipe.vae.to(torch.float32); where the call then fails in the VAE (its float16 latents or input image), "
        f'instead call it with output_type="latent" (its VAE as it is), then pipe.vae.to(torch.float32) and decode '
        f"{decode}{outside}"
    )
    if upcast is False:  # SD 1.5's StableDiffusionPipeline and its kin
        return f"this pipeline does not read vae.config.force_upcast (SDXL's do): {own}"
    flag = "vae.config.force_upcast=True where the pipeline reads it (SDXL's do)"
    return f"keep the VAE in float32 for the decode: {flag}, otherwise {own}"


def upcast_of(details: dict[str, Any]) -> dict[str, Any]:
    """:func:`vae_advice`'s ``upcast``, ``video``, ``sdxl``, ``casts`` and ``decode``, read from an anomaly's details
    (not there: not known; not SDXL's)."""
    return {
        "upcast": details.get("reads_force_upcast"),
        "video": details.get("decode_latents", False),
        "sdxl": details.get("sdxl_vae", False),
        "casts": details.get("casts_latents"),
        "decode": details.get("latent_decode"),
        "encodes": details.get("input_image", False),
    }


def near_max_advice(where: str, details: dict[str, Any]) -> str:
    """What to do about values near their dtype's max that ``where`` (``component.module``) made, on which
    the next module overflowed (``details``: the ``nonfinite``'s ``dtype``, ``vae_role``, ``sd_vae``,
    ``vae_autocast``). bfloat16 holds float32's range, so no wider dtype helps there: the values are wrong, not the
    precision.

    >>> near_max_advice("unet.conv_out", {"dtype": "float16"})
    'run this component in bfloat16 or float32, or upcast this module'
    >>> near_max_advice("vae.decoder.conv_in", {"dtype": "bfloat16", "vae_role": True}).split(":")[0]
    "bfloat16 holds float32's range, so float32 overflows on these values too"

    Made under float16 autocast (``weights_dtype``, kept where the weights differ: :func:`overflow_advice`), the
    VAE's too: it is float32 already, and its weights' dtype does not change what autocast computes in.

    >>> near_max_advice("vae.decoder.conv_in", {"dtype": "float16", "weights_dtype": "float32", "vae_role": True})
    'it ran under float16 autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., \
dtype=torch.bfloat16)) or run vae.decoder.conv_in outside autocast'
    """
    dtype = details.get("dtype")
    if dtype == "float16" and details.get("weights_dtype"):  # float32 weights under float16 autocast
        return autocast_advice(where, details["weights_dtype"])
    if dtype in ("bfloat16", "float32"):
        wider = "bfloat16 holds float32's range, so float32 overflows on these values too"
        wider = wider if dtype == "bfloat16" else "no wider dtype holds them"
        return f"{wider}: check {where}'s weights and the scale of its inputs"
    if details.get("vae_role"):
        return _near_max_vae_advice(where, details)
    if dtype == "float16":
        return "run this component in bfloat16 or float32, or upcast this module"
    return "compute this component in bfloat16 or float32"


def overflow_advice(where: str, details: dict[str, Any]) -> str:
    """What to do about values ``where`` (``component.module``, or the component) made near the max of the
    dtype it ran in (``details``: the ``overflow_risk``'s ``dtype``, ``vae_role``, ``sd_vae``, ``vae_autocast``). A
    wider dtype holds fp16's values; bfloat16's largest value is float32's, so no dtype gives bf16's more room: their
    scale is what to change (as :func:`near_max_advice` says of a NaN/Inf made from them).

    >>> overflow_advice("unet.conv_out", {"dtype": "float16"})
    'run this component in bfloat16 or float32, or upcast this module'
    >>> overflow_advice("unet.conv_out", {"dtype": "bfloat16"}).split(":")[0]
    "bfloat16 holds float32's range, so float32 gives these values no more room"

    A float16 output of a module whose weights are not (``weights_dtype``, kept where they differ) ran under
    ``torch.autocast``: the component is float32 already, and its weights' dtype does not change what
    autocast computes in.

    >>> overflow_advice("unet.conv_out", {"dtype": "float16", "weights_dtype": "float32"}).split(":")[0]
    'it ran under float16 autocast (its weights are float32)'
    """
    if details.get("dtype") == "float16" and details.get("weights_dtype"):
        return autocast_advice(where, details["weights_dtype"])
    if details.get("dtype") == "bfloat16":
        return (
            "bfloat16 holds float32's range, so float32 gives these values no more room: "
            f"check {where}'s weights and the scale of its inputs"
        )
    if details.get("vae_role"):
        return _near_max_vae_advice(where, details)
    return "run this component in bfloat16 or float32, or upcast this module"


def _near_max_vae_advice(where: str, details: dict[str, Any]) -> str:
    """:func:`vae_advice` for the VAE-role module ``where`` whose output, in its weights' ``dtype``, came near the
    max: the autocast it ran under (``vae_autocast``) is said where it computed in that dtype (a float16 VAE's
    upcast alone would not leave float16 autocast), not where the module's output escaped it."""
    dtype, autocast = details.get("dtype"), details.get("vae_autocast")
    under = autocast if autocast == dtype else None
    return vae_advice(where.partition(".")[0], details.get("sd_vae", False), dtype, under, **upcast_of(details))


def autocast_advice(where: str, weights_dtype: str) -> str:
    """What to do about float16 values near the max that ``where`` made under float16 autocast, its weights being
    ``weights_dtype``: what autocast computes in is what to change (:func:`overflow_advice`, :func:`near_max_advice`).
    """
    return (
        f"it ran under float16 autocast (its weights are {weights_dtype}): autocast to bfloat16 instead "
        f"(torch.autocast(..., dtype=torch.bfloat16)) or run {where} outside autocast"
    )
