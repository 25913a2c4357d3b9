"""Modular Diffusers: a ``ModularPipeline`` (tiny SDXL blocks, the family whose components the
project already builds) is watched like a ``DiffusionPipeline``; a ``ComponentsManager`` is
accepted and the collections sharing a component are recorded; an object that cannot be watched
gets one sentence naming its type."""

from __future__ import annotations

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
