"""How a signal reaches ``diffusion-debug launch`` and the script it runs: sent to the command, to the
launcher (``python -m diffusion_debug.jobs.launch``, as a supervisor starts it) alone or to its whole group,
by the terminal (Ctrl-C), or left to the launcher's death; the script saves its run and the launcher ends by
the signal. Each test is a real launch of launch_small_script.py (one process)."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from diffusion_debug.record import load_run
from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env, stop_launch

SCRIPT = Path(__file__).with_name("launch_small_script.py")
ROOT = Path(__file__).resolve().parents[2]
ONE_PROCESS = ["--num_processes", "1", "--cpu", "--num_machines", "1", "--mixed_precision", "no"]
ONE_PROCESS += ["--dynamo_backend", "no"]


def _run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def _launch_until(
    tmp_path: Path,
    rounds: int,
    *script_args: str,
    module: str = "diffusion_debug.cli launch",
    processes: list[str] = ONE_PROCESS,
    site: Path | None = None,
    terminal: int | None = None,
) -> tuple[subprocess.Popen, int]:
    """``diffusion-debug launch`` (one process; ``module``: the launcher's module run directly) of a script
    training until stopped, read until it printed ``rounds`` rounds (0: not read); the launcher and the script's pid.
    ``site``: a folder first on the processes' PYTHONPATH. ``terminal``: a pty's slave end, the command's stdin and
    controlling terminal, the command leading its session with no shell (else it has none; under a job-control
    shell: :func:`_launch_in_a_shell`)."""
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    command = [sys.executable, "-m", *module.split(), "--debug-output-dir", str(tmp_path / "runs")]
    command += [*processes, str(SCRIPT), "--forever", *script_args]

    def started() -> None:
        for sent in (signal.SIGINT, signal.SIGQUIT):  # not ignored, as a shell without job control leaves them
            signal.signal(sent, signal.SIG_DFL)  # for `cmd &` (the command keeps a signal ignored ignored)
        if terminal is not None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # its group the terminal's foreground (docker run -it, ssh -t)

    environment = cpu_launch_env(ROOT)
    if site is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(site), environment["PYTHONPATH"]])
    launcher = subprocess.Popen(
        command,
        env=environment,
        cwd=tmp_path,
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test's signal goes to the launcher's pid alone
        preexec_fn=started,
    )
    for line in launcher.stdout if rounds else ():
        if line.startswith(f"round {rounds - 1} "):
            return launcher, int(line.split()[-1])
    if rounds == 0:
        return launcher, 0
    stop_launch(launcher)
    pytest.fail(f"the launched script stopped before round {rounds}: {launcher.stderr.read()[-3000:]}")


def _end(launcher: subprocess.Popen) -> tuple[str, str]:
    """The launcher's stdout and stderr once it ended (else stopped with every process of its session, the
    script's too, and the test failed)."""
    try:
        return launcher.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stop_launch(launcher)
        pytest.fail("the launcher did not end after the signal")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# the launcher ends by the signal itself (Popen's returncode -N), as a plain `accelerate launch` does:
# a shell loop or a script running it stops on Ctrl-C, where an exit status 130 would go on. A SIGUSR1 (SLURM's
# --signal=USR1@60) to a script without a handler for it, which it would end with nothing saved, reaches it as
# SIGTERM: the run is saved, and the command ends by SIGUSR1 (before this fix: by SIGUSR1 with events.jsonl only)
@pytest.mark.parametrize(
    ("sent", "saved_as"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT), (signal.SIGUSR1, signal.SIGTERM)],
    ids=lambda s: s.name,
)
def test_a_signal_to_the_launcher_ends_the_script_with_a_saved_run(tmp_path, sent, saved_as):
    launcher, script_pid = _launch_until(tmp_path, 3)
    os.kill(launcher.pid, sent)  # to the launcher alone, as a job scheduler or `kill PID` sends it
    _, stderr = _end(launcher)
    assert launcher.returncode == -sent, stderr[-3000:]
    assert _gone(script_pid)  # the launcher returned once the script's process had ended
    run_dir = _run_dir(tmp_path)
    run = load_run(run_dir)
    name = saved_as.name
    assert run.summary["end"] == {"status": "interrupted", "signal": name}
    assert run.summary["training"]["total_steps"] >= 3
    said = f"The run was interrupted by {name} before the script finished; the figures stop there."
    assert said in (run_dir / "report.html").read_text(encoding="utf-8") and said in stderr


