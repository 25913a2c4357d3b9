"""Numeric options out of their range (issue 24): one line, exit 2, before any work and before a run
directory, where they were an internal error (exit 1) from a library deep in the run, or a hang."""

from __future__ import annotations

import pytest

from diffusion_debug.cli import main
from diffusion_debug.jobs.finetune import MAX_BATCH_SIZE
from diffusion_debug.jobs.pipeline_loading import saved_scheduler_config

BIG = str(2**70)

CASES = [
    # numpy, which Accelerate's set_seed seeds too, takes 32 bits (was ValueError, exit 1)
    (
        ["train", "--seed", "-1"],
        "diffusion-debug train: error: argument --seed: must be between 0 and 2**32-1, not -1",
    ),
    (
        ["train", "--seed", str(2**32)],
        "diffusion-debug train: error: argument --seed: must be between 0 and 2**32-1, not 4294967296",
    ),
    # more steps than the scheduler's training timesteps (demo: ValueError after its first run started)
    (
        ["demo", "--steps", "1001"],
        "diffusion-debug demo: error: --steps 1001 is more than the scheduler's 1000 training timesteps "
        "(at most 1000).",
    ),
    # doctor: tabulated as "no run finished", exit 0
    (
        ["doctor", "--steps", BIG],
        f"diffusion-debug doctor: error: --steps {BIG} is more than the scheduler's 1000 training timesteps "
        "(at most 1000).",
    ),
    # eight synthetic batches made up front: a huge batch filled memory before the first step
    (
        ["train", "--batch-size", BIG],
        f"diffusion-debug train: error: --batch-size {BIG} is more than {MAX_BATCH_SIZE}.",
    ),
]


@pytest.mark.parametrize(("argv", "line"), CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_an_out_of_range_number_is_one_line_exit_2(capsys, tmp_path, argv, line):
    out_dir = tmp_path / "out"
    try:
        code = main([*argv, "--output-dir", str(out_dir)])
    except SystemExit as exit:  # argparse's own one line
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.rstrip("\n").removesuffix(" (--help for usage)") == line
    assert not out_dir.exists() or not any(out_dir.iterdir())  # no run directory


def test_a_model_directorys_scheduler_config_is_read_without_loading(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text('{"num_train_timesteps": 500}')
    assert saved_scheduler_config(str(tmp_path))["num_train_timesteps"] == 500
    (tmp_path / "scheduler" / "scheduler_config.json").write_text("[1, 2")  # unreadable: loading says so later
    assert saved_scheduler_config(str(tmp_path)) == {}
    assert saved_scheduler_config(None, "sd3")["num_train_timesteps"] == 1000
