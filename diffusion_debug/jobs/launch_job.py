"""``diffusion-debug launch`` as a job of an interactive shell: Ctrl-Z, ``fg`` and ``bg`` (launch.py's "Signals").

In a terminal's foreground the command gives the terminal to the launcher's process group (the script shares it),
so the terminal's Ctrl-Z stops the launcher and its script, not the command, which is the shell's job: the shell
would wait on for it and the terminal would stay wedged. The command waits for the launcher as su and sudo wait
for theirs (:func:`wait_as_job`): when the launcher stops, it takes the terminal back and stops itself by the same
signal, so the shell sees its job stopped (``jobs``); continued (``fg``: the shell gave it the terminal; ``bg``: it
did not), it gives the terminal to the launcher's group where it holds it now, and continues that group.

Limits: outside a terminal's foreground (a scheduler, ``&``) the command does not stop with the launcher: nothing
there would continue it. A launcher stopped and continued by someone else than the shell (``kill -STOP -PGID``,
then ``kill -CONT -PGID``) leaves the command stopped, the shell's job, until ``fg`` or ``bg``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable

LOOK_S = 0.1
"""How often a launch continued in the background looks whether it was brought to the foreground."""


def wait_as_job(process: subprocess.Popen, terminal: int | None, sleep: Callable[[float], None] = time.sleep) -> int:
    """The return code of ``process`` (negative: the signal that ended it), the launcher, which leads a process
    group of its own; ``terminal``: the terminal the command gave that group (None: none, the launcher is waited
    for as before). Each stop of the launcher stops this process too, until the shell continues it. Continued in
    the background (``bg``), it looks every :data:`LOOK_S` whether the shell brought it to the foreground (a
    ``fg`` of a running job sends no SIGCONT) and then gives the launcher's group the terminal."""
    if terminal is None:
        return process.wait()
    group, background = process.pid, False
    while True:
        pid, status = os.waitpid(group, os.WUNTRACED | (os.WNOHANG if background else 0))
        if pid == 0:  # running in the background
            if _foreground(terminal) == os.getpgrp():
                background = not _continue(group, terminal)
            else:
                sleep(LOOK_S)
        elif os.WIFSTOPPED(status):
            background = not _stop_with(group, terminal, os.WSTOPSIG(status))
        else:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode


def _stop_with(group: int, terminal: int, stopped_by: int) -> bool:
    """The launcher's ``group`` was stopped by ``stopped_by`` (the terminal's Ctrl-Z, a read of the terminal in
    the background): this process stops too, the terminal its own again, and goes on when continued; whether in
    the foreground."""
    if _foreground(terminal) == group:
        set_foreground(terminal, os.getpgrp())
    # the same signal, as the shell shows it ("Stopped", "Stopped (tty input)"); SIGSTOP where it is not at its
    # default. In an orphaned group (the shell gone: none would continue it) the kernel drops a SIGTSTP: on at once
    at_default = signal.getsignal(stopped_by) == signal.SIG_DFL
    os.kill(os.getpid(), stopped_by if at_default else signal.SIGSTOP)
    return _continue(group, terminal)


def _continue(group: int, terminal: int) -> bool:
    """Continued by the shell: ``fg`` gave this process's group the terminal before it continued it (then it is
    the launcher's group's again), ``bg`` did not; whether in the foreground."""
    foreground = _foreground(terminal) == os.getpgrp()
    if foreground:
        set_foreground(terminal, group)
    try:
        os.killpg(group, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
    return foreground


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


def _foreground(terminal: int) -> int | None:
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
