"""Modular Diffusers: a ``ModularPipeline`` (tiny SDXL blocks, the family whose components the
project already builds) is watched like a ``DiffusionPipeline``; a ``ComponentsManager`` is
accepted and the collections sharing a component are recorded; an object that cannot be watched
gets one sentence naming its type; a guider's layer hooks, on for one call of a step, are on again
for that call's replay; guiders that reshape the guidance leave an fp16 image bitwise."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import HAS_MODULAR

pytestmark = pytest.mark.skipif(not HAS_MODULAR, reason="this diffusers has no modular pipelines")

MODULE = "up_blocks.1.resnets.0.conv2"


@pytest.fixture(scope="module")
def parts():
    """The tiny SDXL's components (seed 0), and a builder of modular SDXL pipelines over them."""
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    components = {k: v for k, v in tiny_pipeline("sdxl").components.items() if v is not None}

    def modular(**init):
        pipe = StableDiffusionXLAutoBlocks().init_pipeline(**init)
        pipe.update_components(**components)
        return pipe

    return components, modular


def call(pipe):
    out = pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0))
    return np.asarray(out.values["images"][0])


def watched(pipe, tmp_path, **config):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error", **config))
    with dbg:
        image = call(pipe)
    dbg.close()
    return dbg, image


def test_a_modular_pipeline_is_watched_with_its_roles_and_steps_and_unchanged_output(parts, tmp_path):
    pipe = parts[1]()
    plain = call(pipe)
    dbg, image = watched(pipe, tmp_path)
    assert np.array_equal(plain, image)
    assert [(c.name, c.role) for c in dbg.components] == [
        ("unet", "denoiser"),
        ("vae", "vae"),
        ("text_encoder", "text_encoder"),
        ("text_encoder_2", "text_encoder"),
    ]
    report = dbg.report()
    assert [(row["step"], row["timestep"], row["denoiser_calls"]) for row in report.steps] == [(0, 501, 2), (1, 1, 2)]
    assert [a for a in report.anomalies if a.kind != "scheduler_config"] == []  # 2 leading steps: a true warning
    assert {name: report.components[name]["calls"] for name in ("unet", "vae", "text_encoder")} == {
        "unet": 4,
        "vae": 1,
        "text_encoder": 1,
    }


def test_an_inf_in_a_modular_pipelines_unet_is_named_exactly_with_a_bundle(parts, tmp_path):
    pipe = parts[1]()
    with plant_nonfinite(pipe.unet.get_submodule(MODULE), from_call=2):  # step 1 (two guidance calls a step)
        dbg, _ = watched(pipe, tmp_path, policy="warn")
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", MODULE, 1)
    assert [p.name for p in (report.run_dir / "bundles").iterdir()] == ["unet-step1"]


