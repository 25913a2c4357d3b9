"""The fork server of the jobs tests' single-process training runs: test_launch_safety.py's runs of
launch_small_script.py and test_launch.py's of the t2i and plain torch.optim scripts."""

from __future__ import annotations

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
