"""The pytest plugin, on real pytest sessions in their own processes: every pipeline call of a test
is watched, one run directory per test, a planted Inf fails its test with the headline, a clean
test passes; a pipeline the debugger refuses runs unwatched and a pipeline class first imported in
a test is watched; a directory that cannot be written is one error before any test; under xdist the
controller's summary counts the workers' calls; and a 300-test session's summary fits a screen.
This repository's own test files, in any order on one command line, keep their folders' conftest
fixtures (a session on the same server: it imported torch and diffusers for both).
A session of one process is a child of tests/fork_server.py's process (torch, transformers and
diffusers' base classes imported once), the xdist session's controller a Python of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fork_server import Forks

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


def _env():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["COLUMNS"] = "120"  # the summary cuts messages to the terminal's width
    return env


SESSION_IMPORTS = ("torch", "transformers:CLIPTextModel", "diffusers:DiffusionPipeline", "diffusers:DDPMScheduler")
"""What a session of these tests imports before its plugin wraps a pipeline (its test module, at
collection); never the pipeline module a test imports itself (``pipeline_stable_diffusion``)."""


# the tests of `forks` run on one worker under `pytest -n 2 --dist loadgroup`: its server starts once
FORKS = pytest.mark.xdist_group("plugin_forks")


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """The sessions of one process each are children of tests/fork_server.py's process, which
    imported SESSION_IMPORTS once (started once per test worker that needs it); the plugin loads in
    each child, as ``-p`` loads it."""
    server = Forks(tmp_path_factory.mktemp("forks"), _env(), SESSION_IMPORTS)
    yield server
    server.close()


def session(tmp_path, *options, tests=USER_TESTS, xdist=False, forks=None):
    """``pytest --diffusion-debug`` on ``tests`` (written to test_user.py) in its own process: a
    child of ``forks`` where given, else a Python of its own (the xdist controller's)."""
    (tmp_path / "test_user.py").write_text(tests)
    command = ["-p", "diffusion_debug.pytest_plugin", "--diffusion-debug"]
    command += ["-q", "-p", "no:cacheprovider", *([] if xdist else ["-p", "no:xdist"]), "-W", "ignore"]
    command += [*options, "test_user.py"]
    if forks is not None:
        done = forks.run(tmp_path, _env(), command, module="pytest")
    else:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *command],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert "Traceback" not in done.stdout + done.stderr and "AttributeError" not in done.stdout, done.stdout[-3000:]
    return done


def summary(out: str) -> list[str]:
    """The lines of the plugin's section of the terminal summary."""
    lines = out[out.index("= diffusion-debug =") :].splitlines()[1:]
    return lines[: next((i for i, line in enumerate(lines) if line.startswith("=")), len(lines))]


def user_summary(root: Path) -> list[str]:
    """The summary of USER_TESTS, in one process or on two xdist workers."""
    return [
        f"2 pipeline calls watched in 2 tests: 5 anomalies of 3 kinds; runs in {root}",
        "error nonfinite: 1 in 1 test, e.g. test_user.py::test_inf_in_the_unet at unet up_blocks.1.resnets.0.conv2, "
        "step 1 (t=1)",
        "    unet.up_blocks.1.resnets.0.conv2 produced NaN/Inf from finite inputs (check its dtype, inputs and "
        "weights; try fl...",  # cut to the terminal's 120 columns
        "warning scheduler_config: 2 in 2 tests, e.g. test_user.py::test_clean",  # 2 leading steps: true
        "    With 2 steps and timestep_spacing='leading' the first step is t=501 of 1000, so sampling starts from a "
        "partly den...",
        "warning latent_divergence: 1 in 1 test, e.g. test_user.py::test_inf_in_the_unet at step 1 (t=1)",
        "    Latents became non-finite (256 values); the denoiser output was already non-finite (see the nonfinite "
        "anomaly).",
        "warning nonfinite: 1 in 1 test, e.g. test_user.py::test_inf_in_the_unet at vae",
        "    vae received non-finite input and passed it on; fix the first NaN/Inf at unet "
        "up_blocks.1.resnets.0.conv2, step 1...",
        "failed by diffusion-debug: 1 test",
        "    test_user.py::test_inf_in_the_unet: nonfinite at unet up_blocks.1.resnets.0.conv2, step 1 (t=1)",
    ]


