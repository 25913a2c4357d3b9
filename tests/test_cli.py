import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_debug.cli import main
from diffusion_debug.record import load_json
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.launch import free_port

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "tiny-sd"
    tiny_pipeline("sd", seed=3).save_pretrained(path)
    return path


def test_every_command_has_help(capsys):
    for command in ("demo", "run", "train", "doctor", "report", "inspect", "replay", "why", "serve"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert f"usage: diffusion-debug {command}" in capsys.readouterr().out


def test_run_on_a_saved_pipeline_directory(capsys, tmp_path, saved_pipeline):
    code, out, err = run_cli(
        capsys,
        "run",
        "--model",
        saved_pipeline,
        "--steps",
        3,
        "--output-dir",
        tmp_path,
        "--prompt",
        "a photo of a cat",
        "--seed",
        1,
    )
    assert code == 0, err
    run_dir = Path(out.strip().splitlines()[-1].removeprefix("report: ")).parent
    summary = load_json(run_dir / "summary.json")
    assert len(summary["steps"]) == 3
    assert summary["components"]["unet"]["parameters"] == sum(
        p.numel() for p in tiny_pipeline("sd", seed=3).unet.parameters()
    )
    assert (run_dir / "image.png").is_file() and (run_dir / "report.html").is_file()
    assert "steps (3 recorded)" in out and "UNet2DConditionModel" in out


FAULTY_MODULE = "up_blocks.1.resnets.0.conv2"


@pytest.fixture(scope="module")
def faulty_pipeline(tmp_path_factory):
    """A saved pipeline whose UNet has one Inf weight: a fault that reloads with it."""
    pipe = tiny_pipeline("sd", seed=3)
    with torch.no_grad():
        pipe.unet.get_submodule(FAULTY_MODULE).weight.view(-1)[0] = float("inf")
    path = tmp_path_factory.mktemp("faulty") / "tiny-sd"
    pipe.save_pretrained(path)
    return path


def test_run_with_policy_raise_exits_1_after_saving_the_run(capsys, tmp_path, faulty_pipeline):
    code, out, err = run_cli(
        capsys, "run", "--model", faulty_pipeline, "--policy", "raise", "--steps", 3, "--output-dir", tmp_path
    )
    assert code == 1
    assert "stopped by policy 'raise'" in err and FAULTY_MODULE in err
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    (first,) = [a for a in anomalies if a["kind"] == "nonfinite" and a["component"] == "unet"]
    assert (first["module"], first["step"], first["severity"]) == (FAULTY_MODULE, 0, "error")
    assert "nonfinite" in out  # the terminal summary of the saved run


def test_replay_a_bundle_names_the_producer(capsys, tmp_path, faulty_pipeline):
    code, out, _ = run_cli(capsys, "run", "--model", faulty_pipeline, "--steps", 2, "--output-dir", tmp_path)
    assert code == 0
    (bundle,) = (p for p in tmp_path.rglob("bundles/*") if p.is_dir())
    code, out, _ = run_cli(capsys, "replay", bundle, "--model", faulty_pipeline)
    assert code == 0
    assert out.startswith(f"first non-finite value: unet {FAULTY_MODULE} (step 0")


def test_replay_a_near_max_bundle_names_the_maker_and_where_it_overflowed(capsys, tmp_path, monkeypatch):
    """A bf16 VAE conv planted at 0.9 of bf16's max makes the next GroupNorm overflow: the run's bundle,
    replayed by the command on the same (planted) VAE, names the conv that made the values and the norm
    that overflowed on them; a VAE call has no denoising step, so none is named (before: "(step None,
    timestep None)")."""
    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.jobs import pipeline_loading
    from diffusion_debug.testing import plant_overflow

    conv, norm = "decoder.up_blocks.1.resnets.0.conv2", "decoder.up_blocks.1.resnets.1.norm1"
    pipe = tiny_pipeline("sd", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda model, kind, dtype, device: pipe)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with plant_overflow(pipe.vae.get_submodule(conv), fraction=0.9):
        with dbg:
            pipe("a cat", num_inference_steps=1, output_type="np")
        (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
        bundle = dbg.report().save() / error.details["bundle"]
        code, out, err = run_cli(capsys, "replay", bundle, "--quiet")
    dbg.close()
    assert (error.component, error.module, error.details["overflowed_in"]) == ("vae", conv, norm)
    assert (code, err) == (0, "")
    assert out == f"values near the dtype's max made by: vae {conv}, on which vae {norm} made NaN/Inf\n"


def test_replay_of_a_bundle_from_direct_denoiser_calls_names_the_step_alone(capsys, tmp_path, monkeypatch):
    """A loop that calls the UNet itself (no scheduler step) numbers its calls but has no timestep: the
    bundle's meta.json holds step 0, timestep null, and the line names the step alone (before:
    "(step 0, timestep None)")."""
    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.jobs import pipeline_loading

    pipe = tiny_pipeline("sd", seed=3)
    with torch.no_grad():
        pipe.unet.get_submodule(FAULTY_MODULE).weight.view(-1)[0] = float("inf")
    monkeypatch.setattr(pipeline_loading, "load_pipeline", lambda model, kind, dtype, device: pipe)
    unet = pipe.unet
    latents = torch.randn(1, unet.config.in_channels, 8, 8)
    prompt = torch.randn(1, 4, unet.config.cross_attention_dim)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        unet(latents, 10, encoder_hidden_states=prompt)
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    bundle = dbg.report().save() / error.details["bundle"]
    dbg.close()
    meta = load_json(bundle / "meta.json")
    assert (meta["step"], meta["timestep"]) == (0, None)
    code, out, err = run_cli(capsys, "replay", bundle, "--quiet")
    assert (code, err) == (0, "")
    assert out == f"first non-finite value: unet {FAULTY_MODULE} (step 0)\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["run", "--model", "/nonexistent/pipe"],
            "error: --model '/nonexistent/pipe' is not a diffusers pipeline directory (no model_index.json).",
        ),
        (["inspect", "--model", "/nonexistent/pipe"], "is not a diffusers pipeline directory"),
        (["report", "/nonexistent/run"], "error: '/nonexistent/run' is not a run directory: no such directory."),
        (
            ["train", "--inject", "boom@3"],
            "--inject 'boom@3' is not understood: use KIND@STEP with KIND one of nan-grad, lr-spike, lr-jump, "
            "nan-loss-rank1, nan-input, loss-spike.",
        ),
        (["train", "--data", "/nonexistent/images"], "--data '/nonexistent/images' is not a directory of images."),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def process_state():
    """What ``_quiet_libraries`` changes in the process: variables, library loggers, loading bars, warning filters."""
    import logging
    import warnings

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    names = ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY")
    loggers = ("diffusers", "transformers", "huggingface_hub", "accelerate")
    return (
        {name: os.environ.get(name) for name in names},
        {name: logging.getLogger(name).level for name in loggers},
        (diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()),
        list(warnings.filters),
    )


@pytest.mark.parametrize("argv", [["run", "--model", "/nonexistent/pipe"], ["report", "/nonexistent/run"]])
def test_a_command_run_in_process_leaves_the_libraries_logging_and_warnings_as_they_were(capsys, argv):
    """``main`` called in a process that goes on (a notebook, this suite) quietens diffusers and
    transformers for its command only: their verbosity, loading bars, the HF variables and the
    warning filters are put back. They stayed set: a later test or call of the process lost
    diffusers' warnings and loading bars (DIFFUSERS_VERBOSITY=error, six more warning filters)."""
    before = process_state()
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "error:" in err
    assert process_state() == before


def test_bad_config_file_is_reported_before_loading_anything(capsys, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text("polcy: raise\n")
    code, _, err = run_cli(capsys, "run", "--config", config, "--output-dir", tmp_path)
    assert code == 2
    assert err.strip() == "diffusion-debug run: error: Unknown config key 'polcy'; did you mean 'policy'?"
    assert [p.name for p in tmp_path.iterdir()] == ["typo.yaml"]  # no run directory


def test_argparse_rejects_bad_values(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--steps", "0"])
    assert info.value.code == 2
    assert "must be at least 1, not 0" in capsys.readouterr().err


def test_report_rebuilds_html_from_the_saved_files(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "run", "--steps", 2, "--output-dir", tmp_path, "--prompt", "photo " * 100)
    run_dir = Path(out.strip().splitlines()[-1].removeprefix("report: ")).parent
    (run_dir / "report.html").unlink()
    code, out, _ = run_cli(capsys, "report", run_dir)
    assert code == 0
    assert out.index("prompt_truncated") < out.index("steps (2 recorded)")
    assert (run_dir / "report.html").is_file()
    assert "prompt_truncated" in (run_dir / "report.html").read_text()


def test_inspect_json_and_table(capsys, saved_pipeline):
    code, out, _ = run_cli(capsys, "inspect", "--model", saved_pipeline, "--json")
    assert code == 0
    analysis = json.loads(out)
    pipe = tiny_pipeline("sd", seed=3)
    expected = sum(p.numel() for name in ("unet", "vae", "text_encoder") for p in getattr(pipe, name).parameters())
    assert analysis["total_parameters"] == expected
    code, out, _ = run_cli(capsys, "inspect", "--kind", "sdxl")
    assert code == 0
    assert "text_encoder_2" in out and "CLIPTextModelWithProjection" in out and "EulerDiscreteScheduler" in out


def test_train_single_process_finds_the_planted_nan_gradient(capsys, tmp_path):
    code, out, err = run_cli(
        capsys, "train", "--steps", 5, "--inject", "nan-grad@3", "--output-dir", tmp_path, "--cpu"
    )
    assert code == 0, err
    run_dir = Path(out.strip().splitlines()[-1].removeprefix("report: ")).parent
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    found = [a for a in anomalies if a["kind"] == "nonfinite"]
    assert found and found[0]["step"] == 3
    assert found[0]["parameter"].startswith("mid_block.") and found[0]["parameter"].endswith("weight")


@pytest.mark.xdist_group("launches")  # one launch at a time under pytest -n 2 (see test_multiprocess.py)
def test_train_under_accelerate_launch_two_processes(tmp_path):
    # no CUDA_VISIBLE_DEVICES here on purpose: `train --cpu` must hide a GPU by itself
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate_2cpu.yaml"),
        "--main_process_port",
        str(free_port()),
        "-m",
        "diffusion_debug.cli",
        "train",
        "--cpu",
        "--steps",
        "5",
        "--inject",
        "nan-loss-rank1@3",
        "--policy",
        "skip",
        "--output-dir",
        str(tmp_path),
        "--no-html",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = load_json(run_dir / "summary.json")
    losses = [a for a in summary["anomalies"] if a["kind"] == "nonfinite_loss"]
    # skip zeroed the poisoned gradients on both ranks, so the weights stayed finite after step 3
    assert [(a["rank"], a["step"]) for a in losses] == [(1, 3)]
    assert "stopped" not in proc.stderr
    said = f"\nrun: {run_dir} (--no-html: no report.html; diffusion-debug report RUN_DIR builds it)\n"
    assert said in proc.stdout, proc.stdout[-500:]
    assert not (run_dir / "report.html").exists()


def test_doctor_refuses_an_unknown_dtype_in_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "doctor", "--dtypes", "float32,fp8", "--output-dir", tmp_path)
    assert code == 2
    assert err.strip() == (
        "diffusion-debug doctor: error: --dtypes: unknown dtype 'fp8'; choose from float32, float16, bfloat16."
    )
    assert list(tmp_path.iterdir()) == []


def test_doctor_prints_a_table_and_a_recommendation(capsys, tmp_path):
    code, out, err = run_cli(capsys, "doctor", "--dtypes", "float16", "--steps", "1", "--output-dir", tmp_path)
    assert code == 0, err
    assert out.splitlines()[0].split()[:3] == ["run", "component", "finite"]
    assert "recommended: vae float16, text_encoder float16, unet float16" in out
    (doctor_dir,) = tmp_path.iterdir()
    assert f"details: {doctor_dir / 'doctor.json'}" in out
    assert sorted(p.name for p in doctor_dir.iterdir()) == ["doctor.json", "float16", "float32"]
    # each dtype's run names what it loaded, for its report's replay command (issue 23)
    for dtype in ("float16", "float32"):
        used = load_json(doctor_dir / dtype / "invocation.json")
        assert used == {"command": "doctor", "model": None, "kind": "sd", "dtype": dtype}


def _copy_of(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "model"))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            lambda model: (model / "scheduler" / "scheduler_config.json").write_text("{broken"),
            "OSError: It looks like the config file at '{model}/scheduler/scheduler_config.json' is not a valid "
            "JSON file.",
        ),
        (
            lambda model: (model / "unet" / "diffusion_pytorch_model.safetensors").unlink(),
            "OSError: Error no file named diffusion_pytorch_model.bin found in directory {model}/unet.",
        ),
    ],
    ids=["broken-scheduler-config", "no-unet-weights"],
)
def test_doctor_on_a_model_that_cannot_load_is_one_line_before_any_run(
    capsys, tmp_path, saved_pipeline, damage, reason
):
    model = _copy_of(saved_pipeline, tmp_path)
    damage(model)
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "doctor", "--model", model, "--steps", 1, "--output-dir", out_dir)
    assert code == 2 and out == ""
    message = f"diffusion-debug doctor: error: --model '{model}' could not be loaded: " + reason.format(model=model)
    assert err.strip().splitlines()[-1] == message
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