def test_a_sigusr1_to_a_two_process_launch_reaches_a_plain_scripts_workers_as_sigterm_with_a_saved_run(tmp_path):
    """torchrun's workers (sessions of their own) get the command's SIGUSR1 from the launcher; a worker that leaves it
    at its default gets SIGTERM instead, so its run is saved (before: both workers died by SIGUSR1, events files
    only). The launch then ends as torchrun ends for workers ended by SIGTERM (exit status 1)."""
    two = ["--num_processes", "2", *ONE_PROCESS[2:]]
    launcher, _ = _launch_until(tmp_path, 3, processes=two)
    os.kill(launcher.pid, signal.SIGUSR1)
    _, stderr = _end(launcher)
    assert "(SIGUSR1)" not in stderr, stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    run = load_run(run_dir)
    assert run.summary["end"] == {"status": "interrupted", "signal": "SIGTERM"}
    assert run.summary["training"]["total_steps"] >= 3
    assert (run_dir / "report.html").is_file()


def test_a_killed_command_ends_the_launcher_and_the_script_with_a_saved_run(tmp_path):
    """``diffusion-debug launch`` itself SIGKILLed (the OOM killer, a scheduler's hard stop): the launcher
    gets SIGTERM as its parent dies and ends, and the script then gets SIGTERM as its own parent ends and
    saves its run, report.html too, after its own 8 s cleanup (accelerate 1.16's launcher, left to answer
    that SIGTERM, killed the script 5 seconds later: no summary.json). Under accelerate 1.16 what the script
    writes to stderr meanwhile, its terminal summary, is lost (a pipe through the launcher, which ended at
    once: launch.py's docstring)."""
    launcher, script_pid = _launch_until(tmp_path, 3, "--cleanup-s", "8")
    started = psutil.Process(launcher.pid).children(recursive=True)
    os.kill(launcher.pid, signal.SIGKILL)
    stdout, stderr = _end(launcher)  # until the script, which holds the pipe, ended
    _, alive = psutil.wait_procs(started, timeout=120)
    assert alive == [] and _gone(script_pid)
    assert stdout.endswith("cleaned up\n"), stdout[-300:]
    run_dir = _run_dir(tmp_path)
    assert load_run(run_dir).summary["end"] == {"status": "interrupted", "signal": "SIGTERM"}
    said = "The run was interrupted by SIGTERM before the script finished; the figures stop there."
    assert said in (run_dir / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize("to", ["launcher", "group"])
def test_a_sigterm_to_the_launcher_started_directly_ends_it_after_the_scripts_cleanup_and_run(tmp_path, to):
    """``python -m diffusion_debug.jobs.launch`` started by a supervisor itself: a SIGTERM to its pid alone
    reaches the script too (the launcher forwards it: it waited its GRACE_S, 60 s, with the script training
    on, and ended before the script), and so does one to its whole group (the script, in a group of its own,
    gets it forwarded), without cutting the script's own 3 s cleanup: the launcher ends by SIGTERM once the
    script ended, the run saved."""
    launcher, script_pid = _launch_until(tmp_path, 3, "--cleanup-s", "3", module="diffusion_debug.jobs.launch")
    (os.kill if to == "launcher" else os.killpg)(launcher.pid, signal.SIGTERM)
    try:
        launcher.wait(timeout=300)
    except subprocess.TimeoutExpired:
        stop_launch(launcher)
        pytest.fail("the launcher did not end after the signal")
    script_gone = _gone(script_pid)  # as the launcher ended: it waited for the script
    stdout, stderr = _end(launcher)
    assert launcher.returncode == -signal.SIGTERM, stderr[-3000:]
    assert script_gone
    assert stdout.endswith("cleaned up\n"), stdout[-300:]
    run = load_run(_run_dir(tmp_path))
    assert run.summary["end"] == {"status": "interrupted", "signal": "SIGTERM"}
    assert run.summary["training"]["total_steps"] >= 3


def test_the_same_signal_again_within_repeat_s_is_noted_not_raised_again(monkeypatch):
    """The launcher forwards a signal the script may have had from the group: that repeat does not raise
    into the script's cleanup; one later, or another signal, raises as before."""
    from diffusion_debug.jobs import launch_end

    now = [100.0]
    monkeypatch.setattr(launch_end.time, "monotonic", lambda: now[0])
    signals = launch_end.Signals()
    with pytest.raises(launch_end.Interrupted):
        signals._on_signal(signal.SIGTERM, None)
    now[0] += launch_end.REPEAT_S - 0.01
    assert signals._on_signal(signal.SIGTERM, None) is None  # the repeat: noted
    with pytest.raises(KeyboardInterrupt):  # another signal
        signals._on_signal(signal.SIGINT, None)
    now[0] += 0.02
    with pytest.raises(launch_end.Interrupted):  # SIGTERM again, REPEAT_S after the first
        signals._on_signal(signal.SIGTERM, None)
    assert (signals.received, launch_end.REPEAT_S) == (signal.SIGTERM, 2.0)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen's process_group is Python 3.11's")
def test_the_launchers_popen_swap_starts_the_script_in_its_own_group_and_is_undone_at_that_popen(monkeypatch):
    """launch_end.script_in_own_group on accelerate's module globals: the process started with OWN_GROUP set leads a
    group of its own, and the globals are the modules again at once; a caller's own ``start_new_session`` is kept
    (before: ``process_group`` added to it, PermissionError in the child, the script never started), and
    ``isinstance`` with the swapped ``Popen`` works (before: a functools.partial, TypeError)."""
    from diffusion_debug.jobs.launch_end import OWN_GROUP, script_in_own_group

    probe = [sys.executable, "-c", "import os; print(os.getpid(), os.getpgrp(), os.getsid(0))"]
    namespace = {"subprocess": subprocess, "psutil": psutil}

    def started(popen: type, **options: object) -> list[int]:
        process = popen(probe, stdout=subprocess.PIPE, text=True, **options)
        assert isinstance(process, popen)
        return [int(n) for n in process.communicate()[0].split()]

    with script_in_own_group(namespace):  # no OWN_GROUP: the child in this group, the swap kept for the block
        assert started(namespace["subprocess"].Popen)[1] == os.getpgrp() and namespace["subprocess"] is not subprocess
    assert namespace == {"subprocess": subprocess, "psutil": psutil}
    monkeypatch.setenv(OWN_GROUP, "1")
    with script_in_own_group(namespace):
        pid, group, session = started(namespace["psutil"].Popen)  # as accelerate 1.16 starts the script
        assert (group, session) == (pid, os.getsid(0))
        assert namespace == {"subprocess": subprocess, "psutil": psutil}  # undone at that Popen
    with script_in_own_group(namespace):
        pid, group, session = started(namespace["subprocess"].Popen, start_new_session=True)
        assert (group, session) == (pid, pid)


# a script with its own graceful stop (a checkpoint saved on SIGTERM or Ctrl-C, its handler counting its
# calls) gets a signal sent to the launcher's pid alone (a supervisor, `kill PID`) once, forwarded (SIGTERM:
# below, with SIGTSTP, SIGCONT and SIGUSR1); one sent to the launcher's whole group without a terminal (a
# scheduler, `kill -TERM -PGID`) once too, forwarded (before, the script shared the launcher's group and had it
# twice, from the group and forwarded), and `diffusion-debug launch` returns only once the script's save is done;
# the terminal's Ctrl-C once (below). [SIGINT-launcher]'s script calls os.setpgrp() itself and runs (not EPERM,
# as a script made a session leader would have it); not [SIGTERM-group]'s, which would leave the group itself
# and have the signal once on main too
@pytest.mark.parametrize(
    ("sent", "to"), [(signal.SIGINT, "launcher"), (signal.SIGTERM, "group")], ids=lambda v: getattr(v, "name", v)
)
def test_a_scripts_own_signal_handler_is_called_once_for_one_signal_to_the_launcher(tmp_path, sent, to):
    count = tmp_path / "handled.txt"
    args = ("--count-signals", str(count), "--cleanup-s", "1")
    if to == "launcher":
        command, script_pid = _launch_until(tmp_path, 3, *args, "--setpgrp", module="diffusion_debug.jobs.launch")
        assert os.getpgid(script_pid) == script_pid
        os.kill(command.pid, sent)
    else:
        command, script_pid = _launch_until(tmp_path, 3, *args)
        os.killpg(_launcher_of(command), sent)
    try:
        command.wait(timeout=300)
    except subprocess.TimeoutExpired:
        stop_launch(command)
        pytest.fail("the command did not end after the signal")
    script_gone = _gone(script_pid)  # as the command ended: it waited for the script
    stdout, stderr = _end(command)
    assert command.returncode == -sent, stderr[-3000:]
    assert script_gone and stdout.endswith("\n") and stdout.splitlines()[-1].startswith("trained ")
    assert count.read_text() == f"{sent.name}\n"


def _until_status(pid: int, stopped: bool) -> bool:
    """Whether the process ``pid`` is (``stopped``) or is not stopped, looked at until it is, for up to 120 s."""
    for _ in range(1200):
        if (psutil.Process(pid).status() == psutil.STATUS_STOPPED) == stopped:
            return True
        time.sleep(0.1)
    return False


def _rounds(launcher: subprocess.Popen, rounds: int) -> None:
    """Read the launcher's stdout on, until the script printed ``rounds`` more rounds."""
    for line in launcher.stdout:
        rounds -= line.startswith("round ")
        if rounds == 0:
            return
    pytest.fail("the launched script stopped training")


def test_sigtstp_sigcont_sigusr1_then_sigterm_to_the_launcher_reach_the_script(tmp_path):
    """Without a terminal (the forwarding path; a terminal's Ctrl-Z: below): a SIGTSTP to the launcher stops the
    script (before: the launcher alone, the script training on), a SIGCONT continues it; a SIGUSR1 reaches the
    script's own handler once (a checkpoint: it trains on; before, it ended the launcher at its default), and a
    SIGTERM then ends the launch by SIGTERM, the script's handler called once for it."""
    count = tmp_path / "handled.txt"
    args = ("--count-signals", str(count), "--cleanup-s", "1")
    launcher, script_pid = _launch_until(tmp_path, 3, *args, module="diffusion_debug.jobs.launch")
    os.kill(launcher.pid, signal.SIGTSTP)
    stopped = _until_status(script_pid, stopped=True) and _until_status(launcher.pid, stopped=True)
    os.kill(launcher.pid, signal.SIGCONT)
    continued = _until_status(script_pid, stopped=False)
    if not (stopped and continued):
        stop_launch(launcher)  # the script's whole session, as the launcher had it
    assert (stopped, continued) == (True, True)
    os.kill(launcher.pid, signal.SIGUSR1)
    _rounds(launcher, 2)  # trains on after its checkpoint
    os.kill(launcher.pid, signal.SIGTERM)
    stdout, stderr = _end(launcher)
    assert launcher.returncode == -signal.SIGTERM, stderr[-3000:]
    assert _gone(script_pid) and stdout.splitlines()[-1].startswith("trained ")
    assert count.read_text() == "SIGUSR1\nSIGTERM\n"


class _Shell:
    """An interactive bash in a pty (its controlling terminal, job control on), typed into through the pty's master
    end, running ``diffusion-debug launch`` as its foreground job, its output in out.txt and err.txt."""

    def __init__(self, tmp_path: Path, master: int, bash: subprocess.Popen) -> None:
        self.tmp_path, self.master, self.bash, self.screen = tmp_path, master, bash, ""

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def until(self, text: str, timeout: float = 120.0) -> str:
        """Read the terminal until it shows ``text`` (else the test fails): what it showed up to it."""
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.master], [], [], left)[0]:
                pytest.fail(f"the terminal never showed {text!r}: {self.screen[-2000:]!r}")
            try:
                self.screen += os.read(self.master, 4096).decode(errors="replace")
            except OSError:  # the shell and every job ended (EIO)
                pytest.fail(f"the terminal closed before showing {text!r}: {self.screen[-2000:]!r}")
        shown, _, self.screen = self.screen.partition(text)
        return shown

    def out(self) -> str:
        out = self.tmp_path / "out.txt"
        return out.read_text() if out.exists() else ""  # made once the shell read the line

    def rounds(self, rounds: int) -> int:
        """Until the script printed ``rounds`` rounds in all (else the test fails): its pid."""
        for _ in range(3000):
            lines = [line for line in self.out().splitlines() if line.startswith("round ")]
            if len(lines) >= rounds:
                return int(lines[-1].split()[-1])
            time.sleep(0.1)
        pytest.fail(f"the launched script stopped before round {rounds}: {(self.tmp_path / 'err.txt').read_text()}")

    def status(self) -> int:
        """The exit status the shell has for its last job."""
        self.type('echo "status $? $((6 * 7))"\n')  # what the terminal echoes as typed is not "42"
        return int(self.until(" 42").rpartition("status ")[2])


