"""`diffusion-debug launch` on unmodified scripts that use a training engine of their own, started by
`accelerate launch` as a plain process launcher (2 CPU processes, gloo): DDP or FSDP2 with no
Accelerate (``DistributedDataParallel`` or ``fully_shard``, a plain torch AdamW; launch_torch_script.py)
and a raw DeepSpeed ZeRO-2 or ZeRO-3 engine (``deepspeed.initialize``, ``engine.backward(loss);
engine.step()``; launch_zero_script.py). One run of 14 steps each (ZeRO-2's of 2 micro-steps
each), clean but for a NaN that a module's backward pre-hook makes in rank 1's own gradient of
``conv_in`` at step 12, before the engine's reduction gives it to rank 0: the headline names rank 1
in the four places (summary.json, report.html, the terminal, the export), rank 0 is told it
received it. FSDP2's step 0 has a run of its own, and so has an out-of-memory error in step 0's
forward on FSDP2 and on ZeRO-3 (the debugger made as that forward begins, on both engines).

The scripts run as the processes of ``diffusion-debug launch --cpu --num_processes 2`` run them
(``diffusion_debug.jobs.launched.main``: the seams installed, the script as ``__main__``, the run saved
at its end), one after the other in the two processes of the session's one ``accelerate launch`` of
multiprocess_job.py (conftest.py's ``multiprocess_job``; its :data:`LAUNCHED` holds each run's script,
arguments and environment), each with its own run directory, stdout and stderr: four launches less (each two
processes importing torch, diffusers, and FSDP or DeepSpeed: ~18 CPU-s). The command's own side (its
options, ``--cpu`` made one job) is test_launch.py's."""

import csv
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from diffusion_debug.cli import main
from diffusion_debug.record import by_cause, load_run
from diffusion_debug.testing.launch import check_step_0_oom_on_two_ranks, first_row_where

pytestmark = pytest.mark.xdist_group("launches")

PARAMETER = "conv_in.weight"


def _launch(launched_in_job, scenario: str) -> tuple[Path, str, str]:
    """The run directory, the script's stdout and the launch's stderr."""
    done = launched_in_job(scenario)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (done.args / "runs").iterdir()
    return run_dir, done.stdout, done.stderr


