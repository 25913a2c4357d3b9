"""More stacks people run, each watched against a twin pipeline making the same call unwatched
(bitwise equal output, no ``debugger_error``, no warning or error but the true ones) and with an
Inf planted in the denoiser named at its module and step: the call options (prompt embeddings
passed directly, several images per prompt, a list of generators, ``guidance_rescale``, numpy
and tuple outputs, a callback editing the latents and the prompt embeddings, SDXL's
``denoising_end``, IP-Adapter image embeddings, an IP-Adapter loaded between fp16 calls of one
attach); schedulers swapped in with ``from_config`` (second-order Heun and KDPM2, whose step
index is the loop index diffusers gives the callback, ancestral, EDM, multistep); the pipelines
InstructPix2Pix, the x4 upscaler, T2I-Adapter, Depth2Img, LCM, DeepFloyd IF, PixArt-Σ, Sana,
Lumina 2, AuraFlow and CogVideoX; and the guidance gap, measured only where a step's batch holds
an unconditional and a conditional half."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import kind_missing
from diffusion_debug.testing.zoo_more import CALLS

CONV = "up_blocks.1.resnets.0.conv2"
# true for random tiny weights: the latents of these stacks run far from the schedule's noise level
# (DDIM over the same model from t=999 does the same)
DIVERGE = ("latent_divergence",)
IP_EMBED = 16  # the IP-Adapter's image embedding width


def cfg(tmp_path, probes: str | None) -> DebugConfig:
    return DebugConfig(output_dir=str(tmp_path), log_level="error", **({"probes": probes} if probes else {}))


def output(result: Any) -> torch.Tensor:
    found = result[0] if isinstance(result, tuple) else getattr(result, "images", getattr(result, "frames", None))
    return torch.as_tensor(found)


def noisy(dbg, allowed: tuple[str, ...] = ()) -> list[tuple]:
    """What a clean run must not have: a ``debugger_error``, an error, or a warning other than the
    true scheduler warning (few steps with leading spacing) and ``allowed``."""
    return [
        (a.kind, a.component, a.module, a.step)
        for a in dbg.report().anomalies
        if a.kind == "debugger_error"
        or (a.severity in ("error", "warning") and a.kind not in ("scheduler_config", *allowed))
    ]


def errors(dbg) -> list[tuple]:
    return [(a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies if a.severity == "error"]


def watched_like_its_twin(
    tmp_path,
    make: Callable[[], Any],
    run: Callable[[Any], Any],
    *,
    planted: tuple[str, str, int],
    from_call: int | None = None,
    probes: str | None = None,
    allowed: tuple[str, ...] = (),
):
    """The watched pipeline's output is its unwatched twin's, bit for bit, the run is quiet, and an
    Inf planted in ``planted`` (component, module) from its call ``from_call`` (0-based; by default
    the step ``planted[2]``: one call a step) is named there at the step ``planted[2]``. Returns
    the debugger (closed) for further assertions."""
    component, module, step = planted
    twin, pipe = make(), make()
    expected = output(run(twin))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, probes))
    with dbg:
        assert torch.equal(output(run(pipe)), expected)
    assert noisy(dbg, allowed) == []
    with (
        plant_nonfinite(
            getattr(pipe, component).get_submodule(module), from_call=step if from_call is None else from_call
        ),
        dbg,
    ):
        run(pipe)
    assert errors(dbg) == [("nonfinite", component, module, step)]
    dbg.close()
    return dbg


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def ip_adapter_state_dict(unet, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """An IP-Adapter (image projection to 4 tokens, a key and value projection per cross-attention)
    for ``unet``, in the format ``unet._load_ip_adapter_weights`` reads."""
    generator = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    image_proj = {
        "proj.weight": torch.randn(4 * cross, IP_EMBED, generator=generator) * 0.1,
        "proj.bias": torch.zeros(4 * cross),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    ip_adapter, key = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = unet.get_submodule(name.removesuffix(".processor")).to_q.out_features
            for which in ("to_k_ip", "to_v_ip"):
                ip_adapter[f"{key}.{which}.weight"] = torch.randn(hidden, cross, generator=generator) * 0.1
            key += 2
    return {"image_proj": image_proj, "ip_adapter": ip_adapter}


def sd_with_ip_adapter():
    pipe = tiny_pipeline("sd")
    pipe.unet._load_ip_adapter_weights([ip_adapter_state_dict(pipe.unet)], low_cpu_mem_usage=False)
    pipe.set_ip_adapter_scale(0.6)
    return pipe


def load_ip_adapter(pipe, dtype: torch.dtype = torch.float32) -> None:
    """An IP-Adapter as ``pipe.load_ip_adapter`` puts one on: a CLIP image encoder (its image embedding
    ``IP_EMBED`` wide, 1 layer) and feature extractor registered, the image projection and the key and
    value projections loaded into the UNet; every weight in ``dtype``."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    vision = CLIPVisionConfig(
        hidden_size=32,
        image_size=32,
        projection_dim=IP_EMBED,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=1,
        patch_size=8,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        encoder = CLIPVisionModelWithProjection(vision).to(dtype).eval()
    pipe.register_modules(image_encoder=encoder, feature_extractor=CLIPImageProcessor(crop_size=32, size=32))
    pipe.unet._load_ip_adapter_weights([ip_adapter_state_dict(pipe.unet)], low_cpu_mem_usage=False)
    pipe.unet.to(dtype)