def test_components_shared_through_a_manager_are_recorded_per_pipeline(parts, tmp_path, caplog):
    from diffusers.modular_pipelines import ComponentsManager

    components, modular = parts
    manager = ComponentsManager()
    with caplog.at_level(logging.ERROR, logger="diffusers"):
        for collection in ("sdxl_a", "sdxl_b"):
            for name in ("unet", "vae"):
                manager.add(name, components[name], collection)
    first, second = modular(components_manager=manager, collection="sdxl_a"), modular()
    dbg = DiffusionModelDebugger(first, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        call(second)  # another pipeline running the shared UNet: not this debugger's run
        call(first)
    dbg.close()
    (shared,) = [e["collections"] for e in dbg.record.events if e["type"] == "shared_components"]
    assert shared == {"unet": ["sdxl_a", "sdxl_b"], "vae": ["sdxl_a", "sdxl_b"]}
    assert dbg.report().components["unet"]["calls"] == 4  # the 2 steps of its own call only

    by_manager = DiffusionModelDebugger(manager, DebugConfig(output_dir=tmp_path, log_level="error"))
    assert [(c.name, c.role) for c in by_manager.components] == [  # the text encoders: added by `first`
        ("unet", "denoiser"),
        ("vae", "vae"),
        ("text_encoder", "text_encoder"),
        ("text_encoder_2", "text_encoder"),
    ]
    with by_manager:
        call(second)  # a manager's components are watched in whichever pipeline calls them
    by_manager.close()
    assert by_manager.report().components["unet"]["calls"] == 4


def test_an_object_it_cannot_watch_gets_one_sentence_naming_its_type(parts):
    with pytest.raises(DiffusionDebugError) as info:
        DiffusionModelDebugger(parts[1]().blocks)
    assert str(info.value) == (
        "DiffusionModelDebugger needs a diffusers DiffusionPipeline, a ModularPipeline or a ComponentsManager, "
        "not diffusers's StableDiffusionXLAutoBlocks."
    )


# -- an encode-only call: SDXL's CLIP reads hidden_states[-2], a NaN in its last layer may go unread --------
UNREAD = "encoder.layers.1.mlp.fc2"


def unread_layer(encoder):
    return next(n for n, _ in encoder.named_modules() if n == UNREAD or n.endswith("." + UNREAD))


@pytest.fixture(scope="module")
def encode_only(parts):
    """A ComponentsManager holding the tiny SDXL's components, and a modular pipeline of SDXL's text
    encoder step alone over it (Modular Diffusers' way to encode a prompt once for many denoising calls)."""
    from diffusers.modular_pipelines import ComponentsManager
    from diffusers.modular_pipelines.stable_diffusion_xl.encoders import StableDiffusionXLTextEncoderStep

    components = parts[0]
    manager = ComponentsManager()
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        manager.add(name, components[name])
    text_pipe = StableDiffusionXLTextEncoderStep().init_pipeline(components_manager=manager)
    text_pipe.update_components(
        **{k: components[k] for k in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}
    )
    return manager, text_pipe


@pytest.mark.parametrize("watched_object", ["manager", "text_pipe"])
def test_an_encode_only_modular_call_has_its_error_as_it_returns_and_raise_raises_at_the_call(
    encode_only, tmp_path, watched_object
):
    """As ``pipe.encode_prompt`` alone: no denoising loop follows in the call, so the caller may pass on any
    of the hidden states: the NaN/Inf is the error it was made, there as the call returns (before: held to
    detach), and policy ``raise`` raises it at the call (before: never raised)."""
    manager, text_pipe = encode_only
    target = manager if watched_object == "manager" else text_pipe
    encoder = text_pipe.text_encoder
    module = unread_layer(encoder)
    with plant_nonfinite(encoder.get_submodule(module), value=float("nan")):
        dbg = DiffusionModelDebugger(target, DebugConfig(output_dir=tmp_path, log_level="error"))
        with dbg:
            embeds = text_pipe(prompt="a cat", output="prompt_embeds")
            found = [
                (a.severity, a.kind, a.component, a.module) for a in dbg.record.anomalies if a.kind == "nonfinite"
            ]
        dbg.close()
        assert found == [("error", "nonfinite", "text_encoder", module)]
        assert bool(embeds.isfinite().all())  # hidden_states[-2]
        config = DebugConfig(output_dir=tmp_path / "raise", log_level="error", policy="raise")
        with DiffusionModelDebugger(target, config), pytest.raises(DiffusionDebugError) as raised:
            text_pipe(prompt="a cat", output="prompt_embeds")
    assert (raised.value.anomaly.component, raised.value.anomaly.module) == ("text_encoder", module)


def test_a_nan_a_full_modular_call_does_not_read_is_still_the_warning(parts, tmp_path):
    """A modular pipeline whose blocks hold the denoising loop still holds the finding for the loop's calls."""
    pipe = parts[1]()
    plain = call(pipe)
    module = unread_layer(pipe.text_encoder)
    with plant_nonfinite(pipe.text_encoder.get_submodule(module), value=float("nan")):
        dbg, image = watched(pipe, tmp_path, policy="raise")
    assert np.array_equal(plain, image)
    (found,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert (found.severity, found.module, found.details["unread_output"]) == ("warning", module, True)


@pytest.mark.parametrize("watched_object", ["pipe", "manager"])
def test_one_attach_around_fp16_calls_of_a_manager_with_auto_offload_names_a_nan_at_call_3(
    tmp_path, monkeypatch, watched_object
):
    """A served fp16 modular SDXL whose ``ComponentsManager`` offloads automatically (accelerate's hooks on
    every component: its ``forward`` replaced, its inputs moved; on the CPU, with the free-memory query it needs
    given): one attach around three 1-step calls, each a run with its step recorded; calls 1 and 2 bitwise the
    plain call, and a NaN the UNet's conv makes at call 3 named there, at step 0 of run 3. Alike with the
    debugger on the manager, which holds the pipeline's scheduler (before: one run, step None)."""
    from diffusers.modular_pipelines import ComponentsManager
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks
    from diffusers.utils import torch_utils

    if not hasattr(torch_utils, "TorchDeviceBackend"):  # an older diffusers asks CUDA for its free memory
        pytest.skip("this diffusers offloads automatically to an accelerator only")
    monkeypatch.setattr(torch.cpu, "mem_get_info", lambda index=None: (64 << 30, 64 << 30), raising=False)
    components = {k: v for k, v in tiny_pipeline("sdxl", dtype=torch.float16).components.items() if v is not None}
    components["vae"].register_to_config(force_upcast=False)
    manager = ComponentsManager()
    for name, component in components.items():
        manager.add(name, component)
    manager.enable_auto_cpu_offload(device="cpu")
    pipe = StableDiffusionXLAutoBlocks().init_pipeline(components_manager=manager)
    pipe.update_components(**components)

    def image():
        out = pipe(
            prompt="a cat", num_inference_steps=1, height=32, width=32, generator=torch.Generator().manual_seed(0)
        )
        return np.asarray(out.values["images"][0])

    plain = image()
    assert hasattr(pipe.unet, "_hf_hook")  # offloaded by accelerate's hook
    assert pipe.scheduler in manager.components.values()
    target = manager if watched_object == "manager" else pipe
    step_before = vars(type(pipe.scheduler)).get("step")
    dbg = DiffusionModelDebugger(target, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        same = [np.array_equal(image(), plain) for _ in range(2)]
        with plant_nonfinite(pipe.unet.get_submodule(MODULE), value=float("nan")):
            same.append(np.array_equal(image(), plain))
    dbg.close()
    assert vars(type(pipe.scheduler)).get("step") is step_before  # detached: the scheduler's class as it was
    report = dbg.report()
    assert same == [True, True, False]
    assert [(row["run"], row["step"]) for row in report.steps] == [(1, 0), (2, 0), (3, 0)]
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step, error.details["run"]) == (
        "nonfinite",
        "unet",
        MODULE,
        0,
        3,
    )
    manager.disable_auto_cpu_offload()


def test_a_managers_scheduler_copied_or_pickled_while_attached_and_after_is_the_unwatched_one(parts, tmp_path):
    """A debugger of a ``ComponentsManager`` patches the schedulers it holds: a deep copy of the manager or of the
    scheduler and a pickled scheduler, made while attached or after detach, step as copies of the unwatched one
    (nothing of ours in their dicts, no row recorded for them), the modules' copies without our hooks; detach leaves
    the scheduler, its class and the manager exactly as they were."""
    import copy
    import pickle

    from diffusers import EulerDiscreteScheduler
    from diffusers.modular_pipelines import ComponentsManager

    def trajectory(scheduler):
        scheduler.set_timesteps(2)
        sample = torch.ones(1, 4, 4, 4)
        for t in scheduler.timesteps:
            sample = scheduler.step(sample * 0.5, t, sample).prev_sample
        return sample

    scheduler = EulerDiscreteScheduler.from_config(parts[0]["scheduler"].config)
    manager = ComponentsManager()
    manager.add("scheduler", scheduler)
    manager.add("unet", parts[0]["unet"])
    ids = [next(key for key, value in manager.components.items() if value is v) for v in (scheduler, parts[0]["unet"])]
    names = ("step", "set_timesteps")
    classes = {(c, n): vars(c).get(n) for c in type(scheduler).__mro__ for n in names}
    state, held = dict(vars(scheduler)), dict(vars(manager))
    expected = trajectory(copy.deepcopy(scheduler))
    dbg = DiffusionModelDebugger(manager, DebugConfig(output_dir=tmp_path, log_level="error"))
    for attached in (True, False):
        if attached:
            dbg.attach()
        copied = copy.deepcopy(manager)
        copies = [copy.deepcopy(scheduler), pickle.loads(pickle.dumps(scheduler)), copied.components[ids[0]]]
        assert [set(names) & set(vars(c)) for c in copies] == [set()] * 3
        assert all(torch.equal(trajectory(c), expected) for c in copies)
        unet_hooks = [h for m in copied.components[ids[1]].modules() for h in m._forward_hooks.values()]
        assert unet_hooks == []  # the copied unet is a plain one (before: an inert CopiedHook a hook)
        if attached:
            assert dbg.report().steps == []  # no copy watched ...
            assert torch.equal(trajectory(scheduler), expected) and len(dbg.report().steps) == 2  # ... the original is
            dbg.detach()
            assert {(c, n): vars(c).get(n) for c in type(scheduler).__mro__ for n in names} == classes
            assert vars(scheduler).keys() == state.keys() and all(vars(manager)[k] is v for k, v in held.items())
    dbg.close()


SKIPPED = "mid_block.attentions.0.transformer_blocks"
"""The UNet blocks SkipLayerGuidance skips (their first) in the guider tests."""


@pytest.fixture(scope="module")
def guided(parts):
    """For the two guider tests (one build for both): a modular pipeline on a copy of the UNet (the
    guider's hooks go on the copy), its default guider, and a SkipLayerGuidance skipping
    ``SKIPPED``'s first block; each test puts the guider it starts from in place."""
    guiders = pytest.importorskip("diffusers.guiders")
    from diffusers.hooks import LayerSkipConfig

    components, modular = parts
    config = LayerSkipConfig(indices=[0], fqn=SKIPPED)
    guider = guiders.SkipLayerGuidance(
        skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0, skip_layer_config=config
    )
    pipe = modular()
    pipe.update_components(unet=copy.deepcopy(components["unet"]))
    return pipe, pipe.guider, guider


def _inf_while_skipped(pipe):
    """A forward hook for ``MODULE`` that makes its output Inf only while the guider's hooks are on
    ``SKIPPED``'s first block (the guided pass of a step)."""
    block = pipe.unet.get_submodule(f"{SKIPPED}.0")

    def inf_while_skipped(module, args, output):
        registry = vars(block).get("_diffusers_hook")
        if registry is not None and registry.hooks:
            output = output.clone()
            output.view(-1)[0] = float("inf")
            return output
        return None

    return inf_while_skipped


def test_a_guiders_layer_hooks_on_for_one_call_of_a_step_are_on_again_for_its_replay(guided, tmp_path):
    """SkipLayerGuidance places its hooks on a UNet block before the step's third call and takes them off
    after it: watched, the image is bitwise the plain one, and a NaN made only while they are on is named at
    its module and step (before: at the UNet alone; the replay at the step's end ran without them), the
    guider swapped in after the debugger was made (followed at the next attach)."""
    pipe, default, guider = guided
    pipe.update_components(guider=default)  # the default CFG while the debugger is made
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    pipe.update_components(guider=guider)  # in place of the default CFG, after the debugger was made
    plain = call(pipe)

    with dbg:
        image = call(pipe)
    with pipe.unet.get_submodule(MODULE).register_forward_hook(_inf_while_skipped(pipe)), dbg:  # planted first
        call(pipe)
    dbg.close()
    assert np.array_equal(plain, image)
    report = dbg.report()
    assert [(row["run"], row["step"], row["denoiser_calls"]) for row in report.steps] == [
        (run, step, calls) for run in (1, 2) for step, calls in ((0, 2), (1, 3))
    ]
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step, error.details["run"]) == (
        "nonfinite",
        "unet",
        MODULE,
        1,
        2,
    )


def test_a_guider_swapped_while_attached_changes_no_image_and_its_layer_fault_is_named(guided, tmp_path):
    """``pipe.update_components(guider=...)`` between two calls of one attach (SkipLayerGuidance in, then the
    default CFG back): every component is hooked again, which costs time only: each image is bitwise the plain one
    of its guider, and a NaN made only while the guider's layer hooks are on is named at its module and step."""
    pipe, default, guider = guided
    pipe.update_components(guider=default)
    plain = call(pipe)
    pipe.update_components(guider=guider)
    plain_skipping = call(pipe)

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe.update_components(guider=default)
        images = [call(pipe)]
        pipe.update_components(guider=guider)
        with pipe.unet.get_submodule(MODULE).register_forward_hook(_inf_while_skipped(pipe)):
            call(pipe)
        images.append(call(pipe))
    dbg.close()
    assert np.array_equal(images[0], plain) and np.array_equal(images[1], plain_skipping)
    assert not np.array_equal(plain, plain_skipping)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step, a.details["run"]) for a in errors] == [
        ("nonfinite", "unet", MODULE, 1, 2)
    ]
    assert [row["run"] for row in dbg.report().steps] == [1, 1, 2, 2, 3, 3]


