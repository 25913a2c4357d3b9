"""Opening a run, the debuggers' shared lifecycle, the live report, and giving back."""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..config import DebugConfig
from ..errors import DiffusionDebugError
from ..probes import ProbeHandle
from ..record import Anomaly, RunRecord, dumps, to_jsonable, write_atomic
from ..record.anomaly import by_cause
from ..record.run_dir import every_rank_steps, main_process_steps, prepare_run_dir
from ..record.tables import EMPTY_COLUMNS, TABLES, tables, to_dataframe
from ..report.server import RunServer
from .memory_files import write_memory_snapshot
from .out_of_memory import OutOfMemoryWatch


def open_run(
    config: DebugConfig, *, kind: str, name: str | None = None, rank: int = 0, events_name: str = "events.jsonl"
) -> RunRecord:
    """Create the run directory and the record that streams into it. Raises one clear
    DiffusionDebugError if it cannot be written.

    The directory is ``config.run_name`` (a new unique name when unset), held while the run is
    live: a name another live run holds, or whose directory holds an earlier run, gives ``NAME-2``
    ... and a warning saying so, so two runs never share one (see
    :mod:`~diffusion_debug.record.run_claim`). Under several processes
    the main one opens the run and the others pass its directory's ``name`` (see the training
    debugger), joining it."""
    if name is not None:
        run_dir = prepare_run_dir(config.output_dir, name)
        return RunRecord(config, kind=kind, run_dir=run_dir, rank=rank, events_name=events_name)
    record = RunRecord(config, kind=kind, rank=rank, events_name=events_name)
    if config.run_name is not None and record.run_dir.name != config.run_name:
        warnings.warn(
            f"diffusion-debug: run_name {config.run_name!r} is taken (by a live run, or its directory holds an "
            f"earlier run: runs never share one); this run writes to {str(record.run_dir)!r}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return record


# -- the lifecycle ---------------------------------------------------------------------------------


class Lifecycle:
    """``attach()`` → a handle whose ``remove()`` detaches; ``detach()`` (undone by a later
    ``attach()``); ``close()`` (final: detach, release the event stream). A subclass registers
    its hooks in :meth:`_register` and removes them in :meth:`_unregister`."""

    _handle: ProbeHandle | None = None
    _closed: bool = False
    _server: RunServer | None = None
    _finalizer: weakref.finalize | None = None
    _oom: OutOfMemoryWatch | None = None
    """Set by a debugger: records a ``torch.OutOfMemoryError`` in its watched calls (then re-raised)."""
    _oom_hooks: ProbeHandle | None = None
    record: RunRecord

    @property
    def server_url(self) -> str | None:
        """Where the live run is served (config ``serve_port``), e.g. ``http://127.0.0.1:8766``; None
        when off, on a process other than the main one, and after ``close()``."""
        alive = self._finalizer is not None and self._finalizer.alive
        return self._server.url if self._server is not None and alive else None

    def _register(self) -> None:  # pragma: no cover - every debugger overrides it
        raise NotImplementedError

    def _unregister(self) -> None:  # pragma: no cover - every debugger overrides it
        raise NotImplementedError

    def _out_of_memory(self, error: BaseException | None) -> None:
        """An OOM leaving ``with`` / ``watch``: recorded if no hook did, then let go of."""
        if self._oom is not None and isinstance(error, torch.OutOfMemoryError):
            self._oom.record(error)
            self._oom.release()

    def memory_snapshot(self, name: str) -> dict[str, Any]:
        """Write ``memory/<name>.json`` (host RSS, CUDA allocated / reserved / peak) and, on CUDA,
        the allocator's snapshot ``memory/<name>.pickle`` (for https://pytorch.org/memory_viz; with
        stack traces when ``torch.cuda.memory._record_memory_history()`` is on) into the run
        directory; returns what was written (``files`` relative to the run directory)."""
        return write_memory_snapshot(self.record, name)

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def attach(self) -> ProbeHandle:
        """Register every hook; returns a handle whose ``remove()`` detaches. Idempotent."""
        if self._closed:
            raise DiffusionDebugError(f"This {type(self).__name__} was closed; create a new one.")
        if self._handle is not None:
            return self._handle
        try:
            self._register()
            if self._oom is not None:
                self._oom_hooks = self._oom.attach()
        except BaseException:
            self._unregister()
            raise
        ref: weakref.ref[ProbeHandle]
        handle = ProbeHandle([], on_remove=lambda: self._detach_from(ref))
        ref = weakref.ref(handle)
        self._handle = handle
        return handle

    def _detach_from(self, ref: "weakref.ref[ProbeHandle]") -> None:
        # an old handle must not undo a later attach
        if ref() is not None and ref() is self._handle:
            self.detach()

    def detach(self) -> None:
        """Remove every hook and wrapper; idempotent; a later ``attach()`` watches again."""
        if self._handle is None:
            return
        self._handle = None
        hooks, self._oom_hooks = self._oom_hooks, None
        if self._oom is not None:  # an OOM caught inside the block: its call is over, let go of its frames
            self._oom.release()
        try:
            if hooks is not None:
                hooks.remove()
        finally:
            self._unregister()

    def close(self) -> None:
        """Detach and close ``events.jsonl``; final (``report()`` still works)."""
        self.detach()
        self._closed = True

    def watch(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: attach for each call of ``function`` (a function that runs the pipeline or a
        training step), detach after it, also when it raises.

        >>> class Toy(Lifecycle):
        ...     def _register(self): print("attach")
        ...     def _unregister(self): print("detach")
        >>> toy = Toy()
        >>> @toy.watch
        ... def generate(prompt):
        ...     return prompt.upper()
        >>> generate("a cat")
        attach
        detach
        'A CAT'
        """

        @functools.wraps(function)
        def watched(*args: Any, **kwargs: Any) -> Any:
            was_attached = self.attached
            self.attach()
            try:
                return function(*args, **kwargs)
            except torch.OutOfMemoryError as error:  # recorded (if no hook did), then raised unchanged
                self._out_of_memory(error)
                raise
            finally:
                if not was_attached:  # a debugger attached before the call stays attached
                    self.detach()

        return watched

    def __enter__(self) -> Any:
        self.attach()
        return self

    def __exit__(self, exc_type: object, error: BaseException | None, traceback: object) -> None:
        if error is not None:  # (a clean exit: no call, a reused debugger's every call)
            self._out_of_memory(error)
        self.detach()


# -- the report --------------------------------------------------------------------------------------


@dataclass
class DebugReport:
    """What a debugger saw: anomalies, steps and components, ready to save.

    ``save()`` writes ``summary.json`` (atomically), completes ``events.jsonl``, writes the
    extra files (previews, plots), then builds ``report.html`` from the saved files alone.
    """

    run_dir: Path
    summary: dict[str, Any]
    anomalies: list[Anomaly]
    steps: list[dict[str, Any]]
    components: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    """Extra files to write, by path relative to the run directory."""
    record: RunRecord | None = field(default=None, repr=False)
    is_main: bool = True
    """False on a non-main rank: ``save()`` then only completes that rank's events file, and
    the main process writes summary.json and report.html."""
    explain: Callable[[], Any] | None = field(default=None, repr=False)
    """What :meth:`why` runs (set by a debugger that can replay its origin call)."""
    kept_steps: list[dict[str, Any]] | None = field(default=None, repr=False)
    """The rows summary.json keeps when they are more than :attr:`steps` (a training run's: the
    main process's and the other ranks' it received); None: :attr:`steps`."""

    @classmethod
    def of_rows(cls, rows: list[dict[str, Any]], **fields: Any) -> "DebugReport":
        """A report whose :attr:`steps` are what ``load_run(...).steps`` reads back from ``rows``
        once saved (a training run's: its main process's own, one a step), all of them kept."""
        steps = main_process_steps(fields["summary"], rows)
        return cls(steps=steps, kept_steps=None if len(steps) == len(rows) else list(rows), **fields)

    @property
    def rank_steps(self) -> list[dict[str, Any]]:
        """A training run's step rows, one per step and rank, by step then rank, from every rank's
        event file (as ``load_run(...).rank_steps``); :attr:`steps` for any other run."""
        if self.summary.get("kind") != "training":
            return self.steps
        if self.record is not None:
            self.record.flush_to_disk()
        return every_rank_steps(self.run_dir, self.steps if self.kept_steps is None else self.kept_steps)

    def by_cause(self) -> list[Anomaly]:
        """The anomalies with causes before their consequences (the order of the report's page):
        the first is the :attr:`headline`; :attr:`anomalies` stays in the order they happened."""
        return by_cause(self.anomalies)

    @property
    def headline(self) -> Anomaly | None:
        """The anomaly the report leads with (the cause of the others), None for a clean run."""
        return by_cause(self.anomalies)[0] if self.anomalies else None

    def why(self) -> Any:
        """Replay the call where the first NaN/Inf was made with one factor changed at a time
        (dtype, attention, compile, adapters, diffusers hooks, inputs); write ``why.json`` and
        ``why.md`` into the run directory and return the result (its ``verdict`` names the
        smallest fix; ``print`` shows the table and the verdict). Needs a diffusion run that saved
        a repro bundle."""
        if self.explain is None:
            raise DiffusionDebugError("why() replays a diffusion run's origin call; this report has none to replay.")
        return self.explain()

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(
            {
                **self.summary,
                "anomalies": [a.to_dict() for a in self.anomalies],
                "components": self.components,
                "steps": self.steps if self.kept_steps is None else self.kept_steps,
            }
        )

    def to_pandas(self, table: str = "steps") -> Any:
        """One table of the record as a pandas DataFrame (pandas must be installed): ``"steps"``
        (a row per step, nested statistics as columns such as ``latents.std``), ``"anomalies"`` or
        ``"ranks"`` (training: a row per step and rank). See :mod:`diffusion_debug.record.tables`."""
        if table not in TABLES:
            raise ValueError(f"to_pandas: table {table!r} is not one of {', '.join(TABLES)}.")
        steps = self.rank_steps  # a training run's every rank's every step: the event files hold them all
        return to_dataframe(tables(steps, self.anomalies)[table], EMPTY_COLUMNS[table])

    def save(self, html: bool = True, durable: bool = True) -> Path:
        """Write the run directory and return its path (``durable=False``: each file whole for
        every reader but not synced to the disk; see :func:`~diffusion_debug.record.write_atomic`)."""
        if self.record is not None:
            self.record.flush_to_disk()
        if not self.is_main:
            return self.run_dir
        for relative, data in self.files.items():
            write_atomic(self.run_dir / relative, data, durable=durable)
        write_atomic(self.run_dir / "summary.json", dumps(self.to_dict(), indent=1), durable=durable)
        if html:
            from ..report import write_html  # its plotting stack loads here, on the main process only

            write_html(self.run_dir)
        return self.run_dir


# -- giving back -----------------------------------------------------------------------------------


def release(*undo: Callable[[], Any] | None) -> None:
    """Run every ``undo`` in order (None ones skipped), each even when an earlier one raised; the
    first error then goes up (:class:`ProbeHandle`'s loop, which undoes the last added first).
    What a debugger's close, or its garbage collection, gives back."""
    ProbeHandle(SimpleNamespace(remove=step) for step in reversed(undo) if step is not None).remove()
