"""Every declared version works: the checks the floor job of ``make test`` runs on the oldest torch,
diffusers, transformers and accelerate that ``pyproject.toml`` admits (and the suite on the newest).

On the floor the debugger takes the older paths that :mod:`diffusion_debug.installed` detects; these
checks are what a user of that stack must get: the demo names its fault, a watched call is bitwise
the plain one, a NaN in a UNet weight is named at its module and step, an fp16 call runs.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook

from diffusion_debug import DebugConfig, DiffusionModelDebugger, installed
from diffusion_debug.cli import main
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.faults import plant_nonfinite

ROOT = Path(__file__).resolve().parents[1]
FLOORED = ("torch", "diffusers", "transformers", "accelerate")
MODULE = "up_blocks.1.resnets.0.conv2"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _floors() -> dict[str, str]:
    """The declared floor of each package that ``.ci/floor_versions.py`` pins for the floor job."""
    found = dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9.]+)[",]', (ROOT / "pyproject.toml").read_text(), re.M))
    return {name: found[name] for name in FLOORED}


def test_the_installed_stack_is_at_or_above_each_declared_floor():
    for name, floor in _floors().items():
        assert _release(version(name)) >= _release(floor), f"{name} {version(name)} is below the declared {floor}"


def test_the_newer_apis_are_detected_as_the_installed_torch_has_them():
    try:
        handle = register_module_forward_hook(lambda *a: None, with_kwargs=True)
        handle.remove()  # torch's handle forgets the with_kwargs flag: dropped as probes' _remove_global does
        torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
        takes_kwargs = True
    except TypeError:
        takes_kwargs = False
    assert installed.GLOBAL_HOOKS_TAKE_KWARGS is takes_kwargs
    assert installed.HAS_SET_STANCE is callable(getattr(torch.compiler, "set_stance", None))


def _images(pipe, **kwargs) -> np.ndarray:
    generator = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=2, generator=generator, output_type="np", **kwargs).images


def test_a_watched_call_is_bitwise_the_plain_one(tmp_path):
    pipe = tiny_pipeline("sd")
    plain = _images(pipe)
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        watched = _images(pipe)
    assert np.array_equal(plain, watched)
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    assert not [a for a in dbg.report().anomalies if a.severity == "error"]


def test_a_nan_in_a_unet_weight_is_named_at_its_module_and_step_0(tmp_path):
    pipe = tiny_pipeline("sd")
    pipe.unet.get_submodule(MODULE).weight.data[0, 0, 0, 0] = float("nan")
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        _images(pipe)
    headline = dbg.report().headline
    assert (headline.kind, headline.component, headline.module, headline.step) == ("nonfinite", "unet", MODULE, 0)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]


def test_an_fp16_call_runs_watched_and_names_a_planted_inf(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    plain = _images(pipe)
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        watched = _images(pipe)
    assert np.array_equal(plain, watched, equal_nan=True)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    with plant_nonfinite(pipe.unet.get_submodule(MODULE), from_call=1):
        with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
            _images(pipe)
    headline = dbg.report().headline
    assert (headline.component, headline.module, headline.step) == ("unet", MODULE, 1)


@pytest.mark.filterwarnings("ignore")
def test_the_demo_exits_0_and_names_its_planted_unet_fault(tmp_path, monkeypatch, capsys):
    # the CLI's demo in this process: a fresh Python's imports were 4 of its 9 CPU-s (the installed
    # script is run by tests/jobs/test_demo.py's replay)
    monkeypatch.chdir(tmp_path)
    code = main(["demo", "--steps", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "first non-finite value: unet up_blocks.1.resnets.0.conv2 (step 0" in out


def test_the_lowest_python_classifier_is_the_declared_floor():
    """``requires-python`` admits no Python the classifiers (the versions the tests ran on) leave out below."""
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'^requires-python = ">=(3\.\d+)"', text, re.M).group(1)
    listed = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    assert listed and min(listed, key=_release) == floor, (floor, listed)