@FORKS
def test_the_plugin_watches_each_test_and_fails_the_one_with_an_inf(tmp_path, forks):
    done = session(tmp_path, forks=forks)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 failed, 2 passed" in out
    assert "FAILED test_user.py::test_inf_in_the_unet - Failed: diffusion-debug: 1 anomal" in out
    assert (
        "diffusion-debug: 1 anomaly of severity error or worse; first: nonfinite at unet "
        "up_blocks.1.resnets.0.conv2, step 1 (t=1): unet.up_blocks.1.resnets.0.conv2 produced NaN/Inf" in out
    )
    assert summary(out) == user_summary(tmp_path / "diffusion_debug_runs")
    runs = {p.name: list(p.iterdir()) for p in (tmp_path / "diffusion_debug_runs").iterdir()}
    assert sorted(runs) == ["test_user.py_test_clean", "test_user.py_test_inf_in_the_unet"]
    (run,) = runs["test_user.py_test_inf_in_the_unet"]
    saved = json.loads((run / "summary.json").read_text())
    assert [(a["component"], a["module"], a["step"]) for a in saved["anomalies"] if a["severity"] == "error"] == [
        ("unet", "up_blocks.1.resnets.0.conv2", 1)
    ]
    (clean,) = runs["test_user.py_test_clean"]
    assert [row["step"] for row in json.loads((clean / "summary.json").read_text())["steps"]] == [0, 1]


