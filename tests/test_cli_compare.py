"""``diffusion-debug diff RUN_A RUN_B`` and ``diffusion-debug compare`` on the tiny SD pipeline: a UNet
weight changed by 1% is named at its conv and step 0 from two saved runs, as compare_pipelines names
it live; a clean pair, an eager/compiled pair and an fp32/fp16 pair are equal within the stated
tolerance; bad input is one line and exit code 2 before anything is compared or loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, compare_pipelines
from diffusion_debug.cli import main
from diffusion_debug.jobs import pipeline_loading
from diffusion_debug.record import load_json
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import SAME_NOISE_IN_HALF

CALL = dict(prompt="a cat", num_inference_steps=2, output_type="np")
# one worker under `pytest -n 2 --dist loadgroup`: the module's `runs` are made once, not once on each
# worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("cli_compare")
CONV = "up_blocks.1.resnets.0.conv2"
EQUAL = "equal within rtol 1e-05 (float32 against float32): 2 steps compared"


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def saved_run(pipe, out, level="extreme", steps=2):
    debugger = DiffusionModelDebugger(pipe, DebugConfig(level=level, output_dir=str(out)))
    with debugger:
        pipe(**{**CALL, "num_inference_steps": steps}, generator=torch.Generator().manual_seed(0))
    return debugger.report().save()


def changed_pipeline():
    pipe = tiny_pipeline("sd")
    with torch.no_grad():
        pipe.unet.get_submodule(CONV).weight.mul_(1.01)
    return pipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two clean extreme runs (two pipelines loaded alike) and one whose UNet conv weight is 1% larger."""
    out = tmp_path_factory.mktemp("runs")
    return dict(
        a=saved_run(tiny_pipeline("sd"), out),
        clean=saved_run(tiny_pipeline("sd"), out),
        changed=saved_run(changed_pipeline(), out),
    )


def test_diff_names_the_changed_conv_at_step_0_as_compare_pipelines_does(capsys, tmp_path, runs):
    live = compare_pipelines(tiny_pipeline("sd"), changed_pipeline(), **CALL).first_divergence
    code, out, err = run_cli(capsys, "diff", runs["a"], runs["changed"], "--output-dir", tmp_path)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"first divergence: unet {CONV}, step 0, relative error ")
    assert lines[0].endswith(" > rtol 1e-05 (float32 against float32), made there")
    (saved,) = tmp_path.glob("diff-*")
    assert lines[-1] == f"report: {saved / 'report.html'}"
    record = load_json(saved / "comparison.json")
    d = record["first_divergence"]
    assert (d["component"], d["module"], d["step"], d["made_here"]) == (
        live.component,
        live.module,
        live.step,
        live.made_here,
    )
    assert d["timestep"] == live.timestep == 501.0  # the first of 2 leading-spaced steps
    assert 0.005 < d["relative_error"] < 0.02  # a sum of the conv's output, 1% larger
    assert record["tolerance"] == 1e-5 and [s["step"] for s in record["steps"]] == [0, 1]
    # the conv made it; every module after it received it (its table row first)
    modules = record["modules"]
    assert modules[0]["module"] == CONV and modules[0]["made_here"] and modules[0]["input_error"] == 0.0
    assert not any(m["made_here"] for m in modules[1:])
    assert lines[5].split() == [CONV, "made", "there", f"{modules[0]['relative_error']:.4g}", "0"]


def test_diff_of_a_clean_pair_says_equal_within_the_tolerance(capsys, tmp_path, runs):
    code, out, err = run_cli(capsys, "diff", runs["a"], runs["clean"], "--output-dir", tmp_path)
    (saved,) = tmp_path.glob("diff-*")
    assert (code, err) == (0, "")
    assert out.splitlines() == [EQUAL, "", f"report: {saved / 'report.html'}"]


@pytest.mark.skipif(not SAME_NOISE_IN_HALF, reason="this torch draws other noise in float16 than in float32")
def test_diff_of_an_fp32_and_an_fp16_run_is_judged_against_fp16_rounding(capsys, tmp_path, runs):
    """Their module readings are a sum and an abs-max: the step rows are compared, within fp16's tolerance."""
    half = saved_run(tiny_pipeline("sd", dtype=torch.float16), tmp_path)
    code, out, _ = run_cli(capsys, "diff", runs["a"], half, "--output-dir", tmp_path / "diffs")
    assert code == 0
    assert out.splitlines()[0] == "equal within rtol 0.01 (float32 against float16): 2 steps compared"


def test_only_an_extreme_run_records_module_readings_and_diff_falls_back_to_the_step_rows(capsys, tmp_path):
    a, b = saved_run(tiny_pipeline("sd"), tmp_path, "advanced"), saved_run(changed_pipeline(), tmp_path, "advanced")
    assert not (a / "modules.jsonl").exists()
    code, out, _ = run_cli(capsys, "diff", a, b, "--output-dir", tmp_path / "diffs")
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith("first divergence: unet, step 0, relative error ")
    assert first.endswith("made there (step rows only: level extreme records each module)")


