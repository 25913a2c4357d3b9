"""`diffusion-debug launch`: an unmodified training script (launch_script.py, which knows nothing
of the debugger) under `accelerate launch`, 2 CPU processes, watched in every process."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_debug.cli import main
from diffusion_debug.jobs.launch import ENVIRONMENT
from diffusion_debug.jobs.launch import main as launcher
from diffusion_debug.jobs.launch_end import NO_HTML
from diffusion_debug.record import by_cause, load_run
from diffusion_debug.testing.features import CPU_RANKS_JOIN_UNASKED, clip_name
from diffusion_debug.testing.launch import (
    accelerate_launcher,
    cpu_launch_env,
    first_row_where,
    free_port,
    run_launch,
)

# the launches of two processes run one at a time on one worker under `pytest -n 2` (see test_multiprocess.py);
# those of one process (--num_processes 1) run beside the other tests, as test_launch_safety.py's do
LAUNCHES = pytest.mark.xdist_group("launches")

SCRIPT = Path(__file__).with_name("launch_script.py")
PLAIN_ARGUMENTS = ("--steps", "3", "--accumulate", "2")  # the clean launch's, multiprocess_job.py's PLAIN
# what the session's 2-process launch runs for this module: the clean launch's plain reference, and the step 0
# launch's script run as `launch --cpu` runs it in each process (multiprocess_job.py's LAUNCHED)
MULTIPROCESS_JOB_SCENARIOS = ("plain_launch_script", "launched_accelerate_nan0")
ROOT = Path(__file__).resolve().parents[2]


def _two_processes(device: str = "--multi_gpu") -> list[str]:
    """Two processes of the multi-GPU launcher on a machine with no GPU (the tests hide any), or
    ``--cpu``'s: either way ``launch`` makes them one job on gloo (ACCELERATE_USE_CPU=true)."""
    return [device, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"] + [
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


def _run(cmd: list[str], cwd: Path, timeout: int = 300, html: bool = False, **env: str) -> subprocess.CompletedProcess:
    """``html``: the run writes its report.html (seconds a launch; only the tests that read it do)."""
    done = run_launch(cmd, {**cpu_launch_env(ROOT), NO_HTML: "0" if html else "1", **env}, cwd, timeout)
    if done.returncode is None:
        pytest.fail(f"{cmd[:3]} hung")
    return done


def _launch(
    tmp_path: Path, *script_args: str, device: str = "--multi_gpu", html: bool = False, **env: str
) -> subprocess.CompletedProcess:
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    head = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", str(tmp_path / "runs")]
    return _run([*head, *_two_processes(device), str(SCRIPT), *script_args], tmp_path, html=html, **env)


def _run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


@LAUNCHES
def test_a_clean_script_is_quiet_and_its_weights_are_bitwise_those_of_a_plain_launch(tmp_path, multiprocess_job):
    """With gradient accumulation over 2 micro-steps: one monitored step per optimizer step. The
    plain run of the script, with the same arguments, is a scenario of the session's 2-process
    launch of multiprocess_job.py (conftest.py's ``multiprocess_job``, its ``plain_launch_script``),
    not a launch of its own (two more processes importing torch, accelerate and diffusers)."""
    watched = _launch(tmp_path, *PLAIN_ARGUMENTS, "--weights", str(tmp_path / "watched.pt"))
    assert watched.returncode == 0, watched.stderr[-3000:]
    output_dir, runs = multiprocess_job
    plain = runs["plain_launch_script"]
    assert plain.returncode == 0 and plain.stdout.count("PLAIN DONE") == 2, plain.stdout + plain.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    run = load_run(run_dir)
    assert [a.kind for a in run.anomalies if a.severity != "info"] == []
    counts = run.summary["training"]
    assert (counts["total_steps"], counts["accumulating_micro_steps"]) == (3, 3)  # each step's first micro-step
    assert sorted({row["step"] for row in run.steps}) == [0, 1, 2]
    a, b = torch.load(tmp_path / "watched.pt"), torch.load(output_dir / "plain_launch_script" / "plain.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # DIFFUSION_DEBUG_NO_HTML: the run is saved and summarised, without its report.html
    said = f"diffusion-debug launch: run: {run_dir} ({NO_HTML} is set: no report.html; diffusion-debug report RUN_DIR"
    assert said in watched.stderr and "nothing was watched" not in watched.stderr
    assert (run_dir / "summary.json").is_file() and not (run_dir / "report.html").exists()


@LAUNCHES
def test_a_nan_gradient_made_on_rank_1_at_step_12_is_named_on_rank_1_in_all_four_places(tmp_path):
    """Launched with ``--cpu --num_processes 2``, which plain accelerate starts as one process: two
    processes that train as one job, in one run directory. A tensor hook makes rank 1's own gradient
    of one parameter NaN during backward at step 12; DDP's all-reduce gives it to rank 0. The
    terminal, summary.json's headline, report.html's first card and the export name rank 1, and
    rank 0's anomaly says it received it through the reduction."""
    parameter = "up_blocks.0.resnets.0.conv1.weight"
    result = _launch(tmp_path, "--steps", "13", "--nan-grad-at", "12", device="--cpu", html=True, COLUMNS="160")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    run = load_run(run_dir)
    assert run.summary["world_size"] == 2 and "distributed_split" not in [a.kind for a in run.anomalies]
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.parameter, first.rank, first.step) == ("nonfinite", parameter, 1, 12)
    # summary.json: the headline, and the two ranks' anomalies (nothing before step 12)
    where = f"model {parameter}, step 12, rank 1"
    assert (run.summary["headline"]["kind"], run.summary["headline"]["where"]) == ("nonfinite", where)
    through = "the gradient all-reduce"
    assert {(a.kind, a.step, a.rank): a.details["reduction"] for a in run.anomalies} == {
        ("nonfinite", 12, 0): {"origins": [1], "made_here": False, "through": through},
        ("nonfinite", 12, 1): {"origins": [1], "made_here": True, "through": through},
    }
    received = next(a for a in run.anomalies if a.rank == 0)
    assert received.message == (
        f"1 gradient(s) hold NaN/Inf (first registered: {parameter}), received through {through} "
        "from rank 1, whose own gradients were non-finite before it."
    )
    # report.html's first card
    html = (run_dir / "report.html").read_text()
    assert f"Most important: nonfinite at {where}; 1 of the others follow from it." in html
    assert f"diffusion-debug launch: report: {run_dir / 'report.html'}\n" in result.stderr
    # the terminal: the log line once, and the report's first row (its where column, wrapped) is rank 1's
    assert result.stderr.count(f"nonfinite at {where} (first on rank 1 at step 12, then 1 rank)") == 1
    assert first_row_where(result.stderr) == where
    assert "step 12, rank 0" not in result.stderr  # rank 0's copy is folded under rank 1's
    # the export: rank 1 made it, rank 0 received it from rank 1
    assert main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    with open(tmp_path / "export" / "anomalies.csv", newline="") as f:
        rows = {row["rank"]: (row["kind"], row["step"], row["parameter"], row["details"]) for row in csv.DictReader(f)}
    assert {rank: row[:3] for rank, row in rows.items()} == {r: ("nonfinite", "12", parameter) for r in ("0", "1")}
    assert json.loads(rows["1"][3])["reduction"]["made_here"] is True
    assert json.loads(rows["0"][3])["reduction"] == {"origins": [1], "made_here": False, "through": through}


@pytest.mark.skipif(CPU_RANKS_JOIN_UNASKED, reason="this accelerate joins CPU processes without ACCELERATE_USE_CPU")
@LAUNCHES
def test_a_learning_rate_jump_at_step_10_is_named_as_the_cause(tmp_path):
    """With ACCELERATE_USE_CPU=false said by the user (launch leaves it), the two CPU processes train
    alone: each run is whole (its summary and report), names the jump and says how to join them."""
    result = _launch(tmp_path, "--steps", "12", "--lr-jump-at", "10", html=True, ACCELERATE_USE_CPU="false")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 2
    assert all((d / "summary.json").is_file() and (d / "report.html").is_file() for d in run_dirs)
    for run_dir in run_dirs:
        anomalies = load_run(run_dir).anomalies
        split = [a for a in anomalies if a.kind == "distributed_split"]
        assert len(split) == 1 and "set ACCELERATE_USE_CPU=true in the launcher's environment" in split[0].message
        first = by_cause([a for a in anomalies if a.kind != "distributed_split"])[0]
        assert (first.kind, first.step) == ("lr_spike", 10)
        assert "jumped" in first.message and "step 10" in first.message


def test_a_script_it_cannot_attach_to_runs_unchanged_with_its_exit_code(tmp_path):
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    script = tmp_path / "no_training.py"
    script.write_text("import sys\nprint('hello from', sys.argv[1:])\nsys.exit(3)\n")
    one = ["--num_processes", "1", "--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launched = _run([sys.executable, "-m", "diffusion_debug.cli", "launch", *one, str(script), "a"], tmp_path)
    plain = _run([accelerate_launcher(), "launch", *one, str(script), "a"], tmp_path)
    assert launched.returncode == plain.returncode != 0
    assert "hello from ['a']" in launched.stdout
    assert (
        f"diffusion-debug launch: nothing was watched in {script}: it stepped no optimizer of a model it trains "
        "(Accelerator.prepare or torch.optim); the script ran unchanged." in launched.stderr
    )


T2I = Path(__file__).with_name("launch_t2i_script.py")
ONE_CPU = ["--num_processes", "1", "--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def _launch_t2i(tmp_path: Path, *script_args: str) -> subprocess.CompletedProcess:
    """train_text_to_image.py's shape (a prepared DataLoader, a frozen text encoder and VAE), one process."""
    if accelerate_launcher() is None:
        pytest.skip("the accelerate launcher is not installed")
    head = [sys.executable, "-m", "diffusion_debug.cli", "launch", "--debug-output-dir", str(tmp_path / "runs")]
    result = _run([*head, *ONE_CPU, str(T2I), *script_args], tmp_path)
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-3000:]
    return result


def test_a_nan_pixel_in_the_batch_of_step_3_is_the_headline_as_the_input(tmp_path):
    _launch_t2i(tmp_path, "--steps", "5", "--nan-pixels-at", "3")
    run = load_run(_run_dir(tmp_path))
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.component, first.step, first.parameter) == (
        "nonfinite_input",
        "input",
        3,
        'batch["pixel_values"]',
    )
    # from the DataLoader's batch through the frozen VAE's encoder into the UNet
    assert first.details["inputs"] == [
        'batch["pixel_values"]',
        "vae.encoder(sample)",
        "vae.quant_conv(input)",
        "unet(sample)",
    ]
    assert first.details["first_input_values"] == 1 and "inputs=" not in first.message
    loss = next(a for a in run.anomalies if a.kind == "nonfinite_loss")
    assert (loss.step, loss.details["follows"]) == (3, {"kind": "nonfinite_input", "rank": 0})
    headline = run.summary["headline"]
    assert (headline["kind"], headline["where"]) == ("nonfinite_input", 'input batch["pixel_values"], step 3')
    assert headline["consequences"]["kinds"]["nonfinite_loss"] >= 1  # the NaN loss, folded under its cause


# the tests of `t2i_forks` run on one worker under `pytest -n 2 --dist loadgroup`, with test_launch_safety.py's:
# the session's fork server (conftest.py's `training_forks`) starts once
T2I_FORKS = pytest.mark.xdist_group("training_forks")


@pytest.fixture(scope="module")
def t2i_forks(training_forks):
    """``t2i_forks(tmp_path, *script_args, plain=False, script=T2I)``: the t2i script (or ``script``)
    as the one process that ``_launch_t2i``'s launcher starts runs it (``python -m
    diffusion_debug.jobs.launched``, with the launch's settings), else by plain Python: a child of
    tests/fork_server.py's process (conftest.py's ``training_forks``, shared with test_launch_safety.py),
    which imported what the script imports once. The launcher itself is ``_launch_t2i``'s part, in the
    first t2i test."""

    def run(tmp_path: Path, *script_args: str, plain: bool = False, script: Path = T2I) -> subprocess.CompletedProcess:
        if plain:
            return training_forks.run(tmp_path, cpu_launch_env(ROOT), list(script_args), script=str(script))
        env = {**cpu_launch_env(ROOT), ENVIRONMENT: json.dumps({"output_dir": str(tmp_path / "runs")}), NO_HTML: "1"}
        result = training_forks.run(tmp_path, env, [str(script), *script_args], module="diffusion_debug.jobs.launched")
        assert result.returncode == 0 and "done" in result.stdout, result.stderr[-3000:]
        return result

    return run


@T2I_FORKS
def test_a_nan_token_embedding_in_the_frozen_text_encoder_names_the_text_encoder(tmp_path, t2i_forks):
    t2i_forks(tmp_path, "--steps", "4", "--nan-token-embedding-at", "2")
    first = by_cause(load_run(_run_dir(tmp_path)).anomalies)[0]
    assert (first.kind, first.component, first.module, first.parameter, first.step) == (
        "nonfinite_input",
        "text_encoder",
        clip_name("embeddings.token_embedding"),
        clip_name("embeddings.token_embedding.weight"),
        2,
    )
    assert first.details["inputs"][0] == "text_encoder(...)[0]" and first.details["nonfinite_weight_values"] == 16
    assert first.message.startswith("text_encoder, which is not trained, made 128 NaN/Inf value(s) from finite inputs")


@T2I_FORKS
def test_a_clean_t2i_launch_is_quiet_and_trains_bitwise_as_a_plain_run(tmp_path, t2i_forks):
    watched = t2i_forks(tmp_path, "--steps", "4", "--weights", str(tmp_path / "watched.pt"))
    plain = t2i_forks(tmp_path, "--steps", "4", "--weights", str(tmp_path / "plain.pt"), plain=True)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run = load_run(_run_dir(tmp_path))
    assert [a.kind for a in run.anomalies] == [] and "anomalies: 0" in watched.stderr
    assert sorted(row["step"] for row in run.steps) == [0, 1, 2, 3]
    a, b = torch.load(tmp_path / "watched.pt"), torch.load(tmp_path / "plain.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@T2I_FORKS
def test_a_nan_made_in_a_layer_of_the_trained_text_encoder_is_named_at_its_module_and_step(tmp_path, t2i_forks):
    """textual_inversion's shape (the text encoder's embeddings trained, prepared; the UNet frozen): a NaN
    made in its first layer's mlp.fc1 at step 2 is the headline there (launch replays the kept forward,
    having no closure=), and the saved embeddings are the unwatched run's, bitwise (NaN from step 2 on)."""
    planted = ("--steps", "4", "--textual-inversion", "--nan-forward-at", "2")
    watched = t2i_forks(tmp_path, *planted, "--weights", str(tmp_path / "watched.pt"))
    plain = t2i_forks(tmp_path, *planted, "--weights", str(tmp_path / "plain.pt"), plain=True)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run = load_run(_run_dir(tmp_path))
    first = by_cause(run.anomalies)[0]
    module = clip_name("encoder.layers.0.mlp.fc1")
    assert (first.kind, first.component, first.module, first.step, first.rank) == (
        "nonfinite",
        "text_encoder",
        module,
        2,
        0,
    )
    assert run.summary["headline"]["where"] == f"text_encoder {module}, step 2"
    assert f"nonfinite at text_encoder {module}" in watched.stderr
    a, b = torch.load(tmp_path / "watched.pt"), torch.load(tmp_path / "plain.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@T2I_FORKS
def test_a_plain_torch_optim_script_is_watched_through_the_optimizer_step_hook(tmp_path, t2i_forks):
    """The one process that a one-process launch starts, run as a child of the t2i tests' server: the
    launcher's own part, the same for any script, is what the t2i launch and the script it cannot
    attach to test (a launcher and a rank importing torch again: ~4 s of CPU)."""
    t2i_forks(tmp_path, script=Path(__file__).with_name("launch_plain_script.py"))
    first = by_cause(load_run(_run_dir(tmp_path)).anomalies)[0]
    assert (first.kind, first.parameter, first.step) == ("nonfinite", "2.weight", 3)


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["--level", "loud", "train.py"], "level"),
        ([], "launch: the following arguments are required: training_script"),  # was an AttributeError
        (["--debug-config"], "launch: --debug-config needs a value."),
        (["--no_python", "train.sh"], "launch: --no_python runs a program that is not Python"),
        (["--debug-output-dir", "out"], "launch: the following arguments are required: training_script"),
        (["--debug-config", "/dev/zero", "train.py"], "Config file '/dev/zero' is over 64 KB; a config is"),
        (["missing.py", "--lr", "1"], "launch: the script 'missing.py' does not exist."),
        (["--config_file", "nope.yaml", "t.py"], "launch: the accelerate config file 'nope.yaml' does not exist."),
        (["--num_processes", "1", "."], "launch: the script '.' is a directory, not a Python file."),
        (["--debug-output-dir", "/dev/null/runs", "-m", "train"], "--debug-output-dir '/dev/null/runs' cannot be"),
    ],
)
def test_bad_launch_arguments_are_one_line_before_any_process_starts(arguments, line, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if arguments[:1] in ([], ["--level"]):  # what a user types: said by the launcher process, before any other
        assert main(["launch", *arguments]) == 2
    else:  # the launcher's own checks, in this process: the same line and code, without a process each (seconds)
        assert launcher(arguments) == 2
    err = capfd.readouterr().err
    assert err.startswith("diffusion-debug launch: error: ") and line in err and err.count("\n") == 1
    assert not (tmp_path / "debug_output").exists()


@LAUNCHES
def test_a_nan_gradient_made_on_rank_1_at_step_0_names_rank_1(launched_in_job):
    """The debugger is made before the first ``Accelerator.backward``: the check of each rank's own
    gradients is there for step 0's all-reduce too. ``--steps 1 --nan-grad-at 0``, run as each process of
    ``launch --cpu`` runs it (ACCELERATE_USE_CPU=true) in the session's 2-process launch (a launch less)."""
    result = launched_in_job("launched_accelerate_nan0")
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(_run_dir(result.args))
    first = by_cause(run.anomalies)[0]
    assert (first.kind, first.parameter, first.rank, first.step) == (
        "nonfinite",
        "up_blocks.0.resnets.0.conv1.weight",
        1,
        0,
    )
    assert {a.rank: a.details["reduction"]["made_here"] for a in run.anomalies} == {0: False, 1: True}
