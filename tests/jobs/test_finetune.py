"""The diffusers-style fine-tuning job (tiny UNet, DDPMScheduler noise, MSE, Accelerate) on one
process: a healthy run gives no warning; each planted fault is flagged at its own step with its
own kind, and the report's headline and the terminal's first row name it."""

import os
import stat
import urllib.request
from html import escape

import pytest

from diffusion_debug import DebugConfig
from diffusion_debug.cli import main
from diffusion_debug.errors import DiffusionDebugError
from diffusion_debug.jobs.finetune import FinetuneOptions, Injection, check_options, run_finetune
from diffusion_debug.record import by_cause, load_run, severity_rank
from diffusion_debug.report.terminal import render_terminal


def _run(tmp_path, *injections, steps=7, html=True):
    options = FinetuneOptions(
        steps=steps,
        cpu=True,
        injections=[Injection.parse(text) for text in injections],
        config=DebugConfig(output_dir=str(tmp_path)),
        html=html,
    )
    return load_run(run_finetune(options)["run_dir"])


def test_a_healthy_run_gives_no_warning_and_the_real_clipped_flag(tmp_path):
    run = _run(tmp_path, html=False)  # no report.html: seconds saved, the rest as always
    assert not (run.run_dir / "report.html").exists()
    assert [a for a in run.anomalies if severity_rank(a.severity) >= severity_rank("warning")] == []
    # the job clips at max_grad_norm=1.0 and passes it: the tiny UNet's pre-clip norms are above it
    assert all(row["grad_norm_clipped"] is (row["grad_norm"] > 1.0) for row in run.steps)
    assert any(row["grad_norm_clipped"] for row in run.steps)
    # report files are written 0644, like events.jsonl (under the usual umask 022)
    umask = os.umask(0o022)
    os.umask(umask)
    if umask == 0o022:
        modes = {name: stat.S_IMODE((run.run_dir / name).stat().st_mode) for name in ("summary.json", "events.jsonl")}
        assert modes == {"summary.json": 0o644, "events.jsonl": 0o644}


@pytest.mark.parametrize(
    "fault, kind, step, component",
    [
        ("nan-input@3", "nonfinite_input", 3, "input"),
        ("lr-spike@3", "lr_spike", 3, "optimizer"),
        ("loss-spike@4", "loss_spike", 4, "model"),
        ("nan-grad@3", "nonfinite", 3, "model"),
    ],
)
def test_each_planted_fault_is_the_headline_at_its_own_step(tmp_path, fault, kind, step, component):
    run = _run(tmp_path, fault)
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.step, first.rank, first.component) == (kind, step, 0, component)
    assert not any(a.step is not None and a.step < step for a in run.anomalies)  # nothing before the fault
    html = (run.run_dir / "report.html").read_text()
    assert escape(f"Most important: {kind} at {first.where()}") in html
    table = render_terminal(run).split("\n")
    first_row = next(line for line in table if line.startswith(("error", "warning")))
    assert kind in first_row
    if kind == "nonfinite_input":  # the NaN loss and gradients say they follow from it
        loss = next(a for a in run.anomalies if a.kind == "nonfinite_loss")
        assert loss.step == 3 and "from the non-finite input batch" in loss.message
        assert first.parameter == 'inputs["pixel_values"]'
    if kind == "nonfinite":  # the planted gradient, not the last layer in backward order
        assert (
            first.parameter.startswith("mid_block") and "1 gradient(s) hold NaN/Inf, first registered" in first.message
        )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"snr_gamma": -5.0}, "--snr-gamma must be a positive finite number, not -5.0."),
        ({"learning_rate": float("nan")}, "--learning-rate must be a positive finite number, not nan."),
        ({"max_grad_norm": 0.0}, "--max-grad-norm must be a positive finite number, not 0.0."),
        ({"steps": 0}, "--steps must be at least 1, not 0."),
        ({"batch_size": -1}, "--batch-size must be at least 1, not -1."),
    ],
)
def test_numeric_options_are_checked(changes, message):
    with pytest.raises(DiffusionDebugError) as caught:
        check_options(FinetuneOptions(**changes))
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "injections, message",
    [
        (["nan-grad@3"], "--inject nan-grad@3: the run's steps are 0 to 2 (--steps 3), so step 3 never comes."),
        (["loss-spike@99"], "--inject loss-spike@99: the run's steps are 0 to 2 (--steps 3), so step 99 never comes."),
        (
            ["nan-grad@1", "lr-spike@1"],
            "--inject nan-grad@1 and lr-spike@1 are at the same step; plant one fault per step.",
        ),
    ],
)
def test_an_injection_that_would_plant_nothing_is_refused(injections, message):
    with pytest.raises(DiffusionDebugError) as caught:
        check_options(FinetuneOptions(steps=3, injections=[Injection.parse(text) for text in injections]))
    assert str(caught.value) == message