def test_module_readings_are_one_line_per_component_call_in_execution_order(runs):
    lines = [json.loads(line) for line in (runs["a"] / "modules.jsonl").read_text().splitlines()]
    calls = [(c["component"], c["site"], c["step"]) for c in lines]
    # the prompt and the negative prompt, each UNet step, the VAE's decoder
    assert calls == [("text_encoder", "", None)] * 2 + [("unet", "", 0), ("unet", "", 1), ("vae", "decoder", None)]
    unet = {m[0]: m for m in lines[2]["modules"]}
    assert lines[2]["modules"][-1][0] == "" and CONV in unet  # the UNet's own reading returns last


def test_diff_bad_input_is_one_line_before_any_work(capsys, tmp_path, runs):
    out = tmp_path / "out"
    missing = tmp_path / "nothing"
    code, _, err = run_cli(capsys, "diff", missing, runs["a"], "--output-dir", out)
    assert (code, err) == (
        2,
        f"diffusion-debug diff: error: RUN_A {str(missing)!r} is not a run directory: no such directory.\n",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "diff", runs["a"], empty, "--output-dir", out)
    assert (code, err) == (
        2,
        f"diffusion-debug diff: error: {str(empty)!r} is not a run directory: it has no summary.json and no "
        "events.jsonl.\n",
    )
    longer = saved_run(tiny_pipeline("sd"), tmp_path / "three", steps=3)
    code, _, err = run_cli(capsys, "diff", runs["a"], longer, "--output-dir", out)
    assert (code, err) == (
        2,
        "diffusion-debug diff: error: RUN_A recorded 2 denoising steps and RUN_B 3: diff compares runs of one "
        "step count.\n",
    )
    other = tmp_path / "other"  # a copy whose summary names another pipeline
    shutil.copytree(runs["clean"], other)
    summary = load_json(other / "summary.json")
    summary["pipeline"] = "StableDiffusionXLPipeline"
    (other / "summary.json").write_text(json.dumps(summary))
    code, _, err = run_cli(capsys, "diff", runs["a"], other, "--output-dir", out)
    assert (code, err) == (
        2,
        "diffusion-debug diff: error: RUN_A ran StableDiffusionPipeline and RUN_B StableDiffusionXLPipeline: diff "
        "compares two runs of one pipeline.\n",
    )
    assert not out.exists()  # nothing written for any of them


def test_compare_eager_against_aot_eager_is_equal_within_fp32_tolerance(capsys, tmp_path):
    argv = ["compare", "--prompt", "a cat", "--steps", 2, "--b", "compile=aot_eager", "--output-dir", tmp_path]
    code, out, err = run_cli(capsys, *argv)
    (saved,) = tmp_path.glob("compare-*")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "A: kind=sd dtype=float32 compile=off",
        "B: kind=sd dtype=float32 compile=aot_eager",
        EQUAL,
        "",
        f"report: {saved / 'report.html'}",
    ]
    assert load_json(saved / "comparison.json")["first_divergence"] is None


@pytest.mark.skipif(not SAME_NOISE_IN_HALF, reason="this torch draws other noise in float16 than in float32")
def test_compare_fp32_against_fp16_is_judged_against_fp16_rounding(capsys, tmp_path):
    argv = ["compare", "--prompt", "a cat", "--steps", 2, "--b", "dtype=float16", "--output-dir", tmp_path]
    code, out, _ = run_cli(capsys, *argv)
    (saved,) = tmp_path.glob("compare-*")
    assert code == 0
    assert out.splitlines()[:3] == [
        "A: kind=sd dtype=float32 compile=off",
        "B: kind=sd dtype=float16 compile=off",
        "equal within rtol 0.01 (float32 against float16): 2 steps compared",
    ]
    record = load_json(saved / "comparison.json")
    assert record["tolerance"] == 0.01 and record["dtypes"] == ["float32", "float16"]


@pytest.mark.parametrize(
    "side, message",
    [
        (
            ["--b", "dtyp=float16"],
            "--b: unknown key 'dtyp'; did you mean 'dtype'? choose from model, kind, dtype, device, compile.",
        ),
        (["--a", "dtype"], "--a takes KEY=VALUE (e.g. --a dtype=float16), not 'dtype'."),
        (["--b", "dtype=float8"], "--b dtype: 'float8' is not one of float32, float16, bfloat16."),
        (["--b", "kind=flux"], "--b kind: 'flux' is not one of sd, sdxl, sd3."),
    ],
)
def test_compare_bad_settings_are_one_line_before_anything_loads(capsys, tmp_path, monkeypatch, side, message):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *a: pytest.fail("loaded a pipeline"))
    code, out, err = run_cli(capsys, "compare", *side, "--output-dir", tmp_path / "out")
    assert (code, out, err) == (2, "", f"diffusion-debug compare: error: {message}\n")
    assert not (tmp_path / "out").exists()


def test_compare_an_unknown_compile_backend_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda *a: pytest.fail("loaded a pipeline"))
    code, _, err = run_cli(capsys, "compare", "--b", "compile=fast", "--output-dir", tmp_path)
    assert code == 2
    assert err.startswith("diffusion-debug compare: error: --b compile: 'fast' is not a torch.compile backend; ")
    assert "aot_eager" in err and err.count("\n") == 1
