"""What both debuggers share, above the record and the report (layer 5).

* :class:`AnomalySink` — every anomaly of a run passes through it once: folded with its repeats,
  recorded, logged, warned about (policy ``warn``) and queued for the policy; a measurement of the
  debugger's own that fails becomes a ``debugger_error`` (one ``details`` layout).
* :func:`check_policy`, :func:`policy_error` — one meaning for each policy on both sides.
* :func:`open_run` — the run directory and its record, named and created in one place.
* :class:`Lifecycle` — ``attach()`` returns a handle, ``detach()`` can be undone by a later
  ``attach()``, ``close()`` is final; ``with debugger:`` attaches and detaches, and
  ``@debugger.watch`` does the same around each call of a function.
* :class:`DebugReport` — the live view of a run that ``save()`` turns into a run directory.
* :func:`raise_after_saving` — policy ``raise``; :func:`release` — what ``close()`` gives back.

The policies, the same for both debuggers (an anomaly of severity ``error`` triggers them):

=========  ======================================================================================
``record`` record it, nothing else
``warn``   also a Python ``RuntimeWarning`` for every anomaly at or above ``warn_severity``
``skip``   training: zero this step's gradients so ``optimizer.step()`` adds nothing from the
           batch; a pipeline has no optimizer step to skip, so inference rejects it up front
``raise``  save the run directory, then raise :class:`DiffusionDebugError`
``stop``   inference: interrupt the denoising loop (pipelines with ``_interrupt``; raise where
           there is none); training: set ``should_stop`` for the loop to end
=========  ======================================================================================
"""

from __future__ import annotations

import contextlib
import functools
import logging
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator

from .config import POLICIES, DebugConfig
from .errors import ConfigError, DiffusionDebugError
from .probes import ProbeHandle
from .record import KINDS, Anomaly, RunRecord, dumps, severity_rank, to_jsonable, write_atomic
from .record.run_dir import new_run_name, prepare_run_dir
from .report import write_html
from .report.server import RunServer

_LOG_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


# -- policy ------------------------------------------------------------------------------------


def check_policy(config: DebugConfig, supported: tuple[str, ...], who: str) -> None:
    """Reject, before any work starts, a policy that has no meaning for ``who``."""
    if config.policy not in supported:
        reasons = {"skip": "it skips an optimizer step, and a pipeline has none; use 'stop' or 'raise'"}
        reason = reasons.get(config.policy, f"it is not one of {', '.join(map(repr, supported))}")
        raise ConfigError(f"Policy {config.policy!r} cannot be used with {who}: {reason}.")


def policy_error(anomaly: Anomaly, run_dir: Any, reason: str = "") -> DiffusionDebugError:
    """The error policy ``raise`` raises for ``anomaly`` (the run directory already saved)."""
    return DiffusionDebugError(
        f"{anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}{reason} (run directory: {run_dir})",
        anomaly=anomaly,
        run_dir=run_dir,
    )


def raise_after_saving(anomaly: Anomaly, save: Callable[[], Path], reason: str = "") -> None:
    """Policy ``raise``: save the run directory, then raise :func:`policy_error`; a save that fails
    still raises a DiffusionDebugError for the anomaly, saying why nothing was saved."""
    try:
        run_dir = save()
    except Exception as save_error:  # the user gets a DiffusionDebugError either way
        raise DiffusionDebugError(
            f"{anomaly.kind} at {anomaly.where()}: {anomaly.message} The report could not be saved "
            f"({type(save_error).__name__}: {str(save_error)[:200]}){reason}.",
            anomaly=anomaly,
            run_dir=None,
        ) from save_error
    raise policy_error(anomaly, run_dir, reason)


assert set(POLICIES) == {"record", "warn", "skip", "raise", "stop"}  # the table above names each


# -- the anomaly sink --------------------------------------------------------------------------


