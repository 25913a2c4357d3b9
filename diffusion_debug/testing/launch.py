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
from pathlib import Path


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


def run_launch(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher of several processes. ``returncode`` None: it outlived ``timeout``, and
    ``stdout`` / ``stderr`` hold what it printed until stopped. A hung launch gets SIGTERM first:
    torchrun's agent then stops its workers, which run in sessions of their own (killed with the
    launcher, they would live on holding its pipes); SIGKILL if that is not enough."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(cmd, None, stdout or "", stderr or "")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def by_scenario(stdout: str, scenarios: tuple[str, ...]) -> dict[str, str]:
    """Each scenario's lines of a job that prefixes them ``<scenario>: `` (the prefix removed)."""
    out = {scenario: "" for scenario in scenarios}
    for line in stdout.splitlines(keepends=True):
        scenario, _, rest = line.partition(": ")
        if scenario in out:
            out[scenario] += rest
    return out


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
