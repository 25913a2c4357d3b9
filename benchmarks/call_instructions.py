"""Instructions a reused debugger adds to a 1-step tiny SD call, counted by valgrind's callgrind:
a figure that is the same from one run to the next, beside :mod:`~benchmarks.call_cost`'s timing,
whose 95% interval on the ~170 ms fp16 CPU call straddles the 3 ms budget on a shared machine.

``python -m benchmarks.call_instructions [fp32 fp16 bf16] [--calls N] [--read] [--rate-rounds R]``.
The process runs itself under ``valgrind --tool=callgrind --instr-atstart=no``: the imports, the
pipelines' build and the warm-up run uninstrumented; each counted call is bracketed by callgrind's
client requests (zero the counts and instrument, then dump and stop: ``CALLGRIND_*`` from
``valgrind/callgrind.h``, built into a small library with the C compiler). Per dtype, after
:data:`WARM_UP` calls of each kind: ``N`` pairs of a plain call and a watched one (a reused
debugger, ``with dbg:``) at a run no fp16 sentinel reads (the pace set to the debugger's 8th run:
``components.sentinel_pace``), and with ``--read`` one at a run that reads them all (its 2nd); the added figure is
the fewest watched minus the fewest plain (a collection of the garbage collector, run before each
call but possible inside one, only adds). Python's hash seed is fixed (``PYTHONHASHSEED=0``) and
torch runs one thread. Slow: callgrind runs the instrumented code ~50 times slower (an fp16 call
~1 minute), and the uninstrumented warm-up ~5 times: on a 2-core AMD EPYC, fp16 alone took 4.7
minutes of CPU, the three dtypes with ``--read`` 15 (54 minutes' wall while 4 other processes
shared the cores). So it is a script, not a part of ``benchmarks.user_path``.

Instructions are no time: the debugger's Python (dict look-ups, frames, hook dicts) runs at its own
rate, a CPU's fp16 kernels at theirs, and what the debugger does right after the pipeline's compute
finds the caches cold. So the figure is printed in ms two ways, by rates measured on this machine
(``--rate-rounds``: native timing of the same calls in this process, thread CPU time, medians): the
plain call's rate (its instructions per ms) and, for the debugger's own kind of work, fp32's added
rate (fp32's added instructions over its added ms, the timing whose interval is narrow: the fp32
call is ~25 ms). What the count decides with no rate: whether fp16 adds more than fp32 and bf16,
whose added time is known. Under valgrind the CPU has no AVX-512 (torch takes its AVX2 kernels),
so the plain call's count is not the native one's; the debugger's Python is the same code.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from diffusion_debug.diffusion.components.sentinel_pace import SENTINEL_EVERY

_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
"""

DTYPES = ("fp32", "fp16", "bf16")


def _marks(folder: Path) -> Any:
    """The client requests, as a ctypes library built in ``folder`` (``cg_start()``, ``cg_dump(label)``)."""
    source, library = folder / "marks.c", folder / "marks.so"
    source.write_text(_C)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


def _cases(dtype_name: str, output_dir: str) -> tuple[Callable[[], None], Callable[[], None], Any, Any]:
    import torch

    from diffusion_debug import DebugConfig, DiffusionModelDebugger
    from diffusion_debug.testing import tiny_pipeline

    from .call_cost import one_step

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    pipe = one_step(tiny_pipeline("sd", dtype=dtype))
    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir, log_level="error"))

    def plain() -> None:
        pipe("a photo of a cat", num_inference_steps=1, output_type="pil", generator=torch.Generator().manual_seed(0))

    def watched() -> None:
        with debugger:
            plain()

    return plain, watched, debugger, debugger._steps.probes.pace


WARM_UP = 10
"""Uninstrumented calls of each kind before any is counted: Python 3.11 quickens a function's code at
its 8th call (``_PyCode_Quicken``), and an fp16 debugger's unread path was new at its runs 3, 4 and 6
(before cost23, when its runs 1, 2 and 5 read every group): counted there, 0.1-0.4 M instructions of a
call were this warm-up's."""


def _force(pace: Any, kind: str) -> None:
    """The pace set so that the next run reads every group of sentinels (the 2nd) or none (the 8th):
    ``components.sentinel_pace``."""
    if kind == "read":
        pace.runs = 1
    elif kind == "unread":
        pace.runs = 2 * SENTINEL_EVERY - 1


