"""Every tiny pipeline kind of diffusion_debug.testing.zoo (ControlNet, img2img, inpaint, AnimateDiff,
Kandinsky 2.2 prior and decoder, PixArt-α with T5, DiT): bitwise identical output, steps recorded, a
NaN planted in a non-denoiser component or passed as an input named as the one error, policy raise
raising there, and a clean detach; the same for the newer kinds of diffusion_debug.testing.zoo_newer
(Flux Kontext, Fill and Control, Chroma, HunyuanVideo, Mochi, Wan image-to-video, the SDXL refiner)
and of diffusion_debug.testing.zoo_latest (Stable Cascade prior and decoder, SkyReels-V2 diffusion
forcing, Kandinsky 5, CogView4, Sana-Sprint, Z-Image, Allegro) and diffusion_debug.testing.zoo_extra
(Kandinsky 3, HunyuanVideo 1.5, Latte, a consistency model, VisualCloze), skipped where this diffusers
lacks the pipeline, and an Inf in their denoiser named at
its step. Then the latent layouts of Flux
(packed tokens, diffusion_debug.testing.flux), Stable Video Diffusion (5-D, frames before channels)
and Dance Diffusion (3-D audio; both diffusion_debug.testing.zoo_video_audio): the same invariants,
an Inf planted inside the denoiser named at its step, and an advanced run's previews and report
saved."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from diffusion_helpers import pipeline_hooks

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import (
    plant_nonfinite,
    tiny_pipeline,
    zoo_extra,
    zoo_latest,
    zoo_newer,
    zoo_recent,
    zoo_recent_video,
    zoo_video_audio,
)
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.flux import FLUX_CALL
from diffusion_debug.testing.zoo import ZOO_CALLS as OLDER_CALLS
from diffusion_debug.testing.zoo import ZOO_KINDS as OLDER_KINDS

FAMILIES = (zoo_newer, zoo_latest, zoo_extra, zoo_recent, zoo_recent_video)
ZOO_CALLS = {**OLDER_CALLS, **{kind: c for family in FAMILIES for kind, c in family.ZOO_CALLS.items()}}
ZOO_KINDS = OLDER_KINDS + tuple(kind for family in FAMILIES for kind in family.ZOO_KINDS)
# a newer kind is skipped where this diffusers (the floor) lacks its pipeline
ZOO_PARAMS = [
    pytest.param(kind, marks=pytest.mark.skipif(bool(kind_missing(kind)), reason=str(kind_missing(kind))))
    for kind in ZOO_KINDS
]

# the latent layouts other than (B, C, H, W): kind -> (call kwargs, denoiser attribute)
CALLS = {"flux": FLUX_CALL, **zoo_video_audio.CALLS}
KINDS = tuple(CALLS)

# kind -> (component, module) to plant a NaN in (not the denoiser); the input to poison
PLANT = {
    "img2img": ("vae", "encoder.down_blocks.0.resnets.0.conv1"),
    "inpaint": ("vae", "decoder.up_blocks.0.resnets.0.conv2"),
    "controlnet": ("controlnet", "controlnet_cond_embedding.conv_in"),
    "animatediff": ("text_encoder", "encoder.layers.0.mlp.fc1"),
    "kandinsky_prior": ("image_encoder", "visual_projection"),
    "kandinsky_decoder": ("movq", "decoder.conv_in"),
    "pixart": ("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wo"),
    "dit": ("vae", "decoder.conv_in"),
    "flux_kontext": ("vae", "encoder.conv_in"),  # the reference image's encoding
    "flux_fill": ("vae", "encoder.conv_in"),  # the masked image's encoding
    "flux_control": ("vae", "encoder.conv_in"),  # the control image's encoding
    "chroma": ("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wo"),
    "hunyuan_video": ("text_encoder_2", "encoder.layers.0.mlp.fc1"),  # CLIP, the pooled embedding
    "mochi": ("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wo"),
    "wan_i2v": ("image_encoder", "encoder.layers.0.mlp.fc1"),
    "sdxl_refiner": ("text_encoder_2", "encoder.layers.0.mlp.fc1"),
    "stable_cascade_prior": ("text_encoder", "encoder.layers.0.mlp.fc1"),
    "stable_cascade": ("vqgan", "up_blocks.1.depthwise.0"),  # Paella's decode: no `decoder` module of its own
    "skyreels_v2_df": ("vae", "decoder.conv_in"),
    "kandinsky5": ("text_encoder_2", "encoder.layers.0.mlp.fc1"),  # CLIP, the pooled embedding
    "cogview4": ("text_encoder", "layers.0.mlp.down_proj"),
    "sana_sprint": ("text_encoder", "layers.0.mlp.down_proj"),
    "z_image": ("text_encoder", "layers.0.mlp.down_proj"),
    "allegro": ("vae", "decoder.conv_in"),  # its tiled decode
    "kandinsky3": ("movq", "decoder.conv_in"),
    "hunyuan_video15": ("vae", "decoder.conv_in"),
    "sdxl_pag": ("text_encoder_2", "encoder.layers.0.mlp.fc1"),
    "sdxl_controlnet_union": ("controlnet", "controlnet_cond_embedding.conv_in"),
    "ltx": ("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wo"),
    "wan_vace": ("vae", "encoder.conv_in"),  # the control video's encoding
    "flux2_klein": ("text_encoder", "layers.0.mlp.down_proj"),
    "bria": ("vae", "decoder.conv_in"),
    "marigold_depth": ("vae", "encoder.conv_in"),  # the image's encoding
    "stable_audio": ("projection_model", "start_number_conditioner.time_positional_embedding.1"),
    **dict.fromkeys(["ltx_i2v", "ltx_condition", "z_image_img2img"], ("vae", "encoder.conv_in")),  # the image's
    "hidream": ("text_encoder_4", "layers.0.mlp.down_proj"),  # Llama: layers 0 and 1 read by the transformer
    "lumina": ("text_encoder", "layers.0.mlp.down_proj"),
    "chronoedit": ("image_encoder", "encoder.layers.0.mlp.fc1"),
    "sana_video": ("text_encoder", "layers.0.mlp.down_proj"),
    "hunyuan_image21": ("vae", "decoder.conv_in"),
    "latte": ("text_encoder", "encoder.block.0.layer.1.DenseReluDense.wo"),
    "visualcloze": ("vae", "encoder.conv_in"),  # the in-context grid's encoding
}
ONLY_A_DENOISER = {"consistency"}  # a pixel-space UNet alone: no other component to plant a NaN in
LATENTS = {
    "inpaint": (1, 4, 8, 8),
    "animatediff": (1, 4, 2, 8, 8),
    "kandinsky_prior": (1, 32),
    "pixart": (1, 4, 8, 8),
    "chroma": (1, 64, 4),  # packed 2x2: 16x16 latents of 1 channel
    "hunyuan_video": (1, 4, 2, 2, 2),  # 5 frames -> 2 latent frames of 2x2
    "mochi": (1, 12, 2, 2, 2),  # 7 frames -> 2 latent frames of 2x2
    "wan_i2v": (1, 16, 2, 2, 2),
    "stable_cascade_prior": (1, 16, 3, 3),  # 128x128 at the resolution multiple 42.67
    "kandinsky5": (1, 2, 4, 4, 4),  # channels last: 5 frames -> 2 latent frames of 4x4, 4 channels
    "cogview4": (1, 4, 16, 16),
    "sana_sprint": (1, 4, 16, 16),
    "z_image": (1, 16, 16, 16),
    "allegro": (1, 4, 6, 2, 2),  # 24 frames -> 6 latent frames of 2x2
    "kandinsky3": (1, 4, 8, 8),
    "hunyuan_video15": (1, 4, 5, 4, 4),  # 9 frames -> 5 latent frames of 4x4
    "sdxl_pag": (1, 4, 8, 8),
    "sdxl_controlnet_union": (1, 4, 8, 8),
    "ltx": (1, 192, 8),  # packed: 9 frames -> 3 latent frames of 8x8, 8 channels
    "wan_vace": (1, 16, 2, 2, 2),
    "flux2_klein": (1, 4, 8, 8),  # packed by the pipeline: 8x8 latents of 4 channels
    "bria": (1, 64, 16),  # packed 2x2: 16x16 latents of 4 channels
    "hidream": (1, 4, 16, 16),
    "lumina": (1, 4, 16, 16),
    "sana_video": (1, 16, 2, 4, 4),  # 5 frames -> 2 latent frames of 4x4
    "hunyuan_image21": (1, 4, 2, 2),
    "stable_audio": (1, 3, 4),
    "latte": (1, 4, 2, 8, 8),
    "consistency": (1, 3, 8, 8),
}
# the motion adapter's layers live inside the UNet; Wan image-to-video is given prompt embeddings
UNCALLED = {"animatediff": ["motion_adapter"], "wan_i2v": ["text_encoder"], "skyreels_v2_df": ["text_encoder"]}
UNCALLED["hunyuan_video15"] = ["text_encoder_2"]  # its ByT5 encodes text in quotes only
UNCALLED["wan_vace"] = UNCALLED["chronoedit"] = ["text_encoder"]  # given prompt embeddings, as Wan image-to-video
UNCALLED["marigold_depth"] = ["text_encoder"]  # the empty prompt's embedding is kept from the plain call
UNCALLED["hunyuan_image21"] = ["text_encoder_2"]  # its ByT5 encodes text in quotes only
POISON = {
    "img2img": "image",
    "inpaint": "latents",
    "controlnet": "image",
    "animatediff": "latents",
    "kandinsky_prior": "latents",
    "kandinsky_decoder": "image_embeds",
    "pixart": "latents",
    "dit": "guidance_scale",
    "flux_kontext": "image",
    "flux_fill": "image",
    "flux_control": "control_image",
    "chroma": "latents",
    "hunyuan_video": "latents",
    "mochi": "latents",
    "wan_i2v": "image",
    "sdxl_refiner": "image",
    "stable_cascade_prior": "latents",
    "stable_cascade": "image_embeddings",
    "skyreels_v2_df": "prompt_embeds",  # latents passed in make its prepare_latents raise, plain too
    "kandinsky5": "latents",
    "cogview4": "latents",
    "sana_sprint": "latents",
    "z_image": "latents",
    "allegro": "latents",
    "kandinsky3": "latents",
    "hunyuan_video15": "latents",
    **dict.fromkeys(["sdxl_pag", "sdxl_controlnet_union", "ltx", "wan_vace", "flux2_klein", "bria"], "latents"),
    "stable_audio": "latents",
    "hidream": "latents",
    "lumina": "latents",
    "chronoedit": "prompt_embeds",
    "sana_video": "latents",
    "hunyuan_image21": "latents",
    **dict.fromkeys(["latte", "consistency"], "latents"),
    **dict.fromkeys(["marigold_depth", "ltx_i2v", "ltx_condition", "z_image_img2img"], "image"),
}
# the poisoned input the pipeline itself raises on before any component receives it (transformers' CLIP
# image processor: a NaN cannot be converted to uint8): the user's error goes on, the input is recorded
RAISES = {"wan_i2v": ValueError}


@pytest.fixture(scope="module")
def zoo():
    return {kind: tiny_pipeline(kind) for kind in ZOO_KINDS if not kind_missing(kind)}


def cfg(tmp_path, **kwargs):
    kwargs.setdefault("log_level", "error")
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def call(pipe, kind, **extra):
    kwargs = {**ZOO_CALLS[kind][0](), **extra}
    out = pipe(**kwargs, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")
    return torch.as_tensor(out[0])  # diffusers < 0.33's DiT returns numpy whatever output_type says


def full_name(component: torch.nn.Module, module: str) -> str:
    # transformers models nest their layers differently across versions: match the suffix
    return next(n for n, _ in component.named_modules() if n == module or n.endswith("." + module))


def errors(report):
    return [a for a in report.anomalies if a.severity == "error"]


@pytest.mark.parametrize("kind", ZOO_PARAMS)
def test_zoo_identical_output_steps_and_clean_detach(zoo, tmp_path, kind):
    pipe = zoo[kind]
    plain = call(pipe, kind)
    # counted after a first call: transformers >= 5 hooks an encoder's layers itself on its first call
    # with output_hidden_states (SDXL's text_encoder_2, HunyuanVideo's CLIP, Wan's image encoder)
    before = pipeline_hooks(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = call(pipe, kind)
    assert pipeline_hooks(pipe) == before
    assert torch.equal(plain, watched)
    report = dbg.report()
    assert [row["step"] for row in report.steps] == [0, 1]
    assert not errors(report), [a.to_dict() for a in report.anomalies]
    # 2 steps with leading spacing on a discrete scheduler is a true warning; nothing else is
    rules = {a.details.get("rule") for a in report.anomalies if a.kind == "scheduler_config"}
    assert rules <= {"leading_spacing_few_steps"}
    assert set(report.components) >= {name for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    uncalled = [n for n, e in report.components.items() if n != "scheduler" and not e.get("calls")]
    assert uncalled == UNCALLED.get(kind, []), uncalled
    dbg.close()


@pytest.mark.parametrize("kind", [p for p in ZOO_PARAMS if p.values[0] not in ONLY_A_DENOISER])
def test_zoo_planted_nan_in_a_component_is_the_one_error(zoo, tmp_path, kind):
    pipe = zoo[kind]
    component, module = PLANT[kind]
    module = full_name(getattr(pipe, component), module)
    with plant_nonfinite(getattr(pipe, component).get_submodule(module), value=float("nan")):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            call(pipe, kind)
        (error,) = errors(dbg.report())
        assert (error.kind, error.component, error.module) == ("nonfinite", component, module)
        others = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a is not error]
        assert all(error.where() in a.message for a in others), [a.message for a in others]
        dbg.close()
        with pytest.raises(DiffusionDebugError) as raised:
            with DiffusionModelDebugger(pipe, cfg(tmp_path / "raise", policy="raise")):
                call(pipe, kind)
    assert (raised.value.anomaly.component, raised.value.anomaly.module) == (component, module)


def poisoned(kind):
    name = POISON[kind]
    if name == "guidance_scale":
        return name, float("inf")
    value = ZOO_CALLS[kind][0]().get(name)
    value = torch.randn(LATENTS[kind], generator=torch.Generator().manual_seed(1)) if value is None else value.clone()
    value[(0,) * value.dim()] = float("nan")
    return name, value


# VisualCloze's images are PIL and its `latents` argument goes unread (the grid's own latents are noised)
NO_TENSOR_INPUT = {"visualcloze"}


@pytest.mark.parametrize("kind", [p for p in ZOO_PARAMS if p.values[0] not in NO_TENSOR_INPUT])
def test_zoo_nan_input_is_the_one_error(zoo, tmp_path, kind):
    pipe = zoo[kind]
    name, value = poisoned(kind)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with pytest.raises(RAISES[kind]) if kind in RAISES else contextlib.nullcontext():
        with dbg:
            call(pipe, kind, **{name: value})
    (error,) = errors(dbg.report())
    assert (error.kind, error.component, error.module) == ("nonfinite", "input", name), error.message
    dbg.close()
    strict = DiffusionModelDebugger(pipe, cfg(tmp_path / "raise", policy="raise"))
    # policy raise: DiffusionDebugError, unless the pipeline raised first (its error goes on, the input recorded)
    with pytest.raises(RAISES.get(kind, DiffusionDebugError)) as raised:
        with strict:
            call(pipe, kind, **{name: value})
    found = raised.value.anomaly if kind not in RAISES else errors(strict.report())[0]
    assert (found.component, found.module) == ("input", name)
    strict.close()


# a newer kind's denoiser module whose output reaches the denoiser's output, and the denoiser's
# calls a step (Chroma and Wan image-to-video: true CFG, a call for each half)
IN_DENOISER = {
    "flux_kontext": ("transformer", "proj_out", 1),  # the reference image's tokens are cut off after it
    "flux_fill": ("transformer", "proj_out", 1),
    "flux_control": ("transformer", "proj_out", 1),
    "chroma": ("transformer", "proj_out", 2),
    "hunyuan_video": ("transformer", "proj_out", 1),
    "mochi": ("transformer", "proj_out", 1),
    "wan_i2v": ("transformer", "proj_out", 2),
    "sdxl_refiner": ("unet", "up_blocks.1.resnets.0.conv2", 1),
    "stable_cascade_prior": ("prior", "clf.1", 1),  # CFG in one batch
    "stable_cascade": ("decoder", "clf.1", 1),
    "skyreels_v2_df": ("transformer", "proj_out", 2),
    "kandinsky5": ("transformer", "out_layer.out_layer", 2),
    "cogview4": ("transformer", "proj_out", 2),
    "sana_sprint": ("transformer", "proj_out", 1),
    "z_image": ("transformer", "all_final_layer.2-1.linear", 1),  # a list of latents in, a list out
    "allegro": ("transformer", "proj_out", 1),
    "kandinsky3": ("unet", "conv_out", 1),  # CFG in one batch
    "hunyuan_video15": ("transformer", "proj_out", 1),  # its guider's scale 1: no CFG
    "sdxl_pag": ("unet", "up_blocks.1.resnets.0.conv2", 1),  # CFG and PAG in one batch of 3
    "sdxl_controlnet_union": ("unet", "up_blocks.1.resnets.0.conv2", 1),
    "ltx": ("transformer", "proj_out", 1),
    "wan_vace": ("transformer", "proj_out", 2),
    "flux2_klein": ("transformer", "proj_out", 2),
    "bria": ("transformer", "proj_out", 1),
    "marigold_depth": ("unet", "up_blocks.1.resnets.0.conv2", 1),
    "stable_audio": ("transformer", "postprocess_conv", 1),  # proj_out's first token (the global one) is cut off
    "ltx_i2v": ("transformer", "proj_out", 1),
    "ltx_condition": ("transformer", "proj_out", 1),
    "z_image_img2img": ("transformer", "all_final_layer.2-1.linear", 1),
    "hidream": ("transformer", "final_layer.linear", 1),  # its blocks' mixture of experts before it
    "lumina": ("transformer", "layers.1.feed_forward.linear_2", 1),
    "chronoedit": ("transformer", "proj_out", 2),
    "sana_video": ("transformer", "proj_out", 1),
    "hunyuan_image21": ("transformer", "proj_out", 2),  # its guider: a call for each half
    "latte": ("transformer", "proj_out", 1),  # CFG in one batch
    "consistency": ("unet", "conv_out", 1),
    "visualcloze": ("transformer", "proj_out", 1),
}


@pytest.mark.parametrize("kind", [p for p in ZOO_PARAMS if p.values[0] in IN_DENOISER])
def test_newer_kinds_inf_in_the_denoiser_is_named_at_its_step(zoo, tmp_path, kind):
    pipe = zoo[kind]
    component, module, calls_a_step = IN_DENOISER[kind]
    with plant_nonfinite(getattr(pipe, component).get_submodule(module), from_call=calls_a_step):  # from step 1
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            call(pipe, kind)
    (error,) = errors(dbg.report())
    assert (error.kind, error.component, error.module) == ("nonfinite", component, module)
    assert error.step == 1
    dbg.close()


def test_dit_guidance_gap_is_measured(zoo, tmp_path):
    # DiT passes the doubled latents to scheduler.step: the halves are found from guidance_scale
    dbg = DiffusionModelDebugger(zoo["dit"], cfg(tmp_path))
    with dbg:
        call(zoo["dit"], "dit", guidance_scale=4.0)
    assert all(isinstance(row["guidance_gap"], float) and row["guidance_gap"] > 0 for row in dbg.report().steps)
    dbg.close()


def test_roles_come_from_the_pipeline(zoo):
    from diffusion_debug.diffusion.components.inventory import find_components

    roles = {kind: {c.name: c.role for c in find_components(zoo[kind])} for kind in ("controlnet", "kandinsky_prior")}
    assert roles["controlnet"] == {
        "unet": "denoiser",
        "vae": "vae",
        "text_encoder": "text_encoder",
        "controlnet": "control",
    }
    assert roles["kandinsky_prior"] == {
        "prior": "denoiser",
        "image_encoder": "image_encoder",
        "text_encoder": "text_encoder",
    }
    assert [c.role for c in find_components(zoo["kandinsky_decoder"])] == ["denoiser", "vae"]  # unet, movq


def test_a_pipeline_without_denoiser_is_watched_with_one_line(zoo, tmp_path, caplog):
    from diffusers import DiffusionPipeline

    class DecodeOnly(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)

        def __call__(self, latents):
            return self.vae.decode(latents).sample

    pipe = DecodeOnly(zoo["dit"].vae)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    with caplog.at_level("WARNING", logger="diffusion_debug"), dbg:
        latents = torch.zeros(1, 4, 8, 8)
        latents[0, 0, 0, 0] = float("nan")
        pipe(latents)
    assert [r.message for r in caplog.records if "has no denoiser" in r.message][:1]
    (error,) = errors(dbg.report())
    assert (error.component, error.module) == ("input", "latents")
    assert dbg.report().components["vae"]["calls"] == 1
    dbg.close()


# kind -> (a submodule of the denoiser to plant an Inf in, the latents' shape in a step row)
LAYOUTS = {
    "flux": ("transformer_blocks.0.ff.net.2", [1, 64, 4]),  # 16x16 latents of 1 channel, packed 2x2
    "svd": ("down_blocks.0.resnets.0.spatial_res_block.conv1", [1, 2, 4, 16, 16]),  # frames first
    "dance_diffusion": ("down_blocks.1.resnets.0.conv_1", [1, 2, 256]),
}


@pytest.fixture(scope="module")
def layouts():
    return {kind: tiny_pipeline(kind) for kind in KINDS}


def call_layout(pipe, kind, **extra):
    """The images (Flux), frames (SVD) or audio (Dance Diffusion, numpy) of a 2-step call."""
    out = pipe(**{**CALLS[kind][0](), **extra}, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    return torch.as_tensor(out[0])


def finite_stats(stats):
    return (stats["nan"], stats["posinf"], stats["neginf"]) == (0, 0, 0) and all(
        math.isfinite(stats[k]) for k in ("mean", "std", "absmax", "l2")
    )


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_identical_output_steps_and_clean_detach(layouts, tmp_path, kind):
    from diffusion_debug.diffusion.components.inventory import find_components

    pipe, denoiser = layouts[kind], CALLS[kind][1]
    before = pipeline_hooks(pipe)
    plain = call_layout(pipe, kind)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = call_layout(pipe, kind)
    assert pipeline_hooks(pipe) == before
    assert torch.equal(plain, watched) and plain.isfinite().all()
    report = dbg.report()
    assert report.anomalies == [], [a.to_dict() for a in report.anomalies]
    assert {c.name: c.role for c in find_components(pipe)}[denoiser] == "denoiser"
    modules = {name for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert {name: report.components[name]["calls"] > 0 for name in modules} == dict.fromkeys(modules, True)
    assert [row["step"] for row in report.steps] == [0, 1]
    assert [row["timestep"] for row in report.steps] == pytest.approx(pipe.scheduler.timesteps.tolist())
    for row in report.steps:
        assert row["denoiser_calls"] == 1
        assert row["latents"]["shape"] == LAYOUTS[kind][1]
        assert finite_stats(row["latents"]) and finite_stats(row["model_output"]), row
        assert row["latents"]["std"] > 0 and row["model_output"]["std"] > 0
    dbg.close()


@pytest.mark.parametrize("kind", ["flux", "svd"])
def test_layouts_last_step_row_is_the_returned_latents(layouts, tmp_path, kind):
    # output_type="latent" returns the latents the last scheduler step made, in their own layout
    dbg = DiffusionModelDebugger(layouts[kind], cfg(tmp_path))
    with dbg:
        latents = call_layout(layouts[kind], kind, output_type="latent")
    row = dbg.report().steps[-1]["latents"]
    assert row["shape"] == list(latents.shape) == LAYOUTS[kind][1]
    assert row["absmax"] == pytest.approx(latents.abs().max().item(), rel=1e-6)
    assert row["mean"] == pytest.approx(latents.mean().item(), rel=1e-4, abs=1e-6)
    assert row["l2"] == pytest.approx(latents.norm().item(), rel=1e-4)
    dbg.close()


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_inf_planted_in_the_denoiser_is_named_at_its_step(layouts, tmp_path, kind):
    pipe, denoiser = layouts[kind], CALLS[kind][1]
    module = LAYOUTS[kind][0]
    before = pipeline_hooks(pipe)
    with plant_nonfinite(getattr(pipe, denoiser).get_submodule(module), from_call=1):  # from step 1
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            call_layout(pipe, kind)
    assert pipeline_hooks(pipe) == before
    report = dbg.report()
    (error,) = errors(report)
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", denoiser, module, 1)
    assert error.timestep == pytest.approx(pipe.scheduler.timesteps[1].item())
    first, second = report.steps
    assert finite_stats(first["model_output"]) and not finite_stats(second["model_output"])
    dbg.close()


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_advanced_run_saves_previews_and_report(layouts, tmp_path, kind):
    from pathlib import Path

    from PIL import Image

    dbg = DiffusionModelDebugger(layouts[kind], cfg(tmp_path, level="advanced"))
    with dbg:
        call_layout(layouts[kind], kind)
    report = dbg.report()
    assert report.anomalies == [], [a.to_dict() for a in report.anomalies]  # no debugger_error
    run_dir = Path(report.save())
    assert "<html" in (run_dir / "report.html").read_text(encoding="utf-8").lower()
    with Image.open(run_dir / "previews" / "strip.png") as strip:
        assert strip.mode == "RGB" and min(strip.size) > 0
    with Image.open(run_dir / "previews" / "steps.gif") as gif:
        assert gif.n_frames == 2  # one preview per step
    dbg.close()


def test_skyreels_df_steps_are_its_first_frames_copy_once_a_round_and_nothing_is_left_registered(zoo, tmp_path):
    # SkyReels-V2's diffusion forcing steps a deep copy of its scheduler per latent frame, never its own:
    # the first copy stepped after the denoiser's calls is the round's step (a reused debugger: each call)
    from diffusion_debug.diffusion import pipeline_patches

    if "skyreels_v2_df" not in zoo:
        pytest.skip("this diffusers lacks SkyReels-V2")
    pipe = zoo["skyreels_v2_df"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for _ in range(2):
        with dbg:
            pipe(**ZOO_CALLS["skyreels_v2_df"][0](), num_inference_steps=3, output_type="pt")
        assert pipeline_patches._COPIES == {}
    steps = dbg.report().steps
    assert [(row["run"], row["step"], row["denoiser_calls"]) for row in steps] == [
        (run, step, 2) for run in (1, 2) for step in (0, 1, 2)
    ]
    assert [row["timestep"] for row in steps] == pytest.approx(pipe.scheduler.timesteps.tolist() * 2)
    assert not errors(dbg.report())
    dbg.close()


def test_skyreels_df_copies_are_counted_by_the_debugger_of_the_pipeline_that_steps_them(zoo, tmp_path):
    # two SkyReels pipelines (one scheduler class) each watched: the copies one steps are its debugger's
    # steps, whichever debugger attached last; the other's records nothing
    if "skyreels_v2_df" not in zoo:
        pytest.skip("this diffusers lacks SkyReels-V2")
    pipes = [zoo["skyreels_v2_df"], tiny_pipeline("skyreels_v2_df")]
    debuggers = [DiffusionModelDebugger(pipe, cfg(tmp_path / str(i))) for i, pipe in enumerate(pipes)]
    for runs in ([pipes[0]], [pipes[1]]):
        with debuggers[0], debuggers[1]:
            for pipe in runs:
                call(pipe, "skyreels_v2_df")
    assert [[row["step"] for row in d.report().steps] for d in debuggers] == [[0, 1], [0, 1]]
    for d in debuggers:
        d.close()
