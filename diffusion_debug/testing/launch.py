"""What every ``accelerate launch`` of CPU processes in the tests and benchmarks shares: the
launcher beside this Python, a free port for the rendezvous, and an environment that hides any GPU
(on a machine with one, rank 1 would otherwise pick ``cuda:1``) and keeps each process to one
thread (several processes share two cores)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil


def accelerate_launcher() -> str | None:
    """The ``accelerate`` command of this Python's environment (else the one on PATH), or None."""
    return shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")


def free_port() -> int:
    """A TCP port free on the loopback now (for ``--main_process_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on the loopback now, for launches started side by side (each
    socket is held until all are bound, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def cpu_launch_env(root: Path) -> dict[str, str]:
    """This process's environment for CPU-only launched processes that import from ``root``."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONWARNINGS": "ignore",
    }


STOP_GRACE_S = 10.0
"""How long a stopped launch has, after SIGTERM, to stop its ranks and exit before SIGKILL."""


def run_launch(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher of several processes. ``returncode`` None: it outlived ``timeout``, and
    ``stdout`` / ``stderr`` hold what it printed until stopped. A hung launch is stopped by
    :func:`stop_launch`, and so is one whose caller is interrupted (Ctrl-C, a test's timeout that
    raises): no launcher or rank outlives the call."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_launch(proc)
        stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(cmd, None, stdout or "", stderr or "")
    except BaseException:
        stop_launch(proc)
        with contextlib.suppress(Exception):  # closes its pipes and reaps it; the interruption goes on
            proc.communicate(timeout=STOP_GRACE_S)
        raise
    stop_launch(proc)  # what the launch left running after it exited (none, normally)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def stop_launch(proc: subprocess.Popen) -> None:
    """Stop the launcher ``proc`` (started in a session of its own) and every process it started:
    SIGTERM to its session first (torchrun's agent then stops its workers, which run in sessions of
    their own: killed with the launcher, they would live on holding its pipes), then, after
    :data:`STOP_GRACE_S` or as soon as the launcher has exited, SIGKILL to what is left of its
    session and of its descendants. Nothing is signalled when nothing is left."""
    family = []
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(proc.pid).children(recursive=True)
    if not family and not _session(proc.pid):
        proc.poll()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    left = [*family, *_session(proc.pid)]
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    deadline = time.monotonic() + STOP_GRACE_S  # SIGKILL is delivered, not yet acted on: until they are gone
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.01)


def _alive(process: psutil.Process) -> bool:
    """Whether ``process`` still runs (a zombie, dead but not reaped by an init that may never, does not)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session(sid: int) -> list[psutil.Process]:
    """The processes alive in session ``sid`` (zombies left out)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def by_scenario(stdout: str, scenarios: tuple[str, ...]) -> dict[str, str]:
    """Each scenario's lines of a job that prefixes them ``<scenario>: `` (the prefix removed)."""
    out = {scenario: "" for scenario in scenarios}
    for line in stdout.splitlines(keepends=True):
        scenario, _, rest = line.partition(": ")
        if scenario in out:
            out[scenario] += rest
    return out


PLANTED_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (planted by diffusion_debug.testing)"
"""The message of :func:`~diffusion_debug.testing.faults.plant_oom`'s error."""


def check_step_0_oom_on_two_ranks(done: subprocess.CompletedProcess, run: Any) -> None:
    """Assert what a 2-rank launch whose ``conv_in`` raised :data:`PLANTED_OOM` in step 0's forward on
    both ranks (``--steps 1 --oom-at 0``) left: ``out_of_memory`` at the module, step 0, rank 0 (rank 1's
    too where torchrun let it save before stopping it), the run ended as the script did, each rank said
    it, and each rank's script raised the planted error itself, from the planted hook. ``run``: the
    loaded run."""
    assert done.returncode == 1, done.stderr[-3000:]  # both ranks raised
    found = sorted((a.kind, a.component, a.module, a.step, a.rank) for a in run.anomalies)
    assert found[0] == ("out_of_memory", "model", "conv_in", 0, 0)
    assert set(found) <= {("out_of_memory", "model", "conv_in", 0, rank) for rank in (0, 1)}
    assert run.summary["end"]["status"] == "raised" and run.summary["end"]["exception"] == "OutOfMemoryError"
    assert run.summary["end"]["message"] == PLANTED_OOM
    assert "out_of_memory at model conv_in, step 0: " in done.stderr
    assert "out_of_memory at model conv_in, step 0, rank 1: " in done.stderr
    assert "nothing was watched" not in done.stderr and "not watching" not in done.stderr
    lines = done.stderr.splitlines()
    raised = [i for i, line in enumerate(lines) if line == f"torch.OutOfMemoryError: {PLANTED_OOM}"]
    assert len(raised) == 2  # one traceback a rank, its last frame plant_oom's hook
    for i in raised:
        frame = next(line for line in reversed(lines[:i]) if line.startswith("  File "))
        assert frame.endswith(", in hook") and "diffusion_debug/testing/faults.py" in frame


def first_row_where(terminal: str) -> str:
    """The where column of the terminal report's first anomaly row, its wrapped lines joined."""
    lines = terminal.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("severity  kind"))
    start = lines[header].index("where")
    end = lines[header].index("message")
    cells = [lines[header + 2][start:end].strip()]
    for line in lines[header + 3 :]:
        if not line.startswith(" ") or not line[:start].strip() == "":
            break
        cells.append(line[start:end].strip())
    return " ".join(cell for cell in cells if cell)


def sleep_until_stall_named(run_dir: Path, ranks: int, *, margin: float, most: float) -> None:
    """In a launched job's rank stalled on purpose under ``stall_action="wait"``: sleep until the
    debugger's watchers have named the stall on all ``ranks`` ranks (each appends its stacks to
    ``run_dir/stacks-rank<r>.txt`` first: every file grown since this call began, each stack shows
    where its rank waited), then ``margin`` seconds more while the others keep waiting (a few looks
    of each watcher, which must not name it again); ``most`` seconds at most in all (the fixed sleep
    this replaces: a watcher that names nothing leaves the job as that sleep did)."""
    deadline = time.monotonic() + most
    stacks = [Path(run_dir) / f"stacks-rank{rank}.txt" for rank in range(ranks)]
    before = [_size(path) for path in stacks]  # a stall named earlier in the run left its dumps
    while any(_size(path) <= size for path, size in zip(stacks, before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(max(0.0, min(margin, deadline - time.monotonic())))


def _size(path: Path) -> int:
    """The size of ``path`` (-1: none yet)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1