def _named_on_rank_1_in_all_four_places(
    tmp: Path, run_dir: Path, stderr: str, through: str, follow: int, first: str = f"first registered: {PARAMETER}"
) -> None:
    """``first``: how rank 0's anomaly names the first of the NaN gradients (conv_in's weight and
    bias, made NaN together in its backward: the first registered on every engine)."""
    parameter = first.rpartition(": ")[2]
    where = f"model {parameter}, step 12, rank 1"
    run = load_run(run_dir)
    assert run.summary["world_size"] == 2
    found = by_cause(run.anomalies)[0]
    assert (found.kind, found.parameter, found.rank, found.step) == ("nonfinite", parameter, 1, 12)
    # summary.json: the headline, and the two ranks' gradient anomalies of step 12
    assert (run.summary["headline"]["kind"], run.summary["headline"]["where"]) == ("nonfinite", where)
    made = [a for a in run.anomalies if a.kind == "nonfinite" and a.step == 12]
    keys = ("origins", "made_here", "through")  # ZeRO-2's rank 1 also says where the NaN went
    assert {a.rank: {k: a.details["reduction"][k] for k in keys} for a in made} == {
        0: {"origins": [1], "made_here": False, "through": through},
        1: {"origins": [1], "made_here": True, "through": through},
    }
    received = next(a for a in made if a.rank == 0)
    assert received.message == (
        f"2 gradient(s) hold NaN/Inf ({first}), received through {through} "
        "from rank 1, whose own gradients were non-finite before it."
    )
    # report.html's first card
    html = (run_dir / "report.html").read_text()
    assert f"Most important: nonfinite at {where}; {follow} of the others follow from it." in html
    # the terminal: the log line once, and the report's first row is rank 1's
    assert stderr.count(f"nonfinite at {where} (first on rank 1 at step 12, then 1 rank)") == 1
    assert first_row_where(stderr) == where
    assert f"model {parameter}, step 12, rank 0" not in stderr  # rank 0's copy is folded under rank 1's
    # the export: rank 1 made it, rank 0 received it from rank 1
    assert main(["export", str(run_dir), "--out", str(tmp / "export")]) == 0
    with open(tmp / "export" / "anomalies.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["kind"] == "nonfinite" and row["step"] == "12"]
    assert sorted((row["rank"], row["parameter"]) for row in rows) == [("0", parameter), ("1", parameter)]
    made_here = {row["rank"]: json.loads(row["details"])["reduction"]["made_here"] for row in rows}
    assert made_here == {"0": False, "1": True}


def test_plain_ddp_a_nan_made_on_rank_1_at_step_12_is_named_on_rank_1_and_the_clean_steps_are_quiet(
    tmp_path, launched_in_job
):
    """Found through the plain optimizer's parameters (the DDP wrapper's, not the UNet's inside it),
    checked before DDP's all-reduce by the hook launch registered before step 0's backward, which
    the debugger takes over. The NaN update makes step 13's loss NaN on both ranks, and its
    gradients (each rank's own: origins 0 and 1); both follow from step 12's."""
    run_dir, stdout, stderr = _launch(launched_in_job, "launched_ddp_nan12")  # --ddp --steps 14 --nan-grad-at 12
    assert sorted(re.findall(r"RANK \d DONE", stdout)) == ["RANK 0 DONE", "RANK 1 DONE"]
    run = load_run(run_dir)
    assert sorted((a.kind, a.step, a.rank) for a in run.anomalies) == [
        ("nonfinite", 12, 0),
        ("nonfinite", 12, 1),
        ("nonfinite", 13, 0),
        ("nonfinite", 13, 1),
        ("nonfinite_loss", 13, 0),
        ("nonfinite_loss", 13, 1),
    ]
    later = [a.details["reduction"]["origins"] for a in run.anomalies if a.kind == "nonfinite" and a.step == 13]
    assert later == [[0, 1], [0, 1]]
    # each rank's NaN loss of step 13 names rank 1's NaN of step 12 (not rank 0's copy of it), the gradients follow it
    at_13 = [a for a in run.anomalies if a.step == 13]
    causes = {(a.rank, a.details["cause"]["where"]) for a in at_13 if a.kind == "nonfinite_loss"}
    assert causes == {(rank, f"model {PARAMETER}, step 12, rank 1") for rank in (0, 1)}
    assert {a.details["follows"]["kind"] for a in at_13 if a.kind == "nonfinite"} == {"nonfinite_loss"}
    assert sorted({row["step"] for row in run.steps}) == list(range(14))
    _named_on_rank_1_in_all_four_places(tmp_path, run_dir, stderr, "the gradient all-reduce", 5)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_raw_deepspeed_zero_engine_names_the_nan_made_on_rank_1_and_the_skipped_step(
    stage, tmp_path, launched_in_job
):
    """Watched through ``DeepSpeedEngine.backward`` and ``step`` (the engine as the model, its ZeRO
    optimizer as the optimizer), checked before ZeRO's reduction; DeepSpeed skips step 12 and says
    so, naming rank 1; steps 0-11 and 13 are quiet. ZeRO-2 accumulates 2 micro-steps a step
    (``gradient_accumulation_steps``): the NaN made at micro-step 24, the first of step 12, is named
    at step 12, and the 28 micro-steps are 14 steps. The watched ZeRO-3 run must train exactly as the
    same script run plain, with the same arguments, in the same launch (multiprocess_job.py's
    ``plain_zero3_script``, after the watched runs). In a run of the suite DeepSpeed is imported in those
    processes before these runs (by the scenarios before them) and launch patches its engine class at once;
    the import hook that patches it as a script imports it is tested whole by test_launch_deepspeed.py."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    # --steps 14 --stage <stage>, and --accumulation 2 --nan-grad-at 24 (ZeRO-2) or --nan-grad-at 12 (ZeRO-3)
    run_dir, stdout, stderr = _launch(
        launched_in_job, "launched_zero2_nan24" if stage == 2 else "launched_zero3_nan12"
    )
    plain = launched_in_job("plain_zero3_script").stdout if stage == 3 else ""
    done = sorted(re.findall(r"RANK \d DONE skipped=\d steps=\d+", stdout))
    assert done == ["RANK 0 DONE skipped=1 steps=14", "RANK 1 DONE skipped=1 steps=14"]
    if stage == 3:  # the watched run trains exactly as the plain run of the same script and arguments
        assert sorted(re.findall(r"RANK \d DONE skipped=\d steps=\d+", plain)) == done, plain
        losses = sorted(re.findall(r"RANK \d LOSSES \S+", stdout))
        assert len(losses) == 2 and losses == sorted(re.findall(r"RANK \d LOSSES \S+", plain))
    run = load_run(run_dir)
    assert sorted((a.kind, a.step, a.rank) for a in run.anomalies) == [
        ("nonfinite", 12, 0),
        ("nonfinite", 12, 1),
        ("skipped_step", 12, 0),
    ]
    skipped = next(a for a in run.anomalies if a.kind == "skipped_step")
    assert "(non-finite gradients of rank 1 before the reduction" in skipped.message
    # every step of every rank, its loss the mean of its micro-steps' (as the script printed them)
    n = 2 if stage == 2 else 1
    printed = {
        int(r): [float.fromhex(v) for v in hexes.split(",")]
        for r, hexes in re.findall(r"RANK (\d) LOSSES (\S+)", stdout)
    }
    rows = sorted((row["step"], row["rank"], row["micro_steps"], row["loss"]) for row in run.rank_steps)
    assert rows == [
        (s, r, n, pytest.approx(sum(printed[r][s * n : s * n + n]) / n, rel=1e-6)) for s in range(14) for r in (0, 1)
    ]
    assert "not watching" not in stderr and "nothing was watched" not in stderr
    _named_on_rank_1_in_all_four_places(tmp_path, run_dir, stderr, "DeepSpeed ZeRO's gradient reduction", 1)


def test_the_engine_seam_is_patched_once_its_module_has_run_and_the_import_is_unchanged(tmp_path, monkeypatch):
    """The import hook that patches ``DeepSpeedEngine`` without importing DeepSpeed itself: ``then``
    sees the module after its body ran, once, and the import returns that module."""
    from diffusion_debug.jobs.launch_deepspeed import _AfterImport

    (tmp_path / "dd_fake_engine.py").write_text("class DeepSpeedEngine:\n    def step(self):\n        return 'own'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = _AfterImport("dd_fake_engine", lambda module: seen.append(module.DeepSpeedEngine().step()))
    sys.meta_path.insert(0, hook)
    try:
        import dd_fake_engine

        assert seen == ["own"] and dd_fake_engine.DeepSpeedEngine().step() == "own"
        assert sys.modules["dd_fake_engine"] is dd_fake_engine
    finally:
        sys.meta_path.remove(hook)
        sys.modules.pop("dd_fake_engine", None)


def test_installing_the_seams_loads_no_deepspeed_and_uninstalling_removes_the_import_hook():
    from diffusion_debug.jobs.launched import LaunchWatch

    if "deepspeed" in sys.modules:
        pytest.skip("deepspeed was imported already by another test in this process")
    before = list(sys.meta_path)
    watch = LaunchWatch({})
    watch.install()
    try:
        assert "deepspeed" not in sys.modules and len(sys.meta_path) == len(before) + 1
    finally:
        watch.uninstall()
    assert sys.meta_path == before


def test_fsdp2_a_nan_made_in_step_0s_backward_names_rank_1_which_made_it(launched_in_job):
    """With no Accelerator the debugger is made as step 0's forward begins (before FSDP2's unshard),
    before step 0's backward (here ``torch.autograd.backward([loss])``, not ``loss.backward()``); each
    rank's check of its own gradients attaches with it (on FSDP2's groups, no parameter read): the NaN
    planted on rank 1 only is named there. (Before, the debugger was made at the first optimizer step
    and took the count of the check launch attached before that backward, ``EarlyCheck``: still the
    way where no forward made it, tested in-process by test_launch_early_check.py.)"""
    # --steps 1 --nan-grad-at 0 --autograd-backward, DIFFUSION_DEBUG_NO_HTML=1 (no page read)
    run_dir, stdout, _ = _launch(launched_in_job, "launched_fsdp2_nan0")
    assert sorted(re.findall(r"RANK \d DONE", stdout)) == ["RANK 0 DONE", "RANK 1 DONE"]
    run = load_run(run_dir)
    keys = ("origins", "made_here", "through")
    found = {(a.rank, a.step, a.parameter): {k: a.details["reduction"][k] for k in keys} for a in run.anomalies}
    through = "the gradient reduce-scatter"
    assert found == {
        (0, 0, PARAMETER): {"origins": [1], "made_here": False, "through": through},
        (1, 0, PARAMETER): {"origins": [1], "made_here": True, "through": through},
    }
    assert run.summary["headline"]["where"] == f"model {PARAMETER}, step 0, rank 1"


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_an_out_of_memory_error_in_step_0s_forward_is_recorded_on_each_rank_and_goes_up_unchanged(
    engine, launched_in_job
):
    """With no Accelerator the debugger was made at the first optimizer step (FSDP2) or the engine's
    first ``backward`` (DeepSpeed), after step 0's forward: an OOM there (the usual first failure of a
    fine-tune) left no record, only "nothing was watched". It is now made as the model's first forward
    under grad begins, by a pre-hook run before the engine's own (FSDP2's unshard, ZeRO-3's fetch),
    given when the optimizer (FSDP2) or the engine (``deepspeed.initialize``) is made: each rank's OOM,
    planted in ``conv_in`` at step 0 on both ranks, is recorded at its module, step and rank, the run
    saved with how the script ended, and the script's own error reaches it unchanged."""
    if engine == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'diffusion-debug[deepspeed]'; make test tries it)")
    done = launched_in_job(f"launched_{engine}_oom0")  # --steps 1 --oom-at 0, DIFFUSION_DEBUG_NO_HTML=1
    (run_dir,) = (done.args / "runs").iterdir()
    check_step_0_oom_on_two_ranks(done, load_run(run_dir))


MULTIPROCESS_JOB_SCENARIOS = (
    "launched_ddp_nan12",
    "launched_fsdp2_nan0",
    "launched_zero2_nan24",
    "launched_zero3_nan12",
    "plain_zero3_script",
    "launched_fsdp2_oom0",
    "launched_zero3_oom0",
)
"""What the session's 2-process launch runs for this module (multiprocess_job.py's ``LAUNCHED``)."""