class AnomalySink:
    """Folds, records, logs, warns and queues every anomaly of one run.

    Folding: an anomaly whose key matches one still *open* is not recorded again; the first one's
    ``details["count"]`` and ``details["last_step"]`` follow the repeats, and ``events.jsonl``
    gets a one-line ``anomaly_repeated`` event. What keeps a key open is the front-end's window:
    :meth:`end_step` closes the keys not seen since the last call (training: repeats on
    consecutive steps fold), :meth:`new_window` closes all of them (inference: one pipeline run).
    ``once=True`` keys (static checks) stay closed for the debugger's life, until :meth:`clear`.
    """

    def __init__(self, record: RunRecord, config: DebugConfig, logger: logging.Logger):
        self.record = record
        self.config = config
        self.logger = logger
        self.errors: list[Anomaly] = []
        """Error-severity anomalies (repeats included) the policy has not acted on yet."""
        self._open: dict[Hashable, Anomaly] = {}
        self._touched: set[Hashable] = set()
        self._once: set[Hashable] = set()
        record.on_stream_lost = self.stream_lost
        if record.stream_cause is not None:  # lost already while the record was opened
            self.stream_lost(record.stream_cause)

    def emit(self, anomaly: Anomaly, key: Hashable | None = None, *, once: bool = False, log: bool = True) -> bool:
        """Take ``anomaly``; True when it was recorded as a new one (not folded). ``log=False``:
        recorded but not logged (another process logs it: one line per anomaly). ``key``: the kind's
        fold key unless given."""
        kind = KINDS.get(anomaly.kind)
        if kind is None:  # a typo would otherwise reach the record with a generic guide entry
            raise DiffusionDebugError(
                f"Unknown anomaly kind {anomaly.kind!r}; register it with register_kind() first."
            )
        key = kind.fold_key(anomaly) if key is None else key
        if once:
            if key in self._once:
                return False
            self._once.add(key)
        self._touched.add(key)
        first = self._open.get(key)
        if first is not None:
            first.details["count"] = first.details.get("count", 1) + 1
            if anomaly.step is not None:
                first.details["last_step"] = anomaly.step
            self.record.add_event(
                "anomaly_repeated",
                kind=first.kind,
                rank=first.rank,
                component=first.component,
                module=first.module,
                parameter=first.parameter,
                step=anomaly.step,
                count=first.details["count"],
            )
            if anomaly.severity == "error":
                self.errors.append(first)
            return False
        anomaly.details.setdefault("count", 1)
        self._open[key] = anomaly
        self.record.add_anomaly(anomaly)
        if log:
            self._log(anomaly)
        if self.config.policy == "warn" and severity_rank(anomaly.severity) >= severity_rank(
            self.config.warn_severity
        ):
            warnings.warn(
                f"diffusion-debug {anomaly.kind} at {anomaly.where() or 'the run'}: {anomaly.message}",
                RuntimeWarning,
                stacklevel=4,
            )
        if anomaly.severity == "error":
            self.errors.append(anomaly)
        return True

    def _log(self, anomaly: Anomaly) -> None:
        level = _LOG_LEVELS[anomaly.severity]
        if level >= _LOG_LEVELS[self.config.log_level]:
            self.logger.log(level, "%s at %s: %s", anomaly.kind, anomaly.where() or "the run", anomaly.message)

    def take_errors(self) -> list[Anomaly]:
        """The queued error anomalies, oldest first; the queue is emptied."""
        errors, self.errors = self.errors, []
        return errors

    def end_step(self) -> None:
        """Close the keys not emitted since the last call."""
        self._open = {k: a for k, a in self._open.items() if k in self._touched}
        self._touched = set()

    def new_window(self) -> None:
        """Close every key (a new pipeline run)."""
        self._open.clear()
        self._touched.clear()

    def clear(self) -> None:
        """Forget every key and queued error (``clear_debug_history``)."""
        self.new_window()
        self._once.clear()
        self.errors.clear()

    # -- the debugger's own failures ---------------------------------------------------------------
    def debugger_error(
        self, where: str, error: BaseException, *, step: int | None = None, rank: int = 0, message: str | None = None
    ) -> Anomaly:
        """Record that the debugger's ``where`` failed with ``error`` and the run went on."""
        text = f"{type(error).__name__}: {error}"
        anomaly = Anomaly(
            kind="debugger_error",
            severity="warning",
            message=message or f"The debugger's {where} failed ({text[:200]}); the run went on without it.",
            step=step,
            rank=rank,
            details=debugger_error_details(where, error),
        )
        self.emit(anomaly, ("debugger_error", where, rank))
        return anomaly

    def stream_lost(self, error: BaseException) -> None:
        """``events.jsonl`` could not be written: a ``debugger_error`` and one RuntimeWarning
        (whatever the policy); the run goes on, the record is kept in memory for ``save()``."""
        text = f"{type(error).__name__}: {error}"[:200]
        message = (
            f"events.jsonl could not be written ({text}); the run went on and its record is kept in memory for save()."
        )
        anomaly = self.debugger_error("events.jsonl", error, rank=self.record.rank, message=message)
        warned = self.config.policy == "warn" and severity_rank(anomaly.severity) >= severity_rank(
            self.config.warn_severity
        )
        if not warned:  # the sink did not warn already: the one warning
            warnings.warn(f"diffusion-debug debugger_error: {message}", RuntimeWarning, stacklevel=2)

    @contextlib.contextmanager
    def guard(self, where: str, *, step: int | None = None) -> Iterator[None]:
        """Run a measurement: its failure is recorded and the run goes on (unless ``strict``)."""
        try:
            yield
        except DiffusionDebugError:
            raise
        except Exception as error:
            if self.config.strict:
                raise
            self.debugger_error(where, error, step=step)


