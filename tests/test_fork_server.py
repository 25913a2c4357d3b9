"""tests/fork_server.py's process and the child it forked end with the process that started the
server: a killed pytest (or xdist worker) leaves nothing running behind it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent

MIDDLE = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fork_server import Forks
folder = Path(sys.argv[2])
forks = Forks(folder, dict(os.environ))  # as the tests start it, with nothing imported first
print(forks.server.pid, flush=True)
forks.run(folder, dict(os.environ), [], script=str(folder / "sleeper.py"))
"""
"""What starts the server in the test, as a test's worker does: it prints the server's pid, then
waits on a job that does not end (the sleeper)."""

SLEEPER = """
import os, time
with open("child.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace("child.tmp", "child.pid")
time.sleep(600)
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie (ended, not yet reaped by whichever process adopted it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:  # not Linux (no /proc), or reaped in between
        return not stat.parent.exists() and sys.platform.startswith("linux")


def _poll(condition, timeout: float = 30.0):
    """``condition()``'s first true value, asked every 50 ms; None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    return None


def test_the_fork_server_and_its_child_end_when_the_process_that_started_them_is_killed(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "child.pid"
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, str(TESTS), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    server = child = None
    try:
        server = int(middle.stdout.readline())
        child = _poll(lambda: pid_file.exists() and int(pid_file.read_text()))
        assert child and child != server and not _ended(server) and not _ended(child)
        os.kill(middle.pid, signal.SIGKILL)
        middle.wait()
        assert _poll(lambda: _ended(server) and _ended(child)), (server, child)
    finally:  # a failure here must not leave them running either
        for pid in (child, server):
            if pid and not _ended(pid):
                os.kill(pid, signal.SIGKILL)
        middle.kill()
        middle.wait()
        middle.stdout.close()


def test_a_fork_server_whose_parent_died_before_it_started_watching_ends_at_once(tmp_path):
    # a pid that is not its parent's: as the server sees it when its parent died before the ask
    # (a server that missed it would read its empty stdin and end with 0)
    done = subprocess.run(
        [sys.executable, str(TESTS / "fork_server.py"), "--parent=1"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "")
