"""What ``diffusion-debug run`` says after a call that went wrong: policy ``raise`` (its whole
message, and a replay command that runs as printed), policy ``stop`` (where and why), and
``--repeat`` with a planted per-call warning (shown once)."""

from __future__ import annotations

import shlex
from html import escape

import pytest
import torch

from diffusion_debug.cli import main
from diffusion_debug.record import by_cause, load_json, load_run
from diffusion_debug.testing import tiny_pipeline

FAULTY_MODULE = "up_blocks.1.resnets.0.conv2"
# one worker under -n 2 --dist loadgroup: the module's `faulty_pipeline` (a saved pipeline) is made once
pytestmark = pytest.mark.xdist_group("run_outcomes")


@pytest.fixture(scope="module")
def faulty_pipeline(tmp_path_factory):
    """A saved pipeline whose UNet has one Inf weight: the fault travels with the weights."""
    pipe = tiny_pipeline("sd", seed=3)
    with torch.no_grad():
        pipe.unet.get_submodule(FAULTY_MODULE).weight.view(-1)[0] = float("inf")
    path = tmp_path_factory.mktemp("faulty") / "tiny-sd"
    pipe.save_pretrained(path)
    return path


def _only_run_dir(output_dir):
    (run_dir,) = [p for p in output_dir.iterdir() if (p / "summary.json").is_file()]
    return run_dir


def test_the_replay_command_of_a_raise_run_works_as_printed(capsys, tmp_path, monkeypatch, faulty_pipeline):
    monkeypatch.chdir(tmp_path)  # the printed paths are relative to where the user is
    argv = ["run", "--model", str(faulty_pipeline), "--policy", "raise", "--steps", "2", "--output-dir", "out"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    run_dir = _only_run_dir(tmp_path / "out")
    assert load_json(run_dir / "invocation.json")["model"] == str(faulty_pipeline.resolve())

    # the one stderr line is whole: the anomaly's sentence, then the run directory
    cause = by_cause(load_run(run_dir).anomalies)[0]
    assert (cause.kind, cause.module, cause.step) == ("nonfinite", FAULTY_MODULE, 0)
    whole = f"{cause.kind} at {cause.where()}: {cause.message} (run directory: out/{run_dir.name})"
    assert err == f"diffusion-debug: stopped by policy 'raise': {whole}\n"

    # the terminal and report.html print the same replay command, with the model the run loaded
    (printed,) = [line.removeprefix("replay: ") for line in out.splitlines() if line.startswith("replay: ")]
    assert printed == (
        f"diffusion-debug replay out/{run_dir.name}/bundles/unet-step0 --model {faulty_pipeline.resolve()}"
    )
    assert escape(printed) in (run_dir / "report.html").read_text()
    program, *replay_argv = shlex.split(printed)
    assert program == "diffusion-debug"
    assert main(replay_argv) == 0
    assert capsys.readouterr().out.startswith(f"first non-finite value: unet {FAULTY_MODULE} (step 0")


def test_policy_stop_says_where_it_stopped_and_why(capsys, tmp_path, faulty_pipeline):
    argv = ["run", "--model", str(faulty_pipeline), "--policy", "stop", "--steps", "3", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    cause = by_cause(load_run(_only_run_dir(tmp_path)).anomalies)[0]
    assert (cause.kind, cause.module, cause.step) == ("nonfinite", FAULTY_MODULE, 0)
    expected = (
        f"stopped: policy 'stop' ended the denoising loop after step 0 (nonfinite at {cause.where()}); the image "
        "is decoded from the latents of that step."
    )
    assert expected in out.splitlines()


def test_repeat_shows_each_warning_and_each_table_row_once(capsys, tmp_path, faulty_pipeline):
    argv = ["run", "--model", str(faulty_pipeline), "--policy", "warn", "--steps", "2", "--repeat", "2"]
    with pytest.warns(RuntimeWarning) as caught:  # pytest.warns shows every warning ("always")
        assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # the record keeps what each call found: the UNet's Inf and the VAE's non-finite input, twice
    found = [(a.component, a.module) for a in load_run(_only_run_dir(tmp_path)).anomalies if a.kind == "nonfinite"]
    assert sorted(found) == sorted([("unet", FAULTY_MODULE), ("vae", "")] * 2)
    # the warnings and the terminal's table say it once each
    ours = [str(w.message) for w in caught if str(w.message).startswith("diffusion-debug nonfinite")]
    assert len(ours) == len(set(ours)) == 2
    rows = [line for line in out.splitlines() if line.startswith(("error ", "warning ")) and "nonfinite " in line]
    assert len(rows) == 2 and "(found 2 times)" in out