def dynamic_cfg(pipe, i, t, tensors):
    """diffusers' documented dynamic classifier-free guidance: off from step 2, the prompt
    embeddings' conditional half kept."""
    if i == 1:
        tensors["prompt_embeds"] = tensors["prompt_embeds"].chunk(2)[-1]
        pipe._guidance_scale = 0.0
    return tensors


def sd_dynamic_cfg(pipe, **kwargs):
    return pipe(
        "a cat",
        callback_on_step_end=dynamic_cfg,
        callback_on_step_end_tensor_inputs=["prompt_embeds"],
        num_inference_steps=3,
        generator=generator(),
        output_type="pt",
        **kwargs,
    )


def edit_latents_and_embeds(pipe, i, t, tensors):
    tensors["latents"] = tensors["latents"] * 0.9
    if i == 1:
        tensors["prompt_embeds"] = tensors["prompt_embeds"].flip(0)  # swaps the two halves
    return tensors


OPTIONS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], int]] = {  # make, run, step planted
    "embeds_given_two_per_prompt_rescaled_numpy_tuple": (
        lambda: tiny_pipeline("sd"),
        lambda p: p(
            prompt_embeds=torch.linspace(-1, 1, 77 * 32).reshape(1, 77, 32),
            negative_prompt_embeds=torch.zeros(1, 77, 32),
            num_images_per_prompt=2,
            guidance_rescale=0.7,
            output_type="np",
            return_dict=False,
            num_inference_steps=3,
            generator=generator(),
        ),
        1,
    ),
    "two_prompts_two_generators_lora_scale": (
        lambda: tiny_pipeline("sd"),
        lambda p: p(
            ["a cat", "a dog"],
            generator=[torch.Generator().manual_seed(i) for i in range(2)],
            cross_attention_kwargs={"scale": 0.5},
            num_inference_steps=3,
            output_type="pt",
        ),
        1,
    ),
    "callback_edits_latents_and_prompt_embeds": (
        lambda: tiny_pipeline("sd"),
        lambda p: p(
            "a cat",
            callback_on_step_end=edit_latents_and_embeds,
            callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
            num_inference_steps=3,
            generator=generator(),
            output_type="pt",
        ),
        1,
    ),
    "sdxl_denoising_end_latents": (
        lambda: tiny_pipeline("sdxl"),
        lambda p: p(
            "a cat",
            denoising_end=0.5,
            num_images_per_prompt=2,
            output_type="latent",
            num_inference_steps=4,
            generator=generator(),
        ),
        1,
    ),
    "dynamic_cfg_two_per_prompt": (  # the UNet's batch halves at step 2, where the Inf is planted
        lambda: tiny_pipeline("sd"),
        lambda p: sd_dynamic_cfg(p, num_images_per_prompt=2),
        2,
    ),
    "ip_adapter_image_embeds": (
        sd_with_ip_adapter,
        lambda p: p(
            "a cat",
            ip_adapter_image_embeds=[torch.linspace(-1, 1, 2 * IP_EMBED).reshape(2, 1, IP_EMBED)],
            num_inference_steps=3,
            generator=generator(),
            output_type="pt",
        ),
        1,
    ),
}


@pytest.mark.parametrize("probes", [None, "full"], ids=["default", "full_probes"])
@pytest.mark.parametrize("stack", list(OPTIONS))
def test_call_options_change_no_output_and_the_fault_is_named_at_its_module_and_step(tmp_path, stack, probes):
    make, run, step = OPTIONS[stack]
    watched_like_its_twin(tmp_path, make, run, planted=("unet", CONV, step), probes=probes)


