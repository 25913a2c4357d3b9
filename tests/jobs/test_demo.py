"""Tests for diffusion_debug.jobs.demo: the scenarios of ``diffusion-debug demo`` find their faults."""

from __future__ import annotations

import contextlib
import html
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_debug.jobs.demo import INF_MODULE, SCENARIOS, run_demo

# diffusers' schedulers call np.array() on a torch tensor, which numpy 2 flags; upstream noise.
# The planted Inf reaches the image, which diffusers casts to uint8: an expected warning.
pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
    pytest.mark.xdist_group("demo"),  # one worker under -n 2: the module's `demo` (four runs) is made once
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    # from the output directory's parent, as a user would: the printed commands use relative paths
    here = os.getcwd()
    os.chdir(output_dir.parent)  # contextlib.chdir is Python 3.11+; we support 3.10
    logged = _Kept()
    logging.getLogger("diffusion_debug").addHandler(logged)
    try:
        with contextlib.redirect_stdout(printed):
            run_dirs = run_demo(output_dir, steps=4)
    finally:
        os.chdir(here)
        logging.getLogger("diffusion_debug").removeHandler(logged)
    LOGGED[:] = [record.getMessage() for record in logged.records]
    return output_dir, run_dirs, printed.getvalue()


LOGGED: list[str] = []


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_no_log_line_of_a_run_lands_under_another_runs_block(demo):
    """The blocks list every run's anomalies; a log line during the Inf run would print under
    "[1/4] clean run" (stderr, before the Inf run's block)."""
    assert LOGGED == []


def _anomalies(run_dir) -> list[tuple[str, str, str, int | None]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return [(a["kind"], a["component"], a["module"], a["step"]) for a in summary["anomalies"]]


def test_one_run_directory_per_scenario_in_order(demo):
    output_dir, run_dirs, _ = demo
    assert [d.name for d in run_dirs] == ["demo-1-clean", "demo-2-inf", "demo-3-fp16", "demo-4-prompt"]
    assert len(run_dirs) == len(SCENARIOS)
    for run_dir in run_dirs:
        assert run_dir.parent == output_dir
        assert (run_dir / "summary.json").is_file() and (run_dir / "report.html").is_file()


def test_each_planted_fault_is_found_where_it_was_planted(demo):
    _, (clean, inf, fp16, prompt), _ = demo
    clean_kinds = {kind for kind, *_ in _anomalies(clean)}
    assert "nonfinite" not in clean_kinds and "overflow_risk" not in clean_kinds
    assert "prompt_truncated" not in clean_kinds
    assert INF_MODULE == "up_blocks.1.resnets.0.conv2"
    assert ("nonfinite", "unet", INF_MODULE, 0) in _anomalies(inf)  # the weight breaks the first step
    assert ("overflow_risk", "vae", "decoder.up_blocks.0.resnets.0.conv2", None) in _anomalies(fp16)
    assert ("prompt_truncated", "text_encoder", "", None) in _anomalies(prompt)


def test_printed_blocks_show_what_each_fault_adds_then_the_report_paths(demo):
    _, run_dirs, printed = demo
    assert printed.startswith("\n")
    blocks = printed[1:].split("\n\n")
    assert len(blocks) == 5
    assert blocks[0].startswith("[1/4] clean run (random weights, so the latents drift; the debugger says so)\n")
    assert blocks[1].startswith("[2/4] Inf in a UNet weight: what it adds to the clean run\n")
    assert "first non-finite value: unet up_blocks.1.resnets.0.conv2 (step 0," in blocks[1]
    *_, command, replayed = blocks[1].splitlines()
    assert command.startswith("replay: diffusion-debug replay ") and " --model " in command
    assert replayed.startswith("first non-finite value: unet up_blocks.1.resnets.0.conv2 (step 0, timestep ")
    assert blocks[2].startswith("[3/4] fp16 VAE close to overflow: what it adds to the clean run\n1 anomaly\n")
    assert "overflow_risk" in blocks[2]
    assert blocks[3].startswith("[4/4] prompt over 77 tokens: what it adds to the clean run\n1 anomaly\n")
    assert "prompt_truncated" in blocks[3]
    assert blocks[4] == "HTML reports:\n" + "".join(
        f"  {name:36} {run_dir / 'report.html'}\n" for (name, *_), run_dir in zip(SCENARIOS, run_dirs)
    )


def _html_replay_command(run_dir) -> str:
    commands = re.findall(r"<code>(diffusion-debug replay [^<]*)</code>", (run_dir / "report.html").read_text())
    assert len(commands) == 1
    return html.unescape(commands[0])


def test_the_report_replay_command_names_the_saved_pipeline_and_replays_the_fault(demo, capsys):
    output_dir, (_, inf, *_), printed = demo
    command = _html_replay_command(inf)
    assert f"replay: {command}\n" in printed  # the terminal shows the report's command
    args = shlex.split(command)
    assert args[:2] == ["diffusion-debug", "replay"]
    assert args[args.index("--model") + 1] == f"{output_dir.name}/demo-2-inf/pipeline"  # relative to the cwd
    assert (inf / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((inf / "invocation.json").read_text())["model"] == str((inf / "pipeline").resolve())
    # the command as printed, in a fresh process: it names the producer, and no library's warnings
    # or loading bars reach stderr (transformers resets its log level on import, after ours)
    script = Path(sys.executable).parent / "diffusion-debug"
    # without what an earlier in-process main() left in os.environ, or a user's warning filters
    unset = ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run(
        [str(script), *args[1:]], cwd=output_dir.parent, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("first non-finite value: unet up_blocks.1.resnets.0.conv2 (step 0, timestep ")
    assert done.stderr == ""
