"""The pytest plugin, on a real pytest session in its own process: every pipeline call of a test
is watched, one run directory per test, a planted Inf fails its test with the headline, a clean
test passes, and the summary lists each test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_TESTS = textwrap.dedent(
    """
    import pytest
    import torch

    from diffusion_debug.testing import plant_nonfinite, tiny_pipeline


    @pytest.fixture(scope="module")
    def pipe():
        return tiny_pipeline("sd")


    def run(pipe):
        return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")


    def test_clean(pipe):
        assert run(pipe).images.isfinite().all()


    def test_inf_in_the_unet(pipe):
        with plant_nonfinite(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2"), from_call=1):
            run(pipe)  # the user's test passes: the images are NaN but nothing asserts on them


    def test_no_pipeline():
        assert 1 + 1 == 2
    """
)


def session(tmp_path, *options):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "diffusion_debug.pytest_plugin", "--diffusion-debug"]
    command += ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore", *options, "test_user.py"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.xdist_group("launches")
def test_the_plugin_watches_each_test_and_fails_the_one_with_an_inf(tmp_path):
    done = session(tmp_path)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 failed, 2 passed" in out
    assert "FAILED test_user.py::test_inf_in_the_unet - Failed: diffusion-debug: 1 anomal" in out
    assert (
        "diffusion-debug: 1 anomaly of severity error or worse; first: nonfinite at unet "
        "up_blocks.1.resnets.0.conv2, step 1 (t=1): unet.up_blocks.1.resnets.0.conv2 produced NaN/Inf" in out
    )
    summary = out[out.index("diffusion-debug ===") :]
    assert "test_user.py::test_clean: 1 pipeline call(s), 1 warning" in summary  # 2 leading steps: true
    assert "test_user.py::test_inf_in_the_unet: 1 pipeline call(s), 1 error, 3 warnings" in summary
    assert "first error: nonfinite at unet up_blocks.1.resnets.0.conv2, step 1" in summary
    assert "test_no_pipeline" not in summary
    runs = {p.name: list(p.iterdir()) for p in (tmp_path / "diffusion_debug_runs").iterdir()}
    assert sorted(runs) == ["test_user.py_test_clean", "test_user.py_test_inf_in_the_unet"]
    (run,) = runs["test_user.py_test_inf_in_the_unet"]
    saved = json.loads((run / "summary.json").read_text())
    assert [(a["component"], a["module"], a["step"]) for a in saved["anomalies"] if a["severity"] == "error"] == [
        ("unet", "up_blocks.1.resnets.0.conv2", 1)
    ]
    (clean,) = runs["test_user.py_test_clean"]
    assert [row["step"] for row in json.loads((clean / "summary.json").read_text())["steps"]] == [0, 1]