@pytest.mark.xdist_group("launches")  # three processes: one launch at a time (see test_multiprocess.py)
def test_under_xdist_the_controller_counts_what_the_workers_watched(tmp_path):
    """Two workers, one test each: the workers fail the test with the Inf, and the controller's
    summary is the one a single process writes."""
    done = session(tmp_path, "-n", "2", "--dist", "load", xdist=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout
    assert summary(done.stdout) == user_summary(tmp_path / "diffusion_debug_runs")
    assert sorted(p.name for p in (tmp_path / "diffusion_debug_runs").iterdir()) == [
        "test_user.py_test_clean",
        "test_user.py_test_inf_in_the_unet",
    ]


ONLY_A_SCHEDULER = """
class OnlyScheduler(DiffusionPipeline):
    def __init__(self, scheduler):
        super().__init__()
        self.register_modules(scheduler=scheduler)

    def __call__(self, steps=2):
        self.scheduler.set_timesteps(steps)
        return self.scheduler.timesteps.tolist()
"""

REFUSED_AND_IMPORTED_LATE = (
    textwrap.dedent(
        """
    import sys

    import torch
    from diffusers import DDPMScheduler, DiffusionPipeline
    """
    )
    + ONLY_A_SCHEDULER
    + textwrap.dedent(
        """

    def test_a_pipeline_of_only_a_scheduler():
        assert OnlyScheduler(DDPMScheduler())() == [500, 0]
        assert OnlyScheduler(DDPMScheduler())(3) == [666, 333, 0]  # a second one: the reason is given once


    def test_a_pipeline_class_first_imported_in_the_test():
        assert "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion" not in sys.modules
        from diffusion_debug.testing import plant_nonfinite, tiny_pipeline

        pipe = tiny_pipeline("sd")  # imports StableDiffusionPipeline now, while the test runs
        with plant_nonfinite(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2"), from_call=1):
            pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")
    """
    )
)


@FORKS
def test_a_refused_pipeline_runs_unwatched_and_a_class_imported_in_the_test_is_watched(tmp_path, forks):
    done = session(tmp_path, tests=REFUSED_AND_IMPORTED_LATE, forks=forks)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert "FAILED test_user.py::test_a_pipeline_class_first_imported_in_the_test - Failed: diffusion-debug" in (
        done.stdout
    )
    lines = summary(done.stdout)
    assert lines[0] == (
        f"1 pipeline call watched in 1 test: 3 anomalies of 3 kinds; runs in {tmp_path / 'diffusion_debug_runs'}"
    )
    assert lines[1] == (
        "error nonfinite: 1 in 1 test, e.g. test_user.py::test_a_pipeline_class_first_imported_in_the_test at unet "
        "up_blocks.1.resnets.0.conv2, step 1 (t=1)"
    )
    assert lines[-4:] == [
        "failed by diffusion-debug: 1 test",
        "    test_user.py::test_a_pipeline_class_first_imported_in_the_test: nonfinite at unet "
        "up_blocks.1.resnets.0.conv2, step 1 (t=1)",
        "not watched in 1 test, e.g. test_user.py::test_a_pipeline_of_only_a_scheduler:",
        "    OnlyScheduler has no denoiser and no other nn.Module component (pipe.components holds none): there is "
        "nothing to watch.",
    ]
    assert [p.name for p in (tmp_path / "diffusion_debug_runs").iterdir()] == [
        "test_user.py_test_a_pipeline_class_first_imported_in_the_test"
    ]


@FORKS
def test_a_directory_that_cannot_be_written_is_one_error_before_any_test(tmp_path, forks):
    (tmp_path / "a-file").write_text("x")
    done = session(tmp_path, "--diffusion-debug-dir", "a-file/runs", tests=REFUSED_AND_IMPORTED_LATE, forks=forks)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert done.stderr.strip().splitlines() == [
        f"ERROR: --diffusion-debug-dir {str(tmp_path / 'a-file' / 'runs')!r} cannot be written: Not a directory."
    ]
    assert done.stdout == ""


MANY_TESTS = (
    textwrap.dedent(
        """
    import pytest
    import torch
    from diffusers import DDPMScheduler, DiffusionPipeline

    from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
    """
    )
    + ONLY_A_SCHEDULER
    + textwrap.dedent(
        """

    @pytest.fixture(scope="module")
    def pipe():
        return tiny_pipeline("sd")


    @pytest.mark.parametrize("i", range(300))
    def test_case(pipe, i):
        if i % 25 not in (1, 2, 5):  # 264 tests: a pipeline the debugger refuses (cheap: no call watched)
            assert OnlyScheduler(DDPMScheduler())() == [500, 0]
            return
        prompt = "a cat " * (50 if i % 25 != 1 else 1)  # 24 tests: a prompt the tokenizer cuts
        fault = plant_nonfinite(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2")) if i % 25 == 5 else None
        with fault or torch.no_grad():  # 12 of those: an Inf in the UNet
            pipe(prompt, num_inference_steps=1, generator=torch.Generator().manual_seed(i), output_type="latent")
    """
    )
)


@FORKS
def test_the_summary_of_a_300_test_session_fits_a_screen(tmp_path, forks):
    """Grouped by kind, the failed tests named up to 10, a reason not to watch given once: 23 lines
    for 300 tests (one line per test and run gave 531 for 238 tests). 36 of them call a pipeline, 12
    of those fail (more than the 10 named; the lines grow with the kinds, not with the tests: see the
    next test), the 264 others are cheap."""
    done = session(tmp_path, tests=MANY_TESTS, forks=forks)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr
    assert "12 failed, 288 passed" in done.stdout
    lines = summary(done.stdout)
    failed = [f"test_user.py::test_case[{i}]" for i in range(5, 300, 25)]
    root = tmp_path / "diffusion_debug_runs"
    assert lines == [
        f"36 pipeline calls watched in 36 tests: 84 anomalies of 4 kinds; runs in {root}",
        f"error nonfinite: 12 in 12 tests, e.g. {failed[0]} at unet up_blocks.1.resnets.0.conv2, step 0 (t=1)",
        "    unet.up_blocks.1.resnets.0.conv2 produced NaN/Inf from finite inputs (check its dtype, inputs and "
        "weights; try fl...",
        "warning scheduler_config: 36 in 36 tests, e.g. test_user.py::test_case[1]",
        "    With 1 step and timestep_spacing='leading' the first step is t=1 of 1000, so sampling starts from a "
        "partly denois...",
        "warning prompt_truncated: 24 in 24 tests, e.g. test_user.py::test_case[2] at text_encoder",
        '    tokenizer keeps 77 tokens, so 25 token(s) of the prompt were dropped ("cat a cat a cat a cat a cat a '
        "cat a cat a ...",
        "warning latent_divergence: 12 in 12 tests, e.g. test_user.py::test_case[5] at step 0 (t=1)",
        "    Latents became non-finite (256 values); the denoiser output was already non-finite (see the nonfinite "
        "anomaly).",
        "failed by diffusion-debug: 12 tests",
        *[f"    {test}: nonfinite at unet up_blocks.1.resnets.0.conv2, step 0 (t=1)" for test in failed[:10]],
        "    and 2 more (pytest's short test summary lists each)",
        "not watched in 264 tests, e.g. test_user.py::test_case[0]:",
        "    OnlyScheduler has no denoiser and no other nn.Module component (pipe.components holds none): there is "
        "nothing to watch.",
    ]


@FORKS
def test_files_of_a_folder_named_around_a_file_of_the_folder_above_keep_their_conftest_fixtures(tmp_path, forks):
    """Any combination of this repository's test files on one command line runs with its folders'
    conftest fixtures (tests/conftest.py's ``pytest_configure`` orders the files by path under pytest
    9.1, pytest#14964): toolkit's files use tests/toolkit/conftest.py's sd_pipe; a file of tests/
    between them made pytest 9.1 forget it for the second: "fixture 'sd_pipe' not found", 7 errors."""
    files = ["tests/toolkit/test_analyze_model.py", "tests/test_any_number.py", "tests/toolkit/test_inspect_model.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    command = ["-p", "no:cacheprovider", "-n", "0", "--setup-plan", "-q", *files]
    done = forks.run(ROOT, env, command, module="pytest", outputs=tmp_path)
    assert "not found" not in done.stdout and done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.count("SETUP    S sd_pipe") == 1, done.stdout[-3000:]


def test_the_summary_grows_with_the_kinds_and_reasons_not_with_the_tests(tmp_path):
    from diffusion_debug.pytest_plugin import TestRuns, summary_lines

    assert summary_lines([], tmp_path, "error") == ["no diffusers pipeline was called"]
    warning = {"kind": "scheduler_config", "severity": "warning", "where": "", "message": "x " * 100}
    results = [
        TestRuns(f"t.py::test[{i}]", i, calls=2, anomalies=[warning], unwatched=[f"reason {i % 7}"] * 2)
        for i in range(1000)
    ]
    assert summary_lines(results, tmp_path, "error") == [
        f"2000 pipeline calls watched in 1000 tests: 1000 anomalies of 1 kind; runs in {tmp_path}",
        "warning scheduler_config: 1000 in 1000 tests, e.g. t.py::test[0]",
        "    " + "x " * 36 + "x...",  # cut to 80 columns
        # 1000 tests over 7 reasons: 143 tests for each of the first five (said once per test), then a count
        *[line for i in range(5) for line in (f"not watched in 143 tests, e.g. t.py::test[{i}]:", f"    reason {i}")],
        "not watched for 2 more reasons (each test's run says why)",
    ]
    assert summary_lines(results, tmp_path, "warning")[3:6] == [
        "failed by diffusion-debug: 1000 tests",
        "    t.py::test[0]: scheduler_config",
        "    t.py::test[1]: scheduler_config",
    ]