@contextlib.contextmanager
def _launch_in_a_shell(tmp_path: Path, *script_args: str) -> Iterator[_Shell]:
    """``diffusion-debug launch`` (one process) of a script training until stopped, typed into an interactive bash
    in a pty, started once the script printed 3 rounds; afterwards the shell exits (whatever is left in its
    session is stopped, the test failed)."""
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    if shutil.which("bash") is None:
        pytest.skip("no bash to run the launch as a job of an interactive shell")
    master, slave = pty.openpty()

    def started() -> None:
        for sent in (signal.SIGINT, signal.SIGQUIT):  # not ignored, as a shell without job control leaves them
            signal.signal(sent, signal.SIG_DFL)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    environment = {**cpu_launch_env(ROOT), "PS1": "$ ", "TERM": "dumb", "HISTFILE": os.devnull}
    bash = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-i"],
        env=environment,
        cwd=tmp_path,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=started,
    )
    os.close(slave)
    shell = _Shell(tmp_path, master, bash)
    try:
        command = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", "runs", *ONE_PROCESS]
        command += [str(SCRIPT), "--forever", *script_args]
        shell.type(f"{shlex.join(command)} > out.txt 2> err.txt\n")
        shell.rounds(3)
        yield shell
        shell.type("exit\n")
        bash.wait(timeout=60)
    finally:
        stop_launch(bash)
        os.close(master)