def test_why_on_a_nan_of_a_guided_call_replays_it_with_the_guiders_layer_hooks(guided, tmp_path):
    """``report.why()`` on a NaN made only while SkipLayerGuidance's hooks are on replays the call with them
    placed again (before: from the bundle alone, "does not reproduce"); replayed from the bundle alone (the
    CLI's path: no hook objects in a bundle) its verdict names the guider's layer hooks as the cause."""
    from diffusion_debug.diffusion.replay.why import explain_run

    pipe, _, guider = guided
    pipe.update_components(guider=guider)

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error", policy="warn"))
    with pipe.unet.get_submodule(MODULE).register_forward_hook(_inf_while_skipped(pipe)):
        with dbg:
            call(pipe)
        report = dbg.report()
        result = report.why()
        alone = explain_run(report.run_dir, report.anomalies, pipe)
    dbg.close()
    assert (result.baseline.finite, result.component, result.module, result.step) == (False, "unet", MODULE, 1)
    assert "does not reproduce" not in result.verdict
    assert alone.baseline.finite is True
    assert alone.verdict == (
        "the replay of unet is finite: the call ran with hooks a guider placed on its layers for that call "
        f"only (SkipLayerGuidance_0 on {SKIPPED}.0; SkipLayerGuidance_0 on {SKIPPED}.0.ff), which a repro "
        "bundle cannot hold; "
        "call report.why() while the pipeline and its guider are at hand"
    )


