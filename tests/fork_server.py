"""A process that imports what a test's Python processes would import first (the modules named as
its arguments: torch, accelerate, diffusers...) once, then runs each command it reads as a forked
child of itself: runs of a training script, plain or under the bootstrap each launched process
runs (test_launch_safety.py, test_launch.py), a pytest session (test_pytest_plugin.py), or the
README's code blocks (test_readme.py), without importing torch again for each (seconds of CPU a
process on a loaded machine).

A child does what ``python -m MODULE ARGS``, ``python SCRIPT ARGS`` or ``python -c CODE ARGS`` does
from there, in its own process: its own working directory, environment, stdin closed, stdout and
stderr to files; the module, script or code runs as ``__main__`` and the interpreter then ends as
it would (``SystemExit``'s code, atexit handlers, its buffers flushed). Only what is named is
imported here: the debugger of a watched child loads in the child, as in a launched process.

What the server imported is frozen before the first fork (``gc.freeze``): a child's garbage
collections walk only what the child makes.

Protocol: one JSON object a line on stdin, ``{"module" or "script" or "code": ..., "args": [...], "cwd": ...,
"env": {...}, "stdout": FILE, "stderr": FILE}``; one line back on stdout, ``{"returncode": N}``
(N: -SIGNAL for a child ended by a signal), once the child has ended. :class:`Forks` is the
tests' side.

A child's environment is the job's from its first line of Python on, but the modules the server
imported read theirs at import, in the server: what torch reads when it is imported
(``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``TORCH_*``, ``PYTORCH_*``...) comes from the
environment the server was started with, whatever the job's says. The tests' jobs change only
variables read at run time (the debugger's settings, ``COLUMNS``); a job that needs another
import-time setting needs a server of its own.

The server and its child end when the process that started the server dies (a killed pytest or
xdist worker would otherwise leave them running, children of init): on Linux each asks the kernel
for SIGTERM at its parent's death (``PR_SET_PDEATHSIG``), then checks the parent is still there
(it may have died before the ask); elsewhere a thread of the server polls for its parent's pid and
ends the running child and itself. Linux signals at the end of the thread that started the server:
start it from a thread that lives as long as the process (the main one, where xdist runs tests)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

TRAINING = ("torch", "torch._dynamo", "accelerate")
"""What a training script imports (torch._dynamo: what its first torch.optim optimizer loads)."""


class Forks:
    """The tests' side: one server started with ``env``, that imported ``modules``; each :meth:`run`
    a child of it, returning what ``subprocess.run`` of the same command would."""

    def __init__(self, folder: Path, env: dict[str, str], modules: tuple[str, ...] = ()):
        self.folder = folder
        with open(folder / "server.err", "w") as err:
            self.server = subprocess.Popen(
                [sys.executable, __file__, f"--parent={os.getpid()}", *modules],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def run(
        self,
        cwd: Path,
        env: dict[str, str],
        args: list[str],
        module: str | None = None,
        script: str = "",
        outputs: Path | None = None,
        code: str | None = None,
    ):
        """``python -m MODULE ARGS`` (``module``), ``python -c CODE ARGS`` (``code``), else ``python
        SCRIPT ARGS``, in ``cwd`` with ``env``; the child's stdout and stderr pass through files in
        ``outputs`` (``cwd`` unless given)."""
        out, err = (outputs or cwd) / "fork.stdout", (outputs or cwd) / "fork.stderr"
        job = {"module": module} if module else {"code": code} if code is not None else {"script": script}
        job.update(args=args, cwd=str(cwd), env=env, stdout=str(out), stderr=str(err))
        self.server.stdin.write(json.dumps(job) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError("fork_server.py ended: " + (self.folder / "server.err").read_text()[-3000:])
        returncode = json.loads(answer)["returncode"]
        done = subprocess.CompletedProcess([module or script, *args], returncode, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int) -> bool:
    """Ask for SIGTERM when ``parent`` (this process's parent) dies; end now if it has died already.
    False where the kernel cannot be asked (not Linux): the caller then watches for itself."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the ask: no signal will come
                os._exit(1)
            return True
    return False


def _watch_parent(parent: int, running: dict[str, int]) -> None:
    """Where the kernel was not asked: poll for the parent's death, then end the running child and
    this process."""
    while os.getppid() == parent:
        time.sleep(0.5)
    child = running.get("pid")
    if child:
        os.kill(child, signal.SIGTERM)
    os._exit(1)


def _child(job: dict) -> None:
    """In the forked child: become ``python -m MODULE`` / ``python SCRIPT`` and run it."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    if "module" in job:
        sys.argv = [job["module"], *job["args"]]
        sys.path[0] = job["cwd"]  # as -m puts the working directory first
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    elif "code" in job:
        sys.argv = ["-c", *job["args"]]
        sys.path[0] = ""  # as -c puts the working directory first
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(job["code"], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [job["script"], *job["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
        runpy.run_path(job["script"], run_name="__main__")


def serve() -> None:
    names = sys.argv[1:]
    running: dict[str, int] = {}
    if names and names[0].startswith("--parent="):
        parent = int(names.pop(0).partition("=")[2])
        if not _end_with_parent(parent):
            threading.Thread(target=_watch_parent, args=(parent, running), daemon=True).start()
    for name in names:  # "package:Name" loads a lazy attribute (diffusers')
        module, _, attribute = name.partition(":")
        loaded = importlib.import_module(module)
        if attribute:
            getattr(loaded, attribute)
    # What was imported, frozen (out of the garbage collector's walks) before any fork: a child's
    # collections, the last one at its end included, walked every imported object again, writing to
    # each one's memory (a copy of each page for the child): 4 watched runs of launch_small_script.py
    # and the server's start 7.5-7.7 -> 4.0 CPU-s (torch, accelerate), 10.8-11.4 -> 5.7 (the t2i
    # script's diffusers and CLIP too). The objects stay alive as imported modules' do; what a child
    # makes is collected as before.
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                _end_with_parent(server)  # elsewhere, the server's watcher ends it
                _child(job)
            except SystemExit:
                raise
            except BaseException:  # as the interpreter does with an uncaught exception: its traceback
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                raise SystemExit(1) from None
            raise SystemExit(0)  # the interpreter's own end: atexit handlers, buffers flushed
        running["pid"] = pid
        _, status = os.waitpid(pid, 0)
        running.pop("pid")
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