def test_a_fault_in_the_ip_adapter_image_projection_is_named_there(tmp_path):
    make, run, _ = OPTIONS["ip_adapter_image_embeds"]
    module = "encoder_hid_proj.image_projection_layers.0.image_embeds"
    watched_like_its_twin(tmp_path, make, run, planted=("unet", module, 1))


SCHEDULERS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "heun": ("HeunDiscreteScheduler", {}, ()),
    "kdpm2_ancestral": ("KDPM2AncestralDiscreteScheduler", {}, ()),
    "euler_ancestral": ("EulerAncestralDiscreteScheduler", {}, ()),
    "edm_euler": ("EDMEulerScheduler", {}, ()),
    "dpm_karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}, DIVERGE),
    "unipc": ("UniPCMultistepScheduler", {}, DIVERGE),
}


def with_scheduler(name: str) -> Callable[[], Any]:
    def make():
        import diffusers

        cls, options, _ = SCHEDULERS[name]
        pipe = tiny_pipeline("sd")
        pipe.scheduler = getattr(diffusers, cls).from_config(pipe.scheduler.config, **options)
        return pipe

    return make


@pytest.mark.parametrize(
    ("name", "probes"),
    [(name, None) for name in SCHEDULERS] + [("heun", "full"), ("kdpm2_ancestral", "full")],  # full: 2 calls a step
)
def test_a_scheduler_swapped_in_steps_as_diffusers_counts_and_its_fault_is_named(tmp_path, name, probes):
    loop: list[int] = []

    def run(pipe):
        loop.clear()

        def seen(_pipe, i, _t, tensors):
            loop.append(i)
            return tensors

        return pipe("a cat", num_inference_steps=3, generator=generator(), output_type="pt", callback_on_step_end=seen)

    allowed = SCHEDULERS[name][2]
    dbg = watched_like_its_twin(
        tmp_path, with_scheduler(name), run, planted=("unet", CONV, 1), probes=probes, allowed=allowed
    )
    # Heun and KDPM2 call the UNet twice a denoising step: a row (and a step index) per call,
    # as the loop index diffusers gives the callback (5 for 3 steps)
    assert [row["step"] for row in dbg.report().steps if row["run"] == 2] == loop
    assert len(loop) == (5 if name in ("heun", "kdpm2_ancestral") else 3)


@pytest.mark.parametrize(
    ("kind", "cls", "dtype"),
    [("sd", "HeunDiscreteScheduler", torch.float16), ("sdxl", "DPMSolverMultistepScheduler", torch.bfloat16)],
)
def test_a_half_precision_pipeline_with_a_scheduler_swapped_in_changes_no_output(tmp_path, kind, cls, dtype):
    import diffusers

    def make():
        pipe = tiny_pipeline(kind, dtype=dtype)
        pipe.scheduler = getattr(diffusers, cls).from_config(pipe.scheduler.config)
        return pipe

    def run(pipe):
        return pipe("a cat", num_images_per_prompt=2, num_inference_steps=2, generator=generator(), output_type="pt")

    watched_like_its_twin(tmp_path, make, run, planted=("unet", CONV, 1))


@pytest.mark.parametrize("probes", [None, "full"], ids=["default", "full_probes"])
def test_a_scheduler_drawing_from_the_global_rng_draws_what_it_would_unwatched(tmp_path, probes):
    # FlowMatch's stochastic sampling takes its noise from torch.randn_like: the global generator
    import diffusers

    from diffusion_debug.testing.flux import FLUX_CALL

    def make():
        pipe = tiny_pipeline("flux")
        config = pipe.scheduler.config
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config, stochastic_sampling=True)
        return pipe

    def run(pipe, watched=contextlib.nullcontext()):
        torch.manual_seed(123)
        with watched:
            images = pipe(**FLUX_CALL[0](), num_inference_steps=3, generator=generator()).images
        return images, torch.get_rng_state()

    twin, pipe = make(), make()
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, probes))
    for planted in (False, True):  # the planted Inf is localised by a replay: its draws are its own
        with contextlib.ExitStack() as faults:
            for p in (twin, pipe) if planted else ():
                faults.enter_context(plant_nonfinite(p.transformer.proj_out, from_call=1))
            expected, rng = run(twin)
            images, after = run(pipe, dbg)
        assert torch.equal(images, expected) or planted
        assert torch.equal(after, rng)
    assert errors(dbg) == [("nonfinite", "transformer", "proj_out", 1)]
    dbg.close()


