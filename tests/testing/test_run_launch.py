"""Tests for diffusion_debug.testing.launch: a launch stopped on any way out leaves no process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from diffusion_debug.testing import launch
from diffusion_debug.testing.launch import run_launch

# A launcher as torchrun is: a rank in its own session (which a signal to the launcher's does not
# reach), one in the launcher's; their ids written once both run, then it sleeps.
LAUNCHER = """
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
same = subprocess.Popen(sleeper)
own = subprocess.Popen(sleeper, start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{same.pid} {own.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("ranks started", flush=True)
time.sleep(600)
"""


class Interrupted(BaseException):
    """What a test's timeout or a Ctrl-C raises in the caller's thread."""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_session(sid: int) -> list[int]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and os.getsid(process.pid) == sid:
                found.append(process.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.mark.parametrize("how", ["interrupted", "timed out"])
def test_a_launch_stopped_from_outside_leaves_no_launcher_or_rank(how, tmp_path, monkeypatch):
    """The caller's wait ends (an exception raised in it, or the launch's timeout) once the ranks run:
    the launcher, the rank in its session and the rank in a session of its own are all gone."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 5.0)
    script, ids = tmp_path / "launcher.py", tmp_path / "ids"
    script.write_text(LAUNCHER)
    communicate, launched = subprocess.Popen.communicate, []

    def wait_then_stop(self, *args, **kwargs):
        if launched:  # run_launch's own calls once stopping
            return communicate(self, *args, **kwargs)
        launched.append(self.pid)
        deadline = time.monotonic() + 120  # a bound on a wait, not a timing under test
        while not ids.exists() and self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ids.exists(), "the launcher did not start its ranks"
        if how == "interrupted":
            raise Interrupted
        raise subprocess.TimeoutExpired(self.args, 1.0)

    monkeypatch.setattr(subprocess.Popen, "communicate", wait_then_stop)
    cmd = [sys.executable, str(script), str(ids)]
    if how == "interrupted":
        with pytest.raises(Interrupted):
            run_launch(cmd, {}, tmp_path, timeout=600)
    else:
        done = run_launch(cmd, {}, tmp_path, timeout=600)
        assert (done.returncode, done.stdout) == (None, "ranks started\n")
    same, own = (int(pid) for pid in ids.read_text().split())
    (launcher,) = launched
    assert in_session(launcher) == []
    assert [pid for pid in (launcher, same, own) if running(pid)] == []


def test_a_launch_that_ends_returns_its_status_and_output(tmp_path):
    script = tmp_path / "done.py"
    script.write_text("import sys\nprint('rank 0 done')\nprint('a warning', file=sys.stderr)\nsys.exit(3)\n")
    done = run_launch([sys.executable, str(script)], {}, tmp_path, timeout=600)
    assert (done.returncode, done.stdout, done.stderr) == (3, "rank 0 done\n", "a warning\n")
