"""`diffusion-debug launch` on an unmodified script under Accelerate's DeepSpeed plugin (ZeRO-2),
2 CPU processes on gloo (DS_ACCELERATOR=cpu): `accelerator.backward` runs DeepSpeed's backward and
its optimizer step, and the launcher watches them there. One launch of 14 steps, clean but for a
NaN that a tensor hook makes in rank 1's own gradient of one parameter at step 12. Skipped, saying
why, where DeepSpeed does not install or import (``pip install 'diffusion-debug[deepspeed]'``)."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from diffusion_debug.jobs.launch_end import NO_HTML
from diffusion_debug.record import load_run
from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env, free_port, run_launch

pytestmark = pytest.mark.xdist_group("launches")

SCRIPT = Path(__file__).with_name("launch_deepspeed_script.py")
ROOT = Path(__file__).resolve().parents[2]
NAN_PARAMETER = "up_blocks.1.resnets.0.conv2.weight"  # in rank 1's half of ZeRO's flat partition
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,  # said: the script prepares no DataLoader to take it from
    "gradient_accumulation_steps": 1,
    "train_batch_size": "auto",
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "steps_per_print": 10**6,
}
TIMEOUT = 300  # seconds: two processes importing DeepSpeed and diffusers on two shared cores


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, str, str]:
    """The run directory, the script's stdout and the launch's stderr."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    tmp = tmp_path_factory.mktemp("launch_deepspeed")
    config = tmp / "deepspeed.json"
    config.write_text(json.dumps(DEEPSPEED_CONFIG))
    accelerate = ["--use_deepspeed", "--deepspeed_config_file", str(config), "--num_processes", "2"]
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
