"""Progress bars of ``run`` and ``train``: drawn on stderr when it is a terminal (a pseudo-terminal
here), none when stderr is a pipe or with ``--quiet``; stdout carries no bar either way."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from diffusion_debug.cli import main
from diffusion_debug.jobs.progress import TrainingProgress, progress_bar, shows_progress
from diffusion_debug.record import load_run

REPO = Path(__file__).resolve().parents[2]

# one worker under `pytest -n 2 --dist loadgroup`: `terminal_runs` (a run and a train on a terminal, in a
# process of their own) is made once, not once on each worker that runs one of its two tests
pytestmark = pytest.mark.xdist_group("progress")

# one process for both commands: the imports cost more than the tiny runs
_SCRIPT = """
import sys
from diffusion_debug.cli import main
out = sys.argv[1]
assert main(["run", "--steps", "3", "--output-dir", out + "/run", "--no-html"]) == 0
assert main(["train", "--cpu", "--steps", "3", "--output-dir", out + "/train", "--no-html"]) == 0
"""


def _on_a_terminal(tmp_path: Path) -> tuple[str, str]:
    """Run the script with stderr on a pseudo-terminal 120 columns wide; (stderr, stdout) as text."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(slave)
    seen = bytearray()
    while True:  # drain the terminal while the process writes (a full pty would block it)
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    os.close(master)
    stdout = process.stdout.read().decode()
    assert process.wait(timeout=300) == 0, seen.decode(errors="replace")[-3000:]
    return seen.decode(errors="replace"), stdout


@pytest.fixture(scope="module")
def terminal_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("terminal")
    stderr, stdout = _on_a_terminal(tmp_path)
    return tmp_path, stderr, stdout


def test_run_draws_its_denoising_steps_on_a_terminal(terminal_runs):
    _, stderr, stdout = terminal_runs
    assert re.search(r"run: 100%\|[^|]*\| 3/3 \[", stderr)  # the pipeline's own bar, labelled and left complete
    assert "3/3" not in stdout and "\r" not in stdout


def test_train_draws_optimizer_steps_with_the_last_loss_and_anomaly_count(terminal_runs):
    tmp_path, stderr, _ = terminal_runs
    (run_dir,) = (tmp_path / "train").iterdir()
    run = load_run(run_dir)
    last_loss = run.steps[-1]["loss"]
    anomalies = len(run.anomalies)
    final = [line for line in re.split(r"[\r\n]", stderr) if line.startswith("train: 100%")][-1]
    assert "| 3/3 [" in final
    assert final.endswith(f"loss {last_loss:.4g}, anomalies {anomalies}]")


def test_no_bar_when_stderr_is_a_pipe_or_quiet_and_no_html_saves_the_run_without_its_page(capsys, tmp_path):
    assert main(["run", "--steps", "2", "--output-dir", str(tmp_path / "piped"), "--no-html"]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # pytest's capture is not a terminal
    (run_dir,) = (tmp_path / "piped").iterdir()
    said = f"\nrun: {run_dir} (--no-html: no report.html; diffusion-debug report RUN_DIR builds it)\n"
    assert printed.out.endswith(said), printed.out[-500:]
    assert (run_dir / "image.png").is_file() and not (run_dir / "report.html").exists()
    assert shows_progress(quiet=True, stream=sys.__stderr__) is False


def test_training_progress_counts_anomalies_over_micro_steps(capsys):
    progress = TrainingProgress(2, enabled=False)
    progress.saw({"step": 0, "gradients_read": False, "micro_steps": 1})  # a micro-step: no loss, no anomaly
    progress.saw({"step": 0, "loss": 0.5, "anomalies": ["loss_spike"]})
    progress.step_done()
    progress.saw({"step": 1, "loss": float("nan"), "anomalies": ["nonfinite_loss", "nonfinite"]})
    progress.step_done()
    progress.close()
    assert (progress.anomalies, progress.steps, progress.bar.postfix) == (3, 2, "loss nan, anomalies 3")
    assert capsys.readouterr().err == ""  # disabled: nothing drawn


def test_a_terminal_without_a_size_still_gets_a_bar(monkeypatch):
    """``script`` without a terminal opens a 0x0 pseudo-terminal: tqdm would take -1 rows and draw nothing."""
    master, slave = pty.openpty()  # a new pseudo-terminal has the size 0x0
    with os.fdopen(slave, "w", encoding="utf-8") as stream:
        monkeypatch.setattr(sys, "stderr", stream)
        assert shows_progress(stream=stream)
        bar = progress_bar(3, "doctor", "run", enabled=True)
        bar.update(3)
        bar.close()
    drawn = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert re.search(r"doctor: 100%\|[^|]+\| 3/3 \[", drawn.decode())