@pytest.mark.parametrize("cls", ["HeunDiscreteScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler"])
def test_a_second_order_steps_row_has_the_sigma_its_model_call_ran_at(tmp_path, cls):
    import diffusers

    pipe = tiny_pipeline("sd")
    pipe.scheduler = getattr(diffusers, cls).from_config(pipe.scheduler.config, timestep_spacing="trailing")
    scale, ran_at = pipe.scheduler.scale_model_input, []

    def scaled(sample, timestep):  # divides by sqrt(sigma^2 + 1): the sigma of the model's input
        out = scale(sample, timestep)
        ran_at.append(((sample.norm() / out.norm()) ** 2 - 1).sqrt().item())
        return out

    pipe.scheduler.scale_model_input = scaled
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, None))
    with dbg:
        pipe("a cat", num_inference_steps=3, generator=generator(), output_type="latent")
    dbg.close()
    # KDPM2 runs its second-order step's model at the midpoint sigma: it was the next step's sigma
    assert [row["sigma"] for row in dbg.report().steps] == pytest.approx(ran_at, rel=1e-4)
    assert len(ran_at) == 5


@pytest.mark.parametrize(
    "kind",
    [pytest.param(k, marks=pytest.mark.skipif(bool(kind_missing(k)), reason=str(kind_missing(k)))) for k in CALLS],
)
def test_a_pipeline_of_the_family_changes_no_output_and_its_fault_is_named(tmp_path, kind):
    kwargs, component, module = CALLS[kind]
    allowed = DIVERGE if kind in ("lcm", "pixart_sigma", "cogvideox") else ()
    calls = 2 if kind == "lumina2" else 1  # Lumina 2: a call for each guidance half at step 0

    def run(pipe):
        return pipe(**kwargs(), num_inference_steps=3, generator=generator(), output_type="pt")

    allowed += ("vae_saturation",) if kind == "cogvideox" else ()  # its tiny random video VAE
    watched_like_its_twin(
        tmp_path, lambda: tiny_pipeline(kind), run, planted=(component, module, 1), from_call=calls, allowed=allowed
    )


def guidance_gaps(tmp_path, pipe, **kwargs) -> list[tuple]:
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, None))
    with dbg:
        pipe(num_inference_steps=2, generator=generator(), **kwargs)
    dbg.close()
    return [(row["guidance_gap"] is not None, "cond" in row, "uncond" in row) for row in dbg.report().steps]


def test_two_images_of_one_prompt_are_not_called_an_unconditional_and_a_conditional_half(tmp_path):
    # LCM embeds the guidance scale and calls the UNet once on the batch asked for (2 images): there
    # is no guidance gap, whatever guidance_scale says; it measured image 0 against image 1
    lcm = guidance_gaps(tmp_path / "lcm", tiny_pipeline("lcm"), prompt="a cat", num_images_per_prompt=2)
    assert lcm == [(False, False, False)] * 2
    # DiT doubles the latents it hands the scheduler: two class labels make a batch of 4, halved
    dit = guidance_gaps(tmp_path / "dit", tiny_pipeline("dit"), class_labels=[1, 1], guidance_scale=4.0)
    assert dit == [(True, True, True)] * 2
    # SD doubles the UNet's batch: 2 images a prompt, 4 in the UNet, each half 2; with guidance
    # turned off by the callback from step 2 (guidance_scale still 7.5 in the call) the UNet sees the
    # 2 images alone: no halves from there (it measured image 0 against image 1)
    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path / "sd", None))
    with dbg:
        sd_dynamic_cfg(pipe, num_images_per_prompt=2)
    dbg.close()
    rows = [
        (row["guidance_gap"] is not None, "cond" in row, row["model_output"]["shape"][0]) for row in dbg.report().steps
    ]
    assert rows == [(True, True, 4), (True, True, 4), (False, False, 2)]


