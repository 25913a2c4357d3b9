"""``diffusion-debug run --profile STEP``: one denoising step under torch.profiler, through the CLI."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest
from PIL import Image

from diffusion_debug.cli import main
from diffusion_debug.jobs import pipeline_loading
from diffusion_debug.record import load_run
from diffusion_debug.testing import tiny_pipeline


def _raise_on_constant(name):
    raise ValueError(f"non-strict JSON constant {name}")


def _run(monkeypatch, tmp_path, pipe, *flags):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *args, **kwargs: pipe)
    return main(["run", "--steps", "3", "--prompt", "a cat", "--output-dir", str(tmp_path), *flags])


def _run_dir(output_dir):
    (run_dir,) = [p for p in output_dir.iterdir() if (p / "summary.json").is_file()]
    return run_dir


def _hooks(module):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_profile_traces_exactly_the_asked_step_and_ranks_real_blocks(monkeypatch, tmp_path, capsys):
    pipe = tiny_pipeline("sd")
    hooks_before = _hooks(pipe.unet)
    assert _run(monkeypatch, tmp_path / "plain", pipe) == 0
    assert _run(monkeypatch, tmp_path / "profiled", pipe, "--profile", "1") == 0
    out = capsys.readouterr().out
    run_dir = _run_dir(tmp_path / "profiled")
    assert _hooks(pipe.unet) == hooks_before  # nothing of the profiler stays on the modules

    # observing does not change what is observed: the same image bit for bit
    plain = np.asarray(Image.open(_run_dir(tmp_path / "plain") / "image.png"))
    assert np.array_equal(plain, np.asarray(Image.open(run_dir / "image.png")))

    profile = load_run(run_dir).summary["profile"]
    assert profile["step"] == 1 and profile["trace"] == "profile-step1.json" and profile["time"] == "cpu"
    assert profile["memory_snapshot"] is None and "CPU" in profile["memory_note"]
    trace = json.loads((run_dir / "profile-step1.json").read_text(), parse_constant=_raise_on_constant)
    ranges = [e for e in trace["traceEvents"] if e.get("ph") == "X" and str(e.get("name")).startswith("unet")]
    # one step of batched classifier-free guidance is one UNet call: its range is in the trace once
    assert [e["name"] for e in ranges].count("unet") == 1

    modules = {m["name"]: m for m in profile["modules"]}
    places = collections.Counter(id(m) for _, m in pipe.unet.named_modules(remove_duplicate=False))
    assert "unet" in modules and "unet.mid_block" in modules
    for name, row in modules.items():
        if name != "unet":
            pipe.unet.get_submodule(name.removeprefix("unet."))  # every label is a real block
            assert row["total_ms"] <= modules["unet"]["total_ms"]  # a block's time is inside the UNet's
        # one call a step, except a module the UNet uses in several places (diffusers < 0.33 shares one SiLU)
        assert row["calls"] == 1 or places[id(pipe.unet.get_submodule(name.removeprefix("unet.")))] > 1
    # the trace agrees with the summary: the UNet's range lasts as long as its reported time (us vs ms)
    (unet_range,) = [e for e in ranges if e["name"] == "unet"]
    assert unet_range["dur"] / 1e3 == pytest.approx(modules["unet"]["total_ms"], rel=0.05, abs=0.05)
    assert profile["ops"] and all(op["name"].startswith("aten::") for op in profile["ops"])

    assert "profile of step 1" in out and str(run_dir / "profile-step1.json") in out
    # the operator table is in the terminal too: the op of most self time first, with its calls
    assert re.search(r"^operator\s+calls\s+self cpu ms$", out, flags=re.M)
    top = profile["ops"][0]
    assert re.search(rf"^{re.escape(top['name'])}\s+{top['calls']}\s+{top['self_ms']:.4g}$", out, flags=re.M)
    page = (run_dir / "report.html").read_text()
    assert "Profile of step 1" in page and "profile-step1.json" in page and "unet.mid_block" in page


def test_profile_of_step_0_starts_before_the_call(monkeypatch, tmp_path, capsys):
    assert _run(monkeypatch, tmp_path, tiny_pipeline("sd"), "--profile", "0") == 0
    profile = load_run(_run_dir(tmp_path)).summary["profile"]
    assert profile["step"] == 0 and (_run_dir(tmp_path) / "profile-step0.json").is_file()
    # step 0 starts at the UNet's first call: the prompt encoding before the loop is not in it
    names = [m["name"] for m in profile["modules"]]
    assert names[0] == "unet" and [m["calls"] for m in profile["modules"] if m["name"] == "unet"] == [1]
    assert not [name for name in names if name.startswith(("text_encoder", "vae"))]


def test_a_pipeline_failing_inside_the_profiled_step_keeps_the_trace(monkeypatch, tmp_path, capsys):
    pipe = tiny_pipeline("sd")
    calls = {"n": 0}

    def fail_in_step_2(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")

    handle = pipe.unet.register_forward_pre_hook(fail_in_step_2)
    try:
        assert _run(monkeypatch, tmp_path, pipe, "--profile", "2") == 1
    finally:
        handle.remove()
    assert "planted failure" in capsys.readouterr().err
    run_dir = _run_dir(tmp_path)
    profile = load_run(run_dir).summary["profile"]
    assert profile["note"].startswith("the profiled step did not end (an error, or policy stop)")
    json.loads((run_dir / "profile-step2.json").read_text(), parse_constant=_raise_on_constant)
    assert _hooks(pipe.unet) == 0


def test_a_step_outside_the_run_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the pipeline must not load")

    monkeypatch.setattr(pipeline_loading, "load_pipeline", no_loading)
    assert main(["run", "--steps", "3", "--profile", "3", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "diffusion-debug run: error: --profile 3 is not a denoising step of a 3-step run "
        "(steps count from 0; at most 2)."
    )
    assert not list(tmp_path.iterdir())


def test_a_pipeline_without_step_callbacks_is_refused_with_one_line(monkeypatch, tmp_path, capsys):
    pipe = tiny_pipeline("sd")
    pipe.__call__ = lambda prompt, **kwargs: None  # the shape of a pipeline older than callback_on_step_end
    assert _run(monkeypatch, tmp_path, pipe, "--profile", "1") == 2
    assert capsys.readouterr().err.strip() == (
        "diffusion-debug run: error: --profile needs a pipeline whose call takes callback_on_step_end; "
        "StableDiffusionPipeline does not."
    )
    assert not [p for p in tmp_path.iterdir() if (p / "summary.json").is_file()]