def _command_of(shell: _Shell) -> int:
    """The pid of ``diffusion-debug launch``, the shell's job."""
    (command,) = psutil.Process(shell.bash.pid).children()
    return command.pid


def test_ctrl_z_then_fg_in_an_interactive_shell_then_one_ctrl_c_reaches_the_scripts_own_handler_once(tmp_path):
    """``diffusion-debug launch`` typed into bash in a terminal: Ctrl-Z stops the training (the script, in the
    launcher's group, the terminal's foreground) with its launcher and the command, which the shell lists as its
    stopped job (before: the command waited on for the stopped launcher, the shell for the command, the terminal
    wedged); ``fg`` continues them with the launcher's group the terminal's foreground again, and the script trains
    on; so it does after a second Ctrl-Z and ``bg``, the shell's group the foreground, and after ``fg`` again in the
    foreground (the command gives the launcher's group the terminal: else a Ctrl-C reached the script twice). Then
    one Ctrl-C is one call of the script's SIGINT handler, its run saved, and the command ends by SIGINT."""
    count = tmp_path / "handled.txt"
    with _launch_in_a_shell(tmp_path, "--count-signals", str(count), "--cleanup-s", "1") as shell:
        script_pid = shell.rounds(3)
        group = _launcher_of_pid(_command_of(shell))
        shell.type("\x1a")  # the terminal's suspend character: SIGTSTP to its foreground group
        shell.type('jobs; echo "listed $((6 * 7))"\n')  # read by the shell once its job stopped
        listed = shell.until("listed 42").splitlines()
        assert [line.split()[:2] for line in listed if line.startswith("[1]+")][-1] == ["[1]+", "Stopped"]
        assert _until_status(script_pid, stopped=True) and _until_status(group, stopped=True)
        shell.type("fg\n")
        assert _until_status(script_pid, stopped=False) and _until_foreground(shell.master, group)
        shell.rounds(shell.out().count("round ") + 2)  # trains on
        shell.type("\x1a")
        shell.type('bg; echo "resumed $((6 * 7))"\n')
        shell.until("resumed 42")
        assert _until_status(script_pid, stopped=False) and os.tcgetpgrp(shell.master) == shell.bash.pid
        shell.rounds(shell.out().count("round ") + 2)  # trains on in the background
        shell.type("fg\n")
        assert _until_foreground(shell.master, group)
        shell.type("\x03")  # the terminal's interrupt character: SIGINT to its foreground group
        assert shell.status() == 128 + signal.SIGINT
    assert _gone(script_pid) and shell.out().splitlines()[-1].startswith("trained ")
    assert count.read_text() == "SIGINT\n"
    run = load_run(_run_dir(tmp_path))  # the script's own graceful stop: it finished
    assert run.summary["end"] == {"status": "finished"} and run.summary["training"]["total_steps"] >= 5
    assert (_run_dir(tmp_path) / "report.html").is_file()