def test_nan_loss_rank1_in_one_process_is_one_line_before_the_run(capsys, tmp_path):
    argv = ["train", "--cpu", "--steps", "3", "--inject", "nan-loss-rank1@1", "--output-dir", str(tmp_path), "--quiet"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "diffusion-debug train: error: --inject nan-loss-rank1@1 needs 2 or more processes "
        "(accelerate launch --num_processes 2 ...); this run has 1.\n"
    )
    assert list(tmp_path.iterdir()) == []  # no run directory


@pytest.mark.parametrize("argv", [["--snr-gamma", "-5"], ["--learning-rate", "nan"], ["--learning-rate", "inf"]])
def test_train_rejects_bad_numbers_in_one_line_with_exit_2(capsys, argv):
    assert main(["train", "--cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "must be a positive finite number" in err


def _saved(kind, path, damage=None):
    from diffusion_debug.testing import tiny_pipeline

    tiny_pipeline(kind).save_pretrained(path)
    if damage is not None:
        damage(path)
    return path


@pytest.mark.parametrize(
    "kind, damage, message",
    [
        (
            "sd3",
            None,
            "--model '{model}' has no UNet (a StableDiffusion3Pipeline); train fine-tunes the UNet of a "
            "Stable Diffusion 1.x/2.x pipeline.",
        ),
        (
            "sdxl",
            None,
            "--model '{model}': its UNet needs added conditions ('text_time', as SDXL's); train feeds it text "
            "embeddings only (a Stable Diffusion 1.x/2.x pipeline).",
        ),
        (
            "sd",
            lambda path: (path / "scheduler" / "scheduler_config.json").write_text("{broken"),
            "--model '{model}' could not be loaded: OSError: It looks like the config file at "
            "'{model}/scheduler/scheduler_config.json' is not a valid JSON file.",
        ),
    ],
    ids=["sd3-no-unet", "sdxl-added-conditions", "broken-scheduler-config"],
)
def test_train_on_a_model_it_cannot_train_is_one_line_before_the_run(capsys, tmp_path, kind, damage, message):
    model = _saved(kind, tmp_path / "model", damage)
    capsys.readouterr()  # what saving it printed
    out = tmp_path / "out"
    assert main(["train", "--cpu", "--steps", "1", "--model", str(model), "--output-dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"diffusion-debug train: error: {message.format(model=model)}\n"
    assert list(out.iterdir()) == []  # no run directory


def test_train_serves_the_run_live_with_serve_port_from_the_config(tmp_path, capsys):
    config = tmp_path / "live.yaml"
    config.write_text("serve_port: 0\nlevel: basic\n")
    argv = ["train", "--cpu", "--steps", "1", "--config", str(config), "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--no-html"]) == 0
    out = capsys.readouterr().out
    (run_dir,) = (tmp_path / "o").iterdir()
    assert out.endswith(f"\nrun: {run_dir} (--no-html: no report.html; diffusion-debug report RUN_DIR builds it)\n")
    assert (run_dir / "summary.json").is_file() and not (run_dir / "report.html").exists()
    line = next(line for line in out.splitlines() if line.startswith("serving the live run at http://127.0.0.1:"))
    assert line.endswith("/debug/training/summary")
    with pytest.raises(OSError):  # the job closed its debugger, and the server with it
        urllib.request.urlopen(line.split(" at ", 1)[1], timeout=5)


def test_ctrl_c_during_train_says_where_the_run_so_far_is(tmp_path, capsys, monkeypatch):
    from diffusion_debug.jobs.progress import TrainingProgress

    def interrupt_at_step_1(self):
        if getattr(self, "_done_steps", 0) == 1:
            raise KeyboardInterrupt
        self._done_steps = getattr(self, "_done_steps", 0) + 1

    monkeypatch.setattr(TrainingProgress, "step_done", interrupt_at_step_1)
    assert main(["train", "--cpu", "--steps", "4", "--output-dir", str(tmp_path), "--quiet", "--no-html"]) == 130
    (run_dir,) = tmp_path.iterdir()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"diffusion-debug train: interrupted; the run so far is in {run_dir} (diffusion-debug report DIR)."
    )
    assert [row["step"] for row in load_run(run_dir).steps] == [0, 1]