def test_doctor_tabulates_a_float16_that_cannot_load(capsys, tmp_path, monkeypatch):
    from diffusion_debug.jobs import pipeline_loading

    def load(model, kind, dtype, device):
        if dtype == "float16":
            raise pipeline_loading.DiffusionDebugError("no float16 kernels here (planted)")
        pipe = tiny_pipeline("sd", dtype=getattr(torch, dtype))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    monkeypatch.setattr(pipeline_loading, "load_pipeline", load)
    code, out, err = run_cli(capsys, "doctor", "--dtypes", "float16", "--steps", 1, "--output-dir", tmp_path)
    assert code == 0, err
    (doctor_dir,) = tmp_path.iterdir()
    runs = {run["label"]: run for run in load_json(doctor_dir / "doctor.json")["runs"]}
    assert (runs["float32"]["status"], runs["float16"]["status"]) == ("ok", "failed")
    assert (
        runs["float16"]["note"] == "could not load in float16: DiffusionDebugError: no float16 kernels here (planted)"
    )


def test_doctor_exits_1_when_no_dtype_finished(capsys, tmp_path, monkeypatch):
    from diffusion_debug.jobs import pipeline_loading

    def load(model, kind, dtype, device):
        pipe = tiny_pipeline("sd", dtype=getattr(torch, dtype))
        pipe.set_progress_bar_config(disable=True)

        def fail(module, inputs, output):
            raise RuntimeError("planted")

        pipe.unet.register_forward_hook(fail)
        return pipe

    monkeypatch.setattr(pipeline_loading, "load_pipeline", load)
    code, out, err = run_cli(
        capsys, "doctor", "--dtypes", "float16", "--steps", 1, "--output-dir", tmp_path, "--quiet"
    )
    assert code == 1
    assert "recommended: no run finished; see the notes" in out
    assert err == "diffusion-debug doctor: no dtype's run finished (the table's notes say why).\n"
    (doctor_dir,) = tmp_path.iterdir()
    assert [run["status"] for run in load_json(doctor_dir / "doctor.json")["runs"]] == ["failed", "failed"]