@pytest.mark.parametrize("name", ["TangentialClassifierFreeGuidance", "FrequencyDecoupledGuidance"])
def test_a_guider_that_reshapes_the_guidance_on_fp16_components_leaves_the_image_bitwise(name, tmp_path):
    """Tangential CFG (the unconditional prediction projected off the conditional one) and frequency-decoupled
    guidance (each Laplacian-pyramid band guided apart, kornia's), in fp16: the image is the unwatched one's."""
    guiders = pytest.importorskip("diffusers.guiders")
    if name == "FrequencyDecoupledGuidance":
        pytest.importorskip("kornia")
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    components = {k: v for k, v in tiny_pipeline("sdxl", dtype=torch.float16).components.items() if v is not None}
    pipes = []
    for _ in range(2):  # one unwatched, one watched, over the same components
        pipe = StableDiffusionXLAutoBlocks().init_pipeline()
        pipe.update_components(**components, guider=getattr(guiders, name)())
        pipes.append(pipe)
    plain = call(pipes[0])
    dbg, image = watched(pipes[1], tmp_path)
    assert np.array_equal(plain, image) and np.array_equal(call(pipes[1]), plain)
    assert [a for a in dbg.report().anomalies if a.kind != "scheduler_config"] == []


def test_a_modular_sdxl_pipeline_reads_force_upcast_in_its_decode_step(parts):
    """A ``ModularPipeline``'s own ``__call__`` reads no ``force_upcast``; its SDXL decode step does, so its VAE's
    advice names the flag; blocks without that step (the text encoder's alone) do not read it."""
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    from diffusion_debug.diffusion.components.vae_details import reads_force_upcast

    _, modular = parts
    text_only = StableDiffusionXLAutoBlocks().sub_blocks["text_encoder"].init_pipeline()
    assert (reads_force_upcast(modular()), reads_force_upcast(text_only)) == (True, False)
