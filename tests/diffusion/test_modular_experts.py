"""Modular Diffusers' Wan 2.2 (``Wan22Blocks``: two experts, ``transformer`` for the high-noise steps and
``transformer_2`` after the boundary), bf16, under one debugger reused for two calls: each output is an
unwatched twin's bit for bit, the run is quiet, each step row names the expert that ran it, and an Inf
weight in the second expert's middle block is named at its module and step 1. test_modular.py covers
modular SDXL only, test_experts.py the classic Wan 2.2 pipeline only; this passed when written (coverage,
not a fix)."""

from __future__ import annotations

import types

import pytest
import torch
from diffusion_helpers import inf_weight

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_MODULAR, kind_missing

pytestmark = pytest.mark.skipif(not HAS_MODULAR or bool(kind_missing("wan22")), reason="no modular Wan 2.2 here")

MODULE = "blocks.1.attn1.to_out.0"


@pytest.fixture
def modular(monkeypatch):
    """A builder of modular Wan 2.2 pipelines over the tiny ``wan22``'s bf16 components (boundary 0.875:
    of 2 steps, step 0 is ``transformer``'s and step 1 ``transformer_2``'s)."""
    from diffusers.modular_pipelines.wan import encoders
    from diffusers.modular_pipelines.wan.modular_blocks_wan22 import Wan22Blocks

    if not hasattr(encoders, "ftfy"):  # the modular prompt cleaner calls ftfy without checking it is there
        monkeypatch.setattr(encoders, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)

    def make():
        components = tiny_pipeline("wan22", dtype=torch.bfloat16).components
        pipe = Wan22Blocks().init_pipeline()
        pipe.update_components(**{k: v for k, v in components.items() if v is not None})
        return pipe

    return make


def call(pipe) -> torch.Tensor:
    out = pipe(
        prompt="a cat",
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    return out.values["videos"]


def test_two_modular_wan22_calls_are_the_twins_and_an_inf_in_the_second_expert_is_named(modular, tmp_path):
    twin, pipe = modular(), modular()
    expected = [call(twin), call(twin)]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    got = []
    for _ in range(2):
        with dbg:
            got.append(call(pipe))
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True, True]
    report = dbg.report()
    denoisers = [c.name for c in dbg.components if c.role == "denoiser"]
    assert denoisers == ["transformer", "transformer_2"]
    assert [(row["step"], row["denoiser"]) for row in report.steps] == [(0, "transformer"), (1, "transformer_2")] * 2
    assert [(a.kind, a.severity) for a in report.anomalies] == []
    with inf_weight(pipe.transformer_2.get_submodule(MODULE)):
        with dbg:
            call(pipe)
    errors = [(a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies if a.severity == "error"]
    assert errors == [("nonfinite", "transformer_2", MODULE, 1)]
    dbg.close()
