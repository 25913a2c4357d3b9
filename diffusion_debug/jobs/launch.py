"""``diffusion-debug launch``: an unmodified training script under ``accelerate launch``, with
the training debugger attached in every process (:mod:`~diffusion_debug.jobs.launched`).

The command runs ``python -m diffusion_debug.jobs.launch ARGS`` (:func:`main`): that process is
the launcher, accelerate's own, run in it as ``accelerate launch`` runs it. The accelerate options
are accelerate's, checked by its own parser before anything starts (one line of ours when wrong,
then our settings and the script's path); the script becomes an argument of ``-m
diffusion_debug.jobs.launched`` and every other option is passed on as given, so the processes,
their environment and the exit code are what ``accelerate launch`` gives, with one exception: CPU
processes. ``--cpu`` (or a config's ``use_cpu``) with several processes, where accelerate would
start one, and several processes of its multi-GPU launcher on a machine with no accelerator, where
each would train alone, run as one job on gloo: accelerate's multi-GPU launcher (torchrun) with
``ACCELERATE_USE_CPU=true`` (:func:`cpu_processes`), unless the environment sets that variable already.

The command's own process imports no torch: it only starts the launcher (the cost of a launch is
one Python that imports torch fewer than a launch that parses accelerate's options itself).

Signals: the launcher runs in a process group of its own (the terminal's foreground, where the
command had it), so Ctrl-C in the terminal reaches it as under a plain launch; :data:`FORWARDED` (SIGINT,
SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) sent to the command's pid alone are forwarded to that group (in
the terminal's foreground SIGTERM, SIGUSR1 and SIGUSR2 to the launcher's pid alone, which forwards them; one
the command was started ignoring, as ``nohup`` or a shell's ``&`` do, stays ignored), and a SIGKILL of it
sends SIGTERM to the launcher (Linux; the script's process then gets SIGTERM as its parent ends). After an
interrupt or a failure the command, subreaper of what it started, waits for every process left in its session (the
script's, saving its run; not a daemon the script started in a session of its own) before it returns, up to
:data:`GRACE_S`: on Ctrl-C it returns once report.html is written. The launcher and the command then end by the
signal itself (a shell loop or a scheduler sees "killed
by SIGINT / SIGTERM", not an exit status 130 / 143), under every accelerate: the one-process launcher
waits for the script instead of answering the signal (accelerate 1.16's terminates the script and kills
it 5 seconds later, before report.html), and accelerate 1.16's exit status 128 + N after torch's elastic
agent was signalled becomes the signal N again. SIGUSR1 and SIGUSR2 reach torchrun's workers (forwarded; as
SIGTERM to a worker that leaves it at its default, so its run is saved; torchrun then ends with exit status 1).
Each signal reaches the one-process script once. Outside a terminal's foreground (no terminal: a scheduler,
a supervisor, ``&``) the script leads a group of its own in the same session before its code runs
(:func:`~diffusion_debug.jobs.launch_end.script_in_own_group`): a signal to the launcher's group (``kill -TERM
-PGID``, the command forwarding one) or to its pid reaches the launcher alone, which forwards it to the script
(not to its DataLoader workers, which end with it). SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the run (the launcher
waits for the script, then ends by the signal); SIGUSR1 and SIGUSR2 are the script's to answer (a checkpoint before
a preemption: the launch ends as the script does). One of SIGHUP,
SIGQUIT, SIGUSR1 and SIGUSR2 that the script leaves at its default (no handler in its /proc/PID/status SigCgt,
not ignored), which would end it with nothing saved, is sent to it as SIGTERM: it saves its run, and the
launcher ends by the signal it had (SLURM's ``--signal=USR1@60`` to a script without a handler); SIGTSTP
stops the script and the launcher, SIGCONT continues both. A ``kill -KILL -PGID`` ends the launcher alone:
the script gets SIGTERM as its parent dies (PR_SET_PDEATHSIG, set by the bootstrap), saves its run and ends,
and the command waits for it. SIGTERM rather than SIGKILL: a save that outlives the launcher's GRACE_S is
not cut. The script leads its group, so an ``os.setpgrp()`` of its own does nothing. In a terminal's
foreground the script stays in the launcher's group, so it reads the terminal (pdb) and has the terminal's
Ctrl-C, Ctrl-\\ and Ctrl-Z itself, the launcher with it (a Ctrl-Z stops the command too, the shell's job, and
``fg`` or ``bg`` continues all three; with no job-control shell, ``docker run -it``, it is a brief pause:
:func:`~diffusion_debug.jobs.launch_end.wait_as_job`); the launcher forwards
to it only what a terminal never sends (SIGTERM, the first one; SIGUSR1, SIGUSR2). Why not tell a group signal from
one to the launcher's pid instead: from one sender, ``kill(-PGID)`` and ``kill(PID)`` give the same siginfo
(si_pid, si_code SI_USER), and whether the script had it too (SigPnd / ShdPnd in its /proc/PID/status) is gone once
its handler ran.
Under accelerate 1.16 the one-process script's stderr is a pipe through the launcher (accelerate keeps its
tail for the error it raises): the script sees no terminal there, and what it writes to stderr after the
launcher ended (a SIGKILLed command) is lost. accelerate 1.16 raises that tail again in its error for a
failed script (its summary and traceback printed twice): the launcher raises the error without it, as
accelerate up to 1.15 raised it. DeepSpeed's multi-node launch (pdsh) is left to accelerate: under 1.16 a
signal still terminates it and kills it 5 seconds later.

Limits: a sender that signals every process of the job itself (a SLURM cgroup, systemd), or the whole group of a
launcher in a terminal's foreground (``kill -TERM -PGID`` from another terminal), reaches the one-process script
twice: REPEAT_S drops the repeat for our own handler only, so a SIGTERM handler of the script's own (a checkpoint
saved on it) is called twice. A SIGINT, SIGHUP or SIGQUIT sent to the pid of a launcher in a terminal's foreground
is not forwarded (the terminal's would be had twice). Outside a terminal's foreground: an ``os.setsid()`` in the
script fails with EPERM (it leads its group; in a terminal's foreground, and under ``accelerate launch``, it
works), as it does in torchrun's workers; a launch started with ``&`` and brought to the foreground keeps its
script in its own group, which stops (SIGTTIN) if it reads the terminal; a script that ignores SIGTERM runs on
after a ``kill -KILL -PGID``, and after a SIGHUP, SIGQUIT, SIGUSR1 or SIGUSR2 it leaves at its default (sent as
SIGTERM); a SIGTSTP or SIGCONT sent to the command is not forwarded. An mpirun (accelerate's CPU multi-node launch)
is the one-process launcher's child as the script is, and stays in its group. Under Python 3.10 a signal to the
launcher's group in the script's first moments, before the bootstrap left it, reaches the script from the group too
(from 3.11 the launcher starts it in a group of its own: launch_end.script_in_own_group).
Long because the signal paths of the command, the launcher and its one-process launcher are one design, read
together, and split they would each need the others' docstring.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import DiffusionDebugError
from .launch_end import (
    OWN_GROUP,
    as_forwarded,
    die_with_parent,
    end_by,
    libc,
    script_in_own_group,
    session_children,
    set_foreground,
    take_terminal_back,
    wait_as_job,
)

ENVIRONMENT = "DIFFUSION_DEBUG_LAUNCH"
"""The launcher's settings for every process (JSON: output_dir, config, level, policy)."""
BOOTSTRAP = "diffusion_debug.jobs.launched"
OWN_OPTIONS = ("--debug-output-dir", "--debug-config", "--level", "--policy")
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals that stop a run: the launcher waits for the script's save, then ends by the signal."""
USER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""The script's to answer (a checkpoint before a preemption): forwarded; the launch ends as the script does."""
FORWARDED = (*ENDING, *USER_SIGNALS)
_DIRECTED = (signal.SIGTERM, *USER_SIGNALS)
"""What a terminal never sends: the launcher forwards these to a script that shares its group, too."""
_AGENT_SIGNALS = frozenset(int(s) for s in ENDING)
"""The signals torch's elastic agent turns into a SignalException (accelerate 1.16: exit status 128 + N)."""
GRACE_S = 60.0
"""How long the launcher waits, after an interrupt or a failure, for the processes still saving."""


