"""A process that imports what launch_small_script.py imports (torch, its optimizers' torch._dynamo,
accelerate) once, then runs each command it reads as a forked child of itself: test_launch_safety's
runs of that script, plain or under the bootstrap each launched process runs, without importing
torch again for each (seconds of CPU a run on a loaded machine).

A child does what ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` does from there, in its own
process: its own working directory, environment, stdin closed, stdout and stderr to files; the
module or script runs as ``__main__`` and the interpreter then ends as it would (``SystemExit``'s
code, atexit handlers, its buffers flushed). The debugger is not imported here: a watched child
imports it itself, as a launched process does.

Protocol: one JSON object a line on stdin, ``{"module" or "script": ..., "args": [...], "cwd": ...,
"env": {...}, "stdout": FILE, "stderr": FILE}``; one line back on stdout, ``{"returncode": N}``
(N: -SIGNAL for a child ended by a signal), once the child has ended."""

import json
import os
import runpy
import sys

import accelerate  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (what the script's first torch.optim optimizer imports)


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
    else:
        sys.argv = [job["script"], *job["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
        runpy.run_path(job["script"], run_name="__main__")


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(job)
            except SystemExit:
                raise
            except BaseException:  # as the interpreter does with an uncaught exception: its traceback
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                raise SystemExit(1) from None
            raise SystemExit(0)  # the interpreter's own end: atexit handlers, buffers flushed
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
