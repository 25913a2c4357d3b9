"""How a launched script ended, and the signals that end it (:mod:`~diffusion_debug.jobs.launched`).

The end is recorded in summary.json as ``end``: ``{"status": "finished"}`` (with ``exit_code`` when
the script called ``sys.exit`` with another code than 0), ``{"status": "raised", "exception":
"RuntimeError", "message": ..., "where": "train.py, line 12, in <module>", "traceback": ...}`` (the
last frames, bounded) or ``{"status": "interrupted", "signal": "SIGTERM"}``.

SIGINT and SIGTERM, where the script left their default handlers, raise where the script is (Ctrl-C's
``KeyboardInterrupt``, :class:`Interrupted` for SIGTERM) so that the run is saved; a SIGTERM then ends
the process by the signal, as it would have ended it. While the run is being saved a signal is noted
and not raised, so that a second Ctrl-C does not cut summary.json or report.html; the same signal
again within :data:`REPEAT_S` of the first is noted too (a sender that signals every process of the job,
the launcher's too, which forwards it; the launcher in a terminal's foreground, whose script shares its group).

``DIFFUSION_DEBUG_NO_HTML=1`` in the launch's environment (:data:`NO_HTML`): the run is saved without
report.html (a CI job that reads summary.json saves the seconds the page takes to build);
``diffusion-debug report RUN_DIR`` builds it later from the saved files.

``diffusion-debug launch`` as a job of an interactive shell (Ctrl-Z, ``fg`` and ``bg``). In a terminal's foreground
the command gives the terminal to the launcher's process group (the script shares it), so the terminal's Ctrl-Z
stops the launcher and its script, not the command, which is the shell's job: the shell would wait on for it and
the terminal would stay wedged. The command waits for the launcher as su and sudo wait for theirs
(:func:`wait_as_job`): when the launcher stops, it takes the terminal back and stops its own group by the same
signal (the job: the command, and a pipeline's other commands or the ``bash -c`` that runs it, as the terminal's
Ctrl-Z would have), so the shell sees its job stopped (``jobs``) at the first Ctrl-Z; continued (``fg``: the shell
gave it the terminal; ``bg``: it did not), it gives the terminal to the launcher's group where it holds it now, and
continues that group. Only under a job-control shell (:func:`under_job_control`): where the command leads the
terminal's session (``docker run -it``, ``ssh -t host cmd``, ``tmux new cmd``) nothing would continue it, so a
Ctrl-Z there is a brief pause (the launcher's group continued at once) and a ``kill -STOP`` of the launcher is
waited out, as before.

Its limits: outside a terminal's foreground (a scheduler, ``&``), or with a stdin that is no terminal (``cmd <
/dev/null``), the command does not give the launcher the terminal: a Ctrl-Z there stops the command alone, the
training runs on. A launcher stopped and continued by someone else than the shell (``kill -STOP -PGID``, then
``kill -CONT -PGID``) under a job-control shell leaves the command's job stopped until ``fg`` or ``bg``.

Why the command's job control and the launcher's script group are here, with the script's end: they are the
signal paths of the three processes of a launch (the command, the launcher, the script), each module of
``diffusion_debug/jobs`` is one command's or a launch's part, and the folder holds its 20 modules
(``tests/test_layering.py``); a module of their own waits for a package ``jobs/launch``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from .pipeline_loading import one_line

TRACEBACK_FRAMES = 4
"""The innermost frames of a raised script's traceback kept in ``end.traceback``."""
TRACEBACK_CHARS = 4000
REPEAT_S = 2.0
"""A signal received again this soon after the first is the same request twice (sent to the group, and
forwarded by the launcher to its script): it is noted, not raised a second time into the script's cleanup."""
NO_HTML = "DIFFUSION_DEBUG_NO_HTML"
"""Set to 1 (or any value but 0 and empty) in a launch's environment: no report.html is written."""


def writes_html(environ: Any = os.environ) -> bool:
    """Whether the launched run writes report.html: unless :data:`NO_HTML` says not.

    >>> writes_html({}), writes_html({NO_HTML: "0"}), writes_html({NO_HTML: "1"})
    (True, True, False)
    """
    return environ.get(NO_HTML, "").strip() in ("", "0")


def saved_line(run_dir: Any, html: bool, asked: str = f"{NO_HTML} is set") -> str:
    """The last line of a saved training run (launch's main process, ``train``): its report.html,
    else the run directory and what ``asked`` for none.

    >>> saved_line("runs/run-1", False, "--no-html")
    'run: runs/run-1 (--no-html: no report.html; diffusion-debug report RUN_DIR builds it)'
    """
    if html:
        return f"report: {Path(run_dir) / 'report.html'}"
    return f"run: {run_dir} ({asked}: no report.html; diffusion-debug report RUN_DIR builds it)"


