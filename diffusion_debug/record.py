"""The run's record: per-step rows, anomalies and events, bounded in memory, streamed to disk.

A :class:`RunRecord` owns one run directory::

    <output_dir>/<run-name>/
        events.jsonl    one JSON object per line, written as it happens (line-buffered, so a
                        killed run leaves every finished line readable)
        summary.json    written atomically by DebugReport.save()
        report.html     built from the two files above by diffusion_debug.report

All JSON is strict: non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (see :func:`to_jsonable`), so ``json.loads(text, parse_constant=<raise>)`` accepts
every file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .config import SEVERITIES, DebugConfig
from .errors import DiffusionDebugError

#: Stable anomaly kinds (DESIGN.md); debuggers may add more.
ANOMALY_KINDS = (
    "nonfinite",
    "overflow_risk",
    "latent_divergence",
    "vae_saturation",
    "prompt_truncated",
    "scheduler_config",
    "dtype_mismatch",
    "nonfinite_loss",
    "loss_spike",
    "gradient_explosion",
    "gradient_vanishing",
    "skipped_step",
    "memory_growth",
    "rank_desync",
)


@dataclass
class Anomaly:
    """Something worth a person's attention, and where it happened."""

    kind: str
    severity: str
    message: str
    component: str = ""
    module: str = ""
    step: int | None = None
    timestep: float | None = None
    rank: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    parameter: str | None = None

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, not {self.severity!r}.")

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Anomaly":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def where(self) -> str:
        """``unet up_blocks.1.resnets.0.conv2, step 3 (t=761), rank 1`` (parts that are set)."""
        place = " ".join(p for p in (self.component, self.parameter or self.module) if p)
        parts = [place] if place else []
        if self.step is not None:
            parts.append(f"step {self.step}" + (f" (t={_short(self.timestep)})" if self.timestep is not None else ""))
        if self.rank:
            parts.append(f"rank {self.rank}")
        return ", ".join(parts)