def _until_foreground(terminal: int, group: int) -> bool:
    """Whether ``group`` is the terminal's foreground, looked at until it is, for up to 120 s."""
    for _ in range(1200):
        if os.tcgetpgrp(terminal) == group:
            return True
        time.sleep(0.1)
    return False


def test_a_sigterm_to_the_command_in_a_terminal_reaches_the_scripts_own_handler_once(tmp_path):
    """``diffusion-debug launch`` leading a terminal's session with no job-control shell (``docker run -it``,
    ``ssh -t host cmd``: a pty whose foreground is the command's group), where the script shares the launcher's group
    (it reads the terminal, it has the terminal's Ctrl-C itself). The terminal's Ctrl-Z is a brief pause: no shell
    would continue a stopped job, and the script trains on. A ``kill -STOP`` and ``kill -CONT`` of the launcher
    leave the command waiting (before: it stopped itself by SIGSTOP, which its orphaned group does not drop as it
    drops a SIGTSTP, and stayed stopped for good). A SIGTERM to the command's pid then goes to the launcher's pid
    alone, which forwards it (before: to the launcher's group and forwarded, twice), and the command ends by it."""
    master, slave = pty.openpty()
    count = tmp_path / "handled.txt"
    watchdog = threading.Timer(300, stop_launch)
    try:
        args = ("--count-signals", str(count), "--cleanup-s", "1")
        command, script_pid = _launch_until(tmp_path, 3, *args, terminal=slave)
        watchdog.args = [command]  # a launch left stopped for good: its stdout ends, _rounds fails, not hangs
        watchdog.start()
        group = _launcher_of(command)
        assert os.getpgid(script_pid) == group == os.tcgetpgrp(master)
        os.write(master, b"\x1a")  # the terminal's suspend character: SIGTSTP to its foreground group
        _rounds(command, 2)  # trains on
        os.kill(group, signal.SIGSTOP)  # the launcher's pid alone, from outside the terminal
        stopped = _until_status(group, stopped=True)
        os.kill(group, signal.SIGCONT)
        continued = _until_status(group, stopped=False)
        _rounds(command, 2)
        waiting = psutil.Process(command.pid).status() != psutil.STATUS_STOPPED
        seen = (stopped, continued, waiting, os.tcgetpgrp(master))
        if seen != (True, True, True, group):  # the command stopped for good, or the terminal not the launcher's
            stop_launch(command)
        assert seen == (True, True, True, group)
        os.kill(command.pid, signal.SIGTERM)
        stdout, stderr = _end(command)
    finally:
        watchdog.cancel()
        os.close(slave)
        os.close(master)
    assert command.returncode == -signal.SIGTERM, stderr[-3000:]
    assert _gone(script_pid) and stdout.splitlines()[-1].startswith("trained ")
    assert count.read_text() == "SIGTERM\n"


