"""Two and eight CPU processes through `accelerate launch` (gloo): rank-aware anomalies, raise
without a hang, rank desynchronisation, one fixed-size exchange per step, a bounded record. Each
launch takes seconds to start, so the scenarios of the tests below run one after the other in one
launch per world size (each with its own model, debugger and run directory; see
multiprocess_job.py), the two fine-tuning jobs after them in the same 2-process launch (the
session's, conftest.py's ``multiprocess_job``: test_launch.py's plain run of its script is one more). The
8-process scenarios run first in the 8-process launch test_stalls_multiprocess.py's tests share
(conftest.py's ``shared_eight``): eight processes starting cost ~25 CPU-s, two ~7."""

import csv
import json
import math
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.cli import main
from diffusion_debug.record import load_json, load_run, read_jsonl
from diffusion_debug.testing.features import FSDP2_ON_CPU
from diffusion_debug.training.ranks.summary import WIDTH

# Several processes per launch: under `pytest -n 2` the launches run on one worker (two 8-process
# jobs at once on two cores would starve each other past the stall timeout).
pytestmark = pytest.mark.xdist_group("launches")


# the scenarios of the tests below, in their order, run by one launch
SCENARIOS = (
    "nan_rank1",
    "raise",
    "desync",
    "measure_fails_rank1",
    "judge_fails_rank1",
    "record_fails_rank1_raise",
    "record_fails_rank1",
    "judge_fails_quietly_rank1",
    "models_and_samples_rank1",
    "closure_scaler_rank1",
    "scaler_not_passed_ddp",
    "scaler_not_passed_nan0_rank1",
    "scaler_not_passed_nan0_record",
    "scaler_not_passed_finite_ddp",
    *(["fsdp2"] if FSDP2_ON_CPU else []),  # where FSDP2 needs CUDA, it would end the launch
    "nan_grad_rank1",
    "accumulate_unused",
    "accumulate_nan_batch_rank1",
    "accumulate_nan_grad_rank1",
)


def _run_dir(output_dir: Path, done: subprocess.CompletedProcess) -> Path:
    runs = sorted(output_dir.glob("run-*"))
    assert len(runs) == 1, done.stdout + done.stderr  # one run directory, shared by both ranks
    return runs[0]


@pytest.fixture(scope="module")
def launched(multiprocess_job) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The 2-process launch of :data:`MULTIPROCESS_JOB_SCENARIOS`: the session's (conftest.py's
    ``multiprocess_job``, which test_launch.py's plain run of launch_script.py shares)."""
    return multiprocess_job


@pytest.fixture
def scenario(launched):
    """``scenario(name)``: that scenario's share of the launch and its run directory."""
    output_dir, runs = launched
    return lambda name: (runs[name], _run_dir(output_dir / name, runs[name]))