def counted(dtype_names: list[str], calls: int, read: bool = False) -> None:
    """Under callgrind: the counted calls of each dtype (see the module), each dumped with its dtype
    and kind as label."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        marks = _marks(Path(folder))
        for dtype_name in dtype_names:
            plain, watched, debugger, pace = _cases(dtype_name, folder)
            for kind in ["read"] * 2 + ["plain", "unread"] * WARM_UP + ["read"] * (WARM_UP if read else 0):
                _force(pace, kind)
                (plain if kind == "plain" else watched)()
            gc.collect()
            gc.freeze()
            for i, kind in enumerate(["plain", "unread"] * calls + ["read"] * read):
                _force(pace, kind)
                gc.collect()
                marks.cg_start()
                (plain if kind == "plain" else watched)()
                marks.cg_dump(f"{dtype_name}:{kind}-{i}".encode())
            debugger.close()
            gc.unfreeze()


def rate_ms(dtype_name: str, rounds: int) -> dict[str, float]:
    """Native thread CPU ms (medians, interleaved in both orders) of the plain and the unread watched
    call, and their difference's median."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        plain, watched, debugger, pace = _cases(dtype_name, folder)
        for kind in ["read"] * 2 + ["plain", "unread"] * WARM_UP:
            _force(pace, kind)
            (plain if kind == "plain" else watched)()
        gc.collect()
        gc.freeze()
        clock, times = time.thread_time_ns, {"plain": [], "unread": []}
        for i in range(rounds):
            for kind in ("plain", "unread")[:: 1 if i % 2 else -1]:
                _force(pace, kind)
                gc.collect()
                start = clock()
                (plain if kind == "plain" else watched)()
                times[kind].append(clock() - start)
        debugger.close()
    added = statistics.median(w - p for w, p in zip(times["unread"], times["plain"]))
    return {"plain_ms": statistics.median(times["plain"]) / 1e6, "added_ms": added / 1e6}


def _read_dumps(folder: Path) -> dict[str, dict[str, list[int]]]:
    found: dict[str, dict[str, list[int]]] = {}
    for path in sorted(folder.glob("callgrind.out.*")):
        text = path.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (\S+):(\S+)-\d+$", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if label and total:
            found.setdefault(label.group(1), {}).setdefault(label.group(2), []).append(int(total.group(1)))
    return found


def instructions(dtype_names: list[str], calls: int, read: bool = False) -> dict[str, dict[str, list[int]]]:
    """Run :func:`counted` under callgrind in a process of its own: per dtype, the instructions of
    each kind of call."""
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        raise SystemExit("call_instructions needs valgrind (with valgrind/callgrind.h) and a C compiler")
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={folder}/callgrind.out.%p",
            sys.executable,
            "-m",
            "benchmarks.call_instructions",
            "--inner",
            *dtype_names,
            "--calls",
            str(calls),
            *(["--read"] if read else []),
        ]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return _read_dumps(Path(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--calls", type=int, default=2, help="plain and unread watched calls counted (each)")
    parser.add_argument("--rate-rounds", type=int, default=0, help="native timed rounds for the ms rates (0: none)")
    parser.add_argument("--read", action="store_true", help="also count a call the fp16 sentinels read (slower)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        counted(args.dtypes, args.calls, args.read)
        return 0
    rows = {}
    for name, found in instructions(args.dtypes, args.calls, args.read).items():
        plain, unread, read = min(found["plain"]), min(found["unread"]), min(found.get("read", [0]))
        rows[name] = {
            "plain": plain,
            "added_unread": unread - plain,
            "added_read": read - plain if "read" in found else None,
            "spread": {kind: max(v) - min(v) for kind, v in found.items()},
        }
    for name in rows:
        if args.rate_rounds:
            rows[name].update(rate_ms(name, args.rate_rounds))
        print(json.dumps({name: rows[name]}), flush=True)
    fp32 = rows.get("fp32")
    if fp32 and "added_ms" in fp32:
        debugger_rate = fp32["added_unread"] / fp32["added_ms"]
        for name, row in rows.items():
            plain_rate = row["plain"] / row["plain_ms"] if "plain_ms" in row else float("nan")
            print(
                f"{name}: plain {row['plain'] / 1e6:.1f} M instr; added unread {row['added_unread'] / 1e6:.3f} M, "
                f"read {(row['added_read'] or 0) / 1e6:.3f} M; "
                f"at the plain call's rate {row['added_unread'] / plain_rate:.2f} ms, "
                f"at fp32's added rate {row['added_unread'] / debugger_rate:.2f} ms "
                f"(timed: {row.get('added_ms', float('nan')):.2f} ms)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