def test_a_sigint_to_the_launcher_started_directly_ends_it_with_the_scripts_cleanup_and_run(tmp_path):
    """A SIGINT to the pid of ``python -m diffusion_debug.jobs.launch`` alone (no terminal): the script gets
    it (KeyboardInterrupt), runs its cleanup and saves its run; the launcher ends by SIGINT."""
    launcher, script_pid = _launch_until(tmp_path, 3, "--cleanup-s", "1", module="diffusion_debug.jobs.launch")
    os.kill(launcher.pid, signal.SIGINT)
    stdout, stderr = _end(launcher)
    assert launcher.returncode == -signal.SIGINT, stderr[-3000:]
    assert _gone(script_pid) and stdout.endswith("cleaned up\n"), stdout[-300:]
    run = load_run(_run_dir(tmp_path))
    assert run.summary["end"] == {"status": "interrupted", "signal": "SIGINT"}
    assert run.summary["training"]["total_steps"] >= 3


def _launcher_of(command: subprocess.Popen) -> int:
    """The pid of the launcher (``python -m diffusion_debug.jobs.launch``) that ``diffusion-debug launch``
    started, the leader of its process group."""
    return _launcher_of_pid(command.pid)


def _launcher_of_pid(command: int) -> int:
    (launcher,) = psutil.Process(command).children()
    return launcher.pid


