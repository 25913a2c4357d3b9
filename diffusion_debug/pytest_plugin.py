"""A pytest plugin: every diffusers pipeline called in a test session runs under a debugger.

    pytest -p diffusion_debug.pytest_plugin --diffusion-debug tests/

Each test's pipeline calls are watched by a :class:`~diffusion_debug.DiffusionModelDebugger`
(policy ``record``: the test runs exactly as without it); its run directory is written below
``--diffusion-debug-dir`` (default ``diffusion_debug_runs``; one that cannot be written is a usage
error when the session starts), in a folder named after the test; a test whose pipelines showed an
anomaly of severity ``--diffusion-debug-fail-on`` (``error``, the default; ``warning``; or
``never``) fails, with the anomaly's headline. ``--diffusion-debug-level`` picks the config's
level (default ``basic``: sentinel probes and NaN/Inf localisation, no previews).

The terminal summary fits a screen whatever the session's size: the totals, one line per anomaly
kind (its count, its tests, an example test and where) with the example's message, the tests the
plugin failed (the first :data:`FAILED_SHOWN`), and each reason a pipeline was not watched, once::

    2 pipeline calls watched in 2 tests: 5 anomalies of 3 kinds; runs in /repo/diffusion_debug_runs
    error nonfinite: 1 in 1 test, e.g. test_user.py::test_inf at unet up_blocks.1.resnets.0.conv2, step 1 (t=1)
        unet.up_blocks.1.resnets.0.conv2 produced NaN/Inf from finite inputs (check its dtype, inputs and w...
    warning scheduler_config: 2 in 2 tests, e.g. test_user.py::test_clean
        With 2 steps and timestep_spacing='leading' the first step is t=501 of 1000, so sampling starts fro...
    warning latent_divergence: 1 in 1 test, e.g. test_user.py::test_inf at step 1 (t=1)
        Latents became non-finite (256 values); the denoiser output was already non-finite (see the nonfini...
    warning nonfinite: 1 in 1 test, e.g. test_user.py::test_inf at vae
        vae received non-finite input and passed it on; fix the first NaN/Inf at unet up_blocks.1.resnets.0...
    failed by diffusion-debug: 1 test
        test_user.py::test_inf: nonfinite at unet up_blocks.1.resnets.0.conv2, step 1 (t=1)
    not watched in 1 test, e.g. test_user.py::test_refused:
        OnlyScheduler has no denoiser and no other nn.Module component (pipe.components holds none): ...

Under pytest-xdist each worker watches its own tests and hands its findings to the controller
(xdist's ``workeroutput``), whose summary counts them all.

How: for the length of each test's call phase, the ``__call__`` of every ``DiffusionPipeline``
subclass (and of ``ModularPipeline``) is wrapped, and put back after the test. A class created
during the test (a pipeline module first imported in the test body, as ``tiny_pipeline`` does) is
wrapped as it is created, by an ``__init_subclass__`` set on the two base classes for that phase
alone. A pipeline gets one debugger per test, attached around each of its calls.

Limits: a call made by a fixture (outside the test's call phase) is not watched; a call made from
another thread while a watched call runs is watched by the same debugger; an object the debugger
refuses (a pipeline without an ``nn.Module``, e.g. one holding only a scheduler) runs unwatched,
as it would, and the summary says why; a ``__call__`` that a test replaces while it runs is left
as the test leaves it; under xdist, a worker that crashes takes its tests' findings with it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FAIL_ON = ("error", "warning", "never")
_SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}
FAILED_SHOWN = 10
"""How many of the tests the plugin failed the summary names (pytest's own short summary lists all)."""
REASONS_SHOWN = 5
"""How many distinct reasons for an unwatched pipeline the summary gives."""
MIN_WIDTH = 80
"""A message is cut to the terminal's width, or this many characters where it is narrower (the run
directory holds it whole)."""
_WATCHED = "__diffusion_debug_watched__"
"""Set on our wrappers: a wrapper is never wrapped again, and only a wrapper is put back."""
_WORKER_KEY = "diffusion_debug"


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
    """What one test's pipeline calls showed, in plain values (they travel from an xdist worker)."""

    __test__ = False  # a class named Test*, not a test class

    nodeid: str
    position: int = 0
    """Where the test is in the session's collection (the controller of xdist workers orders by it)."""
    calls: int = 0
    runs: list[str] = field(default_factory=list)
    anomalies: list[dict[str, str]] = field(default_factory=list)
    """Each anomaly's ``kind``, ``severity``, ``where`` and ``message``."""
    unwatched: list[str] = field(default_factory=list)
    """One sentence per object that could not be watched (from the debugger's own error)."""


class PipelineWatch:
    """The plugin's state for one session: the wrapped ``__call__``s and each test's debuggers."""

    def __init__(self, config: pytest.Config):
        from .errors import DiffusionDebugError
        from .jobs.pipeline_loading import check_output_dir

        self.root = Path(config.getoption("diffusion_debug_dir")).resolve()
        try:  # before any test runs: one error, not one per test
            check_output_dir(self.root, option="--diffusion-debug-dir")
        except DiffusionDebugError as error:
            raise pytest.UsageError(str(error)) from None
        self.config = config
        self.fail_on = config.getoption("diffusion_debug_fail_on")
        self.level = config.getoption("diffusion_debug_level")
        self.results: list[TestRuns] = []
        self._current: TestRuns | None = None
        self._debuggers: dict[int, Any] = {}  # id(pipe) -> debugger (None: refused), this test only
        self._pipes: list[Any] = []  # keeps each watched pipeline alive while its id is a key
        self._inside = threading.local()
        self._restore: list[Any] = []
        self._positions: dict[str, int] = {}
        self._wrappers: weakref.WeakKeyDictionary[type, tuple[Any, Any]] = weakref.WeakKeyDictionary()
        """class -> (its own ``__call__``, our wrapper of it), made once per session."""

    # -- one test -------------------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.begin(item.nodeid)
        try:
            result = yield
        finally:
            failure = self.end()
        if failure:
            pytest.fail(failure, pytrace=False)
        return result

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._positions = {item.nodeid: i for i, item in enumerate(session.items)}

    def begin(self, nodeid: str) -> None:
        """Watch the pipeline calls from here on, for the test ``nodeid``."""
        self._current = TestRuns(nodeid, self._positions.get(nodeid, len(self._positions)))
        self._restore = self._wrap_calls()

    def end(self) -> str | None:
        """Stop watching, close the test's debuggers and save their runs; the failure message, if
        the test fails."""
        restore, self._restore = self._restore, []
        for undo in reversed(restore):
            undo()
        test, self._current = self._current, None
        debuggers, self._debuggers, self._pipes = self._debuggers, {}, []
        for dbg in debuggers.values():
            if dbg is None:  # refused: it ran unwatched, and test.unwatched says why
                continue
            try:
                dbg.close()
                report = dbg.report()
                test.runs.append(str(report.save(html=False, durable=False)))  # scratch runs: no fsync
            except Exception as error:  # the debugger never fails the test it watches
                test.unwatched.append(f"diffusion-debug could not save the run ({type(error).__name__}: {error})")
                continue
            test.anomalies += [
                {"kind": a.kind, "severity": a.severity, "where": a.where(), "message": a.message}
                for a in report.anomalies
            ]
        if test.calls or test.unwatched:
            self.results.append(test)
        worst = _worst(test.anomalies, self.fail_on)
        if not worst:
            return None
        first = worst[0]
        return (
            f"diffusion-debug: {len(worst)} anomal{'y' if len(worst) == 1 else 'ies'} of severity "
            f"{self.fail_on} or worse; first: {first['kind']}{_at(first)}: {first['message']} "
            f"(runs: {', '.join(test.runs)})"
        )

    # -- the wrapped calls ------------------------------------------------------------------------
    def _wrap_calls(self) -> list[Any]:
        """Wrap the ``__call__`` each pipeline class defines, and each one a class created from now
        on defines; returns the undos."""
        try:
            from diffusers import DiffusionPipeline
        except ImportError:  # a session without diffusers: nothing to watch
            return []
        bases: list[type] = [DiffusionPipeline]
        try:
            from diffusers.modular_pipelines import ModularPipeline

            bases.append(ModularPipeline)
        except ImportError:
            pass
        restore: list[Any] = []
        seen, classes = set(), list(bases)
        while classes:
            cls = classes.pop()
            if cls in seen:
                continue
            seen.add(cls)
            classes += cls.__subclasses__()
            self._wrap_class(cls, restore)
        for base in bases:
            self._watch_new_classes(base, restore)
        return restore

    def _wrap_class(self, cls: type, restore: list[Any]) -> None:
        original = vars(cls).get("__call__")
        if original is None or getattr(original, _WATCHED, False):
            return
        made = self._wrappers.get(cls)
        if made is None or made[0] is not original:
            made = (original, self._watched(original))
            self._wrappers[cls] = made
        wrapper = made[1]
        type.__setattr__(cls, "__call__", wrapper)

        def undo() -> None:
            if vars(cls).get("__call__") is wrapper:  # a test that replaced it keeps its own
                type.__setattr__(cls, "__call__", original)

        restore.append(undo)

    def _watch_new_classes(self, base: type, restore: list[Any]) -> None:
        """Set ``base.__init_subclass__`` so that a pipeline class created during the test is wrapped
        too; the undo puts back what ``base`` had."""
        own = vars(base).get("__init_subclass__")
        watch = self

        def __init_subclass__(cls, **kwargs):
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            if watch._current is not None:
                watch._wrap_class(cls, restore)

        type.__setattr__(base, "__init_subclass__", classmethod(__init_subclass__))

        def undo() -> None:
            if own is None:
                type.__delattr__(base, "__init_subclass__")
            else:
                type.__setattr__(base, "__init_subclass__", own)

        restore.append(undo)

    def _watched(self, original):
        @functools.wraps(original)
        def call(pipe, *args, **kwargs):
            test = self._current
            if test is None or getattr(self._inside, "active", False):
                return original(pipe, *args, **kwargs)  # outside a test, a sub-pipeline, or a super().__call__
            dbg = self._debugger(pipe, test)
            if dbg is None:
                return original(pipe, *args, **kwargs)
            try:
                dbg.attach()
            except Exception as error:  # cannot watch this call: it runs as it would
                test.unwatched.append(_refusal(error))
                return original(pipe, *args, **kwargs)
            test.calls += 1
            self._inside.active = True
            try:
                with dbg:
                    return original(pipe, *args, **kwargs)
            finally:
                self._inside.active = False

        setattr(call, _WATCHED, True)
        return call

    def _debugger(self, pipe: Any, test: TestRuns) -> Any:
        """The test's debugger of ``pipe`` (made at its first call), or None where it is refused."""
        key = id(pipe)
        if key not in self._debuggers:
            from .config import DebugConfig
            from .diffusion.debugger import DiffusionModelDebugger

            folder = self.root / _safe_name(test.nodeid)
            config = DebugConfig(level=self.level, output_dir=str(folder), policy="record", log_level="error")
            try:
                self._debuggers[key] = DiffusionModelDebugger(pipe, config)
            except Exception as error:  # not watchable: it runs as it would
                test.unwatched.append(_refusal(error))
                self._debuggers[key] = None
            self._pipes.append(pipe)
        return self._debuggers[key]

    # -- the end ----------------------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller writes the summary
            workeroutput[_WORKER_KEY] = [dataclasses.asdict(test) for test in self.results]

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """On the xdist controller: a worker's findings join the session's."""
        for test in (getattr(node, "workeroutput", None) or {}).get(_WORKER_KEY, ()):
            self.results.append(TestRuns(**test))
        self.results.sort(key=lambda test: test.position)  # as one process would have run them

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput"):
            return
        terminalreporter.section("diffusion-debug")
        width = max(MIN_WIDTH, self.config.get_terminal_writer().fullwidth)
        for line in summary_lines(self.results, self.root, self.fail_on, width):
            terminalreporter.write_line(line)


def summary_lines(results: list[TestRuns], root: Path, fail_on: str, width: int = MIN_WIDTH) -> list[str]:
    """The session's summary, grouped: its length grows with the kinds of anomaly and of refusal
    seen, never with the number of tests; a message is cut to ``width``."""
    from .jobs.pipeline_loading import one_line

    watched = [test for test in results if test.calls]
    if not results:
        return ["no diffusers pipeline was called"]
    by_kind: dict[tuple[str, str], list[tuple[TestRuns, dict[str, str]]]] = {}
    for test in results:
        for anomaly in test.anomalies:
            by_kind.setdefault((anomaly["severity"], anomaly["kind"]), []).append((test, anomaly))
    calls = sum(test.calls for test in results)
    total = sum(len(found) for found in by_kind.values())
    seen = (
        f"{_count(total, 'anomaly', 'anomalies')} of {_count(len({kind for _, kind in by_kind}), 'kind')}"
        if total
        else "no anomaly"
    )
    lines = [f"{_count(calls, 'pipeline call')} watched in {_count(len(watched), 'test')}: {seen}; runs in {root}"]
    order = sorted(by_kind, key=lambda key: (-_SEVERITY_RANK.get(key[0], 0), -len(by_kind[key]), key[1]))
    for severity, kind in order:
        found = by_kind[(severity, kind)]
        test, example = found[0]
        tests = len({id(t) for t, _ in found})
        lines.append(f"{severity} {kind}: {len(found)} in {_count(tests, 'test')}, e.g. {test.nodeid}{_at(example)}")
        lines.append(f"    {one_line(example['message'], width - 4)}")
    failed = [(test, worst[0]) for test in results if (worst := _worst(test.anomalies, fail_on))]
    if failed:
        lines.append(f"failed by diffusion-debug: {_count(len(failed), 'test')}")
        lines += [f"    {test.nodeid}: {first['kind']}{_at(first)}" for test, first in failed[:FAILED_SHOWN]]
        if len(failed) > FAILED_SHOWN:
            lines.append(f"    and {len(failed) - FAILED_SHOWN} more (pytest's short test summary lists each)")
    reasons: dict[str, list[str]] = {}
    for test in results:
        for sentence in dict.fromkeys(test.unwatched):
            reasons.setdefault(sentence, []).append(test.nodeid)
    for sentence, tests in list(reasons.items())[:REASONS_SHOWN]:
        lines.append(f"not watched in {_count(len(tests), 'test')}, e.g. {tests[0]}:")
        lines.append(f"    {one_line(sentence)}")  # the reason whole (up to 300 characters): it is given once
    if len(reasons) > REASONS_SHOWN:
        lines.append(f"not watched for {len(reasons) - REASONS_SHOWN} more reasons (each test's run says why)")
    return lines


def _worst(anomalies: list[dict[str, str]], fail_on: str) -> list[dict[str, str]]:
    """The anomalies that fail a test under ``--diffusion-debug-fail-on``."""
    if fail_on == "never":
        return []
    return [a for a in anomalies if _SEVERITY_RANK.get(a["severity"], 0) >= _SEVERITY_RANK[fail_on]]


def _at(anomaly: dict[str, str]) -> str:
    """`` at unet up_blocks.1, step 3 (t=761)``, or nothing for an anomaly of the whole run."""
    return f" at {anomaly['where']}" if anomaly["where"] else ""


def _refusal(error: Exception) -> str:
    """Why a pipeline runs unwatched: the debugger's own sentence, or an internal error named."""
    from .errors import DiffusionDebugError

    if isinstance(error, DiffusionDebugError):
        return str(error)
    return f"diffusion-debug could not watch it ({type(error).__name__}: {error})"


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _safe_name(nodeid: str) -> str:
    """A test's node id as one folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150] or "test"
