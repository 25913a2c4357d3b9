"""`launch` never breaks the script it runs, watches every optimizer, and saves how the run ended
(issue 47): single-process runs of launch_small_script.py, a script that knows nothing of the
debugger, either through the bootstrap each launched process runs (``python -m
diffusion_debug.jobs.launched SCRIPT``, what ``accelerate launch`` starts) or through
``diffusion-debug launch`` itself where the launcher's part is tested (signals). Runs that end
normally are forked children of one process per test worker that imported torch and accelerate once
(tests/fork_server.py, conftest.py's ``training_forks``, which imported test_launch.py's t2i script's
diffusers and CLIP too): the debugger still loads and attaches in each; the runs whose exit status and
traceback are the interpreter's own (a raising script) and the plain runs the watched weights are
compared with are processes of their own."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_debug.jobs.launch_end import NO_HTML
from diffusion_debug.jobs.launched import ENVIRONMENT
from diffusion_debug.record import by_cause, load_run
from diffusion_debug.testing.launch import accelerate_launcher, cpu_launch_env

SCRIPT = Path(__file__).with_name("launch_small_script.py")
ROOT = Path(__file__).resolve().parents[2]

# one worker under `pytest -n 2 --dist loadgroup`: the session's fork server (conftest.py's `training_forks`,
# shared with test_launch.py's t2i tests) and the plain runs of the module's fixtures are made once, not once
# on each worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("training_forks")

ONE_PROCESS = ["--num_processes", "1", "--cpu", "--num_machines", "1", "--mixed_precision", "no"]
ONE_PROCESS += ["--dynamo_backend", "no"]


@pytest.fixture(scope="module")
def forks(training_forks):
    """``forks(tmp_path, settings, *script_args)``: what ``python -m diffusion_debug.jobs.launched SCRIPT
    ARGS`` (the script as one launched process runs it; ``settings``: DIFFUSION_DEBUG_LAUNCH as given, None
    unset) returns, or with ``plain=True`` ``python SCRIPT ARGS``: a process forked from tests/fork_server.py's
    (conftest.py's ``training_forks``), which imported torch and accelerate once for the session (with what
    test_launch.py's t2i script imports), not a Python importing them for each run (~2 CPU-s each);
    ``html``: the run writes its report.html."""

    def run(
        tmp_path: Path, settings: str | None, *script_args: str, plain: bool = False, html: bool = False
    ) -> subprocess.CompletedProcess:
        env = {**cpu_launch_env(ROOT), NO_HTML: "0" if html else "1"}  # report.html: seconds, where it is read
        if settings is not None:
            env[ENVIRONMENT] = settings
        if plain:
            return training_forks.run(tmp_path, env, list(script_args), script=str(SCRIPT))
        return training_forks.run(tmp_path, env, [str(SCRIPT), *script_args], module="diffusion_debug.jobs.launched")

    return run


def _settings(tmp_path: Path, runs: str = "runs") -> str:
    return json.dumps({"output_dir": str(tmp_path / runs)})


def _run_dir(tmp_path: Path, runs: str = "runs") -> Path:
    (run_dir,) = (tmp_path / runs).iterdir()
    return run_dir


def _equal_weights(a: Path, b: Path) -> bool:
    first, second = torch.load(a), torch.load(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("diffusion-debug launch:")]


WHY = "; it runs unwatched, as under accelerate launch."


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, forks):
    """The script run by plain Python with ``--optimizers LAYOUT``, once per layout in this module
    (a process each): its output and its weights."""
    done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def run(layout: str) -> tuple[subprocess.CompletedProcess, Path]:
        if layout not in done:
            folder = tmp_path_factory.mktemp(f"plain-{layout}")
            done[layout] = (
                forks(folder, None, "--optimizers", layout, "--out", "plain.pt", plain=True),
                folder / "plain.pt",
            )
        return done[layout]

    return run


@pytest.fixture(scope="module")
def plain_gan(plain_runs) -> tuple[subprocess.CompletedProcess, Path]:
    """The GAN-style script run by plain Python: its output and its weights."""
    return plain_runs("gan")


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (
            '{"output_dir": "%s/a-file/runs"}',
            r"the debugger could not be made \(Cannot write the run directory '%s/a-file/runs/run-[^']+' "
            r"\(output_dir='%s/a-file/runs'\): Not a directory\)",
        ),
        (
            '{"level": "loud"}',
            r"its settings in DIFFUSION_DEBUG_LAUNCH are wrong \(Config key 'level' must be one of 'basic', "
            r"'advanced', 'extreme', not 'loud'\)",
        ),
        (
            '{"level": ',
            r"DIFFUSION_DEBUG_LAUNCH is not valid JSON \(JSONDecodeError: Expecting value: line 1 column 11 "
            r"\(char 10\)\)",
        ),
    ],
    ids=["unwritable-run-dir", "bad-level", "invalid-json"],
)
def test_a_debugger_that_cannot_be_made_leaves_the_exit_code_and_outputs_of_a_plain_run(
    tmp_path, settings, why, plain_gan, forks
):
    (tmp_path / "a-file").write_text("")
    settings = settings.replace("%s", str(tmp_path))
    why = why.replace("%s", re.escape(str(tmp_path)))
    watched = forks(tmp_path, settings, "--optimizers", "gan", "--out", "watched.pt")
    plain, weights = plain_gan
    assert (watched.returncode, watched.stdout) == (plain.returncode, plain.stdout) == (0, "trained 6\n")
    assert _equal_weights(tmp_path / "watched.pt", weights)
    (line,) = _ours(watched.stderr)  # one line, and no "ran unchanged" after it
    assert re.fullmatch(f"diffusion-debug launch: not watching {re.escape(str(SCRIPT))}: {why}{re.escape(WHY)}", line)
    assert not (tmp_path / "runs").exists()


def test_a_script_that_raises_unwatched_keeps_its_own_exit_code_and_traceback(tmp_path, forks):
    watched = forks(tmp_path, '{"level": "loud"}', "--raise-at", "2")
    plain = forks(tmp_path, None, "--raise-at", "2", plain=True)
    assert watched.returncode == plain.returncode == 1
    error = "RuntimeError: the data ran out after round 2\n"
    assert watched.stderr.endswith(error) and plain.stderr.endswith(error)
    assert len(_ours(watched.stderr)) == 1


LAYOUTS = {"gan": 12, "text": 6}
"""Training steps of 6 rounds: a GAN round is the discriminator's step (its own backward), then the
generator's; a text-encoder round is one backward with two optimizers stepping on it: one step."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_prepared_optimizers_are_watched_quietly_and_bitwise_unchanged(tmp_path, layout, plain_runs, forks):
    watched = forks(tmp_path, _settings(tmp_path), "--optimizers", layout, "--out", "watched.pt")
    assert watched.returncode == 0 and watched.stdout == "trained 6\n", watched.stderr[-3000:]
    plain, weights = plain_runs(layout)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert _equal_weights(tmp_path / "watched.pt", weights)
    run = load_run(_run_dir(tmp_path))
    assert [a.kind for a in run.anomalies if a.severity != "info"] == []
    assert run.summary["training"]["total_steps"] == LAYOUTS[layout]
    assert [row["step"] for row in run.steps] == list(range(LAYOUTS[layout]))
    assert set(run.summary["components"]["model"]["models"]) == {"generator", "discriminator"}
    assert run.summary["end"] == {"status": "finished"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("accelerate", [True, False], ids=["prepared", "plain-torch"])
def test_a_nan_in_the_second_optimizers_model_is_named_at_its_step(tmp_path, layout, accelerate, forks):
    """A NaN in the discriminator's gradient at round 3: training step 6 of a GAN (after the
    generator's and discriminator's steps of rounds 0-2), step 3 of the text-encoder layout."""
    plain_torch = () if accelerate else ("--no-accelerate",)
    done = forks(tmp_path, _settings(tmp_path), "--optimizers", layout, "--nan-at", "3", *plain_torch)
    assert done.returncode == 0 and done.stdout == "trained 6\n", done.stderr[-3000:]
    run = load_run(_run_dir(tmp_path))
    first = by_cause(run.anomalies)[0]
    found = (first.kind, first.component, first.parameter, first.step)
    assert found == ("nonfinite", "discriminator", "2.weight", 6 if layout == "gan" else 3)
    assert run.summary["training"]["total_steps"] == LAYOUTS[layout]


def test_a_crashed_run_says_how_it_ended_in_summary_report_and_terminal(tmp_path, forks):
    done = forks(tmp_path, _settings(tmp_path), "--raise-at", "2", html=True)
    assert done.returncode == 1
    line = next(n for n, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "raise RuntimeError" in text)
    where = f"{SCRIPT}, line {line}, in <module>"
    run_dir = _run_dir(tmp_path)
    end = load_run(run_dir).summary["end"]
    assert {k: end[k] for k in ("status", "exception", "message", "where")} == {
        "status": "raised",
        "exception": "RuntimeError",
        "message": "the data ran out after round 2",
        "where": where,
    }
    assert end["traceback"].startswith('Traceback (most recent call last):\n  File "' + str(SCRIPT))
    assert end["traceback"].endswith("RuntimeError: the data ran out after round 2\n")
    said = f"The script raised RuntimeError: the data ran out after round 2 at {where}; the figures stop there."
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert said.replace("<", "&lt;").replace(">", "&gt;") in page and "ended <b>raised RuntimeError</b>" in page
    # the terminal summary says it before "anomalies: 0", and the script's traceback follows
    assert done.stderr.index(said) < done.stderr.index("anomalies: 0") < done.stderr.index("Traceback")
    assert load_run(run_dir).summary["training"]["total_steps"] == 3


def test_the_end_of_a_script_that_exits_or_handles_its_interrupt():
    from diffusion_debug.jobs.launch_end import describe_end

    assert describe_end(None, None) == describe_end(SystemExit(0), None) == {"status": "finished"}
    assert describe_end(SystemExit(3), None) == {"status": "finished", "exit_code": 3}
    assert describe_end(SystemExit("usage: train.py"), None) == {"status": "finished", "exit_code": 1}  # as Python
    # a script that caught Ctrl-C and returned, or exited, was still interrupted
    assert describe_end(None, signal.SIGINT) == {"status": "interrupted", "signal": "SIGINT"}
    assert describe_end(SystemExit(0), signal.SIGTERM) == {"status": "interrupted", "signal": "SIGTERM"}
    assert describe_end(KeyboardInterrupt(), None) == {"status": "interrupted", "signal": "SIGINT"}


def test_a_model_prepared_after_the_first_step_is_named_as_not_watched(tmp_path, forks):
    done = forks(tmp_path, _settings(tmp_path), "--late-second")
    assert done.returncode == 0 and done.stdout == "trained 6\n", done.stderr[-3000:]
    said = "diffusion-debug launch: Discriminator was prepared after the first training step, so it is not watched."
    assert _ours(done.stderr)[0] == said and done.stderr.count(said) == 1
    run = load_run(_run_dir(tmp_path))
    assert run.summary["components"]["model"]["class"] == "Generator"


def test_the_command_s_own_process_imports_no_torch():
    # the command only starts the launcher and forwards signals to it: torch loads in the launcher
    code = (
        "import sys; from diffusion_debug.cli import main; from diffusion_debug.jobs import launch, launch_end; "
        "print(sorted(m for m in ('torch', 'accelerate', 'diffusion_debug.jobs.launched') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=cpu_launch_env(ROOT), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr[-3000:]


def test_the_models_of_a_plain_script_are_found_after_a_torch_compile_left_a_dead_proxy():
    """The models a plain torch script trains are found through the garbage collector's list, which
    holds the dead weakref.proxy any torch.compile leaves until the collector runs (isinstance() on it
    raises ReferenceError): a GAN's two models and optimizers, found by their type."""
    import weakref

    from diffusion_debug.jobs.launch_plain import plain_models

    gone = torch.nn.Linear(1, 1)
    dead = weakref.proxy(gone)
    del gone
    generator, discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    first = torch.optim.SGD(generator.parameters(), lr=0.1)
    second = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    models, optimizers = plain_models(first)
    # earlier tests of this process may leave live models and optimizers of their own (fixtures)
    ours = {id(generator), id(discriminator), id(first), id(second)}
    assert [id(m) for m in models if id(m) in ours] == [id(generator), id(discriminator)]
    assert [id(o) for o in optimizers if id(o) in ours] == [id(first), id(second)]
    assert models[0] is generator and optimizers[0] is first
    del dead


# torch's elastic agent (several processes: accelerate's multi-GPU launcher, gloo on CPU) turns the signal
# it was sent into a SignalException, after its workers ended and saved the run (Ctrl-C before its handlers
# are in place: a KeyboardInterrupt); accelerate up to 1.15 let either go up, 1.16 exits 128 + N for them
# (commands/launch.py, _run_torchrun: sys.exit(128 + error.sigval), sys.exit(130)): the agent is stood in
# for inside accelerate's own launcher, so that its handling of the signal is the one installed's
SIGNALLED_AGENT = """
import signal, sys
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.api import SignalException
from diffusion_debug.jobs.launch import main

def agent(args):
    if sys.argv[3] == "SIGINT":
        raise KeyboardInterrupt
    raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

torch.distributed.run.run = agent
options = ["--num_processes", "2", "--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
sys.exit(main(["--debug-output-dir", sys.argv[2], *options, sys.argv[1]]))
"""


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_the_elastic_agent_raised_ends_the_launcher_by_that_signal_without_a_traceback(tmp_path, sent):
    """As the one-process launch ends (above): a shell loop stops; it was exit status 1 after torch's
    SignalException traceback, and 143 / 130 under accelerate 1.16."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_AGENT, str(script), str(tmp_path / "runs"), sent.name],
        env=cpu_launch_env(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (-sent, "")


@pytest.mark.parametrize("code", [137, 147, 128 + 17, 1, 2, 128])
def test_an_exit_status_that_is_no_signal_of_the_agent_is_left_as_it_is(code):
    """Only the agent's signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT) from 128 + N: 137 (SIGKILL) and 147
    (SIGSTOP) raised OSError when their handler was reset, inside the launcher's except clause."""
    from diffusion_debug.jobs.launch import _end_by_agent_signal

    assert _end_by_agent_signal(SystemExit(code)) is None


def test_an_accelerate_without_a_simple_launcher_launches_unwrapped(tmp_path, monkeypatch):
    """accelerate's one-process launcher is detected, never assumed (DESIGN): where accelerate has no
    ``simple_launcher`` the launch runs as accelerate runs it, and none is added."""
    import accelerate.commands.launch as accelerate_launch

    from diffusion_debug.jobs import launch

    launched = []
    monkeypatch.delattr(accelerate_launch, "simple_launcher")
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: launched.append(args.training_script_args))
    monkeypatch.setenv(ENVIRONMENT, "")
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert launch.main(["--debug-output-dir", str(tmp_path / "runs"), *ONE_PROCESS, str(script)]) == 0
    assert launched == [[str(script)]] and not hasattr(accelerate_launch, "simple_launcher")


def test_a_script_with_its_own_training_debugger_gets_one_run_of_that_debugger(tmp_path):
    """A script that makes its own TrainingDebugger (README's lines), run by ``diffusion-debug launch``:
    launch steps aside for it and says so in one line; one run directory (the script's), its NaN of
    round 3 recorded and logged once, and saved with how the script ended; launch's
    ``--debug-output-dir``, which its checks made, is gone."""
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    command = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", str(tmp_path / "runs")]
    command += [*ONE_PROCESS, str(SCRIPT), "--own-debugger", str(tmp_path / "own"), "--nan-at", "3"]
    env = {**cpu_launch_env(ROOT), NO_HTML: "1"}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.endswith("trained 6\n"), done.stderr[-3000:]
    assert not (tmp_path / "runs").exists()  # made by launch's own run only: no empty folder left behind
    run_dir = _run_dir(tmp_path, "own")
    said = (
        f"diffusion-debug launch: {SCRIPT} makes its own TrainingDebugger, so launch steps aside: the script's "
        f"debugger watches the run, in {run_dir} (launch's --debug-output-dir, --level, --policy and "
        "--debug-config do not apply to it)."
    )
    assert _ours(done.stderr)[0] == said and done.stderr.count("TrainingDebugger") == 1
    run = load_run(run_dir)
    assert run.summary["end"] == {"status": "finished"}
    assert run.summary["training"]["total_steps"] == 6
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.parameter, first.step) == ("nonfinite", "2.weight", 3)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    made = [e for e in events if e["type"] == "anomaly" and (e["kind"], e["step"]) == ("nonfinite", 3)]
    assert len(made) == 1 and "first registered 2.weight" in made[0]["message"]
    logged = [line for line in done.stderr.splitlines() if line.startswith("nonfinite at model 2.weight, step 3: ")]
    assert len(logged) == 1


def test_a_pipeline_debugger_of_the_script_keeps_its_own_run_and_launch_says_where(tmp_path, forks):
    """A training script that watches its validation pipeline call with its own DiffusionModelDebugger
    (after round 2, an Inf made by the UNet's conv_out at its second step): two runs, launch's
    training run (6 steps, no anomaly) and the pipeline's (its NaN recorded and logged once), and
    launch's last line says where the pipeline's is."""
    done = forks(tmp_path, _settings(tmp_path), "--pipeline-debugger", str(tmp_path / "val"))
    assert done.returncode == 0 and done.stdout.endswith("trained 6\n"), done.stderr[-3000:]
    training, validation = load_run(_run_dir(tmp_path)), load_run(_run_dir(tmp_path, "val"))
    assert (training.summary["training"]["total_steps"], training.anomalies) == (6, [])
    kinds = [(a.kind, a.component, a.module, a.step) for a in validation.anomalies if a.kind == "nonfinite"]
    assert kinds == [("nonfinite", "unet", "conv_out", 1)]
    events = [json.loads(line) for line in (validation.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events].count("run_start") == 1
    assert sum(line.startswith("nonfinite at unet conv_out, step 1") for line in done.stderr.splitlines()) == 1
    said = "diffusion-debug launch: the script's own DiffusionModelDebugger wrote its pipeline calls to a run "
    assert _ours(done.stderr)[-1] == f"{said}apart from this one: {validation.run_dir}."


def test_an_error_of_the_scripts_own_training_debugger_has_its_traceback_as_without_launch(tmp_path, forks):
    """The script's TrainingDebugger cannot be made (its output_dir is a file): the error goes up
    as it does without launch, the frames from the script's line to the raise the same (no
    frame of launch's between), exit status 1, after one line of launch's."""
    (tmp_path / "a-file").write_text("")
    args = ("--own-debugger", str(tmp_path / "a-file"))
    watched, plain = forks(tmp_path, _settings(tmp_path), *args), forks(tmp_path, None, *args, plain=True)

    def from_script(stderr: str) -> str:
        frames = stderr[stderr.index(f'  File "{SCRIPT}"') :]
        return re.sub(r"run-[0-9a-f-]+", "RUN", frames)

    assert watched.returncode == plain.returncode == 1
    assert from_script(watched.stderr) == from_script(plain.stderr)
    assert "launched.py" not in from_script(watched.stderr) and len(_ours(watched.stderr)) == 1
    assert not (tmp_path / "runs").exists()


def test_a_launched_script_that_raises_has_its_summary_and_traceback_printed_once(tmp_path):
    """``diffusion-debug launch`` of a script that raises: the command exits 1, the script's terminal summary
    and traceback on its stderr once. accelerate 1.16's one-process launcher keeps the tail of the script's
    stderr, written through already, and raised it again inside its CalledProcessError (``from
    RuntimeError(stderr)``): the summary and the traceback were printed twice."""
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    command = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", str(tmp_path / "runs")]
    command += [*ONE_PROCESS, str(SCRIPT), "--raise-at", "1"]
    env = {**cpu_launch_env(ROOT), NO_HTML: "1"}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    said = "The script raised RuntimeError: the data ran out after round 1"
    raised = 'raise RuntimeError(f"the data ran out after round {step}")'
    assert (done.stderr.count(said), done.stderr.count(raised)) == (1, 1), done.stderr[-6000:]
    assert done.stderr.index(said) < done.stderr.index(raised)
