"""A VAE compiled whole (``pipe.vae = torch.compile(pipe.vae)``, ``vae.compile()``) compiles its
``forward``, which the pipeline never calls (``vae.decode`` runs uncompiled): one
``compile_bypassed`` warning for the debugger's calls, with the fix; a VAE whose ``decode`` or
``decoder`` is compiled, and an uncompiled one, get nothing."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline

WRAPPED = (
    "vae is wrapped by torch.compile, which compiles its forward, but the pipeline calls vae.decode, which runs "
    "uncompiled: compile that method (pipe.vae.decode = torch.compile(pipe.vae.decode)) or vae.decoder "
    "(pipe.vae.decoder.compile())."
)
IN_PLACE = WRAPPED.replace("is wrapped by torch.compile", "was compiled in place (vae.compile())")


def compiled(how: str):
    pipe = tiny_pipeline("sd")
    if how == "torch.compile(vae)":
        pipe.vae = torch.compile(pipe.vae, backend="eager")
    elif how == "vae.compile()":
        pipe.vae.compile(backend="eager")
    elif how == "vae.decode compiled":
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    elif how == "torch.compile(vae) and its decode":
        pipe.vae = torch.compile(pipe.vae, backend="eager")
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    elif how == "vae.decoder.compile()":
        pipe.vae.decoder.compile(backend="eager")
    return pipe


def bypassed(how: str, tmp_path) -> list[str]:
    pipe = compiled(how)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):  # a reused debugger: said once
        with dbg:
            pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")
    found = [a for a in dbg.report().anomalies if a.kind == "compile_bypassed"]
    dbg.close()
    assert all((a.severity, a.component, a.module, a.step) == ("warning", "vae", "", None) for a in found)
    return [a.message for a in found]


@pytest.mark.parametrize("how, expected", [("torch.compile(vae)", WRAPPED), ("vae.compile()", IN_PLACE)])
def test_a_vae_compiled_whole_gets_one_line_naming_the_method_to_compile(how, expected, tmp_path):
    assert bypassed(how, tmp_path) == [expected]


@pytest.mark.parametrize(
    "how", ["uncompiled", "vae.decode compiled", "torch.compile(vae) and its decode", "vae.decoder.compile()"]
)
def test_a_vae_whose_decode_or_decoder_is_compiled_gets_nothing(how, tmp_path):
    assert bypassed(how, tmp_path) == []