def _terminal_report(run_dir: Path, capsys, monkeypatch) -> tuple[list[str], int]:
    """The lines ``diffusion-debug report --no-html`` prints for ``run_dir`` (160 columns: rows
    unwrapped, whatever runs the test; in this process, not a new one importing it all again) and
    the index of the first error row."""
    monkeypatch.setenv("COLUMNS", "160")
    capsys.readouterr()
    assert main(["report", str(run_dir), "--no-html"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines, next(i for i, line in enumerate(lines) if line.startswith("error"))


def _summaries(stdout: str) -> dict[int, dict]:
    """Each rank's printed training summary (without anomaly_counts)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RANK ") and " SUMMARY " in line:
            rank, _, payload = line[len("RANK ") :].partition(" SUMMARY ")
            out[int(rank)] = json.loads(payload)
    return out


def test_nan_loss_on_rank1_reaches_the_report_with_its_rank(scenario):
    done, run_dir = scenario("nan_rank1")
    tmp_path = run_dir.parent
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1 saved too (after main): it flushed its own events and returned the shared run dir
    assert f"RANK 1 SAVED {run_dir}" in done.stdout.replace(str(tmp_path.resolve()), str(tmp_path)), done.stdout
    summary = load_json(run_dir / "summary.json")
    first_loss = [a for a in summary["anomalies"] if a["kind"] == "nonfinite_loss"][0]
    assert (first_loss["rank"], first_loss["step"]) == (1, 3)
    assert not any(a["kind"] == "nonfinite_loss" and a["rank"] == 0 and a["step"] == 3 for a in summary["anomalies"])
    grads = [a for a in summary["anomalies"] if a["kind"] == "nonfinite" and a["step"] == 3]
    # DDP averages the NaN into both ranks' gradients; names carry no "module." prefix
    assert sorted(a["rank"] for a in grads) == [0, 1]
    # ... named as what follows from rank 1's NaN loss, by the first registered on both ranks (rank 0's
    # own loss is finite: it had named the last layer, where backward met the NaN, until the exchange)
    assert all(a["parameter"] == "0.weight" and a["details"]["follows"]["rank"] == 1 for a in grads)
    assert all(a["details"]["order"] == "registration" and "first_registered" not in a["details"] for a in grads)
    # the cause comes first: the headline, the terminal's first row; every rank's row in the steps
    assert "Most important: nonfinite_loss at model, step 3, rank 1" in (run_dir / "report.html").read_text()
    steps = {(s["step"], s["rank"]): s for s in summary["steps"]}
    assert steps[(3, 1)]["loss"] == "nan" and steps[(3, 0)]["loss"] != "nan"
    # load_run: .steps the main process's own rows, one a step; .rank_steps every rank's, from the event files
    run = load_run(run_dir)
    assert [(s["step"], s["rank"]) for s in run.steps] == [(s, 0) for s in range(6)]
    assert [(s["step"], s["rank"]) for s in run.rank_steps] == [(s, r) for s in range(6) for r in (0, 1)]
    assert run.rank_steps[7]["loss"] == "nan" and run.steps[3]["loss"] != "nan"  # step 3: rank 1's NaN alone
    # the live report (main's report() before its save) has the same .steps and .rank_steps
    (line,) = [line for line in done.stdout.splitlines() if "LIVE STEPS " in line]
    live_steps, live_rank_steps = json.loads(line.partition("LIVE STEPS ")[2])
    assert live_steps == [[s["step"], s["rank"]] for s in run.steps]
    assert live_rank_steps == [[s["step"], s["rank"]] for s in run.rank_steps]
    assert any(s["rank"] == 1 for s in summary["steps"])  # summary.json also keeps some of rank 1's rows
    assert summary["training"]["total_steps"] == 6 and summary["world_size"] == 2
    assert (run_dir / "events-rank1.jsonl").is_file() and (run_dir / "report.html").is_file()


# the fine-tuning jobs (each builds its own Accelerator), one after the other after SCENARIOS, in their launch
FINETUNES = ("finetune_nan_loss_rank1", "finetune_lr_jump10")
MULTIPROCESS_JOB_SCENARIOS = SCENARIOS + FINETUNES  # what the session's launch runs for this module


@pytest.fixture(scope="module")
def finetuned(launched):
    """``finetuned(name)``: that job's share of the launch and its run directory."""
    output_dir, runs = launched
    return lambda name: (runs[name], _run_dir(output_dir / name, runs[name]))


def test_finetune_job_headline_names_rank1s_nan_loss_at_its_step(finetuned, capsys, monkeypatch):
    # the official scripts' pattern (diffusers UNet, DDPMScheduler noise, MSE, Accelerate) on 2 processes
    done, run_dir = finetuned("finetune_nan_loss_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = load_json(run_dir / "summary.json")
    anomalies = summary["anomalies"]
    assert not any(a["step"] < 5 for a in anomalies if a["step"] is not None)  # no false alarm before
    html = (run_dir / "report.html").read_text()
    assert "Most important: nonfinite_loss at model, step 5, rank 1" in html
    lines, first = _terminal_report(run_dir, capsys, monkeypatch)
    first_row = " ".join([lines[first], *(line.strip() for line in lines[first + 1 : first + 3])])  # wrapped
    assert "nonfinite_loss" in lines[first] and "rank 1" in first_row
    # every rank's row: rank 1's NaN loss is in the step table at step 5 (rank 0's is finite there)
    steps = {(s["step"], s["rank"]): s for s in summary["steps"]}
    assert steps[(5, 1)]["loss"] == "nan" and steps[(5, 0)]["loss"] != "nan"
    assert steps[(4, 1)]["grad_norm_clipped"] in (True, False)
    # one log line per anomaly: rank 1 does not repeat what rank 0 logs (the launch's other job, the lr
    # jump, finds nothing before its step 10)
    assert done.stderr.count("nonfinite_loss at model, step 5, rank 1") == 1, done.stderr[-3000:]


def test_finetune_lr_jump_at_step10_is_the_headline_with_what_follows_folded_and_every_row_exported(finetuned):
    # DDP, AdamW, the lr x1e4 from step 10 on: update ratios, loss spikes, dying gradients and the NaN
    # loss of both ranks follow; the jump is the headline, everything else points at it
    done, run_dir = finetuned("finetune_lr_jump10")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = load_json(run_dir / "summary.json")
    headline, anomalies = summary["headline"], summary["anomalies"]
    assert (headline["kind"], headline["where"]) == ("lr_spike", "optimizer, step 10, rank 0")  # every rank named
    assert headline["message"].startswith("The learning rate jumped from 0.0001 to 1 (x1e+04) at step 10")
    later = [a for a in anomalies if (a["kind"], a["step"]) != ("lr_spike", 10)]
    assert {a["kind"] for a in later} >= {"loss_spike", "gradient_vanishing", "nonfinite_loss", "nonfinite"}
    assert {a["rank"] for a in later} == {0, 1}
    assert all(a["details"]["cause"]["where"] == "optimizer, step 10" for a in later), [a["message"] for a in later]
    assert headline["consequences"]["count"] == len(later) == len(anomalies) - 1
    assert "Most important: lr_spike at optimizer, step 10, rank 0;" in (run_dir / "report.html").read_text()
    # every step of both ranks, though summary.json keeps rank 1's rows only where details were exchanged
    assert main(["export", str(run_dir)]) == 0
    rows = [(int(r["step"]), int(r["rank"])) for r in csv.DictReader(open(run_dir / "ranks.csv", newline=""))]
    assert rows == [(step, rank) for step in range(18) for rank in (0, 1)]
    assert len([s for s in summary["steps"] if s["rank"] == 1]) < 18


def test_policy_raise_stops_both_ranks_without_hanging(scenario):
    done, run_dir = scenario("raise")
    tmp_path = run_dir.parent
    # both raise with the cause, rank 1's NaN loss (not rank 0's NaN gradients that follow)
    assert "RANK 0 RAISED at step 3: nonfinite_loss rank 1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "RANK 1 RAISED at step 3: nonfinite_loss rank 1" in done.stdout
    assert f"run_dir={run_dir}" in done.stdout.replace(str(tmp_path.resolve()), str(tmp_path))
    summary = load_json(run_dir / "summary.json")  # saved by main before anyone raised
    assert any(a["kind"] == "nonfinite_loss" and a["rank"] == 1 and a["step"] == 3 for a in summary["anomalies"])


def test_desynchronised_parameter_is_named(scenario):
    done, run_dir = scenario("desync")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = load_json(run_dir / "summary.json")
    desync = [a for a in summary["anomalies"] if a["kind"] == "rank_desync"]
    # rank 1 changed 2.bias after step 2; checksums are compared every 2nd monitored step
    assert desync and (desync[0]["step"], desync[0]["rank"], desync[0]["parameter"]) == (3, 1, "2.bias")
    assert not any(a["kind"] == "rank_desync" and a["step"] < 3 for a in desync)


def test_measurement_failure_on_rank1_neither_hangs_nor_reads_as_nan_loss(scenario):
    # rank 1's gradient norms raise at step 3, before the step's all_gather: it still joins
    done, run_dir = scenario("measure_fails_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 6" in done.stdout and "RANK 1 DONE 6" in done.stdout
    summary = load_json(run_dir / "summary.json")
    (error,) = [a for a in summary["anomalies"] if a["kind"] == "debugger_error"]
    assert (error["rank"], error["step"]) == (1, 3)
    assert (
        error["message"].startswith("Rank 1 failed to measure step 3")
        and "planted failure in grad_norms" in error["message"]
    )
    assert not any(a["kind"] in ("nonfinite_loss", "nonfinite") for a in summary["anomalies"])
    assert summary["training"]["total_steps"] == 6


def test_failure_after_the_gather_waits_for_the_exchange(scenario):
    # rank 1's NaN loss makes step 3 a step whose details are exchanged; rank 1's per-module
    # norms raise after the gather: it still enters the exchange, then records its error
    done, run_dir = scenario("judge_fails_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 6" in done.stdout and "RANK 1 DONE 6" in done.stdout
    summary = load_json(run_dir / "summary.json")
    errors = [a for a in summary["anomalies"] if a["kind"] == "debugger_error"]
    assert [(a["rank"], a["step"], a["details"]["where"]) for a in errors] == [(1, 3, "judging")]
    assert any(a["kind"] == "nonfinite_loss" and (a["rank"], a["step"]) == (1, 3) for a in summary["anomalies"])


def test_failure_recording_on_rank1_still_raises_on_both_ranks(scenario):
    # policy raise fires at step 3 (rank 1's NaN loss); rank 1's record.add_step raises in that
    # step: rank 1 must still take the policy (its barrier included) and raise like rank 0
    done, run_dir = scenario("record_fails_rank1_raise")
    assert "RANK 0 RAISED at step 3" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "RANK 1 RAISED at step 3" in done.stdout, done.stdout + done.stderr[-3000:]
    summary = load_json(run_dir / "summary.json")
    assert any(a["kind"] == "nonfinite_loss" and (a["rank"], a["step"]) == (1, 3) for a in summary["anomalies"])
    events = read_jsonl(run_dir / "events-rank1.jsonl")
    late = [e for e in events if e["type"] == "anomaly" and e["kind"] == "debugger_error"]
    assert [(e["rank"], e["step"], e["details"]["where"]) for e in late] == [(1, 3, "recording")]


def test_a_debugger_error_only_rank1_recorded_reaches_the_main_report_once_as_its_own(scenario, capsys, monkeypatch):
    # rank 1's record.add_step raises at step 3, a clean step: its debugger_error is recorded after the step's
    # collectives, in rank 1's events file alone; main's report reads it from there, once, at its rank and severity
    done, run_dir = scenario("record_fails_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 6" in done.stdout and "RANK 1 DONE 6" in done.stdout
    message = (
        "Rank 1 failed to record step 3 (RuntimeError: planted failure in add_step) and training went on; "
        "set strict=True to see the traceback."
    )
    summary = load_json(run_dir / "summary.json")
    found = [(a["kind"], a["severity"], a["rank"], a["step"], a["details"]["where"]) for a in summary["anomalies"]]
    assert found == [("debugger_error", "warning", 1, 3, "recording")]
    assert summary["anomalies"][0]["message"] == message
    assert summary["headline"] == {
        "kind": "debugger_error",
        "severity": "warning",
        "where": "model, step 3, rank 1",
        "message": message,
    }
    assert (summary["anomaly_counts"], summary["severity_counts"]) == ({"debugger_error": 1}, {"warning": 1})
    monkeypatch.setenv("COLUMNS", "160")
    capsys.readouterr()
    assert main(["report", str(run_dir), "--no-html"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:5] == [
        "anomalies: 1 (1 warning)",
        "severity  kind            where                  message",
        "--------  --------------  ---------------------  " + "-" * 100,
        "warning   debugger_error  model, step 3, rank 1  " + message[: message.index("; set") + 5],
    ]
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "Most important: debugger_error at model, step 3, rank 1." in page
    assert page.count("<li class='anomaly ") == 1
    assert "<li class='anomaly warning'><span class='chip warning'>warning</span>" in page


def test_summary_counts_are_identical_on_every_rank(scenario):
    # rank 1 alone fails to judge step 3 (nothing special elsewhere): the step counts still agree
    done, run_dir = scenario("judge_fails_quietly_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = _summaries(done.stdout)
    assert set(summaries) == {0, 1} and summaries[0] == summaries[1], summaries
    assert summaries[0]["total_steps"] == 6 and summaries[0]["anomaly_steps"] == 0


def test_two_watched_models_and_a_nan_loss_weight_on_rank1_reach_the_report_by_name(scenario):
    done, run_dir = scenario("models_and_samples_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 6" in done.stdout and "RANK 1 DONE 6" in done.stdout
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    assert not any(a["kind"] == "unwatched_parameters" for a in anomalies)  # both prepared models are watched
    (weight,) = [a for a in anomalies if a["kind"] == "nonfinite_loss_weight"]
    assert (weight["rank"], weight["step"], weight["timestep"]) == (1, 2, 999)
    assert weight["details"]["samples"] == [{"sample": "rank1-sample3", "timestep": 999, "weight": "nan"}]
    (loss,) = [a for a in anomalies if a["kind"] == "nonfinite_loss"]
    assert (loss["rank"], loss["step"], loss["details"]["follows"]["kind"]) == (1, 2, "nonfinite_loss_weight")
    # rank 1's own NaN gradient at step 4, on its text encoder, by name (DDP's all-reduce was done)
    (grad,) = [a for a in anomalies if a["kind"] == "nonfinite" and a["step"] == 4]
    assert (grad["rank"], grad["component"], grad["parameter"], grad["module"]) == (1, "text_encoder", "0.weight", "0")
    assert not [a for a in anomalies if a["step"] not in (2, 4)]


def test_a_closure_replay_for_one_ranks_nan_runs_on_every_rank_and_names_the_op(scenario):
    # a DDP forward broadcasts the BatchNorm's buffers: a replay on rank 1 alone (the only one with
    # an error; under the GradScaler rank 0's NaN gradients are an overflow it handles) used to pair
    # that broadcast with rank 0's next collective and hang the job
    done, run_dir = scenario("closure_scaler_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 4" in done.stdout and "RANK 1 DONE 4" in done.stdout
    (loss,) = [a for a in load_json(run_dir / "summary.json")["anomalies"] if a["kind"] == "nonfinite_loss"]
    assert (loss["rank"], loss["step"]) == (1, 1)
    assert loss["details"]["localization"]["op"] == "PowBackward0"
    assert "anomaly mode names PowBackward0" in loss["message"]
    # the skip of step 1 (seen by rank 0's report after it, before step 2 read it) names the rank whose own
    # gradients overflowed, as step 2's detail exchange does; once, counted once
    summary = load_json(run_dir / "summary.json")
    (skipped,) = [a for a in summary["anomalies"] if a["kind"] == "skipped_step"]
    assert (skipped["step"], skipped["details"]["overflow_ranks"]) == (1, [1])
    assert (skipped["details"]["detected_at_step"], skipped["rank"], skipped["local_rank"]) == ("report", 0, 0)
    assert summary["training"]["skipped_steps"] == summary["training"]["anomaly_counts"]["skipped_step"] == 1
    assert "(rank 1's own gradients overflowed, before the gradient all-reduce; scale 16 -> 8)" in skipped["message"]


def _printed_norms(stdout: str) -> dict[tuple[int, int], dict]:
    """``(rank, step)``: the norm measured, the naive unscaled reference and the scale each rank printed."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RANK ") and " NORMS step " in line:
            head, _, payload = line.partition(": ")
            out[(int(head.split()[1]), int(head.split()[-1]))] = json.loads(payload)
    return out


def test_a_ddp_loop_whose_scaler_was_not_passed_is_read_unscaled_on_every_rank_until_rank1s_nan(scenario):
    """Plain torch DDP (no Accelerate), fp16, GradScaler not passed, policy raise. Before: both ranks raised at
    step 0 (``nonfinite`` rank 0: the scaler's first overflow), the search being off with several processes."""
    done, run_dir = scenario("scaler_not_passed_ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    # the healthy steps 0-5 go on (3 overflows skipped: 65536 -> 8192); rank 1's NaN loss at step 6 stops both
    assert "RANK 0 RAISED at step 6: nonfinite_loss rank 1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "RANK 1 RAISED at step 6: nonfinite_loss rank 1" in done.stdout
    norms = _printed_norms(done.stdout)
    assert sorted(norms) == [(rank, step) for rank in (0, 1) for step in range(6)]
    assert [norms[(0, s)]["scale"] for s in range(6)] == [65536.0, 32768.0, 16384.0, 8192.0, 8192.0, 8192.0]
    for (rank, step), row in norms.items():  # read unscaled (the scaler confirmed by its step of step 0)
        if step >= 3:  # (steps 0-2 overflowed: non-finite either way)
            assert row["measured"] == pytest.approx(row["reference"], rel=1e-6), (rank, step, row)
            assert row["measured"] == norms[(0, step)]["measured"]  # DDP's all-reduced gradients: one norm
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    warned = [a for a in anomalies if a["kind"] == "scaler_not_passed"]
    assert [(a["rank"], a["step"], a["details"]["grad_scale"]) for a in warned] == [(0, 0, 65536.0), (1, 0, 65536.0)]
    errors = [(a["kind"], a["step"], a["rank"]) for a in anomalies if a["severity"] == "error"]
    assert errors == [("nonfinite_loss", 6, 1)]
    assert not any(a["kind"] in ("gradient_explosion", "lr_spike") for a in anomalies)
    summaries = _summaries(done.stdout)
    assert summaries[0] == summaries[1], summaries
    assert (summaries[0]["total_steps"], summaries[0]["skipped_steps"], summaries[0]["anomaly_steps"]) == (7, 3, 2)


def test_a_nan_loss_on_rank1_at_the_first_step_of_an_unpassed_scaler_stops_both_ranks_there(scenario):
    """Rank 1's NaN loss (no scaling makes one) holds nothing; rank 0's step, which looked scaled, is released in
    the same step (the reduce says some rank held none): both raise at step 0 on rank 1's loss, rank 0's NaN
    gradients named as what follows from it."""
    done, run_dir = scenario("scaler_not_passed_nan0_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 RAISED at step 0: nonfinite_loss rank 1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "RANK 1 RAISED at step 0: nonfinite_loss rank 1" in done.stdout
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    assert [(a["kind"], a["step"], a["rank"]) for a in anomalies] == [
        ("nonfinite_loss", 0, 1),
        ("nonfinite", 0, 0),
        ("nonfinite", 0, 1),
    ]
    assert all(a["details"]["follows"] == {"kind": "nonfinite_loss", "rank": 1} for a in anomalies[1:])
    summaries = _summaries(done.stdout)
    assert summaries[0] == summaries[1] and summaries[0]["anomaly_steps"] == 1, summaries


def test_after_rank1s_nan_loss_at_the_first_step_an_unpassed_scaler_is_found_on_both_ranks_at_the_next(scenario):
    """The same NaN loss under policy record, the run going on: rank 0's held step 0 is released in place (rank 1
    held none), and its optimizer is searched again at its next step that looks scaled, where rank 1 searches for
    the first time: both hold, the scaler is confirmed, every later step read unscaled on both ranks alike. Before:
    rank 0 never searched again and read every later step scaled (a gradient_explosion error a step) while rank 1
    read them unscaled."""
    done, run_dir = scenario("scaler_not_passed_nan0_record")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAISED" not in done.stdout, done.stdout
    norms = _printed_norms(done.stdout)
    assert sorted(norms) == [(rank, step) for rank in (0, 1) for step in range(8)], done.stdout
    for (rank, step), row in norms.items():
        if step >= 1 and math.isfinite(row["reference"]):  # (a step that overflowed is non-finite either way)
            assert row["measured"] == pytest.approx(row["reference"], rel=1e-6), (rank, step, row)
            assert row["measured"] == norms[(1 - rank, step)]["measured"]  # one norm on both ranks
    assert sum(math.isfinite(norms[(0, s)]["reference"]) for s in range(1, 8)) >= 3  # steps read, not all skipped
    anomalies = load_json(run_dir / "summary.json")["anomalies"]
    assert not any(a["kind"] in ("gradient_explosion", "lr_spike") for a in anomalies), anomalies
    errors = [(a["kind"], a["step"], a["rank"]) for a in anomalies if a["severity"] == "error"]
    assert errors[0] == ("nonfinite_loss", 0, 1) and all(step == 0 for _, step, _ in errors), errors
    summaries = _summaries(done.stdout)
    assert summaries[0] == summaries[1], summaries


def test_an_unpassed_scalers_finite_held_step_is_recorded_unscaled_on_every_ranks_norm(scenario):
    """fp32 DDP, the GradScaler (65536) not passed: step 0 looks scaled (finite), is held, exchanged, and once the
    scaler is confirmed rank 0's row of it is read unscaled: its norm, every rank's norm and the extremes of the
    step's reduce (DDP's ranks share one scale) within 1e-6 of the naive reference (each rank's all-reduced
    gradients over the scale), and ``grad_norm_clipped`` (``max_grad_norm=100``) False. Before: grad_norm unscaled
    (9.5) but ``grad_norms_by_rank`` and ``ranks.grad_norm`` 65536x it, and the flag True."""
    done, run_dir = scenario("scaler_not_passed_finite_ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    norms = _printed_norms(done.stdout)
    assert sorted(norms) == [(rank, step) for rank in (0, 1) for step in range(3)], done.stdout
    reference = [norms[(rank, 0)]["reference"] for rank in (0, 1)]
    assert 1.0 < reference[0] < 100.0 and norms[(0, 0)]["scale"] == 65536.0
    row = next(r for r in load_json(run_dir / "summary.json")["steps"] if r["step"] == 0 and r["rank"] == 0)
    assert row["grad_scale"] == 65536.0
    assert row["grad_norm"] == pytest.approx(reference[0], rel=1e-6)
    assert row["grad_norms_by_rank"] == pytest.approx(reference, rel=1e-6)
    extremes = row["ranks"]["grad_norm"]
    assert [extremes["min"], extremes["max"]] == pytest.approx([min(reference), max(reference)], rel=1e-6)
    assert row["grad_norm_clipped"] is False
    # rank 1's row as the main process copied it (summary.json's, the live report's) is the one rank 1 read anew
    # (its step_amended), as load_run reads it from rank 1's own file; it kept its scaled norm (65536x) before
    copy = next(r for r in load_json(run_dir / "summary.json")["steps"] if r["step"] == 0 and r["rank"] == 1)
    own = next(r for r in load_run(run_dir).rank_steps if r["step"] == 0 and r["rank"] == 1)
    assert copy["grad_norm"] == pytest.approx(reference[1], rel=1e-6) and copy["grad_scale"] == 65536.0
    (amended,) = [e["values"] for e in read_jsonl(run_dir / "events-rank1.jsonl") if e["type"] == "step_amended"]
    assert {k: copy[k] for k in amended} == {k: own[k] for k in amended} == amended
    (run_dir / "events-rank1.jsonl").unlink()  # rank 1's own file gone: the main's copy, read anew, stands in
    assert next(r for r in load_run(run_dir).rank_steps if (r["step"], r["rank"]) == (0, 1)) == copy


# -- eight processes: one launch, its scenarios one after the other ---------------------------------
SCENARIOS_8 = ("nan_rank5", "clean_history10")  # run by the launch conftest.py's shared_eight starts


@pytest.fixture(scope="module")
def launched_8(shared_eight) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """The 8-process scenarios, run first in the 8-process launch test_stalls_multiprocess.py's
    [clean, validation, raise_rank1_backward, skip_rank5] share (conftest.py's ``shared_eight``; stall_job.py
    runs them): judged by what they saved and printed, as skip_rank5's stall ends that job."""
    output_dir, stdout, stderr = shared_eight
    return output_dir, {name: subprocess.CompletedProcess([], None, stdout[name], stderr) for name in SCENARIOS_8}


def _collectives(stdout: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> the torch.distributed collectives the debugger called in that monitored step."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("RANK ") and " COLLECTIVES step " in line:
            rank, _, rest = line[len("RANK ") :].partition(" COLLECTIVES step ")
            step, _, names = rest.partition(": ")
            out[(int(rank), int(step))] = names
    return out


@pytest.mark.parametrize("world", [2, 8])
def test_each_step_makes_one_fixed_size_all_reduce_whatever_the_world_size(request, world):
    _, runs = request.getfixturevalue("launched" if world == 2 else "launched_8")
    done = runs["nan_rank1" if world == 2 else "nan_rank5"]
    called = _collectives(done.stdout)
    assert set(called) == {(r, s) for r in range(world) for s in range(6)}, done.stdout[-3000:]
    # steps 0-2 are clean: the all_reduce of the same 18 int64 values on 2 and on 8 ranks, nothing
    # else; from the NaN step on (the NaN spreads to every rank's weights) every rank's details too
    one = f"all_reduce[{WIDTH}]"
    expected = {s: one if s < 3 else f"{one},all_gather_object" for s in range(6)}
    assert {key: names for key, names in called.items()} == {(r, s): expected[s] for r, s in called}
    assert WIDTH == 18
    # every rank's gradients were checked before DDP's all-reduce: its flag rode in those 18 values
    assert {r: s["pre_reduction_check"] for r, s in _summaries(done.stdout).items()} == {
        r: {"checked": True, "off": []} for r in range(world)
    }


def test_nan_loss_on_rank5_of_8_is_named_once_and_the_other_ranks_point_at_it(launched_8):
    output_dir, runs = launched_8
    done = runs["nan_rank5"]
    run_dir = _run_dir(output_dir / "nan_rank5", done)
    summary = load_json(run_dir / "summary.json")  # judged by what the job saved (gloo may exit 1 at the end)
    anomalies = summary["anomalies"]
    (loss,) = [a for a in anomalies if a["kind"] == "nonfinite_loss" and a["step"] == 3]
    assert (loss["rank"], loss["local_rank"], loss["host"]) == (5, 5, socket.gethostname())
    assert summary["headline"]["where"] == "model, step 3, rank 5"
    # DDP averages rank 5's NaN into every rank's gradients: eight anomalies, one log line
    grads = [a for a in anomalies if a["kind"] == "nonfinite" and a["step"] == 3]
    assert [(a["rank"], a["local_rank"]) for a in grads] == [(r, r) for r in range(8)]
    assert all(a["details"]["follows"] == {"kind": "nonfinite_loss", "rank": 5} for a in grads)
    assert grads[5]["details"]["also_on_ranks"] == [0, 1, 2, 3, 4, 6, 7]  # the rank that made it heads them
    logged = [line for line in done.stderr.splitlines() if line.startswith(("nonfinite at", "nonfinite_loss at"))]
    assert [line.partition(": ")[0] for line in logged] == [
        "nonfinite_loss at model, step 3, rank 5",
        "nonfinite at model 0.weight, step 3, rank 5 (first on rank 5 at step 3, then 7 ranks)",
        "nonfinite_loss at model, step 4 (first on rank 0 at step 4, then 7 ranks)",
        "nonfinite at model 0.weight, step 4 (first on rank 0 at step 4, then 7 ranks)",
    ]
    # step 4: the NaN weights that step 3's update left on every rank; rank 5's own NaN loss there is a
    # consequence of its step-3 one too, not a repeat of it (it points at it)
    later = [a for a in anomalies if a["kind"] == "nonfinite_loss" and a["step"] == 4]
    assert [a["rank"] for a in later] == list(range(8)) and loss["details"]["count"] == 1
    assert all(a["details"]["cause"]["step"] == 3 for a in later)
    for a in later:
        if a["rank"] == 5:
            continue
        assert {k: a["details"]["cause"][k] for k in ("kind", "step", "rank")} == {
            "kind": "nonfinite_loss",
            "step": 3,
            "rank": 5,
        }
        assert a["message"].endswith("; it follows rank 5's nonfinite_loss at step 3 (model): fix that first.")


def _one_process_summary(output_dir: Path) -> tuple[dict, int]:
    """The clean scenario's model and loop (multiprocess_job.py) on one process without Accelerate."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = DebugConfig(output_dir=str(output_dir), history_size=10, log_level="error")
    generator = torch.Generator().manual_seed(100)
    with TrainingDebugger(model, config=config) as tdbg:
        for step in range(30):
            x = torch.randn(8, 4, generator=generator)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
            optimizer.step()
            optimizer.zero_grad()
        path = tdbg.report().save(html=False) / "summary.json"
    return load_json(path), path.stat().st_size


def test_the_record_of_8_ranks_covers_the_steps_of_1_in_at_most_4x_its_size(launched_8, tmp_path):
    # history_size=10 over 30 steps stands for 1,000 over 1,000+: the rings, not the step count, bound the
    # summary; the main process's ring holds its own rows only, the other ranks' rows have a ring of their own
    output_dir, runs = launched_8
    run_dir = _run_dir(output_dir / "clean_history10", runs["clean_history10"])
    summary = load_json(run_dir / "summary.json")
    single, single_size = _one_process_summary(tmp_path)
    steps = list(range(20, 30))
    assert [s["step"] for s in single["steps"]] == steps
    assert [(s["step"], s["rank"]) for s in summary["steps"]] == [(s, 0) for s in steps]  # a clean run: no rank rows
    assert (run_dir / "summary.json").stat().st_size <= 4 * single_size
    assert all(s["step_time_s"] > 0 for s in summary["steps"])
    # the per-module figures on their schedule (training.step.detail): steps 20 and 25 of these
    assert [s["step"] for s in summary["steps"] if "max_update_to_weight_ratio" in s] == [20, 25]
    # each row's extremes over the 8 ranks, against every rank's own events file
    own = {}
    for path in [run_dir / "events.jsonl", *run_dir.glob("events-rank*.jsonl")]:
        own.update({(e["step"], e["rank"]): e for e in read_jsonl(path) if e["type"] == "step"})
    assert {rank for _, rank in own} == set(range(8))
    for row in summary["steps"]:
        losses = [own[(row["step"], r)]["loss"] for r in range(8)]
        extremes = row["ranks"]["loss"]
        assert (extremes["min_rank"], extremes["max_rank"]) == (losses.index(min(losses)), losses.index(max(losses)))
        assert extremes["min"] == pytest.approx(min(losses), rel=2**-40)
        assert extremes["max"] == pytest.approx(max(losses), rel=2**-40)


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch's FSDP2 needs CUDA streams")
def test_fsdp2_sharded_gradients_give_the_whole_parameters_norms(scenario):
    # fully_shard on 2 CPU processes (gloo): every .grad is a DTensor holding half of each gradient
    done, run_dir = scenario("fsdp2")
    readings = {}
    for line in done.stdout.splitlines():
        if line.startswith("RANK ") and " NORMS step " in line:
            head, _, payload = line.partition(": ")
            readings[head] = json.loads(payload)
    assert len(readings) == 12, done.stdout[-3000:] + done.stderr[-3000:]
    for r in readings.values():
        assert r["measured"] == pytest.approx(r["reference"], rel=1e-6)
        assert r["measured_modules"] == pytest.approx(r["reference_modules"], rel=1e-6)
    # one sum of the shards' squares per step (4 parameters; 8 values on the steps that read the
    # weights too), then the step's reduce: two fixed-size collectives, nothing else
    called = _collectives(done.stdout)
    assert {names for names in called.values()} <= {
        f"all_reduce[4],all_reduce[{WIDTH}]",
        f"all_reduce[8],all_reduce[{WIDTH}]",
    }
    assert len(called) == 12
    # each rank's unsharded gradients were checked before the reduce-scatter: its flag rode in the 18
    assert {r: s["pre_reduction_check"] for r, s in _summaries(done.stdout).items()} == {
        r: {"checked": True, "off": []} for r in (0, 1)
    }
    summary = load_json(run_dir / "summary.json")
    assert [a for a in summary["anomalies"] if a["severity"] != "info"] == [], summary["anomalies"]


def test_nan_gradient_made_on_rank1_before_the_all_reduce_is_named_on_rank1_everywhere(
    scenario, tmp_path, capsys, monkeypatch
):
    """Rank 1's own gradient of 2.weight is NaN at step 12 (a tensor hook in backward); DDP's
    all-reduce gives it to rank 0. The comm hook counted it on rank 1 before the reduction: the
    headline, the terminal, report.html and the export name rank 1; rank 0's says it received it."""
    done, run_dir = scenario("nan_grad_rank1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = load_json(run_dir / "summary.json")
    headline = summary["headline"]
    assert (headline["kind"], headline["where"]) == ("nonfinite", "model 2.weight, step 12, rank 1")
    assert "non-finite in this rank's own gradients before the gradient all-reduce" in headline["message"]
    assert not [a for a in summary["anomalies"] if a["step"] < 12]  # the clean steps added nothing
    assert {r: s["pre_reduction_check"] for r, s in _summaries(done.stdout).items()} == {
        r: {"checked": True, "off": []} for r in (0, 1)
    }
    at12 = {a["rank"]: a for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite", 12)}
    assert at12[0]["parameter"] == at12[1]["parameter"] == "2.weight"
    assert at12[0]["message"] == (
        "1 gradient(s) hold NaN/Inf (first registered: 2.weight), received through the gradient all-reduce "
        "from rank 1, whose own gradients were non-finite before it."
    )
    assert at12[1]["details"]["reduction"] == {"origins": [1], "made_here": True, "through": "the gradient all-reduce"}
    # one collective per clean step, the same width: the flags rode in it
    assert f"RANK 0 COLLECTIVES step 3: all_reduce[{WIDTH}]" in done.stdout
    html = (run_dir / "report.html").read_text()
    assert "Most important: nonfinite at model 2.weight, step 12, rank 1" in html
    lines, first = _terminal_report(run_dir, capsys, monkeypatch)
    assert "nonfinite  model 2.weight, step 12, rank 1" in lines[first]
    assert not any("step 12, rank 0" in line for line in lines)  # rank 0's copy is folded under rank 1's
    assert main(["export", str(run_dir), "--out", str(tmp_path)]) == 0
    with open(tmp_path / "anomalies.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r["kind"], r["step"]) == ("nonfinite", "12")]
    by_rank = {r["rank"]: json.loads(r["details"])["reduction"] for r in rows}
    assert by_rank == {
        "0": {"origins": [1], "made_here": False, "through": "the gradient all-reduce"},
        "1": {"origins": [1], "made_here": True, "through": "the gradient all-reduce"},
    }
    assert (
        done.stderr.count("nonfinite at model 2.weight, step 12, rank 1 (first on rank 1 at step 12, then 1 rank)")
        == 1
    )


def test_ddp_accumulating_with_unused_parameters_counts_optimizer_steps_and_the_update_they_apply(scenario):
    """DDP with ``find_unused_parameters=True`` under ``accelerator.accumulate`` (two micro-steps a
    step; a branch joins the forward at one micro-step only): the steps counted are the optimizer's
    (4 of 8 calls), each step's norm is the same on both ranks, the SGD update it makes (lr x norm)
    is the one applied to the weights, and nothing is found."""
    done, run_dir = scenario("accumulate_unused")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 4" in done.stdout and "RANK 1 DONE 4" in done.stdout
    rows = {}
    for line in done.stdout.splitlines():
        head, _, payload = line.partition(": ")
        if " UPDATE call " in head:
            rows[int(head.split()[1]), int(head.split()[-1])] = json.loads(payload)
    assert sorted(rows) == [(r, c) for r in (0, 1) for c in (1, 3, 5, 7)], done.stdout
    for (rank, call), row in rows.items():
        assert row["steps"] == (call + 1) // 2
        assert row["applied"] == pytest.approx(row["lr_times"], rel=1e-5), (rank, call, row)
        assert row["measured"] == rows[1 - rank, call]["measured"]
    assert load_json(run_dir / "summary.json")["anomalies"] == []


@pytest.mark.parametrize(
    "name, origin",
    [
        ("accumulate_nan_batch_rank1", ("nonfinite_input", "input inputs, step 1, rank 1")),
        ("accumulate_nan_grad_rank1", ("nonfinite", "model 2.weight, step 1, rank 1")),
    ],
    ids=["batch", "gradient"],
)
def test_a_nan_made_on_rank1_at_a_micro_step_ddp_does_not_all_reduce_is_named_on_rank1_at_its_step(
    scenario, name, origin
):
    """Two micro-steps a step under ``accelerator.accumulate``; rank 1's NaN comes at the first micro-step of
    optimizer step 1, which DDP does not all-reduce (``no_sync``): in its batch, or made in its backward. It
    stays in rank 1's accumulated gradients until the second micro-step's all-reduce gives it to rank 0; the
    origin is rank 1 at step 1 (the optimizer step, as ``step=`` counts), and step 2's NaN follows it."""
    done, run_dir = scenario(name)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANK 0 DONE 3" in done.stdout and "RANK 1 DONE 3" in done.stdout
    summary = load_json(run_dir / "summary.json")
    assert (summary["headline"]["kind"], summary["headline"]["where"]) == origin
    assert not [a for a in summary["anomalies"] if a["step"] < 1]
    grads = {a["rank"]: a for a in summary["anomalies"] if (a["kind"], a["step"]) == ("nonfinite", 1)}
    through = "the gradient all-reduce"
    assert grads[0]["details"]["reduction"] == {"origins": [1], "made_here": False, "through": through}
    assert grads[1]["details"]["reduction"] == {"origins": [1], "made_here": True, "through": through}
    # the batch: rank 1's loss of step 1 is NaN (its micro-step's joined the step's mean); both ranks' at step 2
    losses = sorted((a["rank"], a["step"]) for a in summary["anomalies"] if a["kind"] == "nonfinite_loss")
    assert losses == ([(0, 2), (1, 1), (1, 2)] if name == "accumulate_nan_batch_rank1" else [(0, 2), (1, 2)])
    assert summary["headline"]["consequences"]["count"] == len(summary["anomalies"]) - 1
