"""A pytest plugin: every diffusers pipeline called in a test session runs under a debugger.

    pytest -p diffusion_debug.pytest_plugin --diffusion-debug tests/

Each test's pipeline calls are watched by a :class:`~diffusion_debug.DiffusionModelDebugger`
(policy ``record``: the test runs exactly as without it); its run directory is written below
``--diffusion-debug-dir`` (default ``diffusion_debug_runs``), in a folder named after the test;
a test whose pipelines showed an anomaly of severity ``--diffusion-debug-fail-on`` (``error``,
the default; ``warning``; or ``never``) fails, with the anomaly's headline; the terminal summary
lists every watched test with its runs and anomalies. ``--diffusion-debug-level`` picks the
config's level (default ``basic``: sentinel probes and NaN/Inf localisation, no previews).

How: for the duration of each test, the ``__call__`` of every ``DiffusionPipeline`` subclass
(and of ``ModularPipeline``) imported by then is wrapped, and put back after the test; a
pipeline gets one debugger per test, attached around each of its calls.

Limits: a call made by a fixture (outside the test's call phase) is not watched; a pipeline class
first imported inside a test body is not wrapped in that test; a call
made from another thread while a watched call runs is watched by the same debugger; an object
the debugger cannot watch (a pipeline without an ``nn.Module``) runs unwatched, as it would.
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FAIL_ON = ("error", "warning", "never")
_SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("diffusion-debug", "watch every diffusers pipeline call with diffusion-debug")
    group.addoption("--diffusion-debug", action="store_true", help="attach a debugger to every pipeline call")
    group.addoption(
        "--diffusion-debug-dir", default="diffusion_debug_runs", help="where the run directories go (one per test)"
    )
    group.addoption(
        "--diffusion-debug-fail-on",
        default="error",
        choices=FAIL_ON,
        help="fail a test on an anomaly of this severity or worse (never: report only)",
    )
    group.addoption("--diffusion-debug-level", default="basic", choices=("basic", "advanced", "extreme"))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("diffusion_debug"):
        config.pluginmanager.register(PipelineWatch(config), "diffusion-debug-watch")


@dataclass
class TestRuns:
    """What one test's pipeline calls showed."""

    nodeid: str
    calls: int = 0
    runs: list[str] = field(default_factory=list)
    anomalies: list[Any] = field(default_factory=list)
    unwatched: list[str] = field(default_factory=list)
    """One sentence per object that could not be watched (from the debugger's own error)."""


class PipelineWatch:
    """The plugin's state for one session: the wrapped ``__call__``s and each test's debuggers."""

    def __init__(self, config: pytest.Config):
        self.root = Path(config.getoption("diffusion_debug_dir")).resolve()
        self.fail_on = config.getoption("diffusion_debug_fail_on")
        self.level = config.getoption("diffusion_debug_level")
        self.results: list[TestRuns] = []
        self._current: TestRuns | None = None
        self._debuggers: dict[int, Any] = {}  # id(pipe) -> debugger, this test only
        self._pipes: list[Any] = []  # keeps each watched pipeline alive while its id is a key
        self._inside = threading.local()

    # -- one test -------------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self._current = TestRuns(item.nodeid)
        restore = self._wrap_calls()
        try:
            result = yield
        finally:
            for cls, original in restore:
                setattr(cls, "__call__", original)
            failure = self._finish()
        if failure:
            pytest.fail(failure, pytrace=False)
        return result

    def _finish(self) -> str | None:
        """Close the test's debuggers, save their runs; the failure message, if the test fails."""
        test, self._current = self._current, None
        debuggers, self._debuggers, self._pipes = self._debuggers, {}, []
        for dbg in debuggers.values():
            dbg.close()
            report = dbg.report()
            test.runs.append(str(report.save(html=False)))
            test.anomalies += report.anomalies
        if test.calls or test.unwatched:
            self.results.append(test)
        if self.fail_on == "never":
            return None
        worst = [a for a in test.anomalies if _SEVERITY_RANK.get(a.severity, 0) >= _SEVERITY_RANK[self.fail_on]]
        if not worst:
            return None
        first = worst[0]
        return (
            f"diffusion-debug: {len(worst)} anomal{'y' if len(worst) == 1 else 'ies'} of severity "
            f"{self.fail_on} or worse; first: {first.kind} at {first.where()}: {first.message} "
            f"(runs: {', '.join(test.runs)})"
        )

    # -- the wrapped calls ------------------------------------------------------------------------
    def _wrap_calls(self) -> list[tuple[type, Any]]:
        """Wrap the ``__call__`` each pipeline class defines; returns what to put back."""
        try:
            from diffusers import DiffusionPipeline
        except ImportError:  # a session without diffusers: nothing to watch
            return []
        classes: list[type] = [DiffusionPipeline]
        try:
            from diffusers.modular_pipelines import ModularPipeline

            classes.append(ModularPipeline)
        except ImportError:
            pass
        seen, restore = set(), []
        while classes:
            cls = classes.pop()
            if cls in seen:
                continue
            seen.add(cls)
            classes += cls.__subclasses__()
            original = vars(cls).get("__call__")
            if original is not None:
                setattr(cls, "__call__", self._watched(original))
                restore.append((cls, original))
        return restore

    def _watched(self, original):
        @functools.wraps(original)
        def call(pipe, *args, **kwargs):
            if getattr(self._inside, "active", False) or self._current is None:
                return original(pipe, *args, **kwargs)  # a sub-pipeline, or a super().__call__
            dbg = self._debugger(pipe)
            if dbg is None:
                return original(pipe, *args, **kwargs)
            self._current.calls += 1
            self._inside.active = True
            try:
                with dbg:
                    return original(pipe, *args, **kwargs)
            finally:
                self._inside.active = False

        return call

    def _debugger(self, pipe: Any) -> Any:
        from .config import DebugConfig
        from .diffusion.debugger import DiffusionModelDebugger
        from .errors import DiffusionDebugError

        key = id(pipe)
        if key not in self._debuggers:
            test = self._current
            folder = self.root / _safe_name(test.nodeid)
            config = DebugConfig(level=self.level, output_dir=str(folder), policy="record", log_level="error")
            try:
                self._debuggers[key] = DiffusionModelDebugger(pipe, config)
            except DiffusionDebugError as error:  # not watchable: it runs as it would
                test.unwatched.append(str(error))
                self._debuggers[key] = None
            self._pipes.append(pipe)
        return self._debuggers[key]

    # -- the end ----------------------------------------------------------------------------------
    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        terminalreporter.section("diffusion-debug")
        if not self.results:
            write("no diffusers pipeline was called")
            return
        for test in self.results:
            counts: dict[str, int] = {}
            for a in test.anomalies:
                counts[a.severity] = counts.get(a.severity, 0) + 1
            ordered = sorted(counts.items(), key=lambda kv: -_SEVERITY_RANK.get(kv[0], 0))
            told = ", ".join(f"{n} {s}{'' if n == 1 or s == 'info' else 's'}" for s, n in ordered)
            write(f"{test.nodeid}: {test.calls} pipeline call(s), {told or 'no anomaly'}")
            errors = [a for a in test.anomalies if a.severity == "error"]
            if errors:
                write(f"    first error: {errors[0].kind} at {errors[0].where()}")
            for sentence in test.unwatched:
                write(f"    not watched: {sentence}")
            for run in test.runs:
                write(f"    run: {run}")


def _safe_name(nodeid: str) -> str:
    """A test's node id as one folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150] or "test"