class Interrupted(BaseException):
    """SIGTERM in a launched process, raised where the script is (as Ctrl-C raises
    KeyboardInterrupt); a BaseException, so that a script's ``except Exception`` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM while the script runs: the first one received is ``received``.
    ``unwatched()`` true (nothing is watched, nothing will be saved): a signal does what it does
    without the debugger."""

    def __init__(self, unwatched: Callable[[], bool] = lambda: False) -> None:
        self.received: int | None = None
        self._first_at = 0.0
        self.saving = False
        self.unwatched = unwatched
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(signum)
            if current in (signal.SIG_DFL, signal.default_int_handler):  # SIG_IGN (nohup, &) stays
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signum, now
        elif signum == self.received and now - self._first_at < REPEAT_S:
            return  # the same signal twice: from the group and forwarded by the launcher (launch.py)
        if self.saving:
            return  # noted: the run being saved is not cut
        if signum == signal.SIGTERM and self.unwatched():  # ends the process as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as Ctrl-C raises it
        raise Interrupted(signum)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:  # the script's own handler stays
                signal.signal(signum, previous)
        self._previous.clear()


def describe_end(error: BaseException | None, received: int | None) -> dict[str, Any]:
    """The ``end`` of summary.json for a script that raised ``error`` (None: it returned), having
    received the signal ``received`` (None: none)."""
    if isinstance(error, Interrupted):
        received = error.signum
    elif isinstance(error, KeyboardInterrupt) and received is None:
        received = signal.SIGINT
    if received is not None:
        return {"status": "interrupted", "signal": signal.Signals(received).name}
    if error is None:
        return {"status": "finished"}
    if isinstance(error, SystemExit):
        code = error.code
        if code is None or code == 0:
            return {"status": "finished"}
        return {"status": "finished", "exit_code": code if isinstance(code, int) else 1}
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next  # the launcher's frames (this package's bootstrap, runpy) are not the script's
    frames = traceback.extract_tb(tb)
    text = "".join(traceback.format_exception(type(error), error, tb, limit=-TRACEBACK_FRAMES))
    end = {
        "status": "raised",
        "exception": type(error).__qualname__,
        "message": one_line(str(error), 500),
        "traceback": text[-TRACEBACK_CHARS:],
    }
    if frames:
        last = frames[-1]
        end["where"] = f"{last.filename}, line {last.lineno}, in {last.name}"
    return end


def _ours(filename: str) -> bool:
    return "runpy" in filename or filename.endswith(("launched.py", "launch_end.py"))


def end_by_signal(error: Interrupted) -> None:
    """End this process by the signal that raised ``error``, as the signal would have ended it."""
    end_by(error.signum)


def end_by(signum: int) -> None:
    """End this process by the signal ``signum``, as the signal would have ended it."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # the signal is blocked or delayed: the same exit status


OWN_GROUP = "DIFFUSION_DEBUG_OWN_GROUP"
"""Set by the one-process launcher outside a terminal's foreground for the script it starts (launch.py's
"Signals"): the script leaves the launcher's process group."""


def leave_launcher_group(environ: Any = os.environ) -> None:
    """The one-process launcher's script (:data:`OWN_GROUP` set): a process group of its own in the launcher's
    session, so that a signal to the launcher's group (``kill -TERM -PGID``, the command forwarding one) reaches
    the launcher alone, which forwards it to this process's pid, once. Run before the script, so no handler of
    the script's own is installed yet; the variable is taken out, so the script's subprocesses stay where it
    starts them. Where the launcher could not start it in a group of its own (:func:`script_in_own_group`), a
    signal to the launcher's group that comes before this line (the script's first moments) reaches the script
    from the group too."""
    if environ.pop(OWN_GROUP, None) != "1":
        return
    try:
        os.setpgid(0, 0)
    except OSError:  # a group leader already: the launcher signals its pid as any other's
        pass