def test_an_ip_adapter_loaded_between_fp16_calls_of_one_attach_is_watched_from_its_first_call(tmp_path):
    """A served fp16 SD pipeline under one attach: a plain call, then an IP-Adapter loaded (an image
    encoder registered, its projections loaded into the UNet) and called at the scales 0.6 and 0.2
    (``set_ip_adapter_scale`` between calls). The calls are bitwise their unwatched twin's, but the one
    whose new image encoder makes a NaN at its first call, named there, at run 2. Before: the encoder,
    called before ``set_timesteps``, was hooked from there on: its NaN was blamed on the pipeline's code."""
    from PIL import Image

    module = "vision_model.encoder.layers.0.mlp.fc1"
    image = Image.new("RGB", (32, 32), (200, 80, 20))

    def calls(pipe):
        for scale in (None, 0.6, 0.2):
            if scale == 0.6:
                load_ip_adapter(pipe, torch.float16)
                planted = plant_nonfinite(pipe.image_encoder.get_submodule(module), value=float("nan"))
            if scale is not None:
                pipe.set_ip_adapter_scale(scale)
            kwargs = {"ip_adapter_image": image} if scale else {}
            yield pipe("a cat", num_inference_steps=1, generator=generator(), output_type="pt", **kwargs).images
            if scale == 0.6:
                planted.remove()

    twin, pipe = tiny_pipeline("sd", dtype=torch.float16), tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, None))
    with dbg:
        same = [torch.equal(*images) for images in zip(calls(twin), calls(pipe))]
    assert same == [True, False, True]
    found = [
        (a.kind, a.component, a.module, a.details.get("run")) for a in dbg.report().anomalies if a.severity == "error"
    ]
    assert found == [("nonfinite", "image_encoder", module, 2)]
    dbg.close()


def test_ip_adapter_embeds_whose_nan_the_image_encoder_made_passed_back_at_a_later_call_are_the_encoders(tmp_path):
    """``pipe.prepare_ip_adapter_image_embeds`` (its image encoder making a NaN) under one attach, the embeddings
    passed to two calls: the first is that run's, the second a new run, whose error names the image encoder's module
    and run 1, ``ip_adapter_image_embeds`` the way it came (before: ``input ip_adapter_image_embeds``)."""
    from PIL import Image

    module = "vision_model.encoder.layers.0.mlp.fc1"
    pipe = tiny_pipeline("sd")
    load_ip_adapter(pipe)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, None))
    with dbg:
        with plant_nonfinite(pipe.image_encoder.get_submodule(module), value=float("nan")):
            embeds = pipe.prepare_ip_adapter_image_embeds(Image.new("RGB", (32, 32)), None, "cpu", 1, True)
        for _ in range(2):
            pipe("a cat", ip_adapter_image_embeds=embeds, num_inference_steps=1, generator=generator())
    found = [
        (a.component, a.module, a.details.get("run"), a.details.get("passed_as"))
        for a in dbg.report().anomalies
        if a.severity == "error"
    ]
    assert found == [
        ("image_encoder", module, 1, None),
        ("image_encoder", module, 1, ["ip_adapter_image_embeds"]),  # run 2's
    ]
    assert dbg.report().anomalies[-1].details["run"] == 2  # the VAE's, a consequence in run 2
    dbg.close()


def test_a_prompt_switched_by_a_callback_that_calls_encode_prompt_stays_in_the_call_s_run(tmp_path):
    """Prompt switching: ``callback_on_step_end`` calls ``pipe.encode_prompt`` at step 1 and hands the loop
    the new embeddings. The call is one run of 4 steps (it was split: steps 2 and 3 recorded as steps 0 and 1
    of a second run), and an Inf the UNet's conv makes from step 2 on is named there, at step 2 (it was
    named at the whole UNet, at step 0 of a new run); the images are the unwatched call's."""
    pipe = tiny_pipeline("sd")
    faults = contextlib.ExitStack()
    faulty = [False]

    def switch(p, i, t, kwargs):
        if i != 1:
            return {}
        if faulty[0]:  # from step 2 on
            faults.enter_context(plant_nonfinite(p.unet.get_submodule(CONV), value=float("inf")))
        embeds, negative = p.encode_prompt("a dog", "cpu", 1, True)
        return {"prompt_embeds": torch.cat([negative, embeds])}

    def call():
        with faults:
            return pipe(
                "a cat",
                num_inference_steps=4,
                callback_on_step_end=switch,
                callback_on_step_end_tensor_inputs=["prompt_embeds"],
                generator=generator(),
                output_type="pt",
            ).images

    plain = call()
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, None))
    with dbg:
        watched = call()
        faulty[0] = True
        call()
    assert torch.equal(plain, watched)
    report = dbg.report()
    assert [(row["run"], row["step"]) for row in report.steps] == [(run, s) for run in (1, 2) for s in range(4)]
    (first, *_) = [a for a in report.anomalies if a.severity == "error"]
    assert (first.kind, first.component, first.module, first.step, first.details["run"]) == (
        "nonfinite",
        "unet",
        CONV,
        2,
        2,
    )