def _short(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


# -- strict JSON --------------------------------------------------------------------------


def to_jsonable(obj: Any) -> Any:
    """Plain JSON data for ``obj``: non-finite floats become ``"nan"``/``"inf"``/``"-inf"``;
    tensors, numpy values, dtypes, paths, enums and dataclasses become lists, numbers or text."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            return f"<meta tensor {tuple(obj.shape)}>"
        return to_jsonable(obj.detach().cpu().tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        to_dict = getattr(obj, "to_dict", None)
        return to_jsonable(to_dict() if callable(to_dict) else dataclasses.asdict(obj))
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # numpy arrays and scalars
        return to_jsonable(obj.tolist())
    return repr(obj)


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text for ``obj``."""
    return json.dumps(to_jsonable(obj), allow_nan=False, **kwargs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name!r}")


def loads(text: str) -> Any:
    """Parse strict JSON (``NaN``/``Infinity`` are rejected, as any strict reader would)."""
    return json.loads(text, parse_constant=_reject_constant)


def load_json(path: str | os.PathLike) -> Any:
    return loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete line of a JSONL file; a last line cut off by a killed writer is skipped."""
    rows = []
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(loads(line))
        except ValueError:
            if i == len(lines) - 1:  # the unfinished tail of a killed run
                break
            raise
    return rows


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write a file so that readers see the old content or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    binary = isinstance(data, bytes)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# -- the run directory --------------------------------------------------------------------


def new_run_name(prefix: str) -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def prepare_run_dir(output_dir: str | os.PathLike, run_name: str) -> Path:
    """Create ``output_dir/run_name`` and prove it writable, or raise one clear error."""
    run_dir = Path(output_dir) / run_name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise DiffusionDebugError(
            f"Cannot write the run directory {str(run_dir)!r} (output_dir={str(output_dir)!r}): {reason}."
        ) from None
    return run_dir


def versions() -> dict[str, str]:
    """Versions of the libraries a run depends on, for the summary."""
    out = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "accelerate", "diffusion_debug"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except Exception:  # pragma: no cover - missing optional library
                continue
        out[name] = getattr(module, "__version__", "unknown")
    out["cuda"] = torch.version.cuda or "none"
    return out


class RunRecord:
    """Per-step rows, anomalies and events of one run, with bounded memory.

    ``history_size`` steps and events stay in memory (ring buffers); anomalies keep their
    first ``10 * history_size`` entries plus a count per kind, so the summary is exact even when
    the list is not.  With ``stream=True`` every entry is also appended to ``events.jsonl``
    as it happens.
    """

    def __init__(
        self,
        config: DebugConfig,
        *,
        kind: str,
        run_dir: Path | None = None,
        rank: int = 0,
        stream: bool | None = None,
        events_name: str = "events.jsonl",
    ):
        self.config = config
        self.kind = kind
        self.rank = rank
        self.run_dir = run_dir or prepare_run_dir(
            config.output_dir, config.run_name or new_run_name(config.debug_file_prefix)
        )
        self.started = time.time()
        self.steps: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        self.events: deque[dict[str, Any]] = deque(maxlen=config.history_size)
        self.anomalies: list[Anomaly] = []
        self.max_anomalies = 10 * config.history_size
        self.anomaly_counts: Counter[str] = Counter()
        self.severity_counts: Counter[str] = Counter()
        self.dropped_anomalies = 0
        self.events_path = self.run_dir / events_name
        self.stream_error: str | None = None
        self._stream = None
        self._streamed = bool(config.save_debug_info if stream is None else stream)
        if self._streamed:
            self._stream = open(self.events_path, "a", encoding="utf-8", buffering=1)  # line-buffered
        self._write(to_jsonable({"type": "start", "kind": kind, "config": config.to_dict(), "versions": versions()}))

    def _write(self, entry: dict[str, Any]) -> None:
        """Keep ``entry`` (already plain JSON data) and stream it.  A failing disk never breaks
        the run: streaming stops, ``stream_error`` says why, the ring buffer goes on."""
        entry = {"time": round(time.time(), 6), "rank": self.rank, **entry}
        self.events.append(entry)
        if self._stream is not None:
            try:
                self._stream.write(json.dumps(entry, allow_nan=False) + "\n")
            except (OSError, ValueError, TypeError) as error:
                self.stream_error = f"{type(error).__name__}: {error}"
                self.close()

    def add_step(self, row: dict[str, Any]) -> None:
        row = to_jsonable(row)
        self.steps.append(row)
        self._write({"type": "step", **row})

    def add_anomaly(self, anomaly: Anomaly) -> None:
        self.anomaly_counts[anomaly.kind] += 1
        self.severity_counts[anomaly.severity] += 1
        if len(self.anomalies) < self.max_anomalies:
            self.anomalies.append(anomaly)
        else:
            self.dropped_anomalies += 1
        self._write({"type": "anomaly", **anomaly.to_dict()})

    def add_event(self, type: str, **data: Any) -> None:
        self._write({"type": type, **to_jsonable(data)})

    def clear(self) -> None:
        self.steps.clear()
        self.events.clear()
        self.anomalies.clear()
        self.anomaly_counts.clear()
        self.severity_counts.clear()
        self.dropped_anomalies = 0

    def summary(self) -> dict[str, Any]:
        """The record's part of summary.json."""
        return {
            "kind": self.kind,
            "run_dir": str(self.run_dir),
            "started": self.started,
            "duration_s": time.time() - self.started,
            "anomaly_counts": dict(self.anomaly_counts),
            "severity_counts": dict(self.severity_counts),
            "dropped_anomalies": self.dropped_anomalies,
            "stream_error": self.stream_error,
            "config": self.config.to_dict(),
            "versions": versions(),
        }

    def flush_to_disk(self) -> None:
        """Make events.jsonl complete: flush the stream; without one (not streaming, or the
        stream was closed), write the buffered events unless the streamed file holds more."""
        if self._stream is not None:
            self._stream.flush()
        elif not self._streamed:
            write_atomic(self.events_path, "".join(dumps(e) + "\n" for e in self.events))

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.steps)
