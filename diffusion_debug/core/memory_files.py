"""Memory written into the run directory: ``debugger.memory_snapshot(name)`` and the snapshot an
out-of-memory error leaves (:mod:`.out_of_memory`).

>>> import tempfile, json
>>> from diffusion_debug import DebugConfig
>>> from diffusion_debug.core import open_run
>>> record = open_run(DebugConfig(output_dir=tempfile.mkdtemp()), kind="diffusion")
>>> entry = write_memory_snapshot(record, "before-decode")
>>> entry["files"], entry["host"]["rss_mb"] > 0
(['memory/before-decode.json'], True)
>>> sorted(json.loads((record.run_dir / "memory/before-decode.json").read_text()))
['cuda', 'cuda_snapshot', 'host', 'name', 'time']
>>> record.close()

On CUDA the allocator's snapshot (``torch.cuda.memory._snapshot()``) is pickled beside the JSON as
``memory/<name>.pickle``, the file https://pytorch.org/memory_viz opens; it holds each allocation's
stack trace when memory history is on (``torch.cuda.memory._record_memory_history()``), else the
segments and blocks only.

Limits: the CUDA figures are of the current device; a name already written gets ``-2``, ``-3``...;
a snapshot of a large process can be tens of MB.
"""

from __future__ import annotations

import pickle
import re
import time
from typing import Any

import torch

from ..errors import DiffusionDebugError
from ..memory import memory_sample
from ..record import RunRecord, dumps, write_atomic

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def write_memory_snapshot(record: RunRecord, name: str, **extra: Any) -> dict[str, Any]:
    """Write ``memory/<name>.json`` (host figures, CUDA allocated / reserved / peak) and, on CUDA,
    ``memory/<name>.pickle``; record a ``memory_snapshot`` event; return the entry written."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise DiffusionDebugError(
            f"A memory snapshot name is a plain file name (letters, digits, '.', '_', '-'), not {name!r}."
        )
    folder = record.run_dir / "memory"
    stem, n = name, 1
    while (folder / f"{stem}.json").exists():
        n += 1
        stem = f"{name}-{n}"
    sample = memory_sample()
    host = {k: v for k, v in sample.items() if not k.startswith("cuda_")}
    cuda = {k: v for k, v in sample.items() if k.startswith("cuda_")} or None
    files = [f"memory/{stem}.json"]
    snapshot = None
    if cuda_in_use():
        snapshot = f"memory/{stem}.pickle"
        write_atomic(record.run_dir / snapshot, pickle.dumps(torch.cuda.memory._snapshot()))
        files.append(snapshot)
    entry = {"name": stem, "time": time.time(), "host": host, "cuda": cuda, "cuda_snapshot": snapshot, **extra}
    write_atomic(record.run_dir / files[0], dumps(entry, indent=1))
    record.add_event("memory_snapshot", name=stem, files=files, host=host, cuda=cuda)
    return {**entry, "files": files}
