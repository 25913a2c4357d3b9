"""`diffusion-debug launch` on an unmodified script under Accelerate's DeepSpeed plugin (ZeRO-2),
2 CPU processes on gloo (DS_ACCELERATOR=cpu): `accelerator.backward` runs DeepSpeed's backward and
its optimizer step, and the launcher watches them there. One launch of 14 steps, clean but for a
NaN that a tensor hook makes in rank 1's own gradient of one parameter at step 12; and the same
script with an out-of-memory error in step 0's forward, run as that launch's processes run it in the
session's one 2-process launch (multiprocess_job.py's ``launched_accelerate_zero2_oom0``). Both read
launch_deepspeed_config.json (``train_micro_batch_size_per_gpu`` said: the script prepares no
DataLoader to take it from). Skipped, saying why, where DeepSpeed does not install or import
(``pip install 'diffusion-debug[deepspeed]'``)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from diffusion_debug.jobs.launch_end import NO_HTML
from diffusion_debug.record import load_run
from diffusion_debug.testing.launch import (
    accelerate_launcher,
    check_step_0_oom_on_two_ranks,
    cpu_launch_env,
    free_port,
    run_launch,
)

pytestmark = pytest.mark.xdist_group("launches")

SCRIPT = Path(__file__).with_name("launch_deepspeed_script.py")
ROOT = Path(__file__).resolve().parents[2]
NAN_PARAMETER = "up_blocks.1.resnets.0.conv2.weight"  # in rank 1's half of ZeRO's flat partition
DEEPSPEED_CONFIG = Path(__file__).with_name("launch_deepspeed_config.json")  # ZeRO-2, 2 samples a rank
TIMEOUT = 300  # seconds: two processes importing DeepSpeed and diffusers on two shared cores


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, str, str]:
    """The run directory, the script's stdout and the launch's stderr."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    tmp = tmp_path_factory.mktemp("launch_deepspeed")
    accelerate = ["--use_deepspeed", "--deepspeed_config_file", str(DEEPSPEED_CONFIG), "--num_processes", "2"]
    accelerate += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    accelerate += ["--main_process_port", str(free_port())]
    cmd = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", str(tmp / "runs")]
    cmd += [*accelerate, str(SCRIPT), "--steps", "14", "--nan-grad-at", "12"]
    env = {**cpu_launch_env(ROOT), "DS_ACCELERATOR": "cpu", NO_HTML: "1"}  # its tests read no report.html
    done = run_launch(cmd, env, tmp, TIMEOUT)
    if done.returncode is None:
        pytest.fail("the Accelerate DeepSpeed launch hung")
    if done.stdout.startswith("NO_DEEPSPEED"):
        pytest.skip(f"deepspeed does not import: {done.stdout.splitlines()[0][len('NO_DEEPSPEED ') :]}")
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir, done.stdout, done.stderr


def test_a_nan_made_on_rank_1_at_step_12_is_the_headline_and_the_clean_steps_are_quiet(launched):
    run_dir, stdout, stderr = launched
    # DeepSpeed's own overflow check skipped that step, on both ranks; nothing else was skipped
    assert "RANK 0 DONE skipped=1" in stdout and "RANK 1 DONE skipped=1" in stdout, stdout + stderr[-3000:]
    run = load_run(run_dir)
    found = [(a.kind, a.severity, a.rank, a.step, a.parameter) for a in run.anomalies]
    # clean for 12 steps, and no "made after the first step" line for the torch optimizer inside ZeRO's
    assert found == [("nonfinite", "error", 1, 12, NAN_PARAMETER), ("skipped_step", "info", 0, 12, None)]
    assert "not watched" not in stderr and "debugger_error" not in stderr
    assert run.summary["headline"]["where"] == f"model {NAN_PARAMETER}, step 12, rank 1"
    nan, skipped = run.anomalies
    assert nan.details["reduction"] == {
        "origins": [1],
        "made_here": True,
        "through": "DeepSpeed ZeRO's gradient reduction",
    }
    assert (skipped.details["reason"], skipped.details["overflow_ranks"]) == ("deepspeed_overflow", [1])
    assert skipped.message.startswith("The optimizer step 12 was skipped by DeepSpeed's overflow check")


def test_every_step_is_watched_with_deepspeeds_own_gradient_norm(launched):
    """The first step too (the debugger is made before the engine's first step), each read from the
    rank's ZeRO partitions just before the step: the norm DeepSpeed computed for it, on both ranks."""
    run_dir, stdout, _ = launched
    run = load_run(run_dir)
    assert run.summary["training"]["total_steps"] == 14
    rows = {(row["rank"], row["step"]): row for row in run.rank_steps}
    assert sorted(rows) == [(rank, step) for rank in (0, 1) for step in range(14)]
    printed = re.findall(r"RANK (\d) STEP (\d+) LOSS (\S+) GRAD_NORM (\S+)\n", stdout)
    assert len(printed) == 28, stdout
    for rank, step, loss, norm in printed:
        row = rows[int(rank), int(step)]
        assert row["loss"] == float(loss), (rank, step)
        if int(step) == 12:  # the planted NaN: DeepSpeed's norm says inf, the row keeps NaN
            assert (norm, row["grad_norm"]) == ("inf", "nan")
        else:
            assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-6), (rank, step)


def test_an_out_of_memory_error_in_step_0s_forward_is_recorded_on_each_rank_and_goes_up_unchanged(launched_in_job):
    """Under the plugin the debugger was made at the first ``backward`` (``DeepSpeedEngineWrapper``'s), after
    step 0's forward: an OOM there (the usual first failure of a fine-tune) left only "nothing was watched
    ... it raised OutOfMemoryError". It is now made as the prepared engine's first forward under grad begins
    (DeepSpeed's own hooks are on the model inside it, not on the engine: launch's runs first): each rank's
    OOM, planted in ``conv_in`` at step 0 on both ranks, is recorded at its module, step and rank, the run
    saved with how the script ended, and the script's own error reaches it unchanged."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    done = launched_in_job("launched_accelerate_zero2_oom0")  # --steps 1 --oom-at 0, DIFFUSION_DEBUG_NO_HTML=1
    (run_dir,) = (done.args / "runs").iterdir()
    run = load_run(run_dir)
    check_step_0_oom_on_two_ranks(done, run)
    assert run.summary["world_size"] == 2


MULTIPROCESS_JOB_SCENARIOS = ("launched_accelerate_zero2_oom0",)
"""What the session's 2-process launch runs for this module (multiprocess_job.py's ``LAUNCHED``)."""