def debugger_error_details(where: str, error: BaseException | None) -> dict[str, Any]:
    """The one ``details`` layout of a ``debugger_error``: where, the error, a short traceback."""
    if error is None:
        return {"where": where, "error": None, "traceback": None}
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=4))
    return {"where": where, "error": f"{type(error).__name__}: {error}", "traceback": trace[-2000:]}


# -- the run directory -----------------------------------------------------------------------------


def open_run(
    config: DebugConfig, *, kind: str, name: str | None = None, rank: int = 0, events_name: str = "events.jsonl"
) -> RunRecord:
    """Create the run directory (``name``, else ``config.run_name``, else a new unique name, created
    exclusively) and the record that streams into it. Raises one clear DiffusionDebugError if it
    cannot be written. Under several processes the main one names the run and the others pass
    that ``name`` (see the training debugger)."""
    generated = not (name or config.run_name)
    name = name or config.run_name or new_run_name(config.debug_file_prefix)
    run_dir = prepare_run_dir(config.output_dir, name, exclusive=generated)
    return RunRecord(config, kind=kind, run_dir=run_dir, rank=rank, events_name=events_name)


# -- the lifecycle ---------------------------------------------------------------------------------


class Lifecycle:
    """``attach()`` → a handle whose ``remove()`` detaches; ``detach()`` (undone by a later
    ``attach()``); ``close()`` (final: detach, release the event stream). A subclass registers
    its hooks in :meth:`_register` and removes them in :meth:`_unregister`."""

    _handle: ProbeHandle | None = None
    _closed: bool = False
    _server: RunServer | None = None
    _finalizer: weakref.finalize | None = None

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
            finally:
                if not was_attached:  # a debugger attached before the call stays attached
                    self.detach()

        return watched

    def __enter__(self) -> Any:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
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

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(
            {
                **self.summary,
                "anomalies": [a.to_dict() for a in self.anomalies],
                "components": self.components,
                "steps": self.steps,
            }
        )

    def save(self, html: bool = True) -> Path:
        """Write the run directory and return its path."""
        if self.record is not None:
            self.record.flush_to_disk()
        if not self.is_main:
            return self.run_dir
        for relative, data in self.files.items():
            write_atomic(self.run_dir / relative, data)
        write_atomic(self.run_dir / "summary.json", dumps(self.to_dict(), indent=1))
        if html:
            write_html(self.run_dir)
        return self.run_dir


# -- giving back -----------------------------------------------------------------------------------


def release(*undo: Callable[[], Any] | None) -> None:
    """Run every ``undo`` in order (None ones skipped), each even when an earlier one raised; the
    first error then goes up. What a debugger's close, or its garbage collection, gives back."""
    first: BaseException | None = None
    for step in undo:
        try:
            if step is not None:
                step()
        except BaseException as error:
            first = first or error
    if first is not None:
        raise first