# SIGQUIT sent to the command reaches the script's own handler once, forwarded (before, it ended the command at
# its default; the launcher then had SIGTERM as its parent died, and so had the script), and stops the run as
# SIGTERM does: the command ends by it (SIGUSR1, the script's to answer: above, sent to the launcher)
def test_a_sigquit_to_the_command_reaches_the_scripts_own_handler_once(tmp_path):
    count = tmp_path / "handled.txt"
    command, script_pid = _launch_until(tmp_path, 3, "--count-signals", str(count), "--cleanup-s", "1")
    os.kill(command.pid, signal.SIGQUIT)
    stdout, stderr = _end(command)
    assert command.returncode == -signal.SIGQUIT, stderr[-3000:]
    assert _gone(script_pid) and stdout.splitlines()[-1].startswith("trained ")
    assert count.read_text() == "SIGQUIT\n"


def test_a_sigkill_to_the_launchers_group_leaves_no_script_and_the_command_waits_for_its_save(tmp_path):
    """``kill -KILL -PGID`` of the launcher's group (no terminal): the script, in a group of its own, gets
    SIGTERM as its launcher dies and saves its run in its own 1 s cleanup; the command, their subreaper,
    returns (137, as the launcher ended) only once the script ended: no script is left running."""
    command, script_pid = _launch_until(tmp_path, 3, "--cleanup-s", "1")
    os.killpg(_launcher_of(command), signal.SIGKILL)
    try:
        command.wait(timeout=300)
    except subprocess.TimeoutExpired:
        stop_launch(command)
        pytest.fail("the command did not end after the SIGKILL")
    script_gone = _gone(script_pid)
    stdout, stderr = _end(command)
    assert command.returncode == 137, stderr[-3000:]
    assert script_gone and stdout.endswith("cleaned up\n"), stdout[-300:]
    assert load_run(_run_dir(tmp_path)).summary["end"] == {"status": "interrupted", "signal": "SIGTERM"}


FIRST_MOMENTS = """
import os, signal
if b"diffusion_debug.jobs.launched" in open("/proc/self/cmdline", "rb").read():  # the script's process alone
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    open(READY, "w").close()
    sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
    open(SENDERS, "w").write(f"{sender}\\n")
    os._exit(0)
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the launcher makes the script's group before exec from 3.11")
def test_a_sigterm_to_the_launchers_group_in_the_scripts_first_moments_reaches_it_once_from_the_launcher(tmp_path):
    """``kill -TERM -PGID`` of the launcher's group (no terminal) at the script's start, its interpreter not yet at
    the bootstrap (a sitecustomize that records the sender of the first SIGTERM it gets): the script has it from the
    launcher alone, forwarded once (before: from the group itself, the sender the test, as it had not left the
    launcher's group yet, and forwarded again), and the command ends by SIGTERM."""
    if importlib.util.find_spec("sitecustomize") is not None:
        pytest.skip("this Python has a sitecustomize of its own, which the test's would shadow")
    site, ready, senders = tmp_path / "site", tmp_path / "ready", tmp_path / "senders.txt"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"READY, SENDERS = {str(ready)!r}, {str(senders)!r}\n{FIRST_MOMENTS}")
    command, _ = _launch_until(tmp_path, 0, site=site)
    for _ in range(3000):
        if ready.exists() or command.poll() is not None:
            break
        time.sleep(0.1)
    if not ready.exists():
        stop_launch(command)
        said = command.stderr.read()[-3000:]
        pytest.fail(f"no {ready.name} from the script's process (the command's return code: {command.poll()}): {said}")
    launcher = _launcher_of(command)
    os.killpg(launcher, signal.SIGTERM)
    _, stderr = _end(command)
    assert command.returncode == -signal.SIGTERM, stderr[-3000:]
    assert senders.read_text() == f"{launcher}\n"
