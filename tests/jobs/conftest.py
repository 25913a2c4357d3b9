"""The fork server of the jobs tests' single-process training runs: test_launch_safety.py's runs of
launch_small_script.py and test_launch.py's of the t2i and plain torch.optim scripts; and the reading
of the scripts that the session's 2-process launch of multiprocess_job.py runs as ``diffusion-debug
launch`` runs them (test_launch_engines.py's, test_launch.py's and test_launch_deepspeed.py's)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from fork_server import TRAINING, Forks

from diffusion_debug.testing.launch import cpu_launch_env

ROOT = Path(__file__).resolve().parents[2]

TRAINING_FORKS_IMPORTS = (
    *TRAINING,
    "diffusers:AutoencoderKL",
    "diffusers:DDPMScheduler",
    "transformers:CLIPTextModel",
    "diffusion_debug.testing.training_unets",
)
"""What the t2i script imports before the debugger (launch_small_script.py: torch and accelerate of these)."""


@pytest.fixture(scope="session")
def training_forks(tmp_path_factory) -> Forks:
    """tests/fork_server.py's process for the session, started with the launched processes' CPU
    environment, which imported :data:`TRAINING_FORKS_IMPORTS` once: one server for both modules, not one
    each (~3.7 CPU-s a server). The tests that use it are in the xdist group "training_forks" (one worker
    under ``pytest -n 2 --dist loadgroup``: the server starts once)."""
    server = Forks(tmp_path_factory.mktemp("training-forks"), cpu_launch_env(ROOT), TRAINING_FORKS_IMPORTS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def launched_in_job(multiprocess_job):
    """``launched_in_job(scenario)``: one of multiprocess_job.py's ``LAUNCHED`` scripts, run as a process of
    ``diffusion-debug launch`` runs it (``diffusion_debug.jobs.launched.main``; run dir under
    ``<its folder>/runs``), in the session's one 2-process launch (conftest.py's ``multiprocess_job``), as
    the launch of that script would have returned: its folder as ``args``, what its two processes printed
    (rank 0's, then rank 1's) as ``stdout`` and ``stderr``, and ``returncode`` 0 where both processes ended
    as a launched process that exits 0, else 1. Skips where the script found no DeepSpeed."""
    output_dir, done = multiprocess_job

    def read(scenario: str) -> subprocess.CompletedProcess:
        folder = output_dir / scenario
        if not (folder / "rank1.stderr").is_file():
            pytest.fail(f"{scenario} did not run:\n{done[scenario].stdout[-2000:]}\n{done[scenario].stderr[-3000:]}")
        stdout, stderr = (
            "".join((folder / f"rank{r}.{name}").read_text() for r in (0, 1)) for name in ("stdout", "stderr")
        )
        if stdout.startswith("NO_DEEPSPEED"):
            pytest.skip(f"deepspeed does not import: {stdout.splitlines()[0][len('NO_DEEPSPEED ') :]}")
        exits = sorted(re.findall(r"RANK \d EXIT .*", done[scenario].stdout))
        return subprocess.CompletedProcess(folder, int(exits != ["RANK 0 EXIT 0", "RANK 1 EXIT 0"]), stdout, stderr)

    return read