@contextlib.contextmanager
def script_in_own_group(namespace: dict[str, Any]) -> Iterator[None]:
    """While the one-process launcher runs accelerate's, whose module globals are ``namespace``: the process it
    starts for the script with :data:`OWN_GROUP` set leads a group of its own before it execs (``Popen``'s
    ``process_group``, Python 3.11+: psutil's under accelerate 1.16, subprocess's before), so a signal to the
    launcher's group never reaches it, not in its first moments either (:func:`leave_launcher_group` then finds it
    leading its group). Elsewhere (Python 3.10, an accelerate without either) the bootstrap leaves the group.
    ``namespace`` holds the swapped modules only until that ``Popen`` (or the end of this block): accelerate's
    ``except subprocess.CalledProcessError`` and its ``psutil.Process`` calls after it meet the modules themselves."""
    swapped = {}
    if sys.version_info >= (3, 11):
        for name in ("psutil", "subprocess"):
            module = namespace.get(name)
            if isinstance(getattr(module, "Popen", None), type) and not isinstance(module, _OwnGroupModule):
                swapped[name] = module  # one an outer block swapped is left to that block

    def restore() -> None:
        for name, module in swapped.items():
            if isinstance(namespace.get(name), _OwnGroupModule):
                namespace[name] = module

    namespace.update({name: _OwnGroupModule(module, restore) for name, module in swapped.items()})
    try:
        yield
    finally:
        restore()


class _OwnGroupModule:
    """``module`` (psutil, subprocess) whose ``Popen`` starts a process meant to leave its group (:data:`OWN_GROUP`
    in its environment) in a group of its own, and is ``module`` in all else. That ``Popen`` is a subclass of the
    module's (``isinstance`` of its process is true for both) and calls ``restore`` once it started one."""

    def __init__(self, module: Any, restore: Callable[[], None]) -> None:
        self._module = module

        class Popen(module.Popen):
            def __init__(self, *args: Any, **options: Any) -> None:
                leaves = (options.get("env") or os.environ).get(OWN_GROUP) == "1"
                if leaves and not _groups_asked(options):
                    options["process_group"] = 0
                try:
                    super().__init__(*args, **options)
                finally:
                    if leaves:
                        restore()

        self.Popen = Popen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _groups_asked(options: dict[str, Any]) -> bool:
    """Whether a ``Popen`` call's ``options`` set the child's group or session themselves (``start_new_session``,
    ``process_group``, or a ``preexec_fn`` that may): a ``process_group`` added to ``start_new_session`` fails in
    the child (setsid, then setpgid: EPERM), and the script would never start.

    >>> _groups_asked({"env": {}}), _groups_asked({"start_new_session": True}), _groups_asked({"preexec_fn": None})
    (False, True, False)
    """
    return bool(options.get("start_new_session")) or any(
        options.get(name) is not None for name in ("process_group", "preexec_fn")
    )


ENDS_AT_DEFAULT = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""Forwarded signals that end a process at their default: :func:`as_forwarded` sends SIGTERM instead to a
script that neither catches nor ignores one, so that the bootstrap saves its run."""


def as_forwarded(pid: int, signum: int) -> int:
    """The signal the launcher sends the script ``pid`` for ``signum``: SIGTERM for one of :data:`ENDS_AT_DEFAULT`
    the script left at its default (SigCgt and SigIgn in /proc/PID/status; the bootstrap handles SIGTERM and
    saves the run, where ``signum`` would end the script with nothing saved), else ``signum`` (the script's own
    handler answers it, or it cannot be read).

    >>> as_forwarded(os.getpid(), signal.SIGINT) == signal.SIGINT
    True
    """
    if signum not in ENDS_AT_DEFAULT:
        return signum
    masks: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("SigCgt", "SigIgn"):
                    masks[name] = int(value, 16)
    except (OSError, ValueError):
        return signum
    bit = 1 << (signum - 1)
    if len(masks) < 2 or (masks["SigCgt"] | masks["SigIgn"]) & bit:
        return signum
    return signal.SIGTERM


def session_children() -> list[int] | None:
    """This process's children in its own session (the orphans it reaps as subreaper among them; a daemon that
    left the session with ``setsid`` is not one), or None where /proc does not list children."""
    lists = list(Path("/proc/self/task").glob("*/children"))
    if not lists:
        return None
    session, found = os.getsid(0), []
    for children in lists:
        try:
            pids = children.read_text(encoding="ascii").split()
        except OSError:  # a thread that ended meanwhile
            continue
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
            except OSError:  # reaped meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[3]) == session:  # state, ppid, pgrp, session
                found.append(int(pid))
    return found


def die_with_parent(c_library: Any = None) -> None:
    """Linux: this process gets SIGTERM when its parent dies (a launcher killed with SIGKILL leaves
    no process running on); elsewhere nothing."""
    c_library = c_library or libc()
    if c_library is not None:
        c_library.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def libc() -> Any:
    """The C library (Linux, for ``prctl``), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (OSError, AttributeError):
        return None


LOOK_S = 0.1
"""How often a launch continued in the background looks whether it was brought to the foreground."""