def split_arguments(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our options (they come first) and the rest, for accelerate.

    >>> split_arguments(["--level", "extreme", "--num_processes", "2", "train.py", "--lr", "1"])
    ({'level': 'extreme'}, ['--num_processes', '2', 'train.py', '--lr', '1'])
    """
    own: dict[str, str] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in OWN_OPTIONS:
            break
        if not eq:
            if i + 1 >= len(argv):
                raise DiffusionDebugError(f"launch: {name} needs a value.")
            value, i = argv[i + 1], i + 1
        own[name.removeprefix("--").removeprefix("debug-").replace("-", "_")] = value
        i += 1
    return own, argv[i:]


def _accelerate_parser() -> Any:
    """accelerate's ``launch`` parser, whose errors are one line of ours (not its usage and exit)."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def refuse(message: str) -> None:
        raise DiffusionDebugError(f"launch: {message} (accelerate launch's options, then SCRIPT).")

    parser.error = refuse
    return parser


def accelerate_command(rest: list[str]) -> tuple[list[str], str, bool]:
    """The ``accelerate launch`` command line that runs the script under the bootstrap, the
    script's name and whether it is a module (``-m``); accelerate's own parser checks the options
    (its error is one line of ours)."""
    parsed = _accelerate_parser().parse_args(rest)
    script_at = len(rest) - len(parsed.training_script_args) - 1
    options, script, script_args = rest[:script_at], rest[script_at], rest[script_at + 1 :]
    if parsed.no_python:
        raise DiffusionDebugError(
            "launch: --no_python runs a program that is not Python, so the debugger cannot attach to it; "
            "use accelerate launch directly."
        )
    if parsed.config_file is not None and not Path(parsed.config_file).is_file():
        raise DiffusionDebugError(f"launch: the accelerate config file {parsed.config_file!r} does not exist.")
    options = [o for o in options if o not in ("-m", "--module")]
    bootstrap = [*options, "--module", BOOTSTRAP, *(["--module"] if parsed.module else []), script, *script_args]
    return [sys.executable, "-m", "accelerate.commands.launch", *bootstrap], script, bool(parsed.module)


def check_script(script: str) -> None:
    """A script path that is no file is one sentence before anything starts."""
    path = Path(script)
    if path.is_dir():
        raise DiffusionDebugError(f"launch: the script {script!r} is a directory, not a Python file.")
    if not path.is_file():
        raise DiffusionDebugError(f"launch: the script {script!r} does not exist.")


def check_settings(own: dict[str, str], script: str | None = None) -> dict[str, Any]:
    """Our settings and the ``script`` path (None: a module), checked before any process starts
    and before the output directory is checked (one sentence when wrong)."""
    from ..config import DebugConfig, read_config_file

    data = read_config_file(Path(own["config"])) if own.get("config") else {}
    for key in ("level", "policy", "output_dir"):
        if own.get(key):
            data[key] = own[key]
    config = DebugConfig.from_dict(data)
    if script is not None:
        check_script(script)
    _check_leaving_nothing(config.output_dir)
    settings = {k: v for k, v in own.items() if k != "config"}
    if own.get("config"):
        settings["config"] = str(Path(own["config"]).resolve())
    settings["output_dir"] = str(Path(config.output_dir).resolve())
    return settings


def _check_leaving_nothing(output_dir: str) -> None:
    """``output_dir`` can be written (else one sentence), and the folders the check made are gone
    again: launch's run makes them when it is made, so a script whose own debugger wins, or that
    nothing was watched in, leaves no empty ``--debug-output-dir`` behind. A folder that was there
    already, or holds something now, stays."""
    from .pipeline_loading import check_output_dir

    folder = Path(os.path.abspath(output_dir))
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # the deepest first
    check_output_dir(output_dir, option="--debug-output-dir")
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # no longer empty (another launch's run): it and those above it stay
            break


def cpu_processes(args: Any, environ: dict[str, str]) -> str | None:
    """Make accelerate's parsed ``args`` start CPU processes as one job (see the module docstring):
    sets ``ACCELERATE_USE_CPU=true`` in ``environ`` and, for ``--cpu``, takes the multi-GPU launcher.
    Returns why, or None when the launch is left as it is."""
    if "ACCELERATE_USE_CPU" in environ:
        return None
    from accelerate.commands.config import default_config_file, load_config_from_file

    config = None
    if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
        config = load_config_from_file(args.config_file)
    processes = args.num_processes if args.num_processes is not None else getattr(config, "num_processes", 1)
    if not processes or processes < 2 or (args.num_machines or getattr(config, "num_machines", 1) or 1) > 1:
        return None
    if args.cpu or (getattr(config, "use_cpu", False) and not getattr(config, "mpirun_hostfile", None)):
        # accelerate's simple launcher starts one process for --cpu: torchrun starts them all
        if args.use_deepspeed or args.use_fsdp or args.tpu:
            return None
        args.cpu, args.multi_gpu = False, True
        environ["ACCELERATE_USE_CPU"] = "true"
        return "--cpu"
    multi_gpu = args.multi_gpu or "MULTI" in str(getattr(config, "distributed_type", ""))
    if multi_gpu and not _accelerator_present():
        environ["ACCELERATE_USE_CPU"] = "true"  # else each process would train alone, world size 1
        return "no accelerator"
    return None


def _accelerator_present() -> bool:
    """Whether the processes would find a device of accelerate's multi-process kinds (NVML-based for CUDA:
    this launcher leaves CUDA uninitialised)."""
    from accelerate import utils

    names = ("is_cuda_available", "is_xpu_available", "is_npu_available", "is_mlu_available", "is_musa_available")
    names += ("is_sdaa_available", "is_hpu_available", "is_neuron_available")
    return any(getattr(utils, name, lambda: False)() for name in names)


def run_launch(argv: list[str]) -> int:
    """``diffusion-debug launch ARGV``: the launcher (:func:`main`) in a process of its own, which
    imports torch and accelerate, run by :func:`run_forwarding`; this one stays light."""
    returncode = run_forwarding([sys.executable, "-m", "diffusion_debug.jobs.launch", *argv], dict(os.environ))
    if -returncode in FORWARDED:  # interrupted: end by the same signal, so a shell loop or script stops
        sys.stdout.flush()  # as it would after a plain `accelerate launch` (an exit status 130 does not)
        sys.stderr.flush()
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode if returncode >= 0 else 128 - returncode


def run_forwarding(command: list[str], environment: dict[str, str]) -> int:
    """Run ``command`` in a process group of its own, forward :data:`FORWARDED` to it (to its group; in the
    terminal's foreground, :data:`_DIRECTED` to its pid alone: it forwards those to its script), and after an
    interrupt or a failure wait for the processes left (up to :data:`GRACE_S`); the command's return code
    (negative: the signal that ended it)."""
    c_library = libc()
    reaper = c_library is not None and c_library.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    terminal = _stdin_terminal_if_foreground()
    forwarded: list[int] = []
    process = subprocess.Popen(command, env=environment, preexec_fn=lambda: _own_group(terminal, c_library))
    group = process.pid

    def forward(signum: int, frame: Any) -> None:
        forwarded.append(signum)
        try:
            (os.kill if terminal is not None and signum in _DIRECTED else os.killpg)(group, signum)
        except (ProcessLookupError, PermissionError):
            pass

    # a signal ignored here (a job started with nohup, or in the background by a shell) stays ignored
    previous = {s: signal.signal(s, forward) for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN}
    try:
        returncode = wait_as_job(process, terminal)  # the launcher stopped (Ctrl-Z): the shell's job too, if any
        if forwarded or returncode != 0:  # the script's processes may still be saving their run
            _wait_for_children(group, reaper)
    finally:
        take_terminal_back(terminal, group)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if reaper:
            c_library.prctl(36, 0, 0, 0, 0)
    return returncode


def _stdin_terminal_if_foreground() -> int | None:
    """The terminal on stdin when this process's group is its foreground (else None)."""
    try:
        fd = sys.stdin.fileno()
        return fd if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp() else None
    except (OSError, ValueError, AttributeError):
        return None


def _own_group(terminal: int | None, c_library: Any) -> None:
    """In the child, before accelerate starts: a process group of its own, the terminal's
    foreground where the launcher had it (a script reading the terminal, pdb, works as before),
    and SIGTERM when the launcher dies."""
    os.setpgid(0, 0)
    if terminal is not None:
        set_foreground(terminal, os.getpgrp())
    die_with_parent(c_library)


def _wait_for_children(group: int, reaper: bool, sleep: Callable[[float], None] = time.sleep) -> None:
    """Until no process is left (as subreaper: every orphan in this session reaped, the script's too, which runs
    in a group of its own; else: none of ``group`` answers a signal 0), or :data:`GRACE_S` has passed."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            if reaper:
                if os.waitpid(-1, os.WNOHANG)[0] != 0:
                    continue  # one reaped: look again at once
                if session_children() == []:  # a daemon the script started (its own session) is not waited for
                    return
            else:
                os.killpg(group, 0)
        except (ChildProcessError, ProcessLookupError):
            return
        except PermissionError:
            return
        sleep(0.05)


def main(argv: list[str]) -> int:
    """The launcher: our options and accelerate's checked (one line and exit 2 when wrong, before
    anything is created), then accelerate's ``launch_command`` in this process, as ``accelerate
    launch`` runs it."""
    from .pipeline_loading import one_line

    try:
        own, rest = split_arguments(argv)
        command, script, as_module = accelerate_command(rest)  # accelerate's options first: they create nothing
        settings = check_settings(own, None if as_module else script)
    except DiffusionDebugError as error:
        print(f"diffusion-debug launch: error: {one_line(str(error), 2000)}", file=sys.stderr)
        return 2
    except Exception as error:  # a bug of ours or accelerate's, before anything started: one line
        if os.environ.get("DIFFUSION_DEBUG_TRACEBACK"):
            raise
        reason = one_line(f"{type(error).__name__}: {error}")
        where = "(DIFFUSION_DEBUG_TRACEBACK=1 shows where)"
        print(f"diffusion-debug launch: internal error: {reason} {where}", file=sys.stderr)
        return 1
    from accelerate.commands import launch as accelerate_launch

    args = _accelerate_parser().parse_args(command[3:])
    os.environ[ENVIRONMENT] = json.dumps(settings)
    cpu_processes(args, os.environ)
    simple_launcher = getattr(accelerate_launch, "simple_launcher", None)  # detected, never assumed
    if simple_launcher is not None:
        accelerate_launch.simple_launcher = _waiting_for_the_script(simple_launcher, vars(accelerate_launch))
    # SIGUSR1 / SIGUSR2 to the script's processes (torchrun's workers run in sessions of their own): left at
    # their default, they would end this launcher and leave the script to its parent-death SIGTERM; a worker that
    # leaves one at its default gets SIGTERM instead, so that its run is saved (as_forwarded)
    previous = _handle(USER_SIGNALS, lambda signum, frame: _forward_to_children(signum, as_sigterm=True))
    try:
        accelerate_launch.launch_command(args)
    except BaseException as error:  # accelerate's SystemExit(128 + N) too (1.16)
        _end_by_agent_signal(error)
        raise
    finally:
        if simple_launcher is not None:
            accelerate_launch.simple_launcher = simple_launcher
        _restore(previous)
    return 0


def _handle(signals: tuple[int, ...], handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """``handler`` for each of ``signals`` not ignored (a job started with nohup, or by a shell's ``&``, keeps
    them ignored); the handlers it replaced."""
    return {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) != signal.SIG_IGN}


def _restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _waiting_for_the_script(
    simple_launcher: Callable[[Any], None], namespace: dict[str, Any]
) -> Callable[[Any], None]:
    """accelerate's one-process launcher, run so that a signal leaves the script its time to save its run
    and the launcher then ends by that signal, under every accelerate: this process forwards the signal to the
    script (:func:`_forward_to_children`) and waits for it, up to :data:`GRACE_S`. accelerate 1.16 would
    otherwise answer it by terminating the script and killing it 5 seconds later (``_terminate_process_tree``:
    no report.html, no terminal summary) and exit 143 / 130; up to 1.15 this process died by the signal at once.
    Run in a thread, accelerate's launcher leaves the signals to this (main) thread; the launcher that started
    this process gone (its SIGKILL sends SIGTERM here), it ends at once, as before: the script then gets SIGTERM
    as its parent ends. Outside a terminal's foreground the script runs in a group of its own and every signal
    is forwarded (the module docstring's "Signals"); in it, the script shares this group: the first SIGTERM is
    forwarded, and a SIGINT, SIGHUP or SIGQUIT is not (the terminal's reached the script already)."""

    def run(args: Any) -> None:
        raised: list[BaseException] = []

        def launcher() -> None:
            try:
                simple_launcher(args)
            except BaseException as error:  # its CalledProcessError, or sys.exit(1) under --quiet
                raised.append(error)

        parent, received = os.getppid(), []
        own_group = not _holds_controlling_terminal()  # else the script shares this group, the terminal's foreground

        def note(signum: int, frame: Any) -> None:
            if signum in (signal.SIGTSTP, signal.SIGCONT):  # own_group
                _forward_to_children(signum)
                if signum == signal.SIGTSTP:
                    os.kill(os.getpid(), signal.SIGSTOP)  # stopped with its script; SIGCONT continues both
                return
            if signum in USER_SIGNALS:  # the script's to answer; one it leaves at its default: sent as SIGTERM
                if _forward_to_children(signum, as_sigterm=True):
                    received.append((signum, time.monotonic()))  # the run saved, the launch ends by signum
                return
            received.append((signum, time.monotonic()))
            if os.getppid() != parent:
                end_by(signum)
            if own_group or (len(received) == 1 and not (signum != signal.SIGTERM and _holds_controlling_terminal())):
                _forward_to_children(signum, as_sigterm=True)

        stops = (signal.SIGTSTP, signal.SIGCONT) if own_group else ()
        previous = _handle((*FORWARDED, *stops), note)
        if own_group and not getattr(args, "mpirun_hostfile", None):  # not for an mpirun: the script's own
            os.environ[OWN_GROUP] = "1"  # the script leaves this group (launch_end.leave_launcher_group)
        thread = threading.Thread(target=launcher, name="accelerate launch", daemon=True)
        try:
            with script_in_own_group(namespace):  # swapped until the script started, in its own group
                thread.start()
                while thread.is_alive() and not (received and time.monotonic() > received[0][1] + GRACE_S):
                    thread.join(0.1)
        finally:
            os.environ.pop(OWN_GROUP, None)
            _restore(previous)
        if received:
            end_by(received[0][0])
        error = raised[0] if raised else None
        if isinstance(error, subprocess.CalledProcessError) and -error.returncode in USER_SIGNALS:
            end_by(-error.returncode)  # the script ended by a SIGUSR1 / SIGUSR2 it left at its default: so does this
        if isinstance(error, subprocess.CalledProcessError) and error.stderr is not None:
            # accelerate 1.16 raises the tail of the script's stderr again, which it wrote through already
            # (the script's summary and traceback, twice): the error as accelerate up to 1.15 raised it
            raise subprocess.CalledProcessError(error.returncode, error.cmd) from None
        if error is not None:
            raise error

    return run


def _holds_controlling_terminal() -> bool:
    """Whether this process's group is its controlling terminal's foreground (a Ctrl-C or a hangup there
    reached every process of the group)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _forward_to_children(signum: int, as_sigterm: bool = False) -> bool:
    """``signum`` to this process's child processes still running (the script's, or torchrun's workers), each
    alone: its DataLoader workers are left to it (they end with it), as they are under a signal sent to its pid.
    Where a script sharing this group had it from the group too (a terminal's foreground group signalled whole),
    the repeat is noted there, not raised again (:data:`~diffusion_debug.jobs.launch_end.REPEAT_S`).
    ``as_sigterm``: SIGTERM instead to a child that leaves ``signum`` at a default that ends it
    (:func:`~diffusion_debug.jobs.launch_end.as_forwarded`: its run is saved); whether one was sent that."""
    import psutil

    replaced = False
    for child in psutil.Process().children():
        sent = as_forwarded(child.pid, signum) if as_sigterm else signum
        try:
            child.send_signal(sent)
        except psutil.Error:  # ended meanwhile
            continue
        replaced |= sent != signum
    return replaced


def _end_by_agent_signal(error: BaseException) -> None:
    """torch's elastic agent (several processes) raises a SignalException for the signal it was sent,
    once its workers ended; accelerate 1.16 exits 128 + N for it (and 130 for a KeyboardInterrupt): end
    by that signal, as the one-process launch does (a shell loop stops), not with an exit status after a
    traceback."""
    sigval = getattr(error, "sigval", None)
    if isinstance(error, KeyboardInterrupt):
        sigval = signal.SIGINT
    elif isinstance(error, SystemExit):
        code = error.code
        sigval = code - 128 if isinstance(code, int) else None
    elif type(error).__name__ != "SignalException":
        sigval = None
    if isinstance(sigval, int) and sigval in _AGENT_SIGNALS:  # never 137 -> SIGKILL: no handler to reset
        end_by(sigval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