def test_inspect_shows_device_and_size_and_false_values(capsys):
    code, out, _ = run_cli(capsys, "inspect")
    assert code == 0
    header = out.splitlines()[1].split()
    # nothing has run, so no calls / time / peak columns (they would be empty)
    assert header == ["component", "class", "parameters", "dtype", "device", "MB"]
    unet = next(line for line in out.splitlines() if line.startswith("unet "))
    assert unet.split()[3:6] == ["float32", "cpu", "4.02"]
    assert re.search(r"^clip_sample\s+False$", out, flags=re.M)


def _report_into_head(tmp_path, *flags):
    """``diffusion-debug report RUN FLAGS | head -1`` over a 200,000-line summary; the run directory
    and the finished process."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"kind": "diffusion", "anomalies": [], "steps": []}))
    script = (
        "import sys; from diffusion_debug.cli import main; from diffusion_debug.report import terminal;"
        "terminal.render_terminal = lambda run: 'line\\n' * 200000; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        f'{sys.executable} -c "{script}" report {run} {" ".join(flags)} | head -1',
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run, done


def test_a_closed_pipe_ends_quietly(tmp_path):
    _, done = _report_into_head(tmp_path, "--no-html")
    assert done.stdout == "line\n"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_report_into_a_closed_pipe_still_rebuilds_report_html(tmp_path):
    run, done = _report_into_head(tmp_path)
    assert done.stdout == "line\n"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert (run / "report.html").is_file()  # written before the reader went away


def test_report_and_export_read_a_run_without_importing_diffusers(tmp_path):
    """Reading a run directory loads no pipeline: quieting diffusers' loading bar must not import it
    (seconds of every ``report``); its verbosity variable, set for an import during the command, is
    put back when the command returns (``main`` leaves the process's environment as it found it)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"kind": "diffusion", "anomalies": [], "steps": []}))
    # both commands in one process, one after the other (one Python importing torch, not two): each
    # prints what it left, and the second reads a process in which the first loaded none of it either
    script = (
        "import json, os, sys; from diffusion_debug.cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    code = main(argv)\n"
        "    print('LEFT', code, 'diffusers' in sys.modules, os.environ.get('DIFFUSERS_VERBOSITY'), flush=True)"
    )
    argvs = [["report", str(run), "--no-html"], ["export", str(run), "--out", str(tmp_path / "tables")]]
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)], capture_output=True, text=True, timeout=120
    )
    left = [line for line in done.stdout.splitlines() if line.startswith("LEFT ")]
    assert left == ["LEFT 0 False None"] * 2, (done.stdout, done.stderr)