def wait_as_job(process: subprocess.Popen, terminal: int | None, sleep: Callable[[float], None] = time.sleep) -> int:
    """The return code of ``process`` (negative: the signal that ended it), the launcher, which leads a process
    group of its own; ``terminal``: the terminal the command gave that group (None: none, the launcher is waited
    for as before). Under a job-control shell (:func:`under_job_control`) each stop of the launcher stops this
    process's group too, the shell's job, until the shell continues it; continued in the background (``bg``), it
    looks every :data:`LOOK_S` whether the shell brought it to the foreground (a ``fg`` of a running job sends no
    SIGCONT) and then gives the launcher's group the terminal. With no such shell (the command leads the terminal's
    session: ``docker run -it``, ``ssh -t host cmd``, ``tmux new cmd``) nothing would continue a stopped job: the
    terminal's Ctrl-Z (SIGTSTP) is a brief pause, the launcher's group continued at once, and a launcher stopped by
    someone else (``kill -STOP``) is waited for until that one continues it."""
    if terminal is None:
        return process.wait()
    group, background = process.pid, False
    while True:
        pid, status = os.waitpid(group, os.WUNTRACED | (os.WNOHANG if background else 0))
        if pid == 0:  # running in the background
            if _foreground_group(terminal) == os.getpgrp():
                background = not _continue(group, terminal)
            else:
                sleep(LOOK_S)
        elif os.WIFSTOPPED(status):
            if under_job_control():
                background = not _stop_with(group, terminal, os.WSTOPSIG(status))
            elif os.WSTOPSIG(status) == signal.SIGTSTP:
                _continue_group(group)
        else:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode


def under_job_control() -> bool:
    """Whether a job-control shell would continue this process's group once stopped: the first of this process's
    ancestors outside its group is in its session (a shell that made the group a job of its own; the kernel's
    test that the group is not orphaned, read along this process's ancestry: from the parent for a command run
    alone, through ``bash -c`` for one run in a shell's child). Not where the command leads the session (no shell
    above it there) or where ancestors cannot be read (no /proc beyond the parent)."""
    group, session, pid = os.getpgrp(), os.getsid(0), os.getppid()
    for _ in range(64):
        if pid <= 0:  # the command is the first process of its namespace (a container's pid 1)
            return False
        try:
            if os.getpgid(pid) != group:
                return os.getsid(pid) == session
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
            pid = int(stat.rpartition(")")[2].split()[1])  # state, ppid
        except (OSError, ValueError, IndexError):
            return False
    return False


def _stop_with(group: int, terminal: int, stopped_by: int) -> bool:
    """The launcher's ``group`` was stopped by ``stopped_by`` (the terminal's Ctrl-Z, a read of the terminal in
    the background, a ``kill -STOP``), under a job-control shell: this process's group, the shell's job, stops too
    (a pipeline's other commands, a ``bash -c`` running this one: what the terminal's Ctrl-Z would have stopped),
    the terminal its own again, and goes on when continued; whether in the foreground."""
    if _foreground_group(terminal) == group:
        set_foreground(terminal, os.getpgrp())
    # the same signal, as the shell shows it ("Stopped", "Stopped (tty input)"); this process by SIGSTOP where
    # it does not leave that signal at its default
    os.killpg(os.getpgrp(), stopped_by)
    if signal.getsignal(stopped_by) != signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGSTOP)
    return _continue(group, terminal)


def _continue(group: int, terminal: int) -> bool:
    """Continued by the shell: ``fg`` gave this process's group the terminal before it continued it (then it is
    the launcher's group's again), ``bg`` did not; whether in the foreground."""
    foreground = _foreground_group(terminal) == os.getpgrp()
    if foreground:
        set_foreground(terminal, group)
    _continue_group(group)
    return foreground


def _continue_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def take_terminal_back(terminal: int | None, group: int) -> None:
    """The terminal this process's group's again where the launcher's ``group``, or a group gone, holds it (not
    where the shell took it back: a launch continued with ``bg``)."""
    if terminal is None:
        return
    try:
        foreground = os.tcgetpgrp(terminal)
        if foreground != group:
            os.killpg(foreground, 0)  # raises where no process of it is left
            return
    except ProcessLookupError:
        pass
    except OSError:
        return
    set_foreground(terminal, os.getpgrp())


def _foreground_group(terminal: int) -> int | None:
    """The process group in the foreground of ``terminal`` (None: it cannot be read)."""
    try:
        return os.tcgetpgrp(terminal)
    except OSError:
        return None


def set_foreground(terminal: int, group: int) -> None:
    """Make ``group`` the foreground of ``terminal`` (from a background group too), where it can."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may take it
    try:
        os.tcsetpgrp(terminal, group)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)
